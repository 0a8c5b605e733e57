"""generate --backend openai against a stand-in OpenAI-compatible server (a test double, see
standin_server.py): reasoning shapes, retries, per-row failures, resume, expect_reasoning."""

import pytest

from eagle3kit.config import Config, ConfigError, GenerateConfig, PromptsConfig, TargetConfig
from eagle3kit.generate import run_generate
from eagle3kit.rundir import RunDir, read_jsonl, write_jsonl
from eagle3kit.prompts import prompt_id
from standin_server import StandInServer


@pytest.fixture(scope="module")
def server():
    with StandInServer() as s:
        yield s


def _run(tmp_path, server, texts, **gen):
    run = RunDir(tmp_path / "run")
    rows = []
    for t in texts:
        msgs = [{"role": "user", "content": t}]
        rows.append({"id": prompt_id(msgs), "messages": msgs, "source": "t", "category": None})
    write_jsonl(run / "prompts.jsonl", rows)
    cfg = Config(run_dir=str(run.path), target=TargetConfig(model=str(tmp_path)),   # no local tokenizer: C06 check skipped
                 prompts=PromptsConfig(heldout_fraction=0.0),
                 generate=GenerateConfig(backend="openai", base_url=server.url, model="stand-in", concurrency=4,
                                         max_retries=2, **gen))
    return cfg, run


def test_every_reasoning_shape_is_captured_with_its_source(tmp_path, server):
    # the openai SDK (3.x) has neither reasoning key in its schema: both arrive through model_extra
    shapes = {"vllm_reasoning_field": "model_extra.reasoning", "deepseek_reasoning_content": "model_extra.reasoning_content",
              "inline_think": "inline_think"}
    cfg, run = _run(tmp_path, server, [f"shape:{n}" for n in shapes] + ["plain question"])
    counts = run_generate(cfg, run)
    rows = {r["messages"][0]["content"]: r for _, r in read_jsonl(run / "conversations.jsonl")}
    for name, src in shapes.items():
        assert rows[f"shape:{name}"]["reasoning_source"] == src and rows[f"shape:{name}"]["reasoning"]
    assert rows["shape:vllm_reasoning_field"]["content"] == "ans"
    assert rows["plain question"]["reasoning"] is None
    assert counts["with_reasoning"] == 3 and counts["without_reasoning"] == 1 and counts["failed"] == 0
    assert run.manifest["generation_server"]["version"] == "stand-in-0"


def test_429_is_retried_and_a_400_row_does_not_stop_the_others(tmp_path, server):
    texts = ["flaky429:a", "fail400", "ok 1", "ok 2"]
    cfg, run = _run(tmp_path, server, texts)
    counts = run_generate(cfg, run)
    assert counts["generated"] == 3 and counts["failed"] == 1 and counts["failed_400"] == 1
    assert server.hits["flaky429:a"] == 2
    # the failed row is simply missing: a rerun sends only it, and duplicates nothing
    again = run_generate(cfg, run)
    assert again["already_done"] == 3 and again["failed"] == 1
    ids = [r["id"] for _, r in read_jsonl(run / "conversations.jsonl")]
    assert len(ids) == len(set(ids)) == 3


def test_expect_reasoning_stops_early_and_keeps_what_was_written(tmp_path, server):
    cfg, run = _run(tmp_path, server, [f"question {i}" for i in range(40)], expect_reasoning=True, )
    cfg.generate.concurrency = 1
    with pytest.raises(ConfigError, match="carry no reasoning"):
        run_generate(cfg, run)
    n = sum(1 for _ in read_jsonl(run / "conversations.jsonl"))
    assert 8 <= n < 40                                 # stopped after the probe, rows kept


def test_truncated_or_conflicting_reasoning_never_reaches_a_training_sample(tmp_path, server, smollm2_tokenizer):
    from eagle3kit.tokenize import run_tokenize

    cfg, run = _run(tmp_path, server, ["shape:length_null_content", "shape:both_fields_disagree", "shape:vllm_reasoning_field", "plain"])
    run_generate(cfg, run)
    counts = run_tokenize(cfg, run, smollm2_tokenizer, [2])
    assert counts["dropped_truncated_reasoning"] == 1 and counts["dropped_reasoning_fields_disagree"] == 1
    # SmolLM2 has no <think> special token: a text-only reasoning row cannot be rebuilt for it
    assert counts["dropped_reasoning_without_think_tokens"] == 1 and counts["rows_kept"] == 1


def test_10000_rows_with_the_client_killed_three_times(tmp_path, server):
    """Scale and faults: the client process is SIGKILLed at three random moments; the final file
    holds exactly 10,000 distinct rows (a torn last line is repaired, never duplicated)."""
    import os
    import random
    import signal
    import subprocess
    import sys
    import time

    n = 10_000
    cfg, run = _run(tmp_path, server, [f"scale question {i}" for i in range(n)], )
    cfg_path = tmp_path / "c.yaml"
    from eagle3kit.config import dump_config

    cfg.generate.concurrency = 64
    cfg_path.write_text(dump_config(cfg))
    out = run / "conversations.jsonl"
    cmd = [sys.executable, "-m", "eagle3kit", "generate", "-c", str(cfg_path)]
    rng = random.Random(0)

    def lines() -> int:
        return sum(1 for _ in open(out, "rb")) if out.exists() else 0

    for kill in range(3):
        before = lines()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + 120
        while lines() <= before + 50 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
        time.sleep(rng.uniform(0.0, 1.5))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert lines() > before, f"no progress before kill {kill + 1}"
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    ids = [r["id"] for _, r in read_jsonl(out)]
    assert len(ids) == n and len(set(ids)) == n


def test_streamed_replies_give_the_same_rows(tmp_path, server):
    cfg, run = _run(tmp_path, server, ["shape:stream_reasoning", "shape:stream_reasoning_content", "plain streamed"], stream=True)
    counts = run_generate(cfg, run)
    rows = {r["messages"][0]["content"]: r for _, r in read_jsonl(run / "conversations.jsonl")}
    assert counts["generated"] == 3 and all(r["streamed"] for r in rows.values())
    for name in ("stream_reasoning", "stream_reasoning_content"):
        r = rows[f"shape:{name}"]
        key = name.split("_", 1)[1]
        assert (r["reasoning"], r["content"], r["reasoning_source"]) == ("think", "ans", f"stream.{key}")
    plain = rows["plain streamed"]
    assert plain["content"] == "reply to plain streamed" and plain["completion_ids"] == [7, 8, 2]
    assert plain["usage"]["completion_tokens"] == 3 and rows["shape:stream_reasoning"]["completion_ids"] is None
    assert plain["tool_calls"] is None


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_replies_keep_reasoning_and_calls_through_the_sdk(tmp_path, server, stream):
    """C05 through the OpenAI SDK's own objects (not dicts): the row keeps the reasoning and the
    merged tool call, ready for the turn-2 request."""
    name = "shape:stream_kimi_tool_call" if stream else "shape:kimi_tool_call"
    cfg, run = _run(tmp_path, server, [name], stream=stream)
    assert run_generate(cfg, run)["generated"] == 1
    (row,) = [r for _, r in read_jsonl(run / "conversations.jsonl")]
    assert row["reasoning"] == "The user wants the weather in Paris; I should call get_weather."
    assert row["finish_reason"] == "tool_calls" and row["content"] == ""
    assert row["tool_calls"] == [{"id": "functions.get_weather:0", "type": "function",
                                  "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]


def test_stalls_dropped_connections_and_500s_are_retried(tmp_path, server):
    texts = ["stall:a", "drop:a", "http500:a", "fine"]
    cfg, run = _run(tmp_path, server, texts, timeout_s=1.0)
    counts = run_generate(cfg, run)
    assert counts["generated"] == 4 and counts["failed"] == 0
    assert all(server.hits[t] == 2 for t in texts[:3])          # each fault cost exactly one retry
    rows = {r["messages"][0]["content"]: r["content"] for _, r in read_jsonl(run / "conversations.jsonl")}
    assert rows["drop:a"] == "reply to drop:a"


def test_magpie_synthesis_through_the_completions_endpoint_resumes_by_attempt(tmp_path, server, tiny_target_dir,
                                                                              smollm2_tokenizer):
    """Issue 3: Magpie through a server. The raw templated prefix (SmolLM2's real template) goes to
    /v1/completions; cut or too-short candidates and near-duplicates are dropped; a rerun asking
    for more prompts re-sends no attempt already made."""
    from eagle3kit.prompts import magpie_prefix, run_prompts

    run = RunDir(tmp_path / "run")
    cfg = Config(run_dir=str(run.path), target=TargetConfig(model=str(tiny_target_dir)),
                 prompts=PromptsConfig(synthesize=6, heldout_fraction=0.0, seed=3),
                 generate=GenerateConfig(backend="openai", base_url=server.url, model="stand-in", concurrency=4))
    server.completions.clear()
    counts = run_prompts(cfg, run)
    rows = [r for _, r in read_jsonl(run / "prompts.jsonl")]
    texts = [r["messages"][0]["content"] for r in rows]
    # attempts 0..10: topic 0, 0 (dup), 1, 1 (dup), [cut], 2, [short], 3, 4, [cut], 5 → six distinct kept
    assert texts == [f"Explain topic {k} in detail, please." for k in range(6)]
    assert counts["rows_kept"] == 6 and counts["magpie_kept"] == 6 and "synthesize_shortfall" not in counts
    first = server.completions[0]
    assert first["prompt"] == magpie_prefix(smollm2_tokenizer) and first["prompt"].endswith("<|im_start|>user\n")
    assert first["add_special_tokens"] is False and first["stop_token_ids"] == [smollm2_tokenizer.eos_token_id]
    sent = sorted(b["seed"] - 3 * 1_000_003 for b in server.completions)
    assert len(sent) == len(set(sent)) == counts["magpie_attempts"]
    # ask for more: only new attempts are sent
    server.completions.clear()
    more = cfg.model_copy(update={"prompts": cfg.prompts.model_copy(update={"synthesize": 10})})
    counts2 = run_prompts(more, run)
    resent = {b["seed"] - 3 * 1_000_003 for b in server.completions}
    assert counts2["rows_kept"] == 10 and not resent & set(sent)
    assert [r["messages"][0]["content"] for _, r in read_jsonl(run / "prompts.jsonl")][:6] == texts
