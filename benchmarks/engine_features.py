"""Features from the serving engine against the transformers backend (issue 11, point 1).

vLLM's ``extract_hidden_states`` speculative method captures the aux hidden states while it
serves; :mod:`eagle3kit.vllm_capture` writes them on the CPU build (vLLM's own connector needs
CUDA). This script captures them for held-out GSM8K prompts (SmolLM2, fp32, the run's aux ids),
extracts the same token samples with ``eagle3kit extract`` (transformers), stores the vLLM
states as a feature folder in eagle3kit's format (tagged with the engine and its version) and
compares the two with ``parity``. Prints one table; writes JSON.

    python benchmarks/engine_features.py --shared ../shared --prompts 20 --work runs/engine-features \
        --out benchmarks/results/engine_features.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path


def capture_vllm(target, prompts: list[list[int]], aux_ids: list[int], store: Path) -> list:
    """The aux states vLLM computes for each token of each prompt (fp32 [T, 3, H] each), through
    its ``extract_hidden_states`` method and :class:`eagle3kit.vllm_capture.CPUHiddenStatesConnector`."""
    import gc

    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    from eagle3kit.target import cache_dir, export_fp32_folder

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    folder = export_fp32_folder(target, cache_dir() / "fp32" / target.source["weights_fingerprint"][:16])
    llm = LLM(model=str(folder), dtype="float32", enforce_eager=True, max_model_len=2048, kv_cache_memory_bytes=1 << 30,
              max_num_seqs=8,
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": aux_ids}}},
              kv_transfer_config={"kv_connector": "CPUHiddenStatesConnector", "kv_role": "kv_producer",
                                  "kv_connector_module_path": "eagle3kit.vllm_capture",
                                  "kv_connector_extra_config": {"shared_storage_path": str(store)}})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, temperature=0.0))
    llm.generate([{"prompt_token_ids": prompts[0][:4]}], SamplingParams(max_tokens=1))   # flushes the last write
    states = []
    for p, o in zip(prompts, outs):
        t = load_file(o.kv_transfer_params["hidden_states_path"])
        assert t["token_ids"].tolist()[: len(p)] == p, "vLLM captured other tokens than the prompt"
        states.append(t["hidden_states"][: len(p)])                                  # [T, 3, H]
    del llm
    gc.collect()
    return states


def vllm_feature_folder(a: Path, b: Path, states: list, keep_teacher: bool) -> None:
    """Folder ``b``: the shards of feature folder ``a`` with their aux states replaced by vLLM's
    (bf16), tagged ``source: vllm <version> …`` in the index; the teacher state is kept from ``a``
    when ``keep_teacher`` (vLLM captures aux states only), else left out."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from eagle3kit.engines import installed_vllm
    from eagle3kit.rundir import sha256_json

    b.mkdir(parents=True, exist_ok=True)
    index = json.loads((a / "index.json").read_text())
    index["inputs"]["source"] = f"vllm {installed_vllm()} (extract_hidden_states, eagle3kit.vllm_capture)"
    for s in index["shards"]:
        with safe_open(str(a / s["file"]), "pt") as f:
            meta = {**f.metadata(), "inputs_sha256": sha256_json(index["inputs"])}   # the tagged inputs
        t = load_file(str(a / s["file"]))
        aux = torch.cat([states[s["first_sample"] + k] for k in range(s["samples"])]).to(torch.bfloat16)
        out = {"offsets": t["offsets"], "aux": aux.contiguous()}
        if keep_teacher:
            out["last"] = t["last"]
        save_file(out, str(b / s["file"]), metadata=meta)
    (b / "index.json").write_text(json.dumps(index, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shared", default="../shared")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--work", default="runs/engine-features")
    ap.add_argument("--out", default="benchmarks/results/engine_features.json")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    from eagle3kit.config import PromptSource, load_config
    from eagle3kit.engines import installed_vllm
    from eagle3kit.extract import run_extract
    from eagle3kit.generate import render_prompt_ids
    from eagle3kit.parity import compare_features
    from eagle3kit.prompts import read_source
    from eagle3kit.rundir import RunDir
    from eagle3kit.target import load_target, resolve_aux_layer_ids
    from eagle3kit.tokenize import save_shard

    work = Path(args.work)
    if work.exists():
        shutil.rmtree(work)
    (work / "run").mkdir(parents=True)
    (work / "run" / "config.yaml").write_text(f"run_dir: {work / 'run'}\n")
    cfg = load_config(work / "run" / "config.yaml")
    target = load_target(cfg.target, device="cpu")
    aux_ids = list(resolve_aux_layer_ids(cfg.target, target.num_layers))
    rows, _ = read_source(PromptSource(name="gsm8k_heldout", path=f"{args.shared}/data/chats/gsm8k_train.jsonl", start=-80))
    prompts = [render_prompt_ids(target.tokenizer, r["messages"][:1]) for r in rows[: args.prompts]]
    run = RunDir(work / "run")
    save_shard(run / "tokens.safetensors", [(p, [0] * (len(p) - 1) + [1]) for p in prompts])
    t0 = time.perf_counter()
    hf = run_extract(cfg, run, target, out_dir=str(work / "features-transformers"))
    t_hf = time.perf_counter() - t0

    t0 = time.perf_counter()
    states = capture_vllm(target, prompts, aux_ids, work / "vllm-states")
    t_vllm = time.perf_counter() - t0
    a, b = work / "features-transformers", work / "features-vllm"
    vllm_feature_folder(a, b, states, keep_teacher=False)
    rep = compare_features(target, a, b)
    rec = {"benchmark": "engine_features", "target": "SmolLM2-135M-Instruct (GGUF → fp32)", "prompts": len(prompts),
           "tokens": sum(len(p) for p in prompts), "aux_layer_ids_hf": aux_ids, "vllm": installed_vllm(),
           "seconds": {"transformers_extract": round(t_hf, 2), "vllm_load_and_capture": round(t_vllm, 2)},
           "storage": "both bf16 in the feature folders (vLLM captured fp32)", "parity": rep, "transformers_extract": hf}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rec, indent=1, default=str))
    print("| layer | cosine | relative error | top-1 agreement | pass |\n|---|---:|---:|---:|---|")
    for name, v in rep["layers"].items():
        print(f"| {name} | {v['cosine']:.6f} | {v['relative_error']:.2e} | {v['top1_agreement']:.4f} | {v['pass']} |")
    print(f"verdict: {rep['verdict']} ({rec['tokens']} tokens, {len(prompts)} prompts); wrote {args.out}")


if __name__ == "__main__":
    main()
