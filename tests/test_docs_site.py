"""The documentation site: `mkdocs build --strict` passes (a broken link, an anchor that does not exist or a
page left out of the navigation fails it — shown on a copy with a broken link), and the figures the docs
show are the ones the benchmarks wrote."""

import os
import re
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


#: what a user never reads in the README or the docs: case ids (C35), issue numbers, commit hashes; and in
#: the README no dates either (history lives in CHANGELOG.md and benchmarks/results/)
FORBIDDEN = {
    "case id": r"\bC\d{2}\b",
    "issue number": r"\b[Ii]ssues? #?\d+",
    "commit hash": r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b",
}


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def words_found(text: str, readme: bool) -> list[str]:
    rules = {**FORBIDDEN, **({"date": r"\b20\d\d-\d\d-\d\d\b"} if readme else {})}
    text = " ".join(text.split())  # a phrase wrapped over two lines is still one phrase
    return [f"{what}: {m.group(0)}" for what, p in rules.items() for m in re.finditer(p, text)]


def test_no_case_ids_issue_numbers_or_hashes_in_the_readme_or_docs_and_no_dates_in_the_readme():
    found = {
        str(p.relative_to(REPO)): words
        for p in _pages()
        if (words := words_found(p.read_text(), p.name == "README.md"))
    }
    assert found == {}


def test_the_word_rules_see_what_they_forbid():
    bad = "the template check (C35), issue\n24's aim, measured at 2c1ed6a on 2026-12-04"
    assert [w.split(":")[0] for w in words_found(bad, readme=True)] == [
        "case id", "issue number", "commit hash", "date",
    ]  # fmt: skip
    assert words_found("a sha256 of 64 hex digits is no hash: " + "ab12" * 16, readme=True) == []


def test_the_readme_is_a_landing_page():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    heads = [ln for ln in text.splitlines() if ln.startswith("## ")]
    assert heads[:2] == ["## What it does that the peers do not", "## Try it on a CPU: the two commands"]
    assert (
        "./install.sh && .venv/bin/eagle3kit run" in text
        and "./install.sh && .venv/bin/python -m pytest -q" in text
    )


def _gen():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import gen_reference
    finally:
        sys.path.pop(0)
    return gen_reference


def test_the_generated_reference_pages_match_the_code():
    """docs/reference/ is what tools/gen_reference.py writes from the typer app and the config schema: a
    command, option or config field changed without rerunning it fails here."""
    gen = _gen()
    for name, text in (("cli.md", gen.cli_reference()), ("config-keys.md", gen.config_reference())):
        assert (REPO / "docs" / "reference" / name).read_text() == text, (
            f"docs/reference/{name} is stale: run .venv/bin/python tools/gen_reference.py"
        )


def documented_keys(page: str) -> set[str]:
    """The config keys the first column of a page's tables names: ``a.b``, and ``a.b``, ``c`` (a key of the
    same section) in a row that names several."""
    keys = set()
    for line in page.splitlines():
        if not line.startswith("| `"):
            continue
        names = re.findall(r"`([\w.]+)`", line.split("|")[1])
        section = names[0].rsplit(".", 1)[0] + "." if "." in names[0] else ""
        keys |= {n if "." in n or not section else section + n for n in names}
    return keys


def test_the_configuration_guide_explains_every_key_of_the_schema():
    """docs/config.md (the hand-written guide with the meanings) names every key the schema has and none
    it does not: a field added, renamed or removed without its line fails here."""
    schema = {ln.split("`")[1] for ln in _gen().config_reference().splitlines() if ln.startswith("| `")}
    documented = documented_keys((REPO / "docs" / "config.md").read_text())
    assert sorted(schema - documented) == [] and sorted(documented - schema) == []
