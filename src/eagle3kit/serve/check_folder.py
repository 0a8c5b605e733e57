"""The checks of a drafter folder on its own: its config read once (:class:`DrafterFolder`), widths, layer
count, tensors, variant flags and vocabulary maps against each other and against the target's config.
What an engine makes of the folder is checked in :mod:`eagle3kit.serve.check` with
:mod:`eagle3kit.serve.engine_rules`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3kit.core.engines import (
    installed_vllm,
)
from eagle3kit.model.contract import (
    contract_mismatches,
    required_shapes,
)
from eagle3kit.model.draft_vocab import check_maps
from eagle3kit.model.drafter import DrafterConfig
from eagle3kit.serve.engine_rules import (
    VLLM_VARIANT_SINCE,
    parse_version,
)
from eagle3kit.serve.findings import Finding


@dataclass
class DrafterFolder:
    """What :func:`eagle3kit.serve.check.check_drafter` reads of a drafter folder: ``config`` (config.json as written),
    ``shapes``/``dtypes`` of every tensor (speculators' ``layers.0.*`` renamed ``midlayer.*``), the
    ``maps`` (``d2t``/``t2d`` tensors, loaded: their values are checked), ``speculators`` (layout)."""

    config: dict
    shapes: dict
    dtypes: dict
    maps: dict
    speculators: bool
    nonfinite: list = ()  # float tensors holding NaN or inf


def read_folder(cfg_path: Path, st_path: Path) -> DrafterFolder:
    """Read config.json and the safetensors header (raises whatever the readers raise)."""
    dc = json.loads(cfg_path.read_text(encoding="utf-8"))
    speculators = isinstance(dc, dict) and "speculators_model_type" in dc

    def name(k: str) -> str:  # vLLM's speculators layout calls the one decoder layer layers.0.*
        return "midlayer." + k[len("layers.0.") :] if speculators and k.startswith("layers.0.") else k

    with safe_open(str(st_path), "pt") as f:
        shapes = {name(k): tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {name(k): str(f.get_slice(k).get_dtype()) for k in f.keys()}
        maps = {k: f.get_tensor(k) for k in ("d2t", "t2d") if k in shapes}
        nonfinite = [
            name(k)
            for k in f.keys()
            if dtypes[name(k)].upper() in ("F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2")
            if not bool(torch.isfinite(f.get_tensor(k)).all())
        ]
    return DrafterFolder(dc, shapes, dtypes, maps, speculators, nonfinite)


def check_widths(folder: DrafterFolder, fields, tc) -> tuple[list[Finding], bool]:
    """The drafter generation and its widths against the target: ``(findings, stop)``, where stop
    means an EAGLE-1 head (nothing else is worth checking)."""
    dc, shapes = folder.config, folder.shapes
    H_t, V = int(tc.hidden_size), int(tc.vocab_size)
    out: list[Finding] = []
    if "text_config" in dc:
        out.append(
            Finding(
                "nested_text_config",
                "config.json nests its fields in text_config; engines read the top level",
                "export again (eagle3kit writes a flat Llama-style config)",
            )
        )
    fc = shapes.get("fc.weight")
    H = fields.hidden_size
    # EAGLE-1's head has no draft vocabulary and no lm_head of its own (its fc [H, 2H] alone would also
    # fit an EAGLE-3 drafter of two aux states)
    if fields.draft_vocab_size is None and "lm_head.weight" not in shapes:
        out.append(
            Finding(
                "eagle1_head",
                f"an EAGLE-1 style head (fc {list(fc) if fc else None}, no draft_vocab_size / "
                "lm_head) given as EAGLE-3",
                "serve it with method 'eagle', or train an EAGLE-3 drafter",
            )
        )
        return out, True
    if (fields.target_hidden_size or H) != H_t:
        out.append(
            Finding(
                "target_hidden_size",
                f"target_hidden_size {fields.target_hidden_size or H} but the target's hidden size is {H_t}",
                "train the drafter for this target",
            )
        )
    made_for = fields.target_hidden_size or H
    n_made = fc[1] // made_for if fc is not None and made_for and fc[1] % made_for == 0 else None
    if fc is not None and made_for != H_t and n_made:
        out.append(
            Finding(
                "fc_width",
                f"fc.weight takes {fc[1]} inputs, not {n_made} aux layers × {H_t} = {n_made * H_t} (this "
                f"target's hidden size): a drafter for a target of hidden size {made_for}",
                "train the drafter for this target",
            )
        )
    elif fc is not None and fc[1] % H_t:
        out.append(
            Finding(
                "fc_width",
                f"fc.weight takes {fc[1]} inputs, not a number of aux layers × {H_t} (this "
                "target's hidden size)",
                "train the drafter for this target",
            )
        )
    if fields.vocab_size != V:
        out.append(
            Finding(
                "vocab_size",
                f"vocab_size {fields.vocab_size} but the target's vocabulary has {V} ids",
                "train the drafter for this target",
            )
        )
    return out, False


def is_int(v) -> bool:
    """A JSON whole number (not a bool, a string or a float)."""
    return isinstance(v, int) and not isinstance(v, bool)


def aux_in_weights(shapes: dict, H_t: int) -> int:
    """How many aux states the weights' ``fc`` takes (its input width over the target's hidden size; 3
    without an fc or with a width that is no multiple, which is named on its own)."""
    fc = shapes.get("fc.weight")
    return fc[1] // H_t if fc is not None and fc[1] % H_t == 0 and fc[1] else 3


def check_layer_count(pre: dict, shapes: dict) -> list[Finding]:
    """``num_hidden_layers`` (the decoder layers vLLM builds) against the layers in the weights: missing
    (transformers' default), of another type, or another count."""
    out: list[Finding] = []
    layers = int(any(k.startswith("midlayer.") for k in shapes)) + len(
        {k.split(".")[1] for k in shapes if k.startswith("layers.") and k.split(".")[1] != "0"}
    )
    said = pre.get("num_hidden_layers")
    if not is_int(said):
        out.append(
            Finding(
                "num_hidden_layers",
                f"num_hidden_layers is {'missing' if said is None else repr(said)}: vLLM "
                + (
                    "builds transformers' default (32 for a Llama config)"
                    if said is None
                    else "fails to load it"
                )
                + f", the weights hold {layers} decoder layer(s)",
                f"set num_hidden_layers to {layers}",
            )
        )
    elif said != layers:
        out.append(
            Finding(
                "num_hidden_layers",
                f"num_hidden_layers is {said} but the weights hold {layers} decoder layer(s): vLLM builds {said} "
                f"and {'leaves the others without weights' if said > layers else 'drops the rest'}",
                f"set num_hidden_layers to {layers}",
            )
        )
    return out


def check_tensors(folder: DrafterFolder, fields, tc, variant: dict) -> list[Finding]:
    """Every tensor against :func:`~eagle3kit.model.contract.required_shapes` for the config's
    fields and variant: aux id count against fc, dtypes, missing, misshapen and stray tensors."""
    shapes, dtypes = folder.shapes, folder.dtypes
    H_t, V, H = int(tc.hidden_size), int(tc.vocab_size), fields.hidden_size
    heads = fields.num_attention_heads
    want = required_shapes(
        DrafterConfig(
            hidden_size=H,
            intermediate_size=fields.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=fields.num_key_value_heads or heads,
            head_dim=fields.head_dim or max(1, H // heads),
            rms_norm_eps=float(fields.rms_norm_eps),
            vocab_size=V,
            draft_vocab_size=fields.draft_vocab_size,
            target_hidden_size=H_t,
            aux_layer_ids=list(
                range(aux_in_weights(shapes, H_t))
            ),  # a count that differs is named on its own
            **variant,
        )
    )
    out: list[Finding] = []
    floats = {dtypes[k] for k in want if k in dtypes}
    if any(not t.startswith(("F", "BF")) for t in floats):
        out.append(
            Finding(
                "weight_dtype",
                f"weights stored as {sorted(floats)}; engines need one floating-point dtype",
                "export again",
            )
        )
    mh = shapes.get("mask_hidden")
    if mh is not None and "mask_hidden" in want and math.prod(mh) == math.prod(want["mask_hidden"]):
        shapes = {
            **shapes,
            "mask_hidden": want["mask_hidden"],
        }  # vLLM reads any shape of 3·Ht values (view(1, -1))
    missing, unexpected, misshapen = contract_mismatches(shapes, want)
    if missing:
        out.append(
            Finding(
                "missing_tensor",
                f"the engine would create these empty: {missing}",
                "export again; never serve a drafter with missing weights (it loads, then accepts nothing)",
            )
        )
    bad = [f"{k} {list(shapes[k])} ≠ {list(want[k])}" for k in misshapen]
    if bad:
        out.append(
            Finding("tensor_shape", "shapes that do not fit the config: " + "; ".join(bad), "export again")
        )
    stray = [k for k in unexpected if k not in ("d2t", "t2d")]  # the maps are checked on their own below
    if stray:
        out.append(
            Finding(
                "stray_tensor",
                f"tensors no engine expects: {stray[:8]}",
                "export with `eagle3kit export` (no `model.` prefix, no embed_tokens for a drafter as wide as "
                "its target)",
            )
        )
    return out


def check_variant(variant: dict, engine: str, engine_version: str | None, folder: Path) -> list[Finding]:
    """The variant the folder will be served as: the vLLM release that reads each flag, how a
    parallel-drafting drafter must be launched, and what is not verified for SGLang."""
    on = [k for k in VLLM_VARIANT_SINCE if variant.get(k)]
    out: list[Finding] = []
    if variant.get("parallel_drafting") and engine == "vllm":
        spec = {"method": "eagle3", "model": str(folder.resolve()), "num_speculative_tokens": 3}
        spec["parallel_drafting"] = True
        out.append(
            Finding(
                "parallel_drafting",
                f"a P-EAGLE (parallel-drafting) drafter, mask token {variant['mask_token_id']}: vLLM drafts it "
                "in parallel only when the speculative config says so; without it vLLM skips mask_hidden (a "
                "warning in its log) and drafts a chain this drafter was not trained for",
                f"serve with --speculative-config '{json.dumps(spec)}' (num_speculative_tokens: any K up to "
                "the TTT steps it was trained with)",
                "warning",
            )
        )
    if engine == "sglang" and variant.get("parallel_drafting"):
        out.append(
            Finding(
                "engine_support",
                "a P-EAGLE (parallel-drafting) drafter: eagle3kit knows no SGLang launch that drafts in parallel, "
                "and SGLang would draft it as a chain it was not trained for",
                'serve it with vLLM (--speculative-config with "parallel_drafting": true)',
            )
        )
    elif engine == "sglang" and on:
        out.append(
            Finding(
                "engine_support",
                f"SGLang support for {on} is not verified by eagle3kit (no SGLang runs here)",
                "serve it with vLLM, check the SGLang release you serve with, or train the plain "
                "drafter for SGLang (drafter: {variant: eagle3})",
                "warning",
            )
        )
    want = engine_version or installed_vllm()
    if engine == "vllm" and want and parse_version(want) is not None:
        old = [k for k in on if parse_version(want) < parse_version(VLLM_VARIANT_SINCE[k])]
        if old:
            out.append(
                Finding(
                    "engine_support",
                    f"vLLM {want} does not read {old} (from "
                    + ", ".join(f"{k} {VLLM_VARIANT_SINCE[k]}" for k in old)
                    + "): it would serve another network than the one trained",
                    f"serve on vLLM ≥ {max((VLLM_VARIANT_SINCE[k] for k in old), key=parse_version)}",
                )
            )
    return out


def check_vocab_maps(folder: DrafterFolder, fields, V: int) -> list[Finding]:
    """``d2t``/``t2d``: present exactly when Vd < V, 1-D int64/bool, and valid maps
    (:func:`~eagle3kit.model.draft_vocab.check_maps`) of the right length."""
    shapes, maps = folder.shapes, dict(folder.maps)
    Vd = fields.draft_vocab_size
    out: list[Finding] = []
    if Vd >= V and "d2t" in maps:
        out.append(
            Finding(
                "stray_d2t",
                f"draft_vocab_size {Vd} = vocab_size {V} but the folder holds d2t: vLLM creates no "
                "d2t parameter for a full draft vocabulary and fails to load it",
                "export again (no maps for a full vocabulary)",
            )
        )
    for k, want_dtype in (("d2t", "torch.int64"), ("t2d", "torch.bool")):
        if k in maps and (str(maps[k].dtype) != want_dtype or maps[k].dim() != 1):
            out.append(
                Finding(
                    "vocab_map_dtype",
                    f"{k} is {maps[k].dtype} of shape {list(maps[k].shape)}; engines read a 1-D "
                    f"{want_dtype.replace('torch.', '')}",
                    "export again",
                )
            )
            maps.pop(k)
    if Vd < V and not ("d2t" in shapes and "d2t" not in maps):  # (a d2t of the wrong dtype is reported above)
        if "d2t" not in maps:
            out.append(
                Finding(
                    "missing_d2t",
                    f"draft_vocab_size {Vd} < vocab_size {V} but there is no d2t: the engine would "
                    "map draft ids to the wrong tokens",
                    "export again",
                )
            )
        else:
            try:
                check_maps(maps["d2t"], maps.get("t2d"), V)
            except Exception as e:
                out.append(Finding("vocab_maps", str(e), "rebuild the vocab and export again"))
            if maps["d2t"].numel() != Vd:
                out.append(
                    Finding(
                        "d2t_length",
                        f"d2t has {maps['d2t'].numel()} entries, draft_vocab_size {Vd}",
                        "export again",
                    )
                )
    return out
