"""Drafter checkpoints: the weights ``train`` writes (safetensors, drafter config and provenance
in the metadata), reading them back strictly, and starting a run from another drafter folder."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3kit.core.config import ConfigError
from eagle3kit.core.rundir import load_safetensors, set_aside, sha256_state, write_safetensors
from eagle3kit.model.contract import DrafterImportError
from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter
from eagle3kit.model.folder_read import read_drafter


def init_from_drafter(drafter: Eagle3Drafter, folder: str | Path, target_cfg) -> dict:
    """Start ``drafter`` (freshly built for this run) from the weights of the drafter in ``folder``
    (any layout :func:`eagle3kit.model.folder.read_drafter` reads): every tensor is copied, except
    ``lm_head`` rows, which are matched by target token id (row of draft id i ↔ target id
    i + d2t[i]) so a source with another draft vocabulary still lends every token both share.

    Returns:
        ``{"init_from", "init_from_sha256", "lm_head_rows_copied", "lm_head_rows"}``.
    Raises:
        ConfigError: the source's widths, target vocabulary or aux layer ids differ from this run's
        (naming both values and the setting to change)."""

    try:
        src = read_drafter(folder, target=target_cfg).drafter
    except DrafterImportError as e:
        if "--aux-layer-ids" not in str(e):
            raise
        raise ConfigError(
            f"train.init_from {folder}: {e}. Import it first with `eagle3kit import {folder} --aux-layer-ids "
            "IDS --out DIR` and start from DIR"
        ) from None
    a, b = src.config, drafter.config
    if list(a.aux_layer_ids) != list(b.aux_layer_ids):
        raise ConfigError(
            f"train.init_from {folder} reads aux layers {a.aux_layer_ids} but this run trains on "
            f"{b.aux_layer_ids}; set target.aux_layer_ids: {a.aux_layer_ids}"
        )
    fields = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "target_hidden_size",
        "vocab_size",
    )
    bad = [f"{f} {getattr(a, f)} ≠ {getattr(b, f)}" for f in fields if getattr(a, f) != getattr(b, f)]
    if bad:
        raise ConfigError(
            f"train.init_from {folder} has another shape than this run's drafter: {'; '.join(bad)}"
        )
    if a.variant() != b.variant():
        write = [f"{k}: {str(v).lower()}" for k, v in a.variant().items()]
        write += [f"{k}: false" for k in b.variant() if k not in a.variant() and k != "mask_token_id"]
        drop = (
            " (and no mask_token_id)"
            if "mask_token_id" in b.variant() and "mask_token_id" not in a.variant()
            else ""
        )
        raise ConfigError(
            f"train.init_from {folder} is another drafter variant ({a.variant() or 'EAGLE-3'}) than this run "
            f"trains ({b.variant() or 'EAGLE-3'}); set in the config's drafter section: {', '.join(write)}{drop}"
        )
    state = src.state_dict()
    own = drafter.state_dict()
    with torch.no_grad():
        for k, v in state.items():
            if k not in ("d2t", "t2d", "lm_head.weight"):
                own[k].copy_(v.to(own[k].dtype))
        row_of = torch.full((b.vocab_size,), -1, dtype=torch.int64)
        row_of[torch.arange(a.draft_vocab_size) + src.d2t.cpu()] = torch.arange(a.draft_vocab_size)
        j = row_of[torch.arange(b.draft_vocab_size) + drafter.d2t.cpu()]
        hit = j >= 0
        drafter.lm_head.weight[hit.to(drafter.lm_head.weight.device)] = (
            src.lm_head.weight[j[hit]].to(drafter.lm_head.weight.dtype).to(drafter.lm_head.weight.device)
        )
    return {
        "init_from": str(folder),
        "init_from_sha256": sha256_state(state),
        "lm_head_rows_copied": int(hit.sum()),
        "lm_head_rows": b.draft_vocab_size,
    }


def save_drafter_checkpoint(
    drafter: Eagle3Drafter, path: Path, meta: dict, state: dict | None = None
) -> None:
    """Drafter weights (+ d2t/t2d) as safetensors with the drafter config in the metadata
    (``state``: the whole state dict when the drafter itself is sharded, see
    :func:`eagle3kit.train.distributed.full_state`)."""
    state = {
        k: v.detach().contiguous().cpu()
        for k, v in (state if state is not None else drafter.state_dict()).items()
    }
    # written whole, then renamed: a kill or a full disk never leaves half (DataError naming the file)
    write_safetensors(
        path,
        state,
        {"drafter_config": json.dumps(drafter.config.to_dict()), **{k: str(v) for k, v in meta.items()}},
    )


def load_drafter_checkpoint(path: Path, device="cpu") -> Eagle3Drafter:
    """Inverse of :func:`save_drafter_checkpoint` (strict: no missing or unexpected key)."""

    tensors = load_safetensors(
        path, "give a checkpoint written by `eagle3kit train` (checkpoints/*.safetensors)"
    )
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if "drafter_config" not in meta:
        raise ConfigError(f"{path}: not an eagle3kit drafter checkpoint (no drafter_config metadata)")
    d = Eagle3Drafter(DrafterConfig(**json.loads(meta["drafter_config"])))
    missing, unexpected = d.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ConfigError(
            f"{path}: drafter checkpoint is incomplete or foreign (missing {missing[:4]}, unexpected {unexpected[:4]})"
        )
    return d.to(device)


def checkpoint_provenance(path: Path) -> dict:
    """The provenance ``run_train`` stored in a checkpoint (target, tokenizer, vocab, aux ids)."""

    with safe_open(str(path), "pt") as f:
        return json.loads((f.metadata() or {}).get("provenance", "{}"))


def _set_aside(ckpt: Path, log: Path) -> Path:
    """Move a previous run's checkpoints (and its log and TensorBoard events) to ``checkpoints.prev-N``;
    never delete them."""
    dest = set_aside(ckpt)
    if log.exists():
        log.rename(dest / log.name)
    tb = log.parent / "tensorboard"
    if tb.exists():
        tb.rename(dest / tb.name)
    ckpt.mkdir()
    return dest
