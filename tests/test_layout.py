"""Issue 22: the package's shape is checked, not hoped for.

* imports run downward only, folder by folder in pipeline order, and no module circle exists in
  any folder: import-linter's contracts in ``pyproject.toml`` (``lint-imports``);
* ruff (pyflakes, pycodestyle, isort, imports at the top except the heavy optional ones) is clean
  and the code is formatted;
* no function of the package runs past 80 lines unless its docstring says why.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "eagle3kit"
BIN = Path(sys.executable).parent
LONG = 80
REASON = "Over 80 lines because"


def _tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.fail(
            f"{path} is missing: install the test extras (`./install.sh` does: pip install -e '.[test]')"
        )
    return str(path)


def _lint_imports(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_tool("lint-imports"), "--no-cache"],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(pythonpath), "PATH": "/usr/bin:/bin"},
    )


def test_imports_run_downward_and_never_in_a_circle():
    res = _lint_imports(ROOT, ROOT / "src")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Contracts: 2 kept, 0 broken." in res.stdout


@pytest.mark.parametrize(
    "module,line,contract",
    [
        ("core/ui.py", "from eagle3kit.serve import check  # noqa", "folders import downward only BROKEN"),
        ("data/reasoning.py", "from eagle3kit.data import tokenize  # noqa", "no import circles"),
    ],
)
def test_the_import_contracts_catch_an_upward_import_and_a_circle(tmp_path, module, line, contract):
    """The same contracts on a copy of the package with one bad import added must break."""
    shutil.copytree(PACKAGE, tmp_path / "src" / "eagle3kit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    bad = tmp_path / "src" / "eagle3kit" / module
    bad.write_text(bad.read_text() + "\n" + line + "\n")
    res = _lint_imports(tmp_path, tmp_path / "src")
    assert res.returncode == 1 and contract in res.stdout, res.stdout


def test_ruff_is_clean_and_the_code_formatted():
    paths = ["src", "tests", "benchmarks", "examples"]
    lint = subprocess.run([_tool("ruff"), "check", *paths], cwd=ROOT, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = subprocess.run(
        [_tool("ruff"), "format", "--check", *paths], cwd=ROOT, capture_output=True, text=True
    )
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def long_functions(root: Path) -> list[str]:
    """``path:line name (N lines)`` of every function over :data:`LONG` lines whose docstring, or the
    comment line right above it and its decorators (for a command, whose docstring is its ``--help``),
    does not say why (:data:`REASON`)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                above = lines[first - 2] if first >= 2 else ""
                why = (ast.get_docstring(node) or "") + (above if above.lstrip().startswith("#") else "")
                if n > LONG and REASON not in why:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return found


def test_the_command_line_starts_without_the_heavy_modules_only_some_commands_need():
    """Every `eagle3kit` command imports ``eagle3kit.cli``: vLLM, transformers and torch.distributed's
    checkpoint and FSDP modules (together about 0.7 s, for training only) are imported inside the
    functions that use them, so a command that does not use them never pays for them."""
    heavy = ["vllm", "transformers", "torch.distributed.checkpoint", "torch.distributed.fsdp"]
    code = f"import sys, eagle3kit.cli; print([m for m in {heavy!r} if m in sys.modules])"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr


def test_no_function_runs_past_80_lines_without_a_reason():
    assert long_functions(PACKAGE) == []


def test_the_length_rule_sees_a_long_function(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(LONG))
    (tmp_path / "m.py").write_text(f"def long():\n{body}\n\ndef short():\n    return 1\n")
    assert long_functions(tmp_path) == [f"m.py:1 long ({LONG + 1} lines)"]
    (tmp_path / "m.py").write_text(f'def long():\n    """{REASON} it is a table."""\n{body}')
    assert long_functions(tmp_path) == []


#: what a source file never cites: a design note outside the repository, case ids defined nowhere in it,
#: issue numbers (history belongs in CHANGELOG.md)
OUTSIDE = r"DESIGN\.md|\bC[0-9]{2}\b|[Ii]ssues? [0-9]+|field cases?\b"


def outside_citations(root: Path) -> list[str]:
    """``path:line: text`` for every line under ``root`` (``*.py``) that matches :data:`OUTSIDE`."""
    import re

    return [
        f"{p.relative_to(root)}:{i}: {line.strip()}"
        for p in sorted(root.rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(OUTSIDE, line)
    ]


def test_the_source_cites_only_the_repository(tmp_path):
    """The design of record is docs/architecture.md and docs/conventions.md: no source file cites the
    contributors' note outside the repository, a field case id or an issue number. The check sees each."""
    assert outside_citations(ROOT / "src") == []
    (tmp_path / "m.py").write_text('"""x (DESIGN.md §3)."""\n# as in C27\n# see issue 24\nOK = 1  # CPU 2\n')
    assert [c.split(":")[1] for c in outside_citations(tmp_path)] == ["1", "2", "3"]


#: where a drafter kind's name may appear outside its own package: the registry, the CLI's help texts,
#: and (for DFlash) the DSpark package, whose drafter is DFlash's network with heads added
KIND_NAME_ALLOWED = {
    "dflash": {"core/kinds.py", "cli.py", "cli_measure.py", "drafters/dspark/"},
    "dspark": {"core/kinds.py", "cli.py", "cli_measure.py"},
}


def kind_names_outside(package: Path) -> list[str]:
    """``path:line`` of each line naming a drafter kind (other than the EAGLE-3 family, whose name is the
    package's) outside the kind's own package and :data:`KIND_NAME_ALLOWED`."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        for name, allowed in KIND_NAME_ALLOWED.items():
            if rel.startswith(f"drafters/{name}/") or any(rel.startswith(a) for a in allowed):
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if name in line.lower():
                    found.append(f"{rel}:{n}: {line.strip()}")
    return found


def test_a_kind_is_named_only_in_its_own_package_and_the_registry(tmp_path):
    """A stage never names a drafter kind: its config keys, checks, legacy files and messages live in its
    package (``drafters/<kind>/``) and reach the stages through the registry. A stage that names one is
    found (a copy of the package with one such line planted)."""
    assert kind_names_outside(PACKAGE) == []
    copy = tmp_path / "eagle3kit"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    stage = copy / "train" / "stage.py"
    stage.write_text(stage.read_text() + '\nIS_BLOCK = ("dflash",)\n')
    assert [f.split(":")[0] for f in kind_names_outside(copy)] == ["train/stage.py"]
