import json

import pytest

from eagle3kit.core.config import Config, TokenizeConfig
from eagle3kit.core.rundir import RunDir
from eagle3kit.data.backends import render_prompt_ids
from eagle3kit.data.templates import think_spec
from eagle3kit.data.tokenize import load_shard, run_tokenize, samples_for_row

EOT = 2  # <|im_end|> in SmolLM2's vocabulary


def _row(tok, user, completion_text, finish="stop", with_ids=True):
    msgs = [{"role": "user", "content": user}]
    row = {
        "id": user[:8],
        "messages": msgs,
        "content": completion_text,
        "finish_reason": finish,
        "template_flags": {},
    }
    if with_ids:
        ids = tok(completion_text, add_special_tokens=False)["input_ids"]
        row["completion_ids"] = ids + ([EOT] if finish == "stop" else [])
        row["prompt_ids"] = render_prompt_ids(tok, msgs)
    return row


def build_sample(tok, row, eot, max_length):
    (s,), reason = samples_for_row(tok, row, think_spec(tok), [eot], max_length)
    return s.ids, s.mask, reason


def test_prompt_then_completion_and_mask_covers_exactly_the_reply(smollm2_tokenizer):
    tok = smollm2_tokenizer
    row = _row(tok, "What is 3+3?", "The answer is 6.")
    ids, mask, reason = build_sample(tok, row, EOT, 2048)
    assert reason is None
    prompt = render_prompt_ids(tok, row["messages"])
    assert ids[: len(prompt)] == prompt
    masked = [t for t, m in zip(ids, mask) if m]
    assert tok.decode(masked) == "The answer is 6.<|im_end|>"
    assert 0 < sum(mask) < len(ids)


def test_text_only_rows_get_the_end_of_turn_token_unless_truncated(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids, mask, _ = build_sample(tok, _row(tok, "Q", "A reply", with_ids=False), EOT, 2048)
    assert ids[-1] == EOT and mask[-1] == 1
    ids, mask, _ = build_sample(
        tok, _row(tok, "Q", "A reply cut", finish="length", with_ids=False), EOT, 2048
    )
    assert ids[-1] != EOT


def test_c25_empty_reply_and_reply_past_max_length_are_dropped_and_counted(tmp_path, smollm2_tokenizer):
    tok = smollm2_tokenizer
    run = RunDir(tmp_path)
    rows = [
        _row(tok, "good question", "good answer"),
        _row(tok, "empty one", ""),
        _row(tok, "long prompt " * 40, "answer after the limit"),
        _row(tok, "cut one", "partial", finish="length"),
    ]
    with open(run / "conversations.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    cfg = Config(run_dir=str(tmp_path), tokenize=TokenizeConfig(max_length=48))
    counts = run_tokenize(cfg, run, tok, [EOT])
    assert counts["rows_in"] == 4 and counts["rows_kept"] == 2
    assert counts["dropped_empty_completion"] == 1 and counts["dropped_prompt_reaches_max_length"] == 1
    assert counts["truncated_kept"] == 1 and counts["truncated_kept_share"] == 0.5
    shard = load_shard(run / "tokens.safetensors")
    assert len(shard) == 2 and all(m.any() for _, m in shard)
    # the setting drops rows cut at the generation limit
    cfg.tokenize.drop_truncated = True
    counts = run_tokenize(cfg, run, tok, [EOT])
    assert counts["rows_kept"] == 1 and counts["dropped_truncated"] == 1


def test_self_check_counts_show_and_strict_through_the_cli(tmp_path, smollm2_tokenizer):
    """The self-check runs on every dataset: its counts land in the report; `--show` prints samples
    with the supervised tokens marked; `--strict` turns a mismatch (a row whose stored ids are not
    its text) into an error that writes nothing."""
    from typer.testing import CliRunner

    from eagle3kit.cli import app

    tok = smollm2_tokenizer
    run = RunDir(tmp_path / "run")
    good = [
        _row(tok, f"question {i}", f"answer number {i}" + " \x1b[2J\x1b[31m" * (i == 1)) for i in range(3)
    ]
    bad = _row(tok, "question x", "an answer")
    bad["content"] = "a different answer"  # the stored ids no longer spell the row's text
    with open(run / "conversations.jsonl", "w") as f:
        for r in good + [bad]:
            f.write(json.dumps(r) + "\n")
    (run / "config.yaml").write_text(f"run_dir: {run.path}\n")
    res = CliRunner().invoke(app, ["tokenize", "-r", str(run.path), "--show", "2"])
    assert res.exit_code == 0, res.output
    assert "sample 0" in res.output and "sample 1" in res.output and "sample 2" not in res.output
    assert "answer number 0" in res.output and "legend:" in res.output
    # the data's control characters are shown, never sent to the terminal (a clear-screen used to clear it)
    assert "\x1b" not in res.output and "\\x1b[2J\\x1b[31m" in res.output
    counts = run.report["tokenize"]
    assert counts["selfcheck_rows"] == 4 and counts["selfcheck_mismatch"] == 1 and counts["samples"] == 4
    (run / "tokens.safetensors").unlink()
    res = CliRunner().invoke(app, ["tokenize", "-r", str(run.path), "--strict"])
    assert res.exit_code == 2 and "1 self-check mismatch" in " ".join(res.output.split())
    assert (
        "(1 against the template's render, 0 returned prompt ids) at line(s) 4;"
        in " ".join(res.output.split())
        and not (run / "tokens.safetensors").exists()
    )


def test_zero_samples_is_an_error_that_names_why_and_keeps_the_old_shard(tmp_path, smollm2_tokenizer):
    """Found by a new-user review: conversations whose ids are not in the run's prompts.jsonl used
    to give an empty shard, exit 0, replacing the previous one."""
    from eagle3kit.core.rundir import DataError, write_jsonl

    tok = smollm2_tokenizer
    run = RunDir(tmp_path)
    write_jsonl(run / "conversations.jsonl", [_row(tok, "q one", "a one")])
    cfg = Config(run_dir=str(tmp_path))
    run_tokenize(cfg, run, tok, [EOT])
    before = (run / "tokens.safetensors").read_bytes()
    write_jsonl(run / "prompts.jsonl", [{"id": "other", "messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(
        DataError, match=r"0 training samples .*not_in_prompts 1.*not in this run's prompts.jsonl"
    ):
        run_tokenize(cfg, run, tok, [EOT])
    assert (run / "tokens.safetensors").read_bytes() == before


def test_one_sequence_applies_the_supervise_rule_to_earlier_turns_too(smollm2_tokenizer):
    from eagle3kit.data.templates import MaskRule
    from eagle3kit.data.turn_samples import build_samples

    tok = smollm2_tokenizer
    row = {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "3+3?"},
        ],
        "content": "6.",
        "finish_reason": "stop",
    }
    (s,) = build_samples(tok, row, think_spec(tok), [EOT], "one_sequence", MaskRule(end_of_turn=False))
    assert tok.decode([t for t, m in zip(s.ids, s.mask) if m]) == "4.6."
    (s,) = build_samples(tok, row, think_spec(tok), [EOT], "one_sequence")
    assert tok.decode([t for t, m in zip(s.ids, s.mask) if m]) == "4.<|im_end|>6.<|im_end|>"


def test_malformed_conversation_rows_and_templates_that_refuse_a_chat_are_named_not_tracebacks(
    tmp_path, smollm2_tokenizer
):
    from typer.testing import CliRunner

    from eagle3kit.cli import app
    from eagle3kit.core.rundir import write_jsonl

    tok = smollm2_tokenizer
    run = RunDir(tmp_path / "run")
    (run / "config.yaml").write_text(f"run_dir: {run.path}\n")
    for bad, needle in [
        ({"messages": [{"role": "user", "content": "q"}], "content": 42}, "'content' is a int"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}], "content": "a"},
            "content is a list",
        ),
        ({"messages": ["hi"], "content": "a"}, "string 'role'"),
        (
            {"messages": [{"role": "user", "content": "q"}], "content": "a", "template_flags": "x"},
            "template_flags",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}], "content": "a", "completion_ids": [True, 2]},
            "integer token ids",
        ),
    ]:
        write_jsonl(run / "conversations.jsonl", [_row(tok, "fine", "fine"), bad])
        res = CliRunner().invoke(app, ["tokenize", "-r", str(run.path)])
        out = res.output.replace("\n", "")
        assert (
            res.exit_code == 2 and "conversations.jsonl:2" in out and needle in " ".join(res.output.split())
        )
    # a chat the template itself refuses is dropped, counted and named by line, not a traceback
    import copy

    tok = copy.deepcopy(tok)  # never touch the session's shared tokenizer
    tok.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('must start with user') }}{% endif %}"
        + tok.chat_template
    )
    write_jsonl(
        run / "conversations.jsonl",
        [
            _row(tok, "fine", "fine"),
            {"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]},
        ],
    )
    counts = run_tokenize(Config(run_dir=str(run.path)), run, tok, [EOT])
    assert counts["dropped_template_error"] == 1 and counts["rows_kept"] == 1
