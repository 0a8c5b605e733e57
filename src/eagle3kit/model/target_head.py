"""The part of a target a trainer fed by an engine needs: its token embedding [V, Ht],
final norm and lm_head [V, Ht] (the drafter's input embedding, ``final_norm(h_N)`` and the teacher
logits), its config and tokenizer, and none of its decoder layers.

A trainer fed by vLLM capture servers (``train.online_from``) never runs the target, so loading
it whole would cost a 1T target's memory for three tensors (Kimi-K2.5: 2 × 163,840 × 7,168
parameters, 4.7 GB in bf16, of about 2 TB). The model is built by transformers on PyTorch's
``meta`` device (shapes only, no memory), then only those three modules are given storage and
filled from the checkpoint's safetensors tensors, found under their checkpoint names (a wrapper's
``language_model.*`` names through :func:`~eagle3kit.model.target.language_model_plan`'s key
mapping, as :func:`~eagle3kit.model.target.load_target` loads them). The decoder layers stay on
``meta``: anything that runs the target's forward fails loudly instead of computing with random
weights.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3kit.core.config import ConfigError, TargetConfig
from eagle3kit.core.ui import console
from eagle3kit.model.target import Target, load_target, pick_device, resolve_parts
from eagle3kit.model.target_files import (
    FINGERPRINT_FORMAT,
    language_model_plan,
    load_target_config,
    load_tokenizer,
    locate_target,
    located_fingerprint,
    text_config,
)


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Every tensor name of a safetensors checkpoint folder → the file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    where: dict[str, Path] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            where |= dict.fromkeys(h.keys(), f)
    return where


def load_target_head(cfg: TargetConfig, device: str | torch.device | None = None) -> Target:
    """The target with only its embedding, final norm and lm_head in memory (``cfg.dtype``, on
    ``device``), its decoder layers on the ``meta`` device; ``source["loaded"]`` is ``"head"``.
    A GGUF target (de-quantized whole by transformers) or a ``device_map`` one loads whole
    (:func:`~eagle3kit.model.target.load_target`, ``source["loaded"]`` ``"whole"``).

    Raises:
        ConfigError: the target cannot be located or read (as :func:`load_target`), or its
            checkpoint lacks one of the three tensors (named)."""
    from transformers import AutoModelForCausalLM

    loc = locate_target(cfg)
    if loc["gguf_file"] or cfg.device_map or not Path(loc["path"]).is_dir():
        target = load_target(cfg, device)
        target.source["loaded"] = "whole"
        return target
    folder = Path(loc["path"])
    config, _ = load_target_config(cfg)
    plan = language_model_plan(config, folder)
    tok = load_tokenizer(cfg)
    dtype = getattr(torch, cfg.dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(plan["config"] if plan else config, dtype=dtype)
    parts = resolve_parts(model)
    tied = bool(getattr(text_config(model.config), "tie_word_embeddings", False))
    names = {id(m): n for n, m in model.named_modules()}
    wanted = {  # model parameter name → (module, its parameter's attribute)
        f"{names[id(mod)]}.{p}": (mod, p)
        for mod in (parts.embed, parts.final_norm) + (() if tied else (parts.lm_head,))
        for p, _ in mod.named_parameters(recurse=False)
    }
    mapping = plan["key_mapping"] if plan else {}
    found: dict[str, tuple[str, Path]] = {}
    for key, file in _tensor_files(folder).items():
        name = key
        for pattern, repl in mapping.items():
            name = re.sub(pattern, repl, name)
        if name in wanted:
            found[name] = (key, file)
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise ConfigError(
            f"target {folder}: no tensor for {', '.join(missing)} in its safetensors files (looked for "
            f"under the checkpoint's names{' through the wrapper mapping ' + str(mapping) if mapping else ''}); "
            "give the folder of the whole checkpoint"
        )
    dev = pick_device(str(device) if device is not None else cfg.device)
    for mod in {id(m): m for m, _ in wanted.values()}.values():
        mod.to_empty(device=dev)
    for name, (key, file) in found.items():
        mod, attr = wanted[name]
        with safe_open(str(file), "pt") as h:
            t = h.get_tensor(key)
        param = getattr(mod, attr)
        if tuple(t.shape) != tuple(param.shape):
            raise ConfigError(
                f"target {folder}: {key} is {tuple(t.shape)}, its config.json describes {tuple(param.shape)}; "
                "give the checkpoint's own config.json"
            )
        with torch.no_grad():
            param.copy_(t.to(dtype))
    if tied:
        parts.lm_head.weight = parts.embed.weight
    model.eval()
    model.requires_grad_(False)
    source = dict(loc)
    source["weights_fingerprint"] = located_fingerprint(loc)
    source["fingerprint_format"] = FINGERPRINT_FORMAT
    source["loaded"] = "head"
    held = sum(p.numel() for p in model.parameters() if not p.is_meta)
    total = sum(p.numel() for p in model.parameters())
    console.print(
        f"target: {held:,} of its {total:,} parameters loaded (embedding, final norm, lm_head: the trainer "
        "is fed by the engine)"
    )
    return Target(model=model, tokenizer=tok, parts=parts, source=source)
