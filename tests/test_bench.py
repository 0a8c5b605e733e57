"""`eagle3kit bench` without a real engine: the acceptance arithmetic (C33, C34), the comparison
of two records (C36), the SGLang paths against a replay of hand-written SGLang responses (marked:
no SGLang server runs here), and bad input. The real vLLM runs are in tests/test_bench_vllm.py."""
from __future__ import annotations

import copy
import json

import pytest

from eagle3kit.bench import BenchError, acceptance_from_counters, acceptance_from_meta, run_bench, write_outputs
from eagle3kit.benchreport import compare, load_record


def test_c33_acceptance_rate_and_tokens_per_step_are_named_apart():
    got = [acceptance_from_counters({"drafts": 1, "draft_tokens": 4, "accepted": a}) for a in (0, 2, 4)]
    assert [g["acceptance_rate"] for g in got] == [0.0, 0.5, 1.0]
    assert [g["tau"] for g in got] == [1.0, 3.0, 5.0]
    assert all(g["k"] == 4 for g in got)
    assert "tokens per verify step" in got[0]["formula"]


def test_c34_tau_comes_from_totals_with_its_formula():
    steps = [2, 0, 3, 1]                       # accepted drafts per verify step, K = 3
    per_position = {k: sum(a >= k for a in steps) for k in (1, 2, 3)}
    got = acceptance_from_counters({"drafts": 4, "draft_tokens": 12, "accepted": sum(steps), "per_position": per_position})
    assert got["tau"] == 2.5 and "1 + accepted / drafts" in got["formula"]
    assert got["per_position_acceptance"] == [0.75, 0.5, 0.25]
    # SGLang: pooled Σ completion / Σ verify, not the mean of per-request ratios (which would be 2.4667)
    metas = [{"completion_tokens": 12, "spec_verify_ct": v} for v in (5, 4, 6)]
    assert acceptance_from_meta(metas)["tau"] == 2.4


def _record(version: str, tau: float, tok_s: float, ttft: float) -> dict:
    lat = {"p50": ttft, "p90": ttft, "p99": ttft, "mean": ttft}
    level = {"concurrency": 4, "output_tokens_per_s": tok_s, "request_throughput": tok_s / 32, "ttft_ms": lat,
             "itl_ms": lat, "tpot_ms": lat, "acceptance": {"tau": tau}}
    return {"started": "t", "drafter": {"sha256": "d" * 64},
            "servers": {"speculative": {"engine": {"name": "vllm", "version": version}, "results": [level]}}}


def test_c36_a_drop_beyond_the_tolerance_is_flagged_with_both_engine_versions(tmp_path):
    a = _record("0.31.0", 2.50, 100.0, 50.0)
    ok = compare(a, _record("0.32.0", 2.45, 98.0, 51.0), tolerance=0.05)       # −2%, −2%, +2%: within
    assert ok["regressions"] == [] and (ok["a"]["version"], ok["b"]["version"]) == ("0.31.0", "0.32.0")
    bad = compare(a, _record("0.32.0", 2.20, 90.0, 60.0), tolerance=0.05)      # −12%, −10%, +20%
    assert {r["metric"] for r in bad["regressions"]} >= {"tau", "output_tokens_per_s", "ttft_p50_ms"}
    assert all(r["concurrency"] == 4 for r in bad["regressions"])
    # through the CLI: exit 1 when something regressed, 0 when not
    from typer.testing import CliRunner

    from eagle3kit.cli import app

    for name, rec in (("a", a), ("b", _record("0.32.0", 2.20, 90.0, 60.0)), ("c", _record("0.32.0", 2.49, 100.0, 50.0))):
        (tmp_path / f"{name}.json").write_text(json.dumps(rec))
    run = CliRunner().invoke(app, ["bench", "--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert run.exit_code == 1 and "REGRESSION" in run.output and "0.31.0" in run.output
    assert CliRunner().invoke(app, ["bench", "--compare", str(tmp_path / "a.json"), str(tmp_path / "c.json")]).exit_code == 0
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
    assert spec["server_flags"]["max_running_requests"] == 64 and spec["server_flags"]["speculative_num_draft_tokens"] == 4
    assert spec["template_check"]["method"] == "usage.prompt_tokens" and spec["template_check"]["checked"] == 3
    assert seen.get("refused", 0) == 0                        # never asked for meta_info on a stream
    for level, n in zip(spec["results"], (3, 4)):
        assert level["requests"] == n and level["failures"] == 0 and level["output_tokens"] == 12 * n
        assert level["completion_tokens_source"] == "usage"
        acc = level["acceptance"]
        # c=1: prompts 0,1,2 → 36 / 15; c=4: prompt 0 twice more → 48 / 20; both 2.4; accepted/drafted 21/45, 28/60
        assert acc["tau"] == 2.4 and acc["acceptance_rate"] == round(7 / 15, 6) and acc["source"].startswith("sglang meta_info")
        assert level["sglang_after_stream"] == {"spec_accept_length": 2.38, "spec_accept_rate": 0.46,
                                                "server_info_avg_spec_accept_length": 2.41}
        assert len(level["itl_ms"]) == 4 and level["ttft_ms"]["p50"] is not None
    paths = write_outputs(rec, tmp_path / "out")
    assert all(p.stat().st_size > 0 for p in paths.values())
    assert "sglang 0.5.23" in paths["md"].read_text()
    with pytest.raises(BenchError, match="--overwrite"):
        write_outputs(rec, tmp_path / "out")


def test_bad_input_names_the_thing_and_the_fix(tmp_path):
    from eagle3kit.engines import free_port

    p = tmp_path / "p.jsonl"
    p.write_text('{"turns": ["hi there"]}\n')
    with pytest.raises(BenchError, match=r"no OpenAI-compatible server answers http://127.0.0.1:\d+/v1/models"):
        run_bench(f"http://127.0.0.1:{free_port()}/v1", p, [1], 8, warmup=0)
    with pytest.raises(BenchError, match="does not exist"):
        run_bench("http://127.0.0.1:1", tmp_path / "missing.jsonl", [1], 8)
    with pytest.raises(BenchError, match="positive levels"):
        run_bench("http://127.0.0.1:1", p, [0, 4], 8)
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(BenchError, match="no usable prompt"):
        run_bench("http://127.0.0.1:1", empty, [1], 8)
    rec = copy.deepcopy(_record("0.32.0", 2.0, 10.0, 5.0))
    assert compare(rec, rec)["regressions"] == []
