"""Every long benchmark says up front how long it will take (benchmarks/common.expected_time), so
nobody waits minutes on a script that prints nothing."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

# Scripts whose main need not call expected_time: each finishes in seconds or only reports.
QUICK_OR_REPORT = {
    "device_map_check",  # 32.5 s wall on two H200s (results/device_map.json)
}


def _main(path: Path) -> ast.FunctionDef | None:
    tree = ast.parse(path.read_text())
    return next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"), None)


def _calls_expected_time(fn: ast.FunctionDef) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "expected_time"
        for n in ast.walk(fn)
    )


SCRIPTS = sorted(p for p in BENCH.glob("*.py") if _main(p) is not None)


def test_the_allow_list_names_scripts_that_exist():
    assert QUICK_OR_REPORT <= {p.stem for p in SCRIPTS}


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_each_long_benchmark_states_its_expected_time(path: Path):
    if path.stem in QUICK_OR_REPORT:
        return
    assert _calls_expected_time(_main(path)), (
        f"benchmarks/{path.name}: main() should call common.expected_time(...) after parsing its "
        "arguments (or join QUICK_OR_REPORT, with a comment saying why)"
    )


def test_expected_time_prints_one_flushed_line_with_both_parts(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("common", None)
    from common import expected_time

    expected_time("variants", "about 8 minutes on one H200")
    out = capsys.readouterr().out
    assert out == "variants: expected about 8 minutes on one H200; progress lines follow\n"
    expected_time("peers", "not timed yet")
    assert capsys.readouterr().out == "peers: not timed yet; progress lines follow\n"
