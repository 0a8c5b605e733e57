"""The documentation site: `mkdocs build --strict` passes (a broken link, an anchor that does not exist or a
page left out of the navigation fails it — shown on a copy with a broken link), and the figures the docs
show are the ones the benchmarks wrote."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytest.importorskip("mkdocs", reason="the docs extra (install.sh installs it)")


def build(root: Path, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"), "-d", str(out)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip


def test_the_site_builds_strict(tmp_path):
    res = build(REPO, tmp_path / "site")
    assert res.returncode == 0, res.stderr[-3000:]
    for page in ("install", "dflash", "diagnose", "config", "recipes/llama-8b"):
        assert (tmp_path / "site" / page / "index.html").is_file(), page


def test_a_broken_link_fails_the_strict_build(tmp_path):
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with (tmp_path / "docs" / "dflash.md").open("a") as f:
        f.write("\nSee [the missing page](no-such-page.md).\n")
    res = build(tmp_path, tmp_path / "site")
    assert res.returncode != 0 and "no-such-page.md" in res.stderr, res.stderr[-2000:]


def test_the_figures_are_the_ones_the_benchmarks_wrote():
    for shown, written in (
        ("docs/assets/bench_example.png", "benchmarks/results/bench_example/bench.png"),
        ("docs/assets/scaling.png", "benchmarks/results/scaling.png"),
    ):
        assert (REPO / shown).read_bytes() == (REPO / written).read_bytes(), f"copy {written} to {shown}"
