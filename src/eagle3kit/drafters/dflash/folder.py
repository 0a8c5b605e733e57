"""DFlash drafter folders: the layout vLLM loads (z-lab's public one: ``architectures:
["DFlashDraftModel"]``, ``dflash_config``) and speculators' (``speculators_model_type: dflash``), written
and read.

The two differ in how they name the target layers: vLLM's layout stores DFlash's 0-based decoder-layer
ids (``dflash_config.target_layer_ids``, vLLM adds 1), speculators' the Hugging Face
``output_hidden_states`` indices (``aux_hidden_state_layer_ids``, vLLM subtracts 1 to build
``dflash_config``). A speculators config without ``sliding_window_non_causal: true`` is served with
causal attention inside the block by vLLM 0.32 (its reader sets ``dflash_config.causal`` from that
field), so the speculators export of a non-causal drafter writes it true.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3kit.core.config import ConfigError
from eagle3kit.drafters.dflash.network import DFlashConfig, DFlashDrafter
from eagle3kit.model.target import rope_settings

#: the Qwen3 layer fields both layouts carry
LAYER_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "vocab_size",
    "max_position_embeddings",
    "hidden_act",
)


def _layer_config(c: DFlashConfig, dtype: str) -> dict:
    out = {k: getattr(c, k) for k in LAYER_KEYS}
    out.update(
        model_type="qwen3",
        rope_theta=c.rope_theta,
        attention_bias=False,
        tie_word_embeddings=False,
        torch_dtype=dtype,
        layer_types=["full_attention"] * c.num_hidden_layers,
    )
    if c.rope_scaling:
        out["rope_scaling"] = dict(c.rope_scaling)
    return out


def vllm_config(c: DFlashConfig, dtype: str, provenance: dict | None = None) -> dict:
    """``config.json`` of the layout vLLM's ``DFlashDraftModel`` loads (z-lab's public drafters')."""
    return {
        "architectures": ["DFlashDraftModel"],
        **_layer_config(c, dtype),
        "block_size": c.block_size,
        "num_target_layers": c.num_target_layers,
        "target_hidden_size": c.target_hidden_size,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)},
        "eagle3kit": {"drafter": "dflash", **(provenance or {})},
    }


def speculators_config(c: DFlashConfig, dtype: str, verifier: dict, provenance: dict | None = None) -> dict:
    """``config.json`` of speculators' DFlash layout (its ``DFlashSpeculatorConfig``), greedy proposal of
    ``block_size − 1`` tokens; ``verifier``: ``{"name_or_path", "architectures"}``."""
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "transformer_layer_config": _layer_config(c, dtype),
        "draft_vocab_size": c.vocab_size,
        "block_size": c.block_size,
        "target_hidden_size": c.target_hidden_size,
        "aux_hidden_state_layer_ids": c.aux_layer_ids,
        "mask_token_id": c.mask_token_id,
        "sliding_window_non_causal": True,  # vLLM serves the block causally unless this is true
        "sample_from_anchor": False,
        "torch_dtype": dtype,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier["name_or_path"],
                "architectures": list(verifier["architectures"]),
            },
        },
        "eagle3kit": {"drafter": "dflash", **(provenance or {})},
    }


def write_dflash(
    drafter: DFlashDrafter,
    folder: str | Path,
    layout: str = "vllm",
    dtype: torch.dtype = torch.bfloat16,
    verifier: dict | None = None,
    provenance: dict | None = None,
) -> Path:
    """Write ``model.safetensors`` and ``config.json`` of ``drafter`` into ``folder`` (created; files in
    it are replaced). ``layout``: ``vllm`` or ``speculators`` (which needs ``verifier``).

    Raises:
        ConfigError: an unknown layout, or speculators' without a verifier."""
    if layout not in ("vllm", "speculators"):
        raise ConfigError(f"DFlash export layout {layout!r}: use vllm or speculators")
    if layout == "speculators" and not verifier:
        raise ConfigError("the speculators layout names its verifier: pass the target")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    name = str(dtype).removeprefix("torch.")
    tensors = {
        k: v.detach().to("cpu", dtype).contiguous()
        for k, v in drafter.state_dict().items()
        if not k.startswith("rotary.")
    }
    c = drafter.cfg
    config = (
        vllm_config(c, name, provenance)
        if layout == "vllm"
        else speculators_config(c, name, verifier, provenance)
    )
    tmp = folder / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def is_dflash_config(config: dict) -> bool:
    """Whether a drafter folder's ``config.json`` (as a dict) is a DFlash drafter's (either layout)."""
    return (
        "DFlashDraftModel" in (config.get("architectures") or [])
        or config.get("speculators_model_type") == "dflash"
    )


def is_dflash_folder(folder: str | Path) -> bool:
    """Whether ``folder`` holds a DFlash drafter's ``config.json`` (either layout)."""
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and is_dflash_config(cfg)


def read_dflash_config(config: dict, where: str = "config.json") -> DFlashConfig:
    """A :class:`DFlashConfig` from either layout's ``config.json`` (the vLLM/z-lab one, or speculators').

    Raises:
        ConfigError: a config that is neither, or lacks the mask token, the target layers or the block
            size, naming ``where`` and the field."""
    spec = config.get("speculators_model_type") == "dflash"
    layer = config.get("transformer_layer_config") if spec else config
    if not isinstance(layer, dict):
        raise ConfigError(f"{where}: not a DFlash drafter (no transformer_layer_config)")
    if spec:
        aux = config.get("aux_hidden_state_layer_ids")
        target_ids = [int(i) - 1 for i in aux] if aux else None
        mask_id, block = config.get("mask_token_id"), config.get("block_size")
    else:
        dc = config.get("dflash_config") or {}
        target_ids, mask_id = dc.get("target_layer_ids"), dc.get("mask_token_id", config.get("mask_token_id"))
        block = config.get("block_size")
    missing = [
        n
        for n, v in (("target layer ids", target_ids), ("mask_token_id", mask_id), ("block_size", block))
        if v is None
    ]
    if missing:
        raise ConfigError(f"{where}: a DFlash config without {', '.join(missing)}")
    fields = layer_fields(layer)
    return DFlashConfig(
        **fields,
        target_hidden_size=int(config.get("target_hidden_size") or fields["hidden_size"]),
        num_target_layers=int(config.get("num_target_layers") or max(target_ids) + 1),
        target_layer_ids=[int(t) for t in target_ids],
        block_size=int(block),
        mask_token_id=int(mask_id),
    )


def layer_fields(layer: dict) -> dict:
    """The decoder layers' fields of :class:`DFlashConfig` (widths, heads, eps, vocabulary, rope, max
    positions) from the Qwen3 layer config a block drafter's folder holds.

    Raises:
        KeyError: a required key (hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
            vocab_size) missing."""
    rope = rope_settings(layer)
    heads, H = int(layer["num_attention_heads"]), int(layer["hidden_size"])
    return {
        "hidden_size": H,
        "intermediate_size": int(layer["intermediate_size"]),
        "num_hidden_layers": int(layer["num_hidden_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(layer.get("num_key_value_heads") or heads),
        "head_dim": int(layer.get("head_dim") or H // heads),
        "rms_norm_eps": float(layer.get("rms_norm_eps", 1e-6)),
        "vocab_size": int(layer["vocab_size"]),
        "rope_theta": float(rope["rope_theta"]),
        "rope_scaling": rope["rope_scaling"],
        "max_position_embeddings": int(layer.get("max_position_embeddings") or 4096),
    }


def read_dflash(folder: str | Path) -> DFlashDrafter:
    """Load a DFlash drafter folder of either layout (float32), every tensor required and none left over.

    Raises:
        ConfigError: not a DFlash folder; a tensor missing, misshapen or unknown (named)."""
    folder = Path(folder)
    c = read_dflash_config(json.loads((folder / "config.json").read_text()), str(folder / "config.json"))
    d = DFlashDrafter(c)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder}: no *.safetensors file")
    tensors: dict = {}
    for f in files:
        tensors.update(load_file(str(f)))
    tensors = {k.removeprefix("model."): v for k, v in tensors.items() if not k.startswith(("t2d", "d2t"))}
    want = {k: v for k, v in d.state_dict().items() if not k.startswith("rotary.")}
    bad = [
        f"{k} {tuple(tensors[k].shape)} (want {tuple(v.shape)})"
        for k, v in want.items()
        if k in tensors and tensors[k].shape != v.shape
    ]
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want) - {"embed_tokens.weight", "lm_head.weight"})
    if bad or missing or extra:
        raise ConfigError(
            f"{folder}: the weights do not match its config: "
            + "; ".join(
                p
                for p in (
                    f"missing {missing[:4]}" if missing else "",
                    f"misshapen {bad[:4]}" if bad else "",
                    f"unknown {extra[:4]}" if extra else "",
                )
                if p
            )
        )
    d.load_state_dict({k: tensors[k].float() for k in want}, strict=False)
    return d.float()
