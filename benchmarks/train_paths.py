"""Does the GPU training path train as good a drafter as the readable reference, and how much
faster, on a real target?

For one run directory (conversations already generated; SmolLM2 in the measured run), this
tokenizes and builds the draft vocabulary, then trains a drafter with ``eagle3kit train`` (online
features, cached) for each path and seed, same data order per seed:

* ``reference``: dense TTT attention, fp32, unchunked loss (``train.attention: reference``,
  ``precision: fp32``, ``loss_chunk: 0``);
* ``fast``: the CUDA defaults (flex attention with a block mask, bf16 autocast, chunked loss);
* ``fast+pack``: the same with ``train.pack_length`` (default 2048).

Each drafter is exported and measured: τ (K = 3, simulate mode) on MT-bench first turns and the
held-out last 80 GSM8K questions, and training tokens/s. Resumable (finished trainings are kept).
Prints one table and writes benchmarks/results/train_paths.json.

    python benchmarks/train_paths.py --run RUN_DIR --shared ../shared [--seeds 0 1] [--epochs 6] [--ttt 3]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PATHS = {
    "reference": {"attention": "reference", "precision": "fp32", "loss_chunk": 0},
    "fast": {},
    "fast+pack": {"pack_length": None},  # filled from --pack
}


def main() -> None:
    from common import heldout_tau, open_run, train_variant

    from eagle3kit.core.ui import print_table

    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--shared", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--pack", type=int, default=2048)
    ap.add_argument("--paths", nargs="+", default=list(PATHS))
    ap.add_argument("--eval-tokens", type=int, default=256)
    ap.add_argument("--eval-prompts", type=int, default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train_paths.json"))
    args = ap.parse_args()
    from common import expected_time

    expected_time(
        "train_paths",
        "about 5 minutes of training at the defaults on one H200 (6 trainings of 36-69 s, "
        "results/train_paths.json), the τ evaluation not timed",
    )
    run, cfg, device, target = open_run(args.run)
    state_path = run / "train_paths_state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {"train": {}, "tau": {}}
    for seed in args.seeds:
        for path in args.paths:
            name = f"{path}-seed{seed}"
            if name in state["train"]:
                continue
            settings = {k: args.pack if k == "pack_length" else v for k, v in PATHS[path].items()}
            res, seconds = train_variant(
                cfg,
                run,
                run / "paths" / name,
                target,
                seed=seed,
                epochs=args.epochs,
                ttt_steps=args.ttt,
                **settings,
            )
            state["train"][name] = {
                "seconds": round(seconds, 1),
                "tokens_per_s": res.get("tokens_per_s"),
                "best_val_tau": res.get("best_val_tau"),
                "final_loss": res.get("final_loss"),
                "attention": res.get("attention"),
                "precision": res.get("precision"),
            }
            state_path.write_text(json.dumps(state, indent=2))

    def keep(name, res):
        state["tau"][name] = res
        state_path.write_text(json.dumps(state, indent=2))

    state["tau"], n_prompts = heldout_tau(
        run,
        target,
        args.shared,
        {n: run / "paths" / n / "drafter" for n in state["train"]},
        device,
        args.eval_tokens,
        args.eval_prompts,
        state["tau"],
        keep,
    )
    rows, table = [], []
    for path in args.paths:
        names = [f"{path}-seed{s}" for s in args.seeds]
        taus = {s: [state["tau"].get(n, {}).get(s, {}).get("k3") for n in names] for s in n_prompts}
        tps = [state["train"][n]["tokens_per_s"] for n in names if n in state["train"]]
        rows.append(
            {
                "path": path,
                "settings": PATHS[path],
                "tau": taus,
                "tokens_per_s": tps,
                "final_loss": [state["train"][n]["final_loss"] for n in names if n in state["train"]],
            }
        )
        table.append(
            (
                path,
                f"{sum(tps) / max(len(tps), 1):,.0f} tok/s; "
                + "; ".join(f"{s} τ {v}" for s, v in taus.items()),
            )
        )
    out = {
        "machine": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "target": cfg.target.model,
        "epochs": args.epochs,
        "ttt_steps": args.ttt,
        "k": 3,
        "seeds": args.seeds,
        "eval_tokens": args.eval_tokens,
        "sets": n_prompts,
        "paths": rows,
        "train": state["train"],
    }
    print_table("training paths: tokens/s and τ (K=3, simulate)", table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
