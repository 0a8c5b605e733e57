"""``check`` for a DFlash drafter folder, read as vLLM 0.32 reads it (``qwen3_dflash.py``, its
speculators reader and the DFlash proposer): the config of either layout, every tensor against the
network the config describes, the target layers and widths against the target, the mask token, the
block size against the draft length served, and the attention pattern (causal or not inside the block,
sliding or full) against what was trained and what the CPU build runs."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from eagle3kit.core.config import ConfigError
from eagle3kit.drafters.dflash.folder import read_dflash_config
from eagle3kit.drafters.dflash.network import DFlashDrafter
from eagle3kit.model.target import rope_conflict, rope_settings, same_rope
from eagle3kit.serve.findings import Finding

#: head sizes the CPU build's attention runs (``vllm/v1/attention/backends/cpu_attn.py``)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _finding(code, message, fix, severity="error") -> Finding:
    return Finding(code, message, fix, severity)


def layer_kinds(cfg: dict, layer: dict, n: int) -> tuple[list[str] | None, str | None]:
    """Each draft layer's attention as vLLM's DFlash model resolves it (``_resolve_layer_attention``): the
    ``layer_types`` transformers' config holds — as written, or derived from ``use_sliding_window``,
    ``sliding_window`` and ``max_window_layers`` when absent — with ``dflash_config.use_swa`` making every
    layer sliding unless some already is. Returns (kinds, None), or (None, why) for a ``layer_types`` that
    transformers refuses (another length than the ``n`` layers, or an unknown kind)."""
    types = layer.get("layer_types")
    if types is None:
        window = layer.get("sliding_window") if layer.get("use_sliding_window") else None
        first = layer.get("max_window_layers") or 0
        types = [
            "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(n)
        ]
    elif (
        not isinstance(types, list)
        or len(types) != n
        or not set(types) <= {"sliding_attention", "full_attention"}
    ):
        return (
            None,
            f"layer_types {types!r} is not one of full_attention / sliding_attention for each of the {n} layers",
        )
    if (cfg.get("dflash_config") or {}).get("use_swa") and "sliding_attention" not in types:
        types = ["sliding_attention"] * n
    return list(types), None


def _attention(cfg: dict, layer: dict, speculators: bool, n: int) -> list:
    """Causality inside the block and the layer types, as vLLM resolves them (:func:`layer_kinds`)."""
    out = []
    types, why = layer_kinds(cfg, layer, n)
    if why:
        return [
            _finding(
                "layer_types",
                why + ": transformers refuses the config",
                "write one entry a layer (export again)",
            )
        ]
    sliding = sum(t == "sliding_attention" for t in types)
    if 0 < sliding < len(types):
        out.append(
            _finding(
                "dflash_mixed_attention",
                f"layer_types mixes {sliding} sliding and {len(types) - sliding} full-attention layers: vLLM's CPU "
                "build refuses it (its V1 runner has no mixed sliding/full DFlash drafts)",
                "serve it on a GPU build with the V2 runner, or train full-attention layers",
                "warning",
            )
        )
    if sliding:
        ours = isinstance(cfg.get("eagle3kit"), dict)  # exported by eagle3kit: trained full-attention
        out.append(
            _finding(
                "dflash_sliding",
                f"layer_types makes {sliding} of {len(types)} layers sliding-window attention (window "
                f"{(cfg.get('dflash_config') or {}).get('swa_window_size', layer.get('sliding_window'))}) in vLLM; "
                + (
                    "eagle3kit trained this drafter with full, non-causal attention in every layer"
                    if ours
                    else "eagle3kit's evaluate and diagnose simulate full, non-causal attention in every layer, so "
                    "their τ is not what vLLM serves"
                ),
                "write full_attention for every layer in layer_types (eagle3kit's export does)"
                if ours
                else "measure this drafter where it is served (`eagle3kit bench`)",
                "error" if ours else "warning",
            )
        )
    if speculators:
        if cfg.get("sliding_window_non_causal") is False:
            out.append(
                _finding(
                    "dflash_causal",
                    "sliding_window_non_causal is false: vLLM's speculators reader then serves every layer causal "
                    "inside the block, and a DFlash drafter's full-attention layers were trained non-causal",
                    "set sliding_window_non_causal: true (eagle3kit's export writes it)",
                )
            )
        return out
    causal = layer.get("is_causal")
    if causal is None:
        causal = (cfg.get("dflash_config") or {}).get("causal")
    if causal:
        out.append(
            _finding(
                "dflash_causal",
                "the config makes vLLM attend causally inside the block (is_causal / dflash_config.causal true), "
                "where a DFlash drafter's full-attention layers were trained non-causal",
                "drop the field (vLLM's default for full-attention layers is non-causal)",
            )
        )
    return out


def _tensors(folder: Path, dcfg) -> list:
    shapes: dict = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                shapes[k.removeprefix("model.")] = tuple(st.get_slice(k).get_shape())
    want = {
        k: tuple(v.shape) for k, v in DFlashDrafter(dcfg).state_dict().items() if not k.startswith("rotary.")
    }
    out = []
    missing = sorted(set(want) - set(shapes))
    wrong = [f"{k} {shapes[k]} (want {want[k]})" for k in want if k in shapes and shapes[k] != want[k]]
    extra = sorted(set(shapes) - set(want) - {"embed_tokens.weight", "lm_head.weight", "d2t", "t2d"})
    if missing or wrong:
        out.append(
            _finding(
                "dflash_tensors",
                f"the weights do not match the config: missing {missing[:4]}, misshapen {wrong[:4]}",
                "export again",
            )
        )
    if extra:
        out.append(_finding("dflash_tensors", f"tensors vLLM does not load: {extra[:4]}", "export again"))
    own = [k for k in ("embed_tokens.weight", "lm_head.weight") if k in shapes]
    if own:
        out.append(
            _finding(
                "dflash_own_head",
                f"the folder ships {', '.join(own)}: vLLM uses them instead of the target's unless they equal it",
                "leave them out unless the drafter was trained with them",
                "warning",
            )
        )
    return out


def _fits_target(dcfg, N: int, Ht: int, V: int) -> list:
    """The drafter's width, vocabulary, target layers and mask token against a target of ``N`` layers,
    hidden size ``Ht`` and vocabulary ``V``."""
    out = []
    if dcfg.hidden_size != Ht or dcfg.vocab_size != V:
        out.append(
            _finding(
                "target_hidden_size",
                f"the drafter is {dcfg.hidden_size} wide over a vocabulary of {dcfg.vocab_size}; the target "
                f"{Ht} and {V}: it reads the target's embedding, so it was made for another target",
                "train the drafter for this target",
            )
        )
    if max(dcfg.aux_layer_ids) > N - 1:
        out.append(
            _finding(
                "aux_ids_range",
                f"target layers {dcfg.target_layer_ids} (aux ids {dcfg.aux_layer_ids}) go past the target's {N} layers",
                "train the drafter for this target",
            )
        )
    if dcfg.mask_token_id >= V:
        out.append(
            _finding(
                "dflash_mask_token",
                f"mask_token_id {dcfg.mask_token_id} is no id of the target's {V}",
                "export again",
            )
        )
    return out


def _rope(layer: dict, tc) -> list:
    """The drafter's rope against the target's, every spelling read as the engine reads it (as the EAGLE
    checks do): vLLM's DFlash layer positions its block with the drafter's own rope, and eagle3kit trains
    it with the target's. No ``rope_theta`` at all: vLLM assumes 1,000,000."""
    spelled = [layer] + [
        layer.get(k) for k in ("rope_parameters", "rope_scaling") if isinstance(layer.get(k), dict)
    ]
    if not any(d.get("rope_theta") for d in spelled):
        return [
            _finding(
                "rope",
                "no rope_theta: vLLM's DFlash layer assumes 1,000,000",
                "write the rope the drafter was trained with",
            )
        ]
    twice = rope_conflict(layer)
    if twice:
        return [_finding("rope_twice", f"the drafter's config: {twice}", "keep one spelling (export again)")]
    own, want = rope_settings(layer), rope_settings(tc)
    if same_rope(own, want):
        return []
    return [
        _finding(
            "rope",
            f"the drafter's rope (theta {own['rope_theta']}, scaling {own['rope_scaling']}) differs from the "
            f"target's (theta {want['rope_theta']}, scaling {want['rope_scaling']}): vLLM positions the block "
            "with the drafter's, not the one it was trained with",
            "export again (it copies the target's)",
        )
    ]


def check_dflash(folder: Path, tc, num_speculative_tokens: int | None = None, engine: str = "vllm") -> list:
    """Every finding for serving the DFlash ``folder`` beside a target of text config ``tc``; empty:
    servable. ``num_speculative_tokens``: the draft length to be served (None: ``block_size − 1``)."""
    raw = json.loads((folder / "config.json").read_text())
    speculators = raw.get("speculators_model_type") == "dflash"
    try:
        dcfg = read_dflash_config(raw, str(folder / "config.json"))
    except (ConfigError, KeyError, TypeError, ValueError) as e:
        return [
            _finding(
                "config_invalid", f"{folder / 'config.json'}: {e}", "export again with `eagle3kit export`"
            )
        ]
    layer = raw.get("transformer_layer_config") if speculators else raw
    N, Ht, V = int(tc.num_hidden_layers), int(tc.hidden_size), int(tc.vocab_size)
    out = [
        _finding(
            "dflash",
            f"DFlash drafter: {dcfg.num_hidden_layers} layers, block {dcfg.block_size}, target layers "
            f"{dcfg.target_layer_ids} (aux ids {dcfg.aux_layer_ids}), mask token {dcfg.mask_token_id}; serve with "
            f'--speculative-config \'{{"method": "dflash", "model": "{folder}", "num_speculative_tokens": '
            f"{num_speculative_tokens or dcfg.block_size - 1}}}'",
            "",
            "info",
        )
    ]
    if engine != "vllm":
        out.append(
            _finding(
                "dflash_engine",
                f"DFlash is checked for vLLM only, not {engine}",
                "serve with vLLM",
                "warning",
            )
        )
    out += _fits_target(dcfg, N, Ht, V)
    k = num_speculative_tokens
    if k is not None and k > dcfg.block_size - 1:
        out.append(
            _finding(
                "dflash_block",
                f"num_speculative_tokens {k} > block_size − 1 = {dcfg.block_size - 1}: the slots past the block were "
                "never trained (their drafts are guesses)",
                f"serve with num_speculative_tokens ≤ {dcfg.block_size - 1}",
            )
        )
    out += _rope(layer, tc)
    if dcfg.head_dim not in CPU_HEAD_SIZES:
        out.append(
            _finding(
                "head_size",
                f"head size {dcfg.head_dim} is not one vLLM's CPU attention runs "
                f"({', '.join(map(str, CPU_HEAD_SIZES))})",
                "a GPU build serves it; on a CPU train with a supported head size",
                "warning",
            )
        )
    return out + _attention(raw, layer, speculators, dcfg.num_hidden_layers) + _tensors(folder, dcfg)
