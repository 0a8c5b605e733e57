"""DFlash's part of the training loop (:mod:`eagle3kit.train.stage` runs it for every drafter kind:
lineage, the split, batches, torchrun, online states, the memory plan, resume mid-epoch, the log and
checkpoints): the drafter built for the target, one optimizer step of the block objective
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


def dflash_step(model, opt, target, samples, batch, speed: dict, cfg, world, seed: int, loss_fn=dflash_loss):
    """One optimizer step of the block loss (:func:`eagle3kit.drafters.dflash.objective.dflash_loss`) on
    the samples ``batch`` indexes: anchors drawn with a generator seeded by ``seed``, bf16 autocast
    when ``speed["bf16"]``, backward on every process (as DDP needs), clipping to ``train.grad_clip``,
    the step when any process had a supervised slot. ``loss_fn``: the block loss (another block
    drafter's, with :func:`~eagle3kit.drafters.dflash.objective.dflash_loss`'s contract).

    Returns: (loss, ``{"n": [slots], "acc": [top-1 accuracy per slot 1 … B−1], "tokens", "log"}``)."""
    drafter = getattr(model, "module", model)
    device = next(drafter.parameters()).device
    idx = [i for r in batch for i in (r if isinstance(r, list) else [r])]
    b = dflash_batch(samples, idx, device)
    gen = torch.Generator().manual_seed(seed)
    anchors = pick_anchors(
        b["mask"], [samples[i].ids.numel() for i in idx], drafter.cfg.block_size, cfg.drafter.max_anchors, gen
    )
    gamma = cfg.drafter.gamma or default_gamma(drafter.cfg.block_size)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=speed["bf16"]):
        loss, st = loss_fn(model, target, b, anchors, gamma, cfg.drafter.objective, speed["loss_chunk"])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    n, tokens = world.sum_floats([float(st["n"]), float(b["valid"].sum())])
    if n > 0:
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.train.grad_clip)
        opt.step()
    acc = [c / m if m else 0.0 for c, m in zip(st["correct"], st["count"])]
    log = {"block_tau": round(1 + st["accepted"] / st["blocks"], 4)} if st["blocks"] else {}
    log.update({k: round(st[k], 5) for k in ("block_loss", "confidence_loss") if k in st})
    return loss, {"n": [st["n"]], "acc": acc, "tokens": int(tokens), "log": log}


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
