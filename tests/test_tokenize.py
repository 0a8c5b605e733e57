import json


from eagle3kit.config import Config, TokenizeConfig
from eagle3kit.generate import render_prompt_ids
from eagle3kit.rundir import RunDir
from eagle3kit.templates import think_spec
from eagle3kit.tokenize import load_shard, run_tokenize, samples_for_row

EOT = 2  # <|im_end|> in SmolLM2's vocabulary


def _row(tok, user, completion_text, finish="stop", with_ids=True):
    msgs = [{"role": "user", "content": user}]
    row = {"id": user[:8], "messages": msgs, "content": completion_text, "finish_reason": finish, "template_flags": {}}
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
    ids, mask, _ = build_sample(tok, _row(tok, "Q", "A reply cut", finish="length", with_ids=False), EOT, 2048)
    assert ids[-1] != EOT


def test_c25_empty_reply_and_reply_past_max_length_are_dropped_and_counted(tmp_path, smollm2_tokenizer):
    tok = smollm2_tokenizer
    run = RunDir(tmp_path)
    rows = [_row(tok, "good question", "good answer"), _row(tok, "empty one", ""),
            _row(tok, "long prompt " * 40, "answer after the limit"), _row(tok, "cut one", "partial", finish="length")]
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
    good = [_row(tok, f"question {i}", f"answer number {i}") for i in range(3)]
    bad = _row(tok, "question x", "an answer")
    bad["content"] = "a different answer"          # the stored ids no longer spell the row's text
    with open(run / "conversations.jsonl", "w") as f:
        for r in good + [bad]:
            f.write(json.dumps(r) + "\n")
    (run / "config.yaml").write_text(f"run_dir: {run.path}\n")
    res = CliRunner().invoke(app, ["tokenize", "-r", str(run.path), "--show", "2"])
    assert res.exit_code == 0, res.output
    assert "sample 0" in res.output and "sample 1" in res.output and "sample 2" not in res.output
    assert "answer number 0" in res.output and "legend:" in res.output
    counts = run.report["tokenize"]
    assert counts["selfcheck_rows"] == 4 and counts["selfcheck_mismatch"] == 1 and counts["samples"] == 4
    (run / "tokens.safetensors").unlink()
    res = CliRunner().invoke(app, ["tokenize", "-r", str(run.path), "--strict"])
    assert res.exit_code == 2 and "1 self-check mismatch" in " ".join(res.output.split())
    assert "conversations.jsonl at line(s) 4;" in " ".join(res.output.split()) and not (run / "tokens.safetensors").exists()
