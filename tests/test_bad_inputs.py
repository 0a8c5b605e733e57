"""Bad input gets a clear error naming the thing and the fix, and loses nothing (found by an
adversarial review; each case here once crashed with a traceback or did the wrong thing)."""

import gzip

import pytest
from typer.testing import CliRunner

from eagle3kit.cli import app
from eagle3kit.core.config import ConfigError, PromptSource, load_config
from eagle3kit.core.rundir import DataError, RunDir, load_safetensors, read_jsonl
from eagle3kit.data.sources import read_source


def _src(tmp_path, text: bytes, name="p.jsonl"):
    p = tmp_path / name
    p.write_bytes(text)
    return PromptSource(path=str(p))


@pytest.mark.parametrize(
    "row,needle",
    [
        (b'{"conversations": [{"from": "human", "value": null}]}\n', "must be a string"),
        (b'{"messages": [{"role": "user", "content": 7}]}\n', "must be a string"),
        (b'{"messages": "hi"}\n', "must be a list"),
        (b'{"prompt": {"text": 123}}\n', "must be a string"),
        (b'{"question": 5}\n', "field 'question' must be a string"),
    ],
)
def test_wrongly_typed_rows_name_file_line_and_field(tmp_path, row, needle):
    with pytest.raises(DataError) as e:
        read_source(_src(tmp_path, row))
    assert "p.jsonl:1" in str(e.value) and needle in str(e.value)


def test_non_utf8_fake_gzip_and_directory_are_named(tmp_path):
    with pytest.raises(DataError, match=r"p.jsonl:2: not UTF-8"):
        read_source(_src(tmp_path, b'"ok"\n"caf\xe9"\n'))
    with pytest.raises(DataError, match="not a valid gzip file"):
        read_source(_src(tmp_path, b'"plain"\n', "p.jsonl.gz"))
    real = tmp_path / "real.jsonl.gz"
    with gzip.open(real, "wt") as f:
        f.write('"zipped"\n')
    assert [r for _, r in read_jsonl(real)] == ["zipped"]
    with pytest.raises(DataError, match="is a directory"):
        read_source(PromptSource(path=str(tmp_path)))


def test_config_with_a_duplicated_key_or_non_utf8_bytes(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("vocab:\n  draft_vocab_size: 8\nvocab:\n  draft_vocab_size: 9\n")
    with pytest.raises(ConfigError, match="'vocab' appears twice"):
        load_config(p)
    p.write_bytes(b"run_dir: caf\xe9\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(p)


def test_evaluation_sets_with_the_same_name_are_refused(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("evaluate:\n  sets:\n    - {path: a/x.jsonl}\n    - {path: b/x.jsonl}\n")
    with pytest.raises(ConfigError, match=r"names \['x'\] are used twice"):
        load_config(p)


def test_run_dir_that_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(DataError, match="is a file"):
        RunDir(f)
    with pytest.raises(DataError, match="a parent is a file"):
        RunDir(f / "sub")


def test_a_text_file_where_safetensors_belong(tmp_path):
    p = tmp_path / "tokens.safetensors"
    p.write_text("not tensors")
    with pytest.raises(DataError, match="not a readable safetensors file.*rerun"):
        load_safetensors(p, "rerun `eagle3kit tokenize`")


def test_empty_prompt_source_stops_at_the_prompts_stage(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"run_dir: {tmp_path / 'run'}\nprompts:\n  sources: [{{path: {tmp_path / 'empty.jsonl'}}}]\n"
    )
    res = CliRunner().invoke(app, ["prompts", "-c", str(cfg)])
    assert res.exit_code == 2 and "0 prompts" in " ".join(res.output.split())


@pytest.mark.parametrize(
    "args,needle",
    [
        (["evaluate", "--num-prompts", "-1"], "evaluate.num_prompts"),
        (["evaluate", "--k", "0"], "evaluate.k"),
        (["evaluate", "--max-new-tokens", "-5"], "evaluate.max_new_tokens"),
        (["evaluate", "--mode", "fast"], "evaluate.mode"),
        (
            ["evaluate", "--section", "prompts"],
            "--section names a report.json section: 'evaluate' followed by",
        ),
        (["generate", "--backend", "foo"], "generate.backend"),
        (["train", "--patience", "0"], "train.patience"),
    ],
)
def test_cli_flags_are_validated_like_the_config(tmp_path, args, needle):
    res = CliRunner().invoke(app, args + ["--run-dir", str(tmp_path / "r")])
    assert res.exit_code == 2
    said = " ".join(res.output.split())
    assert needle in said
    if needle.startswith(
        ("evaluate.", "generate.", "train.")
    ):  # the flag is named as the source, not the config
        assert "invalid value on the command line" in said and "from the command line)" in said, said


def test_a_flag_error_blames_the_flag_and_a_rule_over_sections_prints_no_field_path(tmp_path):
    """A bad value from a flag is said to come from the command line (the file is fine); a file's own
    bad value is the file's; a rule over several sections (a DFlash drafter refusing pack_length) is
    its message alone, without an empty field path or the whole config echoed; ``pack_length: null``
    unsets it."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run_dir: {tmp_path / 'r'}\nevaluate: {{k: 3}}\n")
    said = " ".join(CliRunner().invoke(app, ["evaluate", "-c", str(cfg), "--k", "0"]).output.split())
    assert (
        f"invalid value on the command line (config {cfg})" in said
        and "(got 0, from the command line)" in said
    )
    cfg.write_text(f"run_dir: {tmp_path / 'r'}\nevaluate: {{k: 0}}\n")
    said = " ".join(CliRunner().invoke(app, ["evaluate", "-c", str(cfg)]).output.split())
    assert f"{cfg}: invalid config: evaluate.k:" in said and "command line" not in said, said
    cfg.write_text(f"run_dir: {tmp_path / 'r'}\ndrafter: {{variant: dflash}}\ntrain: {{pack_length: 512}}\n")
    said = " ".join(CliRunner().invoke(app, ["train", "-c", str(cfg)]).output.split())
    assert f"{cfg}: invalid config: train.pack_length is not read by a DFlash drafter: unset it" in said, said
    assert "(got {" not in said and ": Value error" not in said
    cfg.write_text(f"run_dir: {tmp_path / 'r'}\ndrafter: {{variant: dflash}}\ntrain: {{pack_length: null}}\n")
    assert load_config(cfg).train.pack_length == 0


def test_every_stage_records_the_config_it_used(tmp_path):
    (tmp_path / "p.jsonl").write_text('"hello there friend"\n"second prompt here"\n')
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"run_dir: {tmp_path / 'run'}\nprompts:\n  sources: [{{path: {tmp_path / 'p.jsonl'}}}]\n"
        "  heldout_fraction: 0.0\nvocab: {draft_vocab_size: 256}\n"
    )
    assert CliRunner().invoke(app, ["prompts", "-c", str(cfg)]).exit_code == 0
    stored = load_config(tmp_path / "run" / "config.yaml")
    assert stored.vocab.draft_vocab_size == 256  # a later `--run-dir` alone uses it, not the defaults


def test_malformed_prompt_rows_are_reported_by_line_and_skipped(tmp_path):
    """Issue 3 point 4: bad JSON, missing fields, wrong types, empty prompts and non-UTF-8 bytes
    are each named by file:line and skipped; the good rows around them go on."""
    src = tmp_path / "mixed.jsonl"
    src.write_bytes(
        b'{"turns": ["first good"]}\n'  # 1
        b'{"turns": [\n'  # 2 bad JSON
        b'{"foo": 1}\n'  # 3 no known format
        b'{"messages": [{"role": "user"}]}\n'  # 4 message without content
        b'{"turns": ["   "]}\n'  # 5 empty prompt
        b'"caf\xe9"\n'  # 6 not UTF-8
        b'{"question": 5}\n'  # 7 wrong type
        b'"second good"\n'  # 8
    )
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"run_dir: {tmp_path / 'run'}\nprompts:\n  heldout_fraction: 0\n  sources: [{{path: {src}}}]\n"
    )
    res = CliRunner().invoke(app, ["prompts", "-c", str(cfg)])
    assert res.exit_code == 0, res.output
    kept = [r["messages"][0]["content"] for _, r in read_jsonl(tmp_path / "run" / "prompts.jsonl")]
    assert kept == ["first good", "second good"]
    rejected = [r for _, r in read_jsonl(tmp_path / "run" / "prompts_rejected.jsonl")]
    assert [r["line"] for r in rejected] == [2, 3, 4, 5, 6, 7]
    reasons = {r["line"]: r["reason"] for r in rejected}
    assert (
        "not valid JSON" in reasons[2]
        and "not UTF-8" in reasons[6]
        and "matches no prompt format" in reasons[3]
    )
    assert (
        "'role' and 'content'" in reasons[4]
        and "empty prompt" in reasons[5]
        and "must be a string" in reasons[7]
    )
    out = " ".join(res.output.split())
    assert "skipped 6 malformed or empty row(s)" in out and "mixed.jsonl:2" in out
    report = RunDir(tmp_path / "run").report["prompts"]
    assert (
        report["dropped_malformed"] == 5 and report["dropped_empty_prompt"] == 1 and report["rows_kept"] == 2
    )
    # the strict setting stops at the first bad row instead
    cfg.write_text(
        cfg.read_text().replace("heldout_fraction: 0\n", "heldout_fraction: 0\n  on_bad_row: error\n")
    )
    res = CliRunner().invoke(app, ["prompts", "-c", str(cfg)])
    assert res.exit_code == 2 and "mixed.jsonl:2: not valid JSON" in " ".join(res.output.split())


def test_ctrl_c_says_what_is_kept_and_how_to_resume(tmp_path, monkeypatch):
    import eagle3kit.cli

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(eagle3kit.cli, "run_extract", interrupted)
    (tmp_path / "run").mkdir()
    res = CliRunner().invoke(app, ["extract", "--run-dir", str(tmp_path / "run"), "--shard-tokens", "4096"])
    out = " ".join(res.output.split())
    assert res.exit_code == 130
    assert (
        "interrupted: `eagle3kit extract` keeps what it finished" in out
        and "run the same command again to resume" in out
    )
    assert not (tmp_path / "run" / "config.yaml").exists()  # an interrupted command stores no config


def test_run_takes_its_config_as_an_argument_or_with_c_like_every_stage(tmp_path):
    """`eagle3kit run -c FILE` is `eagle3kit run FILE` (new-user trial: every other stage takes -c);
    two different configs are refused (exit 2) before anything runs."""
    from typer.testing import CliRunner

    from eagle3kit.cli import app

    bad = tmp_path / "c.yaml"
    bad.write_text("train: {epochs: -3}\n")  # refused by validation: no stage runs
    by_arg, by_opt = (CliRunner().invoke(app, args) for args in (["run", str(bad)], ["run", "-c", str(bad)]))
    assert by_arg.exit_code == by_opt.exit_code != 0 and "epochs" in by_opt.output
    assert " ".join(by_arg.output.split()) == " ".join(by_opt.output.split())
    other = tmp_path / "d.yaml"
    other.write_text("train: {epochs: 1}\n")
    both = CliRunner().invoke(app, ["run", str(bad), "-c", str(other)])
    assert both.exit_code == 2 and "two configs" in " ".join(both.output.split())


def test_check_on_a_folder_that_does_not_exist_says_so_and_exits_2(tmp_path):
    """New-user trial: `check` on a mistyped drafter path listed two missing files as findings
    (exit 1, as for a broken export); a path that is no folder is a usage error naming the path."""
    from typer.testing import CliRunner

    from eagle3kit.cli import app

    res = CliRunner().invoke(app, ["check", str(tmp_path / "no-such-drafter")])
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and f"no drafter folder at {tmp_path / 'no-such-drafter'}" in said
    assert "missing_file" not in said


@pytest.mark.parametrize(
    "text,needle",
    [
        ("", "the file is empty"),  # ran the whole default SmolLM2 job, silently
        ("# every line commented out\n", "the file is empty"),
        (
            "train: {epochs: true}\n",
            "train.epochs: a number is needed here, not true/false",
        ),  # was epochs 1
        ("train: {lr: false}\n", "train.lr: a number is needed here"),
        (  # was aux layers [1, 5]
            "target: {aux_layer_ids: [true, 5, 9]}\n",
            "target.aux_layer_ids: a number is needed here, not true/false",
        ),
        ("train: {betas: [true, 0.9]}\n", "train.betas: a number is needed here"),
    ],
)
def test_an_empty_config_or_true_for_a_number_is_refused(tmp_path, text, needle):
    """Hostile-input trial: `-c empty.yaml` ran the default job without a word, and `epochs: true`
    trained 1 epoch; both are refused (exit 2) before anything runs."""
    from typer.testing import CliRunner

    from eagle3kit.cli import app

    (tmp_path / "c.yaml").write_text(text)
    res = CliRunner().invoke(app, ["prompts", "-c", str(tmp_path / "c.yaml")])
    assert res.exit_code == 2 and needle in " ".join(res.output.split()), res.output
    assert not (tmp_path / "runs").exists()


def test_a_config_path_that_is_a_folder_is_named_as_a_folder(tmp_path):
    from eagle3kit.core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="is a folder, not a YAML file"):
        load_config(tmp_path)
