"""Features from the serving engine against the transformers backend (issue 11, point 1).

The same token samples (held-out GSM8K prompts, SmolLM2 fp32, the default aux ids) are extracted
twice with ``eagle3kit extract``: by the transformers backend and by ``--backend vllm`` (vLLM's
``extract_hidden_states`` method; :mod:`eagle3kit.train.vllm_capture` writes the states on the CPU
build, whose own connector needs CUDA), once with vLLM in fp32 and once with vLLM computing in
bf16 (``engine_args: {dtype: bfloat16}``: other numerics). ``parity`` compares each with the
transformers folder per aux layer and for the teacher state. Prints one table; writes JSON.

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shared", default="../shared")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--work", default="runs/engine-features")
    ap.add_argument("--out", default="benchmarks/results/engine_features.json")
    args = ap.parse_args()
    from common import expected_time

    expected_time(
        "engine_features",
        "not timed as a whole; at --prompts 20 on vLLM's CPU build the transformers extract took 36 s and "
        "the vLLM one 27 s with its engine start (results/engine_features.json; machine not recorded), "
        "then a bf16-engine extract and parity (not timed)",
    )
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    from eagle3kit.core.config import PromptSource, load_config
    from eagle3kit.core.engines import installed_vllm
    from eagle3kit.core.rundir import RunDir
    from eagle3kit.data.backends import render_prompt_ids
    from eagle3kit.data.sources import read_source
    from eagle3kit.data.tokenize import save_shard
    from eagle3kit.model.target import load_target, resolve_aux_layer_ids
    from eagle3kit.serve.parity import compare_features
    from eagle3kit.train.extract import run_extract

    work = Path(args.work)
    if work.exists():
        shutil.rmtree(work)
    (work / "run").mkdir(parents=True)
    (work / "run" / "config.yaml").write_text(f"run_dir: {work / 'run'}\n")
    cfg = load_config(work / "run" / "config.yaml")
    target = load_target(cfg.target, device="cpu")
    aux_ids = list(resolve_aux_layer_ids(cfg.target, target.num_layers))
    rows, _ = read_source(
        PromptSource(name="gsm8k_heldout", path=f"{args.shared}/data/chats/gsm8k_train.jsonl", start=-80)
    )
    prompts = [render_prompt_ids(target.tokenizer, r["messages"][:1]) for r in rows[: args.prompts]]
    run = RunDir(work / "run")
    save_shard(run / "tokens.safetensors", [(p, [0] * (len(p) - 1) + [1]) for p in prompts])
    a, b = work / "features-transformers", work / "features-vllm"
    t0 = time.perf_counter()
    hf = run_extract(cfg, run, target, out_dir=str(a))
    t_hf = time.perf_counter() - t0
    cfg.extract.backend = "vllm"
    t0 = time.perf_counter()
    ve = run_extract(cfg, run, target, out_dir=str(b))
    t_vllm = time.perf_counter() - t0
    rep = compare_features(target, a, b)
    cfg.extract.engine_args = {
        "dtype": "bfloat16"
    }  # another engine numerics: the same vLLM computing in bf16
    c = work / "features-vllm-bf16-engine"
    run_extract(cfg, run, target, out_dir=str(c))
    rep_bf16 = compare_features(target, a, c)
    rec = {
        "benchmark": "engine_features",
        "target": "SmolLM2-135M-Instruct (GGUF → fp32)",
        "prompts": len(prompts),
        "tokens": sum(len(p) for p in prompts),
        "aux_layer_ids_hf": aux_ids,
        "vllm": installed_vllm(),
        "seconds": {
            "transformers_extract": round(t_hf, 2),
            "vllm_extract_incl_engine_start": round(t_vllm, 2),
        },
        "storage": "both bf16 in the feature folders (computed in fp32)",
        "parity": rep,
        "transformers_extract": hf,
        "vllm_extract": ve,
        "parity_vllm_bf16_engine": rep_bf16,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rec, indent=1, default=str))
    print(
        "| vLLM engine | layer | cosine | relative error | top-1 agreement | pass |\n|---|---|---:|---:|---:|---|"
    )
    for engine, r in (("fp32", rep), ("bf16", rep_bf16)):
        for name, v in r["layers"].items():
            print(
                f"| {engine} | {name} | {v['cosine']:.6f} | {v['relative_error']:.2e} | {v['top1_agreement']:.4f} | "
                f"{v['pass']} |"
            )
    print(
        f"verdict against transformers fp32: vLLM fp32 {rep['verdict']}, vLLM bf16 {rep_bf16['verdict']} "
        f"({rec['tokens']} tokens, {len(prompts)} prompts); wrote {args.out}"
    )


if __name__ == "__main__":
    main()
