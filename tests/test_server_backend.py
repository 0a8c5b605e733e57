"""generate --backend openai against a stand-in OpenAI-compatible server (a test double, see
standin_server.py): reasoning shapes, retries, per-row failures, resume, expect_reasoning."""

import pytest
from standin_server import StandInServer

from eagle3kit.core.config import Config, ConfigError, GenerateConfig, PromptsConfig, TargetConfig
from eagle3kit.core.rundir import RunDir, read_jsonl, write_jsonl
from eagle3kit.data.generate import run_generate
from eagle3kit.data.sources import prompt_id


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
    cfg = Config(
        run_dir=str(run.path),
        target=TargetConfig(model=str(tmp_path)),  # no local tokenizer: C06 check skipped
        prompts=PromptsConfig(heldout_fraction=0.0),
        generate=GenerateConfig(
            **{
                "backend": "openai",
                "base_url": server.url,
                "model": "stand-in",
                "concurrency": 4,
                "max_retries": 2,
                **gen,
            }
        ),
    )
    return cfg, run


def test_every_reasoning_shape_is_captured_with_its_source(tmp_path, server):
    # the openai SDK (3.x) has neither reasoning key in its schema: both arrive through model_extra
    shapes = {
        "vllm_reasoning_field": "model_extra.reasoning",
        "deepseek_reasoning_content": "model_extra.reasoning_content",
        "inline_think": "inline_think",
    }
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
    # the failed row is simply missing: a rerun sends only it, duplicates nothing, and says loudly
    # (exit code 2 from the CLI) that this time nothing at all came back
    with pytest.raises(ConfigError, match="all 1 requests failed"):
        run_generate(cfg, run)
    ids = [r["id"] for _, r in read_jsonl(run / "conversations.jsonl")]
    assert len(ids) == len(set(ids)) == 3


def test_expect_reasoning_stops_early_and_keeps_what_was_written(tmp_path, server):
    cfg, run = _run(
        tmp_path,
        server,
        [f"question {i}" for i in range(40)],
        expect_reasoning=True,
    )
    cfg.generate.concurrency = 1
    with pytest.raises(ConfigError, match="carry no reasoning"):
        run_generate(cfg, run)
    n = sum(1 for _ in read_jsonl(run / "conversations.jsonl"))
    assert 8 <= n < 40  # stopped after the probe, rows kept


def test_truncated_or_conflicting_reasoning_never_reaches_a_training_sample(
    tmp_path, server, smollm2_tokenizer
):
    from eagle3kit.data.tokenize import run_tokenize

    cfg, run = _run(
        tmp_path,
        server,
        ["shape:length_null_content", "shape:both_fields_disagree", "shape:vllm_reasoning_field", "plain"],
    )
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
    cfg, run = _run(
        tmp_path,
        server,
        [f"scale question {i}" for i in range(n)],
    )
    cfg_path = tmp_path / "c.yaml"
    from eagle3kit.core.config import dump_config

    cfg.generate.concurrency = (
        16  # 16 requests in flight at each kill; 64 costs the client 1.6x the CPU (httpx's pool)
    )
    cfg_path.write_text(dump_config(cfg))
    out = run / "conversations.jsonl"
    cmd = [sys.executable, "-m", "eagle3kit", "generate", "-c", str(cfg_path)]
    rng = random.Random(0)

    def lines() -> int:
        return sum(1 for _ in open(out, "rb")) if out.exists() else 0

    for kill in range(3):
        before = lines()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
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
    cfg, run = _run(
        tmp_path,
        server,
        ["shape:stream_reasoning", "shape:stream_reasoning_content", "plain streamed"],
        stream=True,
    )
    counts = run_generate(cfg, run)
    rows = {r["messages"][0]["content"]: r for _, r in read_jsonl(run / "conversations.jsonl")}
    assert counts["generated"] == 3 and all(r["streamed"] for r in rows.values())
    for name in ("stream_reasoning", "stream_reasoning_content"):
        r = rows[f"shape:{name}"]
        key = name.split("_", 1)[1]
        assert (r["reasoning"], r["content"], r["reasoning_source"]) == ("think", "ans", f"stream.{key}")
    plain = rows["plain streamed"]
    assert plain["content"] == "reply to plain streamed" and plain["completion_ids"] == [7, 8, 2]
    assert (
        plain["usage"]["completion_tokens"] == 3 and rows["shape:stream_reasoning"]["completion_ids"] is None
    )
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
    assert row["tool_calls"] == [
        {
            "id": "functions.get_weather:0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]


def test_stalls_dropped_connections_and_500s_are_retried(tmp_path, server):
    texts = ["stall:a", "drop:a", "http500:a", "fine"]
    cfg, run = _run(tmp_path, server, texts, timeout_s=1.0)
    counts = run_generate(cfg, run)
    assert counts["generated"] == 4 and counts["failed"] == 0
    assert all(server.hits[t] == 2 for t in texts[:3])  # each fault cost exactly one retry
    rows = {r["messages"][0]["content"]: r["content"] for _, r in read_jsonl(run / "conversations.jsonl")}
    assert rows["drop:a"] == "reply to drop:a"


def test_magpie_synthesis_through_the_completions_endpoint_resumes_by_attempt(
    tmp_path, server, tiny_target_dir, smollm2_tokenizer
):
    """Issue 3: Magpie through a server. The raw templated prefix (SmolLM2's real template) goes to
    /v1/completions; cut or too-short candidates and near-duplicates are dropped; a rerun asking
    for more prompts re-sends no attempt already made."""
    from eagle3kit.data.magpie import magpie_prefix
    from eagle3kit.data.prompts import run_prompts

    run = RunDir(tmp_path / "run")
    cfg = Config(
        run_dir=str(run.path),
        target=TargetConfig(model=str(tiny_target_dir)),
        prompts=PromptsConfig(synthesize=6, heldout_fraction=0.0, seed=3),
        generate=GenerateConfig(backend="openai", base_url=server.url, model="stand-in", concurrency=4),
    )
    server.completions.clear()
    counts = run_prompts(cfg, run)
    rows = [r for _, r in read_jsonl(run / "prompts.jsonl")]
    texts = [r["messages"][0]["content"] for r in rows]
    # attempts 0..10: topic 0, 0 (dup), 1, 1 (dup), [cut], 2, [short], 3, 4, [cut], 5 → six distinct kept
    assert texts == [f"Explain topic {k} in detail, please." for k in range(6)]
    assert counts["rows_kept"] == 6 and counts["magpie_kept"] == 6 and "synthesize_shortfall" not in counts
    first = server.completions[0]
    assert first["prompt"] == magpie_prefix(smollm2_tokenizer) and first["prompt"].endswith(
        "<|im_start|>user\n"
    )
    assert first["add_special_tokens"] is False and first["stop_token_ids"] == [
        smollm2_tokenizer.eos_token_id
    ]
    sent = sorted(b["seed"] - 3 * 1_000_003 for b in server.completions)
    assert len(sent) == len(set(sent)) == counts["magpie_attempts"]
    # ask for more: only new attempts are sent
    server.completions.clear()
    more = cfg.model_copy(update={"prompts": cfg.prompts.model_copy(update={"synthesize": 10})})
    counts2 = run_prompts(more, run)
    resent = {b["seed"] - 3 * 1_000_003 for b in server.completions}
    assert counts2["rows_kept"] == 10 and not resent & set(sent)
    assert [r["messages"][0]["content"] for _, r in read_jsonl(run / "prompts.jsonl")][:6] == texts


def test_malformed_replies_fail_their_row_only_and_never_jam_a_rerun(tmp_path, server):
    """Found by an adversarial review: one nonsense 200 reply used to crash the stage on every rerun."""
    bad = ["raw:choices_empty", "raw:content_list", "raw:html", "raw:broken_json", "raw:ids_text"]
    cfg, run = _run(tmp_path, server, bad + ["raw:no_finish", "fine question"], max_retries=0)
    counts = run_generate(cfg, run)
    assert counts["generated"] == 2 and counts["failed"] == 5 and counts["failed_malformed_reply"] == 5
    rows = {r["messages"][0]["content"]: r for _, r in read_jsonl(run / "conversations.jsonl")}
    assert rows["raw:no_finish"]["flags"] == ["no_finish_reason"]  # stored, but never a training turn
    with pytest.raises(ConfigError, match="all 5 requests failed"):
        run_generate(cfg, run)  # the rerun retries only the 5, cleanly


def test_a_refused_key_stops_at_once_and_the_key_never_reaches_the_console(
    tmp_path, server, monkeypatch, capfd
):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-SECRET-123")
    cfg, run = _run(tmp_path, server, ["raw:401"] + [f"q{i}" for i in range(30)], concurrency=1)
    with pytest.raises(ConfigError) as e:
        run_generate(cfg, run)
    assert "HTTP 401" in str(e.value) and "sk-SECRET-123" not in str(e.value) and "***" in str(e.value)
    out = capfd.readouterr()
    assert "sk-SECRET-123" not in out.out + out.err
    assert sum(1 for _ in read_jsonl(run / "conversations.jsonl")) < 30  # stopped, did not send every row


@pytest.mark.parametrize(
    "url,model,needle",
    [
        ("{root}", "stand-in", "must be the API root, which for vLLM and SGLang ends in /v1"),
        ("{root}/v1", "no-such-model", "serves ['stand-in'], not generate.model 'no-such-model'"),
        ("{root}/v1/chat/completions", "stand-in", "names an endpoint"),
        ("127.0.0.1:9/v1", "stand-in", "is not an http(s) URL"),
        ("http://127.0.0.1:9/v1", "stand-in", "cannot reach the server"),
    ],
)
def test_server_is_checked_before_any_row_is_sent(tmp_path, server, url, model, needle):
    cfg, run = _run(tmp_path, server, ["q"])
    cfg.generate.base_url = url.format(root=server.url[: -len("/v1")])
    cfg.generate.model = model
    with pytest.raises(ConfigError) as e:
        run_generate(cfg, run)
    assert needle in str(e.value)
    assert not (run / "conversations.jsonl").exists() or not (run / "conversations.jsonl").read_text()


def test_two_generate_processes_on_one_run_dir_are_refused(tmp_path, server):
    from eagle3kit.core.rundir import DataError

    cfg, run = _run(tmp_path, server, ["q"])
    with run.lock("generate"):
        with pytest.raises(DataError, match="another `eagle3kit generate`"):
            run_generate(cfg, run)
    assert run_generate(cfg, run)["generated"] == 1  # free again once released


def test_rows_from_other_template_flags_are_not_mixed_and_a_refused_command_keeps_the_stored_config(
    tmp_path, server
):
    from typer.testing import CliRunner

    from eagle3kit.cli import app

    cfg, run = _run(tmp_path, server, ["q1", "q2"])
    run_generate(cfg, run)
    cfg.generate.template_flags = {"enable_thinking": True}
    with pytest.raises(
        ConfigError, match=r"template_flags: \{\} \(line 1, 2 rows\) but now \{'enable_thinking': True\}"
    ):
        run_generate(cfg, run)
    # through the CLI: the refused command does not rewrite config.yaml
    (run / "config.yaml").write_text(
        f"run_dir: {run.path}\ntarget: {{model: {tmp_path}}}\ngenerate: {{backend: openai, "
        f"base_url: '{server.url}', model: stand-in}}\n"
    )
    before = (run / "config.yaml").read_text()
    other = tmp_path / "other.yaml"
    other.write_text(before.replace("model: stand-in}", "model: stand-in, max_new_tokens: 7}"))
    res = CliRunner().invoke(app, ["generate", "-c", str(other)])
    assert res.exit_code == 2 and "sampling" in res.output
    assert (run / "config.yaml").read_text() == before


def test_base_url_with_an_in_process_backend_is_a_contradiction():
    with pytest.raises(ValueError, match="ignore the server"):
        GenerateConfig(backend="transformers", base_url="http://x/v1", model="m")
    assert GenerateConfig(base_url="http://x/v1", model="m").backend == "openai"


def test_magpie_replies_without_text_are_failed_attempts_not_logged(tmp_path, server):
    from eagle3kit.data.prompts import run_prompts

    run = RunDir(tmp_path / "run")
    cfg = Config(
        run_dir=str(run.path),
        target=TargetConfig(model=str(tmp_path)),
        prompts=PromptsConfig(synthesize=3, heldout_fraction=0.0, magpie_prefix="NULL"),
        generate=GenerateConfig(backend="openai", base_url=server.url, model="stand-in", max_retries=0),
    )
    with pytest.raises(ConfigError, match="answered none of"):
        run_prompts(cfg, run)
    assert (run / "magpie_attempts.jsonl").read_text() == ""  # nothing logged that could jam a rerun
