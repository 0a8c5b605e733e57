"""DFlash's part of the training loop (:mod:`eagle3kit.train.stage` runs it for every drafter kind:
lineage, the split, batches, torchrun, online states, the memory plan, resume mid-epoch, the log and
checkpoints): the drafter built for the target, the block objective of one micro-batch
(:mod:`eagle3kit.drafters.dflash.objective`), validation by block drafting, and the checkpoint that
records the drafter's config.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagle3kit.core.rundir import write_safetensors
from eagle3kit.drafters.dflash.network import DFlashConfig, DFlashDrafter
from eagle3kit.drafters.dflash.objective import (
    default_gamma,
    dflash_batch,
    dflash_loss,
    pick_anchors,
)
from eagle3kit.train.batches import flat_indices
from eagle3kit.train.samples import mask_token

#: the metadata key that marks a DFlash checkpoint (export and evaluate read it)
KIND_KEY = "drafter"


def is_dflash_checkpoint(path) -> bool:
    """Whether the safetensors file at ``path`` is a DFlash checkpoint of this stage."""
    with safe_open(str(path), "pt") as f:
        return (f.metadata() or {}).get(KIND_KEY) == "dflash"


def load_dflash_checkpoint(path) -> tuple[DFlashDrafter, dict]:
    """The drafter (float32) and the provenance stored in a checkpoint of this stage."""
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    d = DFlashDrafter(DFlashConfig(**json.loads(meta["config"])))
    d.load_state_dict(load_file(str(path)), strict=False)
    return d.float(), json.loads(meta.get("provenance", "{}"))


def save_dflash_checkpoint(
    drafter: DFlashDrafter, path: Path, meta: dict, state: dict, kind: str = "dflash"
) -> None:
    """``state`` (the whole drafter, float32 on the CPU) written atomically to ``path`` with the
    drafter's config and ``meta`` (epoch, step, provenance) in the metadata; ``kind``: the metadata's
    ``drafter`` (another block drafter's checkpoint in the same format)."""
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in state.items()}
    write_safetensors(
        path,
        tensors,
        {
            KIND_KEY: kind,
            "config": json.dumps(drafter.cfg.to_dict()),
            **{k: str(v) for k, v in meta.items()},
        },
    )


def build_dflash(cfg, target, aux_ids, samples) -> DFlashDrafter:
    """A DFlash drafter for ``target`` reading ``aux_ids`` (HF indices; DFlash's target layer ids are
    one less), seeded by ``train.seed``; its mask token is ``drafter.mask_token_id`` or an id the
    training ``samples`` never use (:func:`eagle3kit.train.samples.mask_token`)."""
    dc = cfg.drafter
    mask_id = mask_token(
        samples, target.tokenizer, target.vocab_size, dc.mask_token_id, target.end_of_turn_ids()
    )
    dcfg = DFlashConfig.from_target(
        target.config, mask_id, dc.num_layers, dc.block_size, [a - 1 for a in aux_ids]
    )
    torch.manual_seed(cfg.train.seed)
    return DFlashDrafter(dcfg)


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index``'s random draws in the step seeded ``seed``: the same whichever
    process or micro-batch of the step holds the sample."""
    return (seed * 1_000_003 + index) % (2**63 - 1)


def dflash_micro_loss(model, target, samples, micro, speed: dict, cfg, seed: int, loss_fn=dflash_loss):
    """The block loss (:func:`eagle3kit.drafters.dflash.objective.dflash_loss`) of the samples ``micro``
    indexes (a micro-batch, forward only: the training loop runs backward and the optimizer step).
    Each sample's anchors are drawn by a generator of its own, seeded by :func:`sample_seed` of
    ``seed`` and its index, so one process with ``train.accumulate: N`` draws what N processes draw;
    bf16 autocast when ``speed["bf16"]``. ``loss_fn``: the block loss (another block drafter's, with
    ``dflash_loss``'s contract).

    Returns: (loss, weight — the loss's denominator Σ w_k —, ``{"n": [slots], "acc": [top-1 accuracy
    per slot 1 … B−1], "tokens": real tokens, "log"}``)."""
    drafter = getattr(model, "module", model)
    device = next(drafter.parameters()).device
    idx = flat_indices(micro)
    b = dflash_batch(samples, idx, device)
    gens = [torch.Generator().manual_seed(sample_seed(seed, i)) for i in idx]
    anchors = pick_anchors(
        b["mask"],
        [samples[i].ids.numel() for i in idx],
        drafter.cfg.block_size,
        cfg.drafter.max_anchors,
        gens,
    )
    gamma = cfg.drafter.gamma or default_gamma(drafter.cfg.block_size)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=speed["bf16"]):
        loss, st = loss_fn(model, target, b, anchors, gamma, cfg.drafter.objective, speed["loss_chunk"])
    acc = [c / m if m else 0.0 for c, m in zip(st["correct"], st["count"])]
    log = {"block_tau": round(1 + st["accepted"] / st["blocks"], 4)} if st["blocks"] else {}
    log.update({k: round(st[k], 5) for k in ("block_loss", "confidence_loss") if k in st})
    return loss, st["weight"], {"n": [st["n"]], "acc": acc, "tokens": int(b["valid"].sum()), "log": log}


def dflash_report(cfg, drafter: DFlashDrafter) -> dict:
    """The ``train`` report's fields about a DFlash drafter."""
    d = drafter.cfg
    return {
        "drafter_variant": "dflash",
        "block_size": d.block_size,
        "num_layers": d.num_hidden_layers,
        "target_layer_ids": d.target_layer_ids,
        "mask_token_id": d.mask_token_id,
        "objective": cfg.drafter.objective,
        "gamma": cfg.drafter.gamma or default_gamma(d.block_size),
    }
