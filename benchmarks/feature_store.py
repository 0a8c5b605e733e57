"""What do fp8 and top-K feature shards cost in acceptance, and what do they save in bytes?

For one run directory (conversations already generated), this tokenizes and builds the draft
vocabulary, then for each storage option — bf16 (the 8·H baseline), fp8, bf16 + top-K teacher,
fp8 + top-K teacher — runs `extract` once and trains a drafter from the shards for each seed
(same data order per seed across options), and measures τ (K = 3, simulate mode, greedy chain)
on MT-bench first turns and held-out GSM8K questions (the last 80 of gsm8k_train.jsonl), with
the target's greedy continuations computed once and shared by every drafter. Resumable: a
finished extraction, drafter or evaluation is not redone, so the work can be split over calls
(``--budget-s`` stops before starting a training that would not finish in time). Prints one
table and writes benchmarks/results/feature_store.json.

    python benchmarks/feature_store.py --run RUN_DIR --shared ../shared [--seeds 0 1] [--topk 16]
        [--epochs 8] [--ttt 3] [--budget-s 540]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    from common import heldout_tau, open_run, train_variant

    from eagle3kit.core.ui import print_table
    from eagle3kit.train.extract import run_extract

    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument(
        "--shared", required=True, help="the shared data folder (holds data/prompts/mt_bench.jsonl …)"
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--eval-tokens", type=int, default=256)
    ap.add_argument("--eval-prompts", type=int, default=None, help="cap per set (smoke runs)")
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "feature_store.json"))
    args = ap.parse_args()
    from common import expected_time

    expected_time(
        "feature_store",
        "not timed as a whole; on one H200 each of its 8 trainings took 27-32 s at 6 epochs "
        "(results/feature_store.json), the 4 extractions and the τ evaluation not timed",
    )
    start = time.perf_counter()
    run, cfg, device, target = open_run(args.run)
    state_path = run / "feature_store_state.json"
    state = (
        json.loads(state_path.read_text()) if state_path.exists() else {"extract": {}, "train": {}, "tau": {}}
    )
    options = [("bf16", "last"), ("fp8", "last"), ("bf16", f"topk:{args.topk}"), ("fp8", f"topk:{args.topk}")]
    for dtype, teacher in options:
        key = f"{dtype}-{teacher}"
        if key not in state["extract"]:
            cfg.extract.dtype, cfg.extract.teacher = dtype, teacher
            state["extract"][key] = run_extract(cfg, run, target)
            state_path.write_text(json.dumps(state, indent=2))
    train_s = [v["seconds"] for v in state["train"].values()]
    for seed in args.seeds:
        for dtype, teacher in options:
            key = f"{dtype}-{teacher}"
            name = f"{key}-seed{seed}"
            if name in state["train"]:
                continue
            if train_s and time.perf_counter() - start + 1.2 * max(train_s) > args.budget_s:
                print(f"budget: stopping before {name}; run again to continue")
                state_path.write_text(json.dumps(state, indent=2))
                return
            res, seconds = train_variant(
                cfg,
                run,
                run / "variants" / name,
                target,
                features=state["extract"][key]["path"],
                seed=seed,
                epochs=args.epochs,
                ttt_steps=args.ttt,
            )
            train_s.append(seconds)
            state["train"][name] = {
                "seconds": round(train_s[-1], 1),
                "tokens_per_s": res.get("tokens_per_s"),
                "best_val_tau": res.get("best_val_tau"),
            }
            state_path.write_text(json.dumps(state, indent=2))

    def keep(name, res):
        state["tau"][name] = res
        state_path.write_text(json.dumps(state, indent=2))

    state["tau"], n_prompts = heldout_tau(
        run,
        target,
        args.shared,
        {n: run / "variants" / n / "drafter" for n in state["train"]},
        device,
        args.eval_tokens,
        args.eval_prompts,
        state["tau"],
        keep,
    )
    sets = list(n_prompts)
    base = state["extract"]["bf16-last"]["bytes_per_token"]
    rows, table = [], []
    for dtype, teacher in options:
        key = f"{dtype}-{teacher}"
        taus = {
            s: [state["tau"].get(f"{key}-seed{sd}", {}).get(s, {}).get("k3") for sd in args.seeds]
            for s in sets
        }
        bpt = state["extract"][key]["bytes_per_token"]
        rows.append(
            {
                "option": key,
                "bytes_per_token": bpt,
                "share_of_bf16": round(bpt / base, 4),
                "bytes": state["extract"][key]["bytes"],
                "tau": taus,
                "seeds": args.seeds,
            }
        )
        table.append(
            (key, f"{bpt} B/token ({bpt / base:.1%}); " + "; ".join(f"{s} τ {taus[s]}" for s in sets))
        )
    out = {
        "machine": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "target": cfg.target.model,
        "tokens": state["extract"]["bf16-last"]["tokens"],
        "epochs": args.epochs,
        "ttt_steps": args.ttt,
        "k": 3,
        "eval_tokens": args.eval_tokens,
        "options": rows,
        "train": state["train"],
        "sets": n_prompts,
    }
    print_table("feature store: bytes per token and τ (K=3, simulate)", table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
