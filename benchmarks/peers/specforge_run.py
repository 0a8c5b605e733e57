"""SpecForge 0.2.0's row of benchmarks/variants.py: its offline trainer on the same training split,
tokens, draft vocabulary and target states as eagle3kit's rows, then its own export, eagle3kit's
import and the same τ measurement (:func:`train_specforge`).

The training split is eagle3kit's (``train.val_fraction`` of the samples held out by the same
seeded shuffle as ``eagle3kit train``), so SpecForge sees exactly the samples eagle3kit trains on.
The states are the target's, computed by eagle3kit (its aux layers (2, N//2, N−3) are SpecForge's
default) and written in SpecForge's ``.ckpt`` format by :mod:`specforge_adapter`. SpecForge keeps
its own defaults except what must match: TTT 7, 12 epochs, learning rate 3e-4, warm-up 3%,
cosine, gradient clip 0.5, seed, about 8,192 tokens an optimizer step (batch 4 × accumulation), the
draft vocabulary. Its final step is exported (SpecForge keeps no best-validation checkpoint).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from common import gpu_processes

from peers import specforge_adapter as sfa


def training_split(samples: list, seed: int, val_fraction: float) -> list:
    """The samples ``eagle3kit train`` trains on (its ``_Training._split`` for one process)."""
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(len(samples) * val_fraction)) if val_fraction > 0 and len(samples) > 1 else 0
    return [samples[i] for i in order[n_val:]]


def train_specforge(args, key: str, vdir: Path, heldout_tau, open_run, ks) -> dict:
    """Features, SpecForge's training, its export, eagle3kit's import and τ, for ``key``
    (``specforge:SEED``); returns the row's result (written to ``vdir/result.json`` by the caller)."""
    import torch

    from eagle3kit.data.tokenize import load_shard
    from eagle3kit.model.draft_vocab import load_vocab
    from eagle3kit.model.target import resolve_aux_layer_ids
    from eagle3kit.serve.importer import run_import
    from eagle3kit.train.batches import Sample
    from eagle3kit.train.samples import compute_features

    seed = int(key.split(":")[1])
    base, cfg, device, target = open_run(str(Path(args.work) / "base"))
    samples = [Sample(i, m) for i, m in load_shard(base / "tokens.safetensors")]
    samples = training_split([s for s in samples if s.mask[1:].any()], cfg.train.seed, cfg.train.val_fraction)
    ids = resolve_aux_layer_ids(cfg.target, target.num_layers)
    vocab, _ = load_vocab(base / "vocab.safetensors")
    compute_features(target, samples, ids, cfg.train.tokens_per_step, device, torch.device("cpu"))
    peers = os.environ.get("SPECFORGE_PATH") or str(Path(__file__).resolve().parents[2] / ".venv" / "peers")
    plan = sfa.prepare_run(
        samples,
        vdir / "specforge",
        target_config=target.config,
        target_model=target.model,
        d2t=vocab.d2t,
        t2d=vocab.t2d,
        aux_layer_ids=ids,
        pythonpath=peers,
        overwrite=True,
        num_epochs=cfg.train.epochs,
        learning_rate=cfg.train.lr,
        ttt_length=cfg.train.ttt_steps,
        batch_size=4,
        tokens_per_step=cfg.train.tokens_per_step,
        seed=seed,
        # SpecForge's default on a GPU; its flex attention has no backward pass on a CPU (the --smoke check)
        attention_backend="flex_attention" if torch.cuda.is_available() else "sdpa",
    )
    tokens = sum(min(s.ids.numel(), 2048) for s in samples) * cfg.train.epochs
    for s in samples:
        s.aux = s.last = s.argmax = None
    seen = {"at_start": gpu_processes(), "launched_together": args.parallel}
    t = time.perf_counter()
    with open(vdir / "specforge.log", "w") as log:
        rc = subprocess.run(
            plan["argv"], env={**os.environ, **plan["env"]}, stdout=log, stderr=subprocess.STDOUT
        ).returncode
    seconds = time.perf_counter() - t
    seen["at_end"] = gpu_processes()
    if rc:
        raise SystemExit(f"SpecForge's trainer exited with {rc}: see {vdir / 'specforge.log'}")
    # its steady rate: samples a second over the log windows after the first (its compilation),
    # times the mean sample's tokens (its batches are random, so a window holds the mean sample)
    rate, windows = sfa.steady_samples_per_s((vdir / "specforge.log").read_text(errors="replace"))
    steady = rate * tokens / (len(samples) * cfg.train.epochs)
    if peers not in sys.path:
        sys.path.insert(0, peers)
    export = sfa.export_to_hf_folder(
        plan["output_dir"], plan["draft_config"], vdir / "export", plan["target"], plan["vocab_mapping"]
    )
    imp = run_import(export, vdir / "drafter", cfg.target, overwrite=True, aux_layer_ids=list(ids))
    tau, counts = heldout_tau(base, target, args.shared, {key: vdir / "drafter"}, device, ks=ks, **args.eval)
    return {
        "key": key,
        "tau": tau[key],
        "prompts": counts,
        "train_seconds": round(seconds, 1),
        "tokens_per_s": round(tokens / seconds),
        "tokens_per_s_wall": round(tokens / seconds),
        "tokens_per_s_steady": round(steady),
        "steady_windows": windows,
        "tokens_per_s_note": "wall: SpecForge's whole run (start-up and compilation included); steady: its "
        "logged samples/s after the first log window, times the mean sample's tokens",
        "train_samples": len(samples),
        "import_layout": imp["layout"],
        "import_notes": imp["notes"],
        "specforge_plan": {
            k: plan["config"]["training"].get(k) for k in ("batch_size", "accumulation_steps", "max_steps")
        },
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "gpu_processes": seen,
    }


if __name__ == "__main__":
    print(json.dumps({"specforge_adapter": sfa.SPECFORGE_VERSION}))
