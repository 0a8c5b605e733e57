"""The drafter variants and losses against each other and against SpecForge 0.2.0, on the same
conversations (issue 24).

One data set, the examples/smollm2-shared-data.yaml recipe (SmolLM2-135M-Instruct writes its own
replies to the OpenAssistant, GSM8K-train and Spec-Bench prompts of ``--shared``; draft vocabulary
8,192), then one drafter per row, each trained with that recipe's settings (TTT 7, 12 epochs,
8,192 tokens a step) and only its own variant or loss changed:

=======================  ===================================================================
``eagle3``               the 2025 EAGLE-3 drafter, forward KL (the baseline; two seeds)
``norm_before_residual``  the decoder layer's residual normed (speculators' default)
``eagle3.1``             EAGLE-3.1's per-layer ``fc_norm`` and ``norm_output``
``speculators_default``  speculators 0.9's default drafter: norm_before_residual, norm_before_fc,
                         norm_output
``p-eagle``              parallel drafting (all K drafts from one forward)
``lk_alpha``             the EAGLE-3 drafter trained with −log α
``lk_lambda``            the EAGLE-3 drafter trained with λ·KL + (1 − λ)(1 − α)
``specforge``            SpecForge 0.2.0's offline trainer on the same tokens, vocabulary and
                         target states (benchmarks/peers/specforge_adapter.py), its own defaults
                         but the settings that must match; imported with ``--aux-layer-ids``
``dflash``               the DFlash block drafter (5 layers, blocks of 8; ``dflash_l2``: 2 layers,
                         ``dflash_b16``: blocks of 16, ``dflash_kl``: distilled from the target)
``speculators_dflash``   speculators 0.9's DFlash trainer on the same tokens, vocabulary and
                         target states (benchmarks/peers/speculators_dflash_adapter.py)
=======================  ===================================================================

Every drafter is measured the same way: τ at K = 3 and 5 (simulate mode, greedy chain) on the 80
MT-bench first turns and the last 80 GSM8K train questions (never trained on), over the target's
256 greedy tokens, computed once and cached in the data run. All rows train with the dense
path (``attention: reference``; ``--precision fp32`` or ``tf32``, the fastest on this small drafter,
results/step_precision.json; ``--loss-chunk``) and ``--parallel`` processes share the GPU: tokens/s
is per process, measured beside the others (the JSON says how many ran at once).

    python benchmarks/variants.py --work /tmp/variants --shared ../shared [--stages data,train,report]
        [--rows eagle3:0,eagle3:1,…,specforge:0] [--parallel 9] [--smoke]

``--speed auto`` trains the rows with ``train``'s own defaults instead (under ``<work>/speed-auto``,
beside the reference rows of the same data run); ``--stages speed`` then compares the two paths
per τ column (results/speed_tau.json; issue 25: the faster path must train the same drafter).

Resumable: a finished stage or row is skipped. Writes ``benchmarks/results/variants.json``
(``rows``: ``name``, ``mt_bench_tau_k3``, ``gsm8k_tau_k3``, ``mt_bench_tau_k5``, ``gsm8k_tau_k5``,
``tokens_per_s``, ``seeds``) and prints one table.

Sizing, as seen on one H200 (2026-12-02, the run in results/variants.json): the data stage on the
2-core CPU with vLLM's CPU build takes 30 minutes (1,500 replies, 574K tokens; on the H200 with
transformers about 4); with ``--precision tf32 --loss-chunk 0`` one row trains 12 epochs of 516K
tokens in about 5 minutes while 5-6 processes share the GPU (about 20K tokens/s each, 100K
together; 108K alone, results/step_precision.json), so 10 eagle3kit rows and SpecForge's take two
waves of about 8 minutes at ``--parallel 5``. Each process holds about 17 GB. The device tool's
steps are in benchmarks/variants_device.sh.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
EXAMPLE = ROOT / "examples" / "smollm2-shared-data.yaml"
# the optimizer and batching every row trains with unless it names others: train's defaults until
# 2026-12-04, so the rows of 2026-12-02 are trained again as they were, whatever train's defaults now
EARLIER = {"betas": (0.9, 0.95), "shuffle": "batches"}
ROWS = {  # name: (drafter section, train.loss[, train settings over EARLIER])
    "eagle3": ({}, "kl"),
    "norm_before_residual": ({"norm_before_residual": True}, "kl"),
    "eagle3.1": ({"variant": "eagle3.1"}, "kl"),
    "speculators_default": (
        {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True},
        "kl",
    ),
    "p-eagle": ({"variant": "p-eagle"}, "kl"),
    "lk_alpha": ({}, "lk_alpha"),
    "lk_lambda": ({}, "lk_lambda"),
    # what SpecForge 0.2.0 trains with otherwise (issue 24's open 2.4%): AdamW's β2 of torch's default,
    # new length-grouped batches every epoch (train.shuffle: samples), and both (train's defaults now)
    "eagle3_betas999": ({}, "kl", {"betas": (0.9, 0.999)}),
    "eagle3_mixed": ({}, "kl", {"shuffle": "samples"}),
    "eagle3_mixed_betas999": ({}, "kl", {"betas": (0.9, 0.999), "shuffle": "samples"}),
    "eagle3.1_mixed_betas999": ({"variant": "eagle3.1"}, "kl", {"betas": (0.9, 0.999), "shuffle": "samples"}),
    # DFlash (its own network): 5 layers, blocks of 8 (16), the paper's cross-entropy; train's own
    # optimizer settings (betas 0.9/0.999, new batches each epoch), as the default EAGLE-3.1 row below
    "dflash": ({"variant": "dflash"}, "kl", {"betas": (0.9, 0.999), "shuffle": "samples", "lr": 6e-4}),
    "dflash_b16": (
        {"variant": "dflash", "block_size": 16},
        "kl",
        {"betas": (0.9, 0.999), "shuffle": "samples", "lr": 6e-4},
    ),
    "dflash_kl": (
        {"variant": "dflash", "objective": "kl"},
        "kl",
        {"betas": (0.9, 0.999), "shuffle": "samples", "lr": 6e-4},
    ),
    "dflash_l2": (
        {"variant": "dflash", "num_layers": 2},
        "kl",
        {"betas": (0.9, 0.999), "shuffle": "samples", "lr": 6e-4},
    ),
}
# peers' trainers on the same data: row name -> (module in benchmarks/peers, its train function)
PEERS = {
    "specforge": ("peers.specforge_run", "train_specforge"),
    "speculators_dflash": ("peers.speculators_dflash_run", "train_speculators_dflash"),
}
DEFAULT_RUNS = ["eagle3:0", "eagle3:1"] + [f"{n}:0" for n in ROWS if n != "eagle3"] + ["specforge:0"]
SPEED = {"attention": "reference", "precision": "fp32", "loss_chunk": 0}
KS = (3, 5)
EXTRA_KS = (7,)  # measured by rows trained since 2026-12-05 (DFlash beside EAGLE-3.1), reported when present
SETS = {"mt_bench": "mt_bench", "gsm8k_heldout": "gsm8k"}
SMOKE = {
    "limit": 12,
    "max_new_tokens": 16,
    "epochs": 1,
    "tokens_per_step": 256,
    "eval_prompts": 3,
    "eval_tokens": 16,
}


def base_config(args) -> Path:
    """``<work>/base/config.yaml``: the example's recipe with its prompt files read from ``--shared``
    (and, with ``--smoke``, a few prompts and tokens). Written again on every start with this
    machine's paths (the data run can be made on one machine and trained on another); a data run
    made at the other size (``--smoke`` or not) is refused."""
    import yaml

    cfg = yaml.safe_load(EXAMPLE.read_text())
    cfg["run_dir"] = str((Path(args.work) / "base").resolve())
    for src in cfg["prompts"]["sources"] + cfg["evaluate"]["sets"]:
        src["path"] = str((Path(args.shared) / src["path"].split("shared/", 1)[1]).resolve())
        if args.smoke:
            src["limit"] = SMOKE["limit"]
    if args.smoke:
        cfg["generate"]["max_new_tokens"] = SMOKE["max_new_tokens"]
        cfg["train"]["epochs"] = SMOKE["epochs"]
        cfg["train"]["tokens_per_step"] = SMOKE["tokens_per_step"]
    out = Path(args.work) / "base" / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    data = out.parent / "variants_data.json"
    if data.exists() and json.loads(data.read_text()).get("smoke", False) != args.smoke:
        raise SystemExit(f"{out.parent} holds a data run of the other size (--smoke); use another --work")
    text = yaml.safe_dump(cfg, sort_keys=False)
    if not out.exists() or out.read_text() != text:  # workers start together: write whole, then rename
        tmp = out.with_name(f".config.{os.getpid()}.yaml")
        tmp.write_text(text)
        os.replace(tmp, out)
    return out


def eval_settings(args) -> dict:
    return (
        {"eval_tokens": SMOKE["eval_tokens"], "eval_prompts": SMOKE["eval_prompts"]}
        if args.smoke
        else {"eval_tokens": 256, "eval_prompts": None}
    )


def stage_data(args) -> None:
    """Prompts, SmolLM2's replies, tokens and the draft vocabulary in ``<work>/base``, and the
    target's greedy continuations of both evaluation sets (cached there)."""
    from common import heldout_sets

    from eagle3kit.core.config import load_config
    from eagle3kit.core.rundir import RunDir
    from eagle3kit.data.generate import run_generate
    from eagle3kit.data.prompts import run_prompts
    from eagle3kit.data.tokenize import run_tokenize
    from eagle3kit.data.vocab import run_vocab
    from eagle3kit.model.target import load_target, pick_device

    cfg = load_config(base_config(args))
    run = RunDir(cfg.run_dir)
    device = pick_device("auto")
    target = load_target(cfg.target, device=device)
    # on a CPU, vLLM's CPU build generates (the stage's auto backend) and writes the continuations too
    backend = "vllm" if device.type == "cpu" and importlib.util.find_spec("vllm") else "transformers"
    t = time.perf_counter()
    stats = {"prompts": run_prompts(cfg, run, target), "generate": run_generate(cfg, run, target)}
    stats["generate_seconds"] = round(time.perf_counter() - t, 1)
    stats["tokenize"] = run_tokenize(cfg, run, tokenizer=target.tokenizer)
    stats["vocab"] = run_vocab(cfg, run, tokenizer=target.tokenizer)
    t = time.perf_counter()
    heldout_sets(run, target, args.shared, **eval_settings(args), backend=backend)
    stats["continuations_seconds"] = round(time.perf_counter() - t, 1)
    stats["backend"], stats["device"], stats["smoke"] = backend, str(device), args.smoke
    (run / "variants_data.json").write_text(json.dumps(stats, indent=2, default=str))


def speed_settings(args, speed: str | None = None) -> dict:
    """The ``train`` speed settings of every eagle3kit row of ``speed`` (default ``--speed``): the
    dense reference path at ``--precision``/``--loss-chunk``, or with ``auto`` train's own defaults."""
    if (speed or getattr(args, "speed", "reference")) == "auto":
        return {"attention": "auto", "precision": "auto", "loss_chunk": None}
    return {**SPEED, "loss_chunk": args.loss_chunk, "precision": args.precision}


def rows_root(args, speed: str | None = None) -> Path:
    """Where the rows of ``speed`` (default ``--speed``) live: ``<work>`` for the reference path,
    ``<work>/speed-auto`` for train's defaults, so both can be trained on one data run."""
    root = Path(args.work)
    return root / "speed-auto" if (speed or getattr(args, "speed", "reference")) == "auto" else root


def run_dir(args, key: str) -> Path:
    name, seed = key.split(":")
    return rows_root(args) / f"{name}-s{seed}"


def train_one(args, key: str) -> None:
    """One row and seed: the drafter trained on the data run's tokens and vocabulary, exported,
    and measured (``<run>/result.json``)."""
    import torch
    from common import gpu_peak_memory, gpu_processes, heldout_tau, open_run, train_variant

    name, seed = key.split(":")
    vdir = run_dir(args, key)
    if name in PEERS:
        module, func = PEERS[name]
        train_peer = getattr(importlib.import_module(module), func)
        out = train_peer(args, key, vdir, heldout_tau, open_run, KS + EXTRA_KS)
        (vdir / "result.json").write_text(json.dumps(out, indent=2))
        return
    drafter, loss, *more = ROWS[name]
    base, cfg, device, target = open_run(str(Path(args.work) / "base"))
    speed = speed_settings(args)
    trained = {**EARLIER, **(more[0] if more else {})}
    settings = {**speed, **trained}
    seen = {"at_start": gpu_processes(), "launched_together": args.parallel}
    res, seconds = train_variant(
        cfg, base, vdir, target, drafter=drafter, seed=int(seed), loss=loss, **settings
    )
    seen["at_end"] = gpu_processes()
    peak = gpu_peak_memory()
    tau, counts = heldout_tau(
        base, target, args.shared, {key: vdir / "drafter"}, device, ks=KS + EXTRA_KS, **args.eval
    )
    out = {
        "key": key,
        "tau": tau[key],
        "prompts": counts,
        "train_seconds": round(seconds, 1),
        **{
            k: res.get(k)
            for k in (
                "tokens_per_s",
                "tokens_per_s_steady",
                "tokens_per_s_wall",
                "best_val_tau",
                "best_epoch",
                "final_loss",
                "train_samples",
            )
        },
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "gpu_processes": seen,
        "gpu_peak_memory": peak,  # since the training stage reset it (the target held, its features included)
        "speed": args.speed,
        "loss_chunk": speed["loss_chunk"],
        "precision": speed["precision"],
        "train_settings": {k: list(v) if isinstance(v, tuple) else v for k, v in trained.items()},
    }
    (vdir / "result.json").write_text(json.dumps(out, indent=2))


def stage_train(args) -> None:
    """Every requested row and seed not yet measured, ``--parallel`` worker processes at a time
    (each loads the target, trains and measures one drafter)."""
    todo = [k for k in args.rows if not (run_dir(args, k) / "result.json").exists()]
    running: list[tuple[str, subprocess.Popen]] = []
    failed = []
    rows_root(args).mkdir(parents=True, exist_ok=True)
    while todo or running:
        while todo and len(running) < args.parallel:
            key = todo.pop(0)
            log = open(rows_root(args) / f"train-{key.replace(':', '-s')}.log", "w")
            argv = [sys.executable, __file__, "--work", args.work, "--shared", args.shared, "--worker", key]
            argv += ["--parallel", str(args.parallel), "--loss-chunk", str(args.loss_chunk)]
            argv += ["--precision", args.precision, "--speed", args.speed]
            argv += ["--smoke"] if args.smoke else []
            running.append(
                (key, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=os.environ))
            )
        time.sleep(2)
        for key, p in list(running):
            if p.poll() is not None:
                running.remove((key, p))
                print(f"[variants] {key}: exit {p.returncode}", flush=True)
                if p.returncode:
                    failed.append(key)
    if failed:
        raise SystemExit(f"rows {failed} failed: see {args.work}/train-*.log")


def console_warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


def epoch_history(vdir: Path) -> dict:
    """A row's validation τ (K = 3) and train loss after each epoch, from its ``report.json``."""
    rep = vdir / "report.json"
    hist = (_read_json(rep, "training").get("train") or {}).get("history", []) if rep.exists() else []
    return {
        "val_tau_k3_by_epoch": [round(h["val_tau"], 4) for h in hist if h.get("val_tau") is not None],
        "loss_by_epoch": [round(h["train_loss"], 4) for h in hist if h.get("train_loss") is not None],
    }


COLUMNS = [f"{short}_tau_k{k}" for short in SETS.values() for k in KS]


def compare_rows(rows: list[dict]) -> dict:
    """The best eagle3kit row against ``eagle3``: its gain per τ column, the seed spreads it must
    beat (the larger of the baseline's and its own, max − min over seeds) and SpecForge's row
    against it.

    A row "wins by more than the seed spread" in a column when its gain over the baseline's mean
    exceeds that spread and every one of its seeds lies above every baseline seed; with fewer than
    two seeds on either side that is not measured (None), never a win. The best row is the one
    with the largest mean relative gain among the rows that win in every column, else among all.
    Rows with a non-finite or missing τ column are left out (listed under ``skipped``).

    Raises:
        ValueError: no ``eagle3`` row, or a baseline τ that is not a positive finite number.
    """

    def finite(r):
        return all(isinstance(r.get(c), (int, float)) and math.isfinite(r[c]) for c in COLUMNS)

    base = next((r for r in rows if r["name"] == "eagle3"), None)
    if base is None:
        raise ValueError("no eagle3 row: the baseline every row is compared with")
    if not finite(base) or min(base[c] for c in COLUMNS) <= 0:
        raise ValueError(f"the eagle3 row's τ is not a positive finite number in every column: {base}")
    skipped = [r["name"] for r in rows if r["name"] not in ("eagle3", *PEERS) and not finite(r)]
    ours = [r for r in rows if r["name"] not in ("eagle3", *PEERS) and finite(r)]
    if not ours:
        return {"skipped": skipped} if skipped else {}

    def taus(r, c):
        key = {"mt_bench": "mt_bench", "gsm8k": "gsm8k_heldout"}[c.split("_tau")[0]]
        return [x["tau"][key][f"k{c[-1]}"] for x in r.get("seeds") or []]

    def columns(r) -> dict:
        out = {}
        for c in COLUMNS:
            mine, theirs = taus(r, c), taus(base, c)
            measured = len(mine) >= 2 and len(theirs) >= 2
            spread = max(base.get("seed_spread", {}).get(c, 0.0), r.get("seed_spread", {}).get(c, 0.0))
            out[c] = {
                "best": r[c],
                "eagle3": base[c],
                "gain": round(r[c] / base[c] - 1, 4),
                "seed_spread": spread if measured else None,
                "wins_by_more_than_seed_spread": (r[c] - base[c] > spread and min(mine) > max(theirs))
                if measured
                else None,
            }
        return out

    cols_of = {r["name"]: columns(r) for r in ours}

    def mean_gain(r):
        return sum(v["gain"] for v in cols_of[r["name"]].values()) / len(COLUMNS)

    winners = [
        r for r in ours if all(v["wins_by_more_than_seed_spread"] for v in cols_of[r["name"]].values())
    ]
    best = max(winners or ours, key=mean_gain)
    cols = cols_of[best["name"]]
    sf = next((r for r in rows if r["name"] == "specforge" and finite(r)), None)
    return {
        "best": best["name"],
        "best_seeds": len(best.get("seeds") or []),
        "baseline_seeds": len(base.get("seeds") or []),
        "columns": cols,
        "mt_bench_k3_gain_over_eagle3": cols["mt_bench_tau_k3"]["gain"],
        "mt_bench_k3_goal_10pct_met": cols["mt_bench_tau_k3"]["gain"] >= 0.10,
        "vs_specforge": {c: round(best[c] / sf[c] - 1, 4) for c in COLUMNS} if sf else None,
        "specforge_vs_eagle3": {c: round(sf[c] / base[c] - 1, 4) for c in COLUMNS} if sf else None,
        "default_should_change": bool(winners) and best in winners,
        "largest_gain": _largest_gain(max(ours, key=mean_gain), cols_of, base, sf),
        **({"skipped": skipped} if skipped else {}),
    }


def compare_blocks(rows: list[dict]) -> dict | None:
    """Each block-drafter row (``dflash…``, ``speculators_dflash``) against EAGLE-3.1 per set and K of
    3, 5 and 7: train's default (``eagle3.1_mixed_betas999``: betas (0.9, 0.999), new batches every
    epoch, as the DFlash rows train) when measured, else ``eagle3.1``. Per column the ratio of mean τ,
    and whether it lies beyond the seed spread (the larger of the two rows' max − min; None when
    either row has one seed). The aim is a ratio of at least 1.2 at K = 7 on both sets. None without
    an EAGLE-3.1 row. A block row's column that is missing or not finite is left out.

    Raises:
        ValueError: a reference τ that is not a positive finite number (naming the row and column).
    """
    named = {r["name"]: r for r in rows}
    ref = named.get("eagle3.1_mixed_betas999") or named.get("eagle3.1")
    blocks = [r for r in rows if r["name"].startswith("dflash") or r["name"] == "speculators_dflash"]
    if ref is None or not blocks:
        return None
    columns = [f"{short}_tau_k{k}" for k in KS + EXTRA_KS for short in SETS.values()]
    columns = [c for c in columns if isinstance(ref.get(c), (int, float))]
    for c in columns:
        if not (math.isfinite(ref[c]) and ref[c] > 0):
            raise ValueError(
                f"the {ref['name']} row's {c} is {ref[c]!r}, not a positive finite number: "
                "the reference the block rows are compared with"
            )
    out = {"reference": ref["name"]}
    for r in blocks:
        two = len(r["seeds"]) > 1 and len(ref["seeds"]) > 1
        cols = {}
        for c in columns:
            if not isinstance(r.get(c), (int, float)) or not math.isfinite(r[c]):
                continue  # a NaN or missing column of the block row is left out
            spread = max((r.get("seed_spread") or {}).get(c, 0.0), (ref.get("seed_spread") or {}).get(c, 0.0))
            cols[c] = {
                "ratio": round(r[c] / ref[c], 4),
                "beyond_seed_spread": abs(r[c] - ref[c]) > spread if two else None,
            }
        k7 = [cols.get(f"{s}_tau_k7", {}).get("ratio") for s in SETS.values()]
        out[r["name"]] = {
            "seeds": len(r["seeds"]),
            "vs_reference": cols,
            "aim_1.2x_at_k7_met": all(v >= 1.2 for v in k7) if all(v is not None for v in k7) else None,
        }
    return out


def _largest_gain(r: dict, cols_of: dict, base: dict, sf: dict | None) -> dict:
    """The row of the largest mean gain over ``eagle3`` whatever its seeds (the ``best`` of
    :func:`compare_rows` needs two): its gain per column, whether each gain exceeds the baseline's
    own seed spread (the only spread a one-seed row has), and its ratio to SpecForge's row."""
    cols = cols_of[r["name"]]
    spread = base.get("seed_spread") or {}
    return {
        "name": r["name"],
        "seeds": len(r.get("seeds") or []),
        "gain": {c: v["gain"] for c, v in cols.items()},
        "gain_above_baseline_spread": {c: r[c] - base[c] > spread.get(c, 0.0) for c in COLUMNS},
        "vs_specforge": {c: round(r[c] / sf[c] - 1, 4) for c in COLUMNS} if sf else None,
    }


def _read_json(path: Path, what: str) -> dict:
    """A JSON object from ``path``; a clear error naming the file otherwise."""
    from common import read_json_object

    return read_json_object(path, f"rerun that row's {what} or delete the file")


def _seed_result(p: Path, name: str) -> dict:
    """One row folder's ``result.json``, checked against its folder name (``NAME-sSEED``)."""
    r = _read_json(p, "training")
    folder_seed = p.parent.name[len(name) + 2 :]
    key = r.get("key")
    if not isinstance(key, str) or key != f"{name}:{folder_seed}":
        raise SystemExit(f"{p}: its key {key!r} is not {name}:{folder_seed}, the folder's row and seed")
    for s in SETS:
        for k in KS:
            v = ((r.get("tau") or {}).get(s) or {}).get(f"k{k}")
            if not isinstance(v, (int, float)):
                raise SystemExit(f"{p}: no τ for {s} at K={k}; rerun the row's evaluation (--stages train)")
    return {"seed": int(folder_seed), **r}


def collect_rows(root: Path) -> list[dict]:
    """Every row measured under ``root`` (``NAME-sSEED/result.json``): per τ column the mean over
    its seeds and, with two or more, ``seed_spread`` (max − min); ``tokens_per_s`` the seeds' mean."""
    rows = []
    for name in [*ROWS, *PEERS]:
        seeds = []
        for p in sorted(root.glob(f"{name}-s*/result.json")):
            tail = p.parent.name[len(name) + 2 :]
            if not tail.isdigit() or str(int(tail)) != tail:  # eagle3-sX, eagle3-s00: not a row's folder
                console_warn(f"{p.parent}: not a row folder (NAME-sSEED); left out")
                continue
            seeds.append({**epoch_history(p.parent), **_seed_result(p, name)})  # a result's own history first
        if not seeds:
            continue
        row = {"name": name}
        for s, short in SETS.items():
            for k in KS:
                vals = [x["tau"][s][f"k{k}"] for x in seeds]
                row[f"{short}_tau_k{k}"] = round(sum(vals) / len(vals), 4)
                if len(vals) > 1:
                    row.setdefault("seed_spread", {})[f"{short}_tau_k{k}"] = round(max(vals) - min(vals), 4)
            for k in EXTRA_KS:
                vals = [((x["tau"].get(s) or {}).get(f"k{k}")) for x in seeds]
                if all(isinstance(v, (int, float)) for v in vals):
                    row[f"{short}_tau_k{k}"] = round(sum(vals) / len(vals), 4)
        tps = [x["tokens_per_s"] for x in seeds if x.get("tokens_per_s")]
        row["tokens_per_s"] = round(sum(tps) / len(tps)) if tps else None
        row["seeds"] = seeds
        rows.append(row)
    return rows


def with_run_info(args, out: dict) -> dict:
    """``out`` with the keys of ``<work>/run_info.json`` (how and where the run was made, written by
    whoever ran it) that it lacks, first, and its ``rows`` last: the file adds to what the run
    recorded, never replaces it (a clash is warned about)."""
    info = Path(args.work) / "run_info.json"
    if not info.exists():
        return out
    extra = _read_json(info, "the run's launcher")
    clash = sorted(k for k in extra if k in out)
    if clash:
        console_warn(f"{info}: {clash} left as the run recorded them")
    return {
        **{k: v for k, v in extra.items() if k not in out},
        **{k: v for k, v in out.items() if k != "rows"},
        "rows": out["rows"],
    }


def stage_report(args) -> dict:
    """``benchmarks/results/variants.json`` and the table: per row the mean over its seeds."""
    rows = collect_rows(rows_root(args))
    base = next((r for r in rows if r["name"] == "eagle3"), None)
    verdict = compare_rows(rows) if base else None
    data = Path(args.work) / "base" / "variants_data.json"
    out = {
        "benchmark": "benchmarks/variants.py",
        "recipe": str(EXAMPLE.relative_to(ROOT)),
        "speed_path": speed_settings(args),
        "smoke": args.smoke,
        "data": json.loads(data.read_text()) if data.exists() else None,
        "rows": rows,
    }
    out = with_run_info(args, out)
    blocks = compare_blocks(rows)
    if blocks:
        out["block_drafters_vs_eagle3.1"] = blocks
    if base:
        out["vs_eagle3_mt_bench_k3"] = {
            r["name"]: round(r["mt_bench_tau_k3"] / base["mt_bench_tau_k3"] - 1, 4) for r in rows
        }
        out["verdict"] = verdict
    if not args.smoke:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    from rich.console import Console
    from rich.table import Table

    table = Table(title="variants: τ (simulate, greedy chain) on 80 MT-bench first turns / 80 held-out GSM8K")
    heads = [
        f"{'MT-bench' if s == 'mt_bench' else 'GSM8K'} K={k}" for k in KS + EXTRA_KS for s in SETS.values()
    ]
    for col in ("row", "seeds", *heads, "train tok/s"):
        table.add_column(col, justify="left" if col in ("row", "seeds") else "right")
    for r in rows:
        table.add_row(
            r["name"],
            ",".join(str(x["seed"]) for x in r["seeds"]),
            *(
                f"{r[c]:.4f}" if isinstance(r.get(c), (int, float)) else "-"
                for k in KS + EXTRA_KS
                for c in (f"{s}_tau_k{k}" for s in SETS.values())
            ),
            str(r["tokens_per_s"]),
        )
    Console(width=140).print(table)
    return out


def stage_speed(args) -> dict:
    """Issue 25's check that the faster path trains the same drafter: every row trained under
    both ``--speed reference`` (``<work>``) and ``--speed auto`` (``<work>/speed-auto``) on the same
    data run, compared per τ column. The auto path "reaches the same τ" in a column when its mean
    lies within the seed spread (the larger of the two paths' max − min over seeds) of the
    reference's mean; with one seed on either side that is not measured (None). Writes
    ``--speed-out`` (results/speed_tau.json) and prints one table.

    Raises:
        SystemExit: no row measured under both paths.
    """
    ref = {r["name"]: r for r in collect_rows(rows_root(args, "reference"))}
    auto = {r["name"]: r for r in collect_rows(rows_root(args, "auto"))}
    names = [n for n in ref if n in auto]
    if not names:
        raise SystemExit(f"{args.work}: no row trained under both --speed reference and --speed auto")

    def side(r: dict) -> dict:
        seeds = r["seeds"]
        keep = ("tokens_per_s", "tokens_per_s_steady", "tokens_per_s_wall", "train_seconds", "precision")
        return {
            **{c: r[c] for c in COLUMNS},
            "seed_spread": r.get("seed_spread"),
            "seeds": [{"seed": x["seed"], "tau": x["tau"], **{k: x.get(k) for k in keep}} for x in seeds],
        }

    rows, verdict = [], True
    for n in names:
        a, b = ref[n], auto[n]
        cols = {}
        for c in COLUMNS:
            measured = len(a["seeds"]) >= 2 and len(b["seeds"]) >= 2
            spread = max((a.get("seed_spread") or {}).get(c, 0.0), (b.get("seed_spread") or {}).get(c, 0.0))
            diff = round(b[c] - a[c], 4)
            within = abs(diff) <= spread if measured else None
            verdict = verdict and bool(within)
            cols[c] = {"difference": diff, "seed_spread": spread if measured else None, "within": within}
        rows.append({"name": n, "reference": side(a), "auto": side(b), "columns": cols})
    out = {
        "benchmark": "benchmarks/variants.py --stages speed",
        "recipe": str(EXAMPLE.relative_to(ROOT)),
        "reference_path": speed_settings(args, "reference"),
        "auto_path": speed_settings(args, "auto"),
        "rule": "auto's mean within the seed spread (max of the two paths' max − min) of the reference's mean",
        "rows": rows,
        "same_tau_within_seed_spread": verdict,
    }
    out = with_run_info(args, out)
    if not args.smoke:
        Path(args.speed_out).write_text(json.dumps(out, indent=2) + "\n")
    from rich.console import Console
    from rich.table import Table

    table = Table(title="the reference path against train's auto path, same data: τ (simulate, greedy chain)")
    for col in ("row", "path", "seeds", *COLUMNS, "tok/s steady"):
        table.add_column(col, justify="left" if col in ("row", "path", "seeds") else "right")
    for r in rows:
        for path in ("reference", "auto"):
            x = r[path]
            steady = [y["tokens_per_s_steady"] or y["tokens_per_s"] for y in x["seeds"]]
            table.add_row(
                r["name"],
                path,
                ",".join(str(y["seed"]) for y in x["seeds"]),
                *(f"{x[c]:.4f}" for c in COLUMNS),
                f"{sum(steady) / len(steady):,.0f}" if all(steady) else "-",
            )
    Console(width=140).print(table)
    print(f"same τ within the seed spread: {verdict}")
    return out


def parse_rows(text: str) -> list[str]:
    """``--rows``: row:seed keys, comma-separated, each once, seed a non-negative integer in ASCII
    digits with no leading zero (``eagle3:0``, ``eagle3:12``); SystemExit naming the fix otherwise."""
    rows = [r.strip() for r in text.split(",") if r.strip()]
    fix = f"give row:seed, seed a non-negative integer, with a row of {[*ROWS, *PEERS]}"
    if not rows:
        raise SystemExit(f"--rows {text!r} names no row: {fix}")
    bad = [
        r
        for r in rows
        if r.partition(":")[0] not in [*ROWS, *PEERS]
        or not re.fullmatch(r"0|[1-9][0-9]*", r.partition(":")[2])
    ]
    if bad:
        raise SystemExit(f"--rows {bad}: {fix}")
    twice = sorted({r for r in rows if rows.count(r) > 1})
    if twice:
        raise SystemExit(
            f"--rows {twice} given more than once: give each row:seed once, seed a non-negative integer"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True, help="working folder (the data run and one folder per row)")
    ap.add_argument("--shared", required=True, help="the shared folder holding data/chats and data/prompts")
    ap.add_argument("--stages", default="data,train,report")
    ap.add_argument("--rows", default=",".join(DEFAULT_RUNS), help="row:seed, comma-separated")
    ap.add_argument(
        "--parallel", type=int, default=4, help="training processes sharing the GPU (~17 GB each)"
    )
    ap.add_argument(
        "--smoke", action="store_true", help="every stage at toy size (a CPU check, not a measurement)"
    )
    ap.add_argument(
        "--loss-chunk",
        type=int,
        default=4096,
        help="train.loss_chunk (4096: the loss in checkpointed chunks; 0: unchunked, the same loss, more memory)",
    )
    ap.add_argument(
        "--precision",
        choices=["fp32", "tf32"],
        default="fp32",
        help="train.precision of every eagle3kit row (tf32: fp32 with TF32 matrix products, CUDA only)",
    )
    ap.add_argument(
        "--speed",
        choices=["reference", "auto"],
        default="reference",
        help="reference: the dense path with --precision and --loss-chunk; auto: what `train` picks on "
        "this device by default (attention, precision and loss_chunk: auto; on CUDA flex + bf16)",
    )
    ap.add_argument("--out", default=str(RESULTS / "variants.json"), help="the results JSON")
    ap.add_argument(
        "--speed-out", default=str(RESULTS / "speed_tau.json"), help="the results JSON of --stages speed"
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.rows = parse_rows(args.rows)
    args.eval = eval_settings(args)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    base_config(args)
    if args.worker:
        return train_one(args, args.worker)
    from common import expected_time

    if args.smoke:
        expected_time("variants --smoke", "not timed yet (toy size on a CPU, measures nothing)")
    elif {"data", "train"} & set(args.stages.split(",")):
        expected_time(
            "variants",
            "data: 30 minutes on a 2-core CPU with vLLM's CPU build, about 4 on one H200 with transformers; "
            "train: two waves of about 8 minutes on one H200 at --parallel 5 --precision tf32 --loss-chunk 0 "
            "(the docstring's sizing, results/variants.json)",
        )
    stages = args.stages.split(",")
    if "data" in stages and not (Path(args.work) / "base" / "variants_data.json").exists():
        stage_data(args)
    if "train" in stages:
        stage_train(args)
    if "report" in stages:
        stage_report(args)
    if "speed" in stages:
        stage_speed(args)


if __name__ == "__main__":
    main()
