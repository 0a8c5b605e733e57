"""Every shell block of the README and the hand-written docs says what it needs and whether CI runs it
(tests/doc_blocks.py: the label forms and the registry of the blocks CI runs), and the cheap ones run
here as written: through bash, in a temp folder laid out like a checkout (`.venv` and `examples/`
linked to this one's, `../shared` to the shared folder)."""

import os
import re
import shlex
import subprocess
from pathlib import Path
from unittest import mock

import doc_blocks as db
import typer
from conftest import SHARED

from eagle3kit.cli import app

REPO = db.REPO


def run_block(text: str, tmp: Path, venv_on_path: bool = False) -> subprocess.CompletedProcess:
    """``text`` run by bash in ``tmp/work`` (``.venv``, ``examples`` and ``../shared`` linked as in a
    clone); ``venv_on_path``: the venv's bin first on PATH, as after the page's ``source …/activate``."""
    work = tmp / "work"
    work.mkdir(parents=True)
    (work / ".venv").symlink_to(REPO / ".venv")
    (work / "examples").symlink_to(REPO / "examples")
    (tmp / "shared").symlink_to(SHARED.resolve())
    env = dict(os.environ)
    if venv_on_path:
        env["PATH"] = f"{REPO / '.venv' / 'bin'}{os.pathsep}{env['PATH']}"
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", text],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


# -- the labels ---------------------------------------------------------------------------------------


def test_every_shell_block_has_a_well_formed_label():
    found = db.all_blocks()
    assert len(found) >= 35  # README.md, docs/*.md and docs/recipes/*.md hold shell blocks, and it saw them
    assert any(b.file == "CONTRIBUTING.md" for b in found)
    problems = db.fence_problems() + [p for b in found if (p := db.label_problem(b))]
    assert problems == [], "\n".join(problems)


FIXTURE = """# A page

*Runs on a CPU; CI runs it (tests/test_x.py::test_a).*

```bash
echo one
```

No label here:

```sh
echo two
```

*Needs a GPU, hopefully.*

```console
$ echo three
```

- a list item

  *Needs a GPU and the Llama-3.1-8B weights; run on an H200.*

  ```shell
  echo four
  ```

```yaml
not: a shell block
```

*Needs a vLLM server on port 8000 (the page above); CI runs it against its own servers (tests/test_y.py::test_b).*

```bash
echo five \\
  six
```
"""


def test_the_parser_sees_each_shell_block_and_flags_a_missing_or_malformed_label():
    found = db.parse(FIXTURE, "page.md")
    assert [(b.index, b.line, b.text) for b in found] == [
        (1, 5, "echo one\n"),
        (2, 11, "echo two\n"),
        (3, 17, "$ echo three\n"),
        (4, 25, "echo four\n"),  # the list item's indent taken off
        (5, 35, "echo five \\\n  six\n"),
    ]
    assert [db.label_problem(b) for b in found] == [
        None,
        "page.md:11: no label line (an italic line, then a blank line) above this shell block",
        "page.md:17: malformed label '*Needs a GPU, hopefully.*'",
        None,
        None,
    ]
    assert [db.ci_test(b) for b in found] == [
        "tests/test_x.py::test_a",
        None,
        None,
        None,
        "tests/test_y.py::test_b",
    ]
    # a label not directly above (no blank line between, or prose between) is no label
    assert db.parse("*Needs a GPU; not run by CI.*\n```bash\nx\n```\n")[0].label is None
    assert db.parse("*Needs a GPU; not run by CI.*\n\ntext\n\n```bash\nx\n```\n")[0].label is None


def test_a_fence_closes_only_on_a_bare_fence_at_least_as_long():
    page = "````md\n```bash\nnot a block\n```\n````\n\n```bash\nhidden\n```bash\n```\n\n```sh\nlast\n```\n"
    assert [(b.line, b.text) for b in db.parse(page)] == [(7, "hidden\n```bash\n"), (12, "last\n")]
    assert db.scan(page, "p.md")[1] == []
    assert db.parse("~~~bash\na\n```\n~~~~ \n")[0].text == "a\n```\n"  # same character only
    blocks, problems = db.scan("text\n\n```bash\nx\n``\n", "p.md")
    assert problems == ["p.md:3: the fence '```' opened here is never closed"]


def test_info_strings_with_attributes_other_shells_and_untagged_transcripts_are_shell_blocks():
    infos = ["bash,ignore", "{.bash}", "sh {title=x}", "zsh", "shell-session", "Console"]
    page = "".join(f"```{info}\nx\n```\n\n" for info in infos)
    assert len(db.parse(page)) == len(infos)
    page = "```\n\n$ eagle3kit check d\nok\n```\n\n```\nplain text\n```\n\n```python\n$ x\n```\n"
    assert [b.text for b in db.parse(page)] == ["\n$ eagle3kit check d\nok\n"]


def _check_node(node: str) -> None:
    """The test ``node`` (FILE::TEST) names exists (this file owns some, test_engine_acceptance.py the rest)."""
    assert node.count("::") == 1, f"{node!r}: write the node as FILE::TEST (two colons)"
    path, name = node.split("::")
    assert path in ("tests/test_doc_blocks.py", "tests/test_engine_acceptance.py"), node
    assert path != "tests/test_doc_blocks.py" or name.startswith("test_") and name in globals(), node
    assert re.search(rf"^def {re.escape(name)}\(", (REPO / path).read_text(), re.M), node


def test_the_registry_is_the_blocks_labelled_ci_runs_it():
    labelled = {b.key: t for b in db.all_blocks() if (t := db.ci_test(b))}
    assert labelled == db.RUN_BY
    for node in db.RUN_BY.values():
        _check_node(node)


def test_the_registry_check_names_a_node_written_with_one_colon_and_escapes_the_name():
    for node, message in (
        ("tests/test_doc_blocks.py:test_x", "write the node as FILE::TEST"),
        ("tests/test_engine_acceptance.py::test_.*", "test_.*"),  # not a pattern matching any test
    ):
        try:
            _check_node(node)
        except AssertionError as e:
            assert message in str(e), e
        else:
            raise AssertionError(f"{node!r} passed")


# -- the blocks CI runs -------------------------------------------------------------------------------


def test_the_test_command_is_what_ci_runs():
    """The README's and getting-started's test command is the line `.ci/run` runs on a clean checkout
    (running it here would run the whole suite inside itself)."""
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    for key in ("README.md#2", "docs/getting-started.md#2"):
        file, n = key.split("#")
        text = db.block(file, int(n)).text.strip()
        assert text == "./install.sh && .venv/bin/python -m pytest -q", key
        assert text in ci, f"{key}: .ci/run does not run {text!r}"


def test_the_install_check_lists_every_command(tmp_path):
    res = run_block(db.block("docs/install.md", 2).text, tmp_path, venv_on_path=True)
    assert res.returncode == 0, res.stderr[-2000:]
    commands = typer.main.get_command(app).commands
    listed = set(re.findall(r"^  ([\w-]+)  ", res.stdout, re.M))  # click's "Commands:" list
    assert len(commands) >= 15 and set(commands) <= listed, sorted(set(commands) - listed)


# -- the servers the bench page starts are the ones CI starts --------------------------------------------


def _flags(argv: list[str]) -> dict[str, str | None]:
    """``--flag value`` / ``--switch`` of an argv, as {flag: value or None}."""
    out, i = {}, 0
    while i < len(argv):
        if argv[i].startswith("--"):
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            out[argv[i]] = argv[i + 1] if has_value else None
            i += 2 if has_value else 1
        else:
            i += 1
    return out


def test_the_bench_page_starts_its_servers_with_the_flags_ci_servers_use(tmp_path):
    """bench.md's `CPU=` flags against what :class:`VLLMServer` (the CI's servers) launches with.
    Both must pass the same dtype, eager mode and context length and fix the KV cache in bytes; the
    page's KV-cache size (1 GB) and `--max-num-seqs 8` are its own (VLLMServer: 256 MiB, vLLM's
    default sequence count), so for those only the flag's presence on the page is checked."""
    from eagle3kit.core.engines import VLLMServer

    line = next(ln for ln in db.block("docs/bench.md", 1).text.splitlines() if ln.startswith("CPU="))
    page = _flags(shlex.split(shlex.split(line)[0].split("=", 1)[1]))
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(
        '{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}'
    )
    with mock.patch("subprocess.Popen") as popen:
        VLLMServer(tmp_path / "target", 8000, tmp_path / "log").spawn()
    ci = _flags(popen.call_args.args[0])
    shared = ("--dtype", "--enforce-eager", "--max-model-len")
    assert {f: page.get(f, "absent") for f in shared} == {f: ci.get(f, "absent") for f in shared}
    assert page["--dtype"] == "float32" and "--enforce-eager" in page
    assert "--kv-cache-memory-bytes" in page and "--kv-cache-memory-bytes" in ci
    assert set(page) - set(ci) <= {"--max-num-seqs"}, sorted(set(page) - set(ci))


def test_engine_block_puts_ci_servers_where_the_page_has_its_own():
    text = db.engine_block("docs/bench.md", 3, "http://h:1", "http://h:2", "/d/drafter", "/s", "/v/bin")
    assert "127.0.0.1" not in text and "runs/default/drafter" not in text and "../shared" not in text
    assert "--base-url http://h:1 --baseline-url http://h:2" in text
    assert text.count("/v/bin/eagle3kit bench") == 2 and "--prompts /s/data/prompts/mt_bench.jsonl" in text
    assert "runs/bench/before/bench.json" in text  # the block's own outputs stay relative
    # diagnose needs only the drafter's server: the plain URL may be given and is unused
    diag = db.engine_block("docs/diagnose.md", 1, "http://h:1", "http://h:2", "/d", "/s", "/v/bin/")
    assert "--base-url http://h:1 --drafter /d " in diag and "h:2" not in diag
    for bad in (
        ("docs/bench.md", 2, "http://h:1", None, "/d", "/s", "/v"),  # the page's :8001 left in
        ("docs/bench.md", 1, "http://h:1", "http://h:2", "/d", "/s", "/v"),  # block 1 has no ../shared
    ):
        try:
            db.engine_block(*bad)
        except ValueError:
            continue
        raise AssertionError(f"no ValueError for {bad[:2]}")


def test_engine_block_replaces_whole_urls_and_paths_only(tmp_path):
    page = tmp_path / "page.md"
    label = "*Needs a server; not run by CI.*\n\n"
    page.write_text(
        f"{label}```bash\n.venv/bin/eagle3kit bench --base-url http://127.0.0.1:8000 "
        "--baseline-url http://127.0.0.1:80001 --drafter runs/default/drafter-old --shared ../shared/x\n```\n"
        f"\n{label}```bash\n.venv/bin/x http://127.0.0.1:8000/v1 runs/default/drafter ../shared\n```\n"
    )
    try:
        db.engine_block(str(page), 1, "http://h:1", "http://h:2", "/d", "/s", "/v")
    except ValueError as e:
        assert "no longer holds 'runs/default/drafter'" in str(e), e
    else:
        raise AssertionError("runs/default/drafter-old taken for runs/default/drafter")
    text = db.engine_block(str(page), 1, "http://h:1", "http://h:2", None, "/s", "/v")
    assert "http://127.0.0.1:80001 --drafter runs/default/drafter-old --shared /s/x" in text
    assert db.engine_block(str(page), 2, "http://h:1", None, "/d", "/s", "/v") == "/v/x http://h:1/v1 /d /s\n"
