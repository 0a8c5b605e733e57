"""Two drafters, one trained on vLLM-captured features and one on transformers features (same
data, same seed), each served by vLLM's CPU build (issue 11, point 3). Prints one table; writes JSON.

The run folder's token samples are extracted twice with ``eagle3kit extract``: by the
transformers backend and by ``--backend vllm`` (aux states and the last layer's pre-norm state
from vLLM's ``extract_hidden_states``, the teacher being ``final_norm`` of the latter). Each
drafter then serves held-out GSM8K questions in vLLM; τ comes from vLLM's spec-decode counters.

    python benchmarks/engine_features_train.py --run runs/default --epochs 8 --prompts 10 \
        --out benchmarks/results/engine_features_train.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--run", default="runs/default", help="a run folder with tokens.safetensors and vocab.safetensors"
    )
    ap.add_argument("--work", default="runs/engine-features-train")
    ap.add_argument("--shared", default="../shared")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/engine_features_train.json")
    ap.add_argument(
        "--resume", action="store_true", help="keep --work: reuse its features and finished drafters"
    )
    args = ap.parse_args()
    from common import expected_time

    expected_time(
        "engine_features_train",
        "about 26 minutes at --epochs 8 --prompts 10 on vLLM's CPU build for the two drafters, training "
        "and serving (671 s + 875 s, results/engine_features_train.json; machine not recorded), after two "
        "extractions (not timed)",
    )

    from common import train_variant

    from eagle3kit.core.config import PromptSource, load_config
    from eagle3kit.core.engines import (
        VLLMServer,
        free_port,
        served_token_ids,
        spec_decode_counters,
        spec_decode_delta,
    )
    from eagle3kit.core.rundir import RunDir
    from eagle3kit.data.sources import read_source
    from eagle3kit.data.tokenize import load_shard
    from eagle3kit.model.target import load_target
    from eagle3kit.model.target_export import export_fp32_folder
    from eagle3kit.serve.parity import compare_features
    from eagle3kit.train.extract import run_extract

    work = Path(args.work)
    if work.exists() and not args.resume:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    for f in ("tokens.safetensors", "vocab.safetensors", "config.yaml"):
        if not (work / f).exists():
            shutil.copy(Path(args.run) / f, work / f)
    cfg = load_config(work / "config.yaml", {"run_dir": str(work)})
    run = RunDir(work)
    target = load_target(cfg.target, device="cpu")
    a, b = work / "features-transformers", work / "features-vllm"
    run_extract(cfg, run, target, out_dir=str(a))  # resumes: nothing to do when complete
    cfg.extract.backend = "vllm"
    run_extract(cfg, run, target, out_dir=str(b))
    cfg.extract.backend = "transformers"
    samples = [ids for ids, _ in load_shard(run / "tokens.safetensors")]
    parity = compare_features(target, a, b)
    rows, _ = read_source(
        PromptSource(
            name="gsm8k_heldout",
            path=f"{args.shared}/data/chats/gsm8k_train.jsonl",
            start=-80,
            limit=args.prompts,
        )
    )
    folder = export_fp32_folder(target)
    result = {
        "benchmark": "engine_features_train",
        "run": args.run,
        "epochs": args.epochs,
        "seed": cfg.train.seed,
        "samples": len(samples),
        "prompts": len(rows),
        "max_tokens": args.max_tokens,
        "k": 3,
        "parity_verdict": parity["verdict"],
        "parity": parity["layers"],
        "drafters": {},
    }
    for name, feats in (("transformers", a), ("vllm", b)):
        done = work / f"result-{name}.json"
        if done.exists():
            result["drafters"][name] = json.loads(done.read_text())
            continue
        if (work / f"drafter-{name}").exists():
            shutil.rmtree(work / f"drafter-{name}")  # an unfinished one: trained again
        t0 = time.perf_counter()
        rep, secs = train_variant(
            cfg, run, work / f"drafter-{name}", target, features=str(feats), epochs=args.epochs
        )
        drafter = work / f"drafter-{name}" / "drafter"
        spec = json.dumps({"method": "eagle3", "model": str(drafter.resolve()), "num_speculative_tokens": 3})
        srv = VLLMServer(
            folder, free_port(), work / f"vllm-{name}.log", extra_args=["--speculative-config", spec]
        ).start(wait_s=400)
        try:
            before = spec_decode_counters(srv.url)
            served_token_ids(srv.url, rows, args.max_tokens)
            acc = spec_decode_delta(before, spec_decode_counters(srv.url))
        finally:
            srv.kill()
        result["drafters"][name] = {
            "train_seconds": round(secs, 1),
            "final_loss": rep.get("final_loss"),
            "vllm": {k: acc[k] for k in ("drafts", "accepted", "tau", "acceptance_rate")},
            "seconds": round(time.perf_counter() - t0, 1),
        }
        done.write_text(json.dumps(result["drafters"][name], default=str))
        print(f"{name}: τ in vLLM {acc['tau']:.4f} ({acc['accepted']}/{acc['drafts']})", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print("| features | τ in vLLM (K 3) | accepted / drafts | train s |\n|---|---:|---:|---:|")
    for name, d in result["drafters"].items():
        print(
            f"| {name} | {d['vllm']['tau']:.4f} | {d['vllm']['accepted']} / {d['vllm']['drafts']} | "
            f"{d['train_seconds']} |"
        )
    print(f"parity of the two feature folders: {parity['verdict']}; wrote {args.out}")


if __name__ == "__main__":
    main()
