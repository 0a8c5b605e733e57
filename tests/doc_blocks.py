"""The shell blocks of the README and the hand-written docs, with the label line above each.

Every fenced block whose info string (up to the first space, ``,`` or ``{``; ``{.bash}`` counts) is
bash, sh, shell, zsh, console or shell-session, or that is untagged and whose first non-blank line
starts with ``$ `` (a transcript), carries one italic line directly
above it (then a blank line, then the fence) saying what it needs and whether CI runs it:

* ``*Runs on a CPU; CI runs it (TEST).*`` — TEST executes exactly this block's text;
* ``*Needs WHAT; CI runs it against its own servers (TEST).*`` — TEST runs it against the vLLM
  servers it starts (:func:`engine_block` swaps in their URLs, drafter, shared folder and venv);
* ``*Needs WHAT; run on an H200.*`` — benchmarks/results/ records this exact command on an H200;
* ``*Needs WHAT; not run by CI.*``

:data:`RUN_BY` names the test of every block labelled "CI runs it" (tests/test_doc_blocks.py
checks both agree)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHELL = {"bash", "sh", "shell", "zsh", "console", "shell-session"}
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>.*)$")
INFO = re.compile(r"^\{?\.?(?P<lang>[^\s,{}]*)")  # "bash,ignore" and "{.bash}" → "bash"
LABEL = re.compile(
    r"^\*(?:Runs on a CPU; CI runs it \((?P<cpu_test>[^()\s]+)\)"
    r"|Needs (?P<what>\S.*?); (?:CI runs it against its own servers \((?P<server_test>[^()\s]+)\)"
    r"|(?P<h200>run on an H200)|(?P<none>not run by CI)))\.\*$"
)

#: "FILE#N" (the Nth shell block of FILE) → the test node that runs it
RUN_BY: dict[str, str] = {
    "README.md#2": "tests/test_doc_blocks.py::test_the_test_command_is_what_ci_runs",
    "docs/getting-started.md#2": "tests/test_doc_blocks.py::test_the_test_command_is_what_ci_runs",
    "docs/install.md#2": "tests/test_doc_blocks.py::test_the_install_check_lists_every_command",
    "docs/bench.md#2": "tests/test_engine_acceptance.py::test_the_bench_page_commands_run_as_written",
    "docs/bench.md#3": "tests/test_engine_acceptance.py::test_the_bench_page_commands_run_as_written",
    "docs/diagnose.md#1": "tests/test_engine_acceptance.py::test_the_diagnose_page_command_runs_as_written",
}


@dataclass(frozen=True)
class Block:
    file: str  # relative to the repo, e.g. "docs/bench.md"
    index: int  # 1-based among the file's shell blocks
    line: int  # 1-based line of the opening fence
    label: str | None  # the italic line directly above (then one blank line), else None
    text: str  # the block's lines, dedented by the fence's indent, ending with a newline

    @property
    def key(self) -> str:
        return f"{self.file}#{self.index}"

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def scan(markdown: str, file: str = "<text>") -> tuple[list[Block], list[str]]:
    """The shell blocks of ``markdown`` and its fence problems (a fence still open at the end of the
    file, as "file:line: ..."). A fence closes only on a line of the same character, at least as long,
    and nothing else but spaces (CommonMark). A label is the line two above the fence when the line
    between is blank and it starts with ``*`` (whether it is well formed is :func:`label_problem`'s)."""
    lines = markdown.splitlines()
    out, problems, i = [], [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or (m.group("fence")[0] == "`" and "`" in m.group("info")):
            i += 1
            continue
        indent, fence = m.group("indent"), m.group("fence")
        info = INFO.match(m.group("info").strip()).group("lang").lower()
        close = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        if j == len(lines):
            problems.append(f"{file}:{i + 1}: the fence {fence!r} opened here is never closed")
        first = next((ln.strip() for ln in lines[i + 1 : j] if ln.strip()), "")
        if info in SHELL or (not info and first.startswith("$ ")):
            above = lines[i - 2].strip() if i >= 2 else ""
            label = above if above.startswith("*") and i >= 2 and not lines[i - 1].strip() else None
            body = [ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1 : j]]
            out.append(Block(file, len(out) + 1, i + 1, label, "".join(ln + "\n" for ln in body)))
        i = j + 1
    return out, problems


def parse(markdown: str, file: str = "<text>") -> list[Block]:
    """The shell blocks of ``markdown`` (:func:`scan`'s)."""
    return scan(markdown, file)[0]


def _scan_file(path: str | Path) -> tuple[list[Block], list[str]]:
    p = Path(path)
    p = p if p.is_absolute() else REPO / p
    name = str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)
    return scan(p.read_text(), name)


def blocks(path: str | Path) -> list[Block]:
    return _scan_file(path)[0]


def pages() -> list[Path]:
    """README.md, CONTRIBUTING.md, docs/*.md and docs/recipes/*.md (docs/reference/ is generated)."""
    docs = REPO / "docs"
    return [
        REPO / "README.md",
        REPO / "CONTRIBUTING.md",
        *sorted(docs.glob("*.md")),
        *sorted((docs / "recipes").glob("*.md")),
    ]


def all_blocks() -> list[Block]:
    return [b for p in pages() for b in blocks(p)]


def fence_problems() -> list[str]:
    """Every page's fences still open at the end of the file (file:line)."""
    return [problem for p in pages() for problem in _scan_file(p)[1]]


def label_problem(block: Block) -> str | None:
    """Why the block's label is missing or malformed, naming file:line; None when it is fine."""
    if block.label is None:
        return f"{block.where}: no label line (an italic line, then a blank line) above this shell block"
    if not LABEL.match(block.label):
        return f"{block.where}: malformed label {block.label!r}"
    return None


def ci_test(block: Block) -> str | None:
    """The test node a "CI runs it" label names, else None."""
    m = LABEL.match(block.label or "")
    return (m.group("cpu_test") or m.group("server_test")) if m else None


def block(file: str, n: int) -> Block:
    found = [b for b in blocks(file) if b.index == n]
    if not found:
        raise LookupError(f"{file} has no shell block {n}")
    return found[0]


def engine_block(
    file: str,
    n: int,
    url_spec: str | Path | None,
    url_plain: str | Path | None,
    drafter: str | Path | None,
    shared: str | Path | None,
    venv_bin: str | Path | None,
) -> str:
    """Block ``n`` of ``file`` with the page's server URLs (http://127.0.0.1:8000 with the drafter,
    :8001 without), ``runs/default/drafter``, ``../shared`` and ``.venv/bin/`` replaced by the given
    ones (paths as strings; ``venv_bin`` is a folder, a trailing ``/`` is added).

    Raises ValueError when a placeholder the block holds has no value, or when a value is given for a
    placeholder the block no longer holds, so a page edit cannot silently run another command; the one
    exception is ``url_plain``, which a block that needs only the drafter's server (diagnose) lacks."""
    text = block(file, n).text
    venv_bin = None if venv_bin is None else str(venv_bin).rstrip("/") + "/"
    url_end, path_end = r"(?!\d)", r"(?![\w-])"  # whole URLs and paths: not :80001, not drafter-old
    for placeholder, end, value, required in (
        ("http://127.0.0.1:8000", url_end, url_spec, True),
        ("http://127.0.0.1:8001", url_end, url_plain, False),
        ("runs/default/drafter", path_end, drafter, True),
        ("../shared", path_end, shared, True),
        (".venv/bin/", "", venv_bin, True),  # ends in "/": what follows is the command
    ):
        pattern = re.compile(re.escape(placeholder) + end)
        if value is None:
            if pattern.search(text):
                raise ValueError(f"{file}#{n} holds {placeholder!r}, but no replacement was given")
        elif pattern.search(text):
            text = pattern.sub(lambda _m, v=str(value): v, text)
        elif required:
            raise ValueError(f"{file}#{n} no longer holds {placeholder!r}")
    return text
