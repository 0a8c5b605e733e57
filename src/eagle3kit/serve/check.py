"""``eagle3kit check``: every fault in an exported drafter that would cost a server start, found in
seconds, each with its fix (docs/conventions.md).

Reads ``config.json`` and the safetensors header (shapes only; ``d2t``/``t2d`` values are
loaded to check their invariants) and the target's config; never loads the target's weights.
Checked: the drafter generation (an EAGLE-1 head given as EAGLE-3, inferred from shapes), every
tensor an engine creates (missing ones would be created empty), stray tensors, widths (``fc``
input = 3 × target hidden), vocab sizes and the ``d2t``/``t2d`` invariants, ``lm_head`` rows,
tied embeddings, aux ids (present, in range, in both conventions, equal to the ids the features
were trained on, and for SGLang what it will really capture on this target family), max
positions against the serving length, rope settings against the target, text fields nested in
``text_config``, the speculators layout (vLLM ≥ 0.10.1 only, never SGLang), and engine support:
vLLM's EAGLE-3 gate by release (:data:`eagle3kit.serve.engine_rules.VLLM_EAGLE3_GATE`) and whether the
installed vLLM's class for the target implements EAGLE-3. Speculators-layout folders are read as such.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3kit.core.config import TargetConfig
from eagle3kit.core.config_train import variant_name
from eagle3kit.core.engines import (
    installed_vllm,
    uses_mla,
)
from eagle3kit.model.contract import (
    DrafterImportError,
    contract_mismatches,
    drafter_fields,
    engine_variant,
    required_shapes,
    served_config,
)
from eagle3kit.model.dflash_folder import is_dflash_folder
from eagle3kit.model.draft_vocab import check_maps
from eagle3kit.model.drafter import DrafterConfig
from eagle3kit.model.target import rope_conflict, rope_settings, same_rope
from eagle3kit.model.target_files import load_target_config, target_architectures
from eagle3kit.serve.dflash_check import check_dflash
from eagle3kit.serve.engine_rules import (
    SGLANG_AUX_RULE,
    VLLM_VARIANT_SINCE,
    parse_version,
    raw_target_config,
    sglang_captured,
    vllm_support_findings,
    vllm_target_config_findings,
)
from eagle3kit.serve.findings import Finding


def verifier_of(drafter_dir: str | Path) -> str | None:
    """The target a speculators-layout folder names (``speculators_config.verifier.name_or_path``, what
    ``vllm serve FOLDER`` loads), or None (another layout, or an unreadable config)."""
    try:
        cfg = json.loads((Path(drafter_dir) / "config.json").read_text())
        name = cfg["speculators_config"]["verifier"]["name_or_path"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return name if isinstance(name, str) and name else None


def _check_verifier(config: dict, target: TargetConfig) -> list[Finding]:
    """A speculators folder's verifier: a local path that is not there is an error (``vllm serve FOLDER``
    would fail to start); one other than the target checked against is a warning."""
    name = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if not isinstance(name, str):
        return []
    fix = (
        "export again naming the target as the serving machine reads it: "
        "`eagle3kit export --format speculators --verifier ID_OR_FOLDER --overwrite`"
    )
    local = name.startswith(("/", ".", "~"))
    if local and not Path(name).expanduser().is_dir():
        return [
            Finding(
                "verifier_missing",
                f"the folder names its target {name}, which does not exist here: `vllm serve` on this folder fails",
                fix,
            )
        ]
    same = (
        Path(name).expanduser().resolve() == Path(target.model).expanduser().resolve()
        if local
        else name == target.model
    )
    if same or (local and target.model.startswith("pkg:")):
        return []
    return [
        Finding(
            "verifier_differs",
            f"`vllm serve` on this folder loads {name}; this check compared it with {target.model}",
            f"check with --target {name}, or " + fix.split(": ", 1)[1],
            "warning",
        )
    ]


def check_drafter(
    drafter_dir: str | Path,
    target: TargetConfig,
    engine: str = "vllm",
    engine_version: str | None = None,
    max_model_len: int | None = None,
    num_speculative_tokens: int | None = None,
) -> list[Finding]:
    """All findings for serving ``drafter_dir`` beside ``target`` on ``engine``; empty = servable.
    A DFlash folder is checked by :func:`eagle3kit.serve.dflash_check.check_dflash` (its block against
    ``num_speculative_tokens``).

    The checks run in this order, each a function below: the folder's files, the config's fields,
    the drafter generation and widths, the tensors against the contract, the vocab maps, positions
    and rope, the aux ids, then what the engine (release, layout, target class) supports.

    Raises:
        ConfigError: the target cannot be located (names it).
    """
    d = Path(drafter_dir)
    cfg_path, st_path = d / "config.json", d / "model.safetensors"
    missing = [
        Finding("missing_file", f"{p} does not exist", "export the drafter with `eagle3kit export`")
        for p in (cfg_path, st_path)
        if not p.is_file()
    ]
    if missing:
        return missing
    if is_dflash_folder(d):
        return check_dflash(d, load_target_config(target)[1], num_speculative_tokens, engine)
    try:
        folder = _read_folder(cfg_path, st_path)
    except Exception as e:
        return [Finding("unreadable", f"{d}: {type(e).__name__}: {str(e)[:160]}", "re-export the drafter")]
    try:
        fields, _ = drafter_fields(folder.config, str(cfg_path))
        variant, variant_notes = engine_variant(folder.config, fields, set(folder.shapes), str(cfg_path))
    except DrafterImportError as e:
        return [
            Finding("config_invalid", str(e), "fix these fields (or export again with `eagle3kit export`)")
        ]
    tcfg, tc = load_target_config(target)
    out, stop = _check_widths(folder, fields, tc)
    out = _check_verifier(folder.config, target) + out
    if stop:
        return out
    if fields.draft_vocab_size is None:
        return out + [
            Finding(
                "config_key",
                "config.json lacks draft_vocab_size (engines would assume the full vocabulary)",
                "export again with `eagle3kit export`",
            )
        ]
    # vLLM sizes fc by the drafter's own target_hidden_size; a drafter of another target is named above
    out += _check_engine_fields(
        folder, fields, fields.target_hidden_size or fields.hidden_size, str(cfg_path)
    )
    out += _check_tensors(folder, fields, tc, variant)
    out += _check_as_exported(folder, variant, engine)
    out += _check_variant(variant, engine, engine_version, d)
    out += _check_vocab_maps(folder, fields, int(tc.vocab_size))
    out += _check_positions(served_config(folder.config, str(cfg_path)), fields, tc, max_model_len)
    out += _check_aux(folder.config, int(tc.num_hidden_layers), tcfg, tc, engine)
    out += _check_attention(folder, raw_target_config(target), engine)
    out += _check_engine(folder, target, tcfg, tc, engine, engine_version)
    out += [
        Finding("nested_flag", note, "write the flag at the top level", "warning")
        for note in variant_notes
        if note.startswith("eagle_config.")
    ]
    return out


@dataclass
class _Folder:
    """What :func:`check_drafter` reads of a drafter folder: ``config`` (config.json as written),
    ``shapes``/``dtypes`` of every tensor (speculators' ``layers.0.*`` renamed ``midlayer.*``), the
    ``maps`` (``d2t``/``t2d`` tensors, loaded: their values are checked), ``speculators`` (layout)."""

    config: dict
    shapes: dict
    dtypes: dict
    maps: dict
    speculators: bool
    nonfinite: list = ()  # float tensors holding NaN or inf


def _check_as_exported(folder: _Folder, variant: dict, engine: str) -> list[Finding]:
    """Non-finite weights, and the variant an engine reads against the one eagle3kit exported
    (``eagle3kit.drafter_variant``): a flag edited by hand serves another network."""
    out = [
        Finding(
            "non_finite",
            f"{k} holds NaN or inf values: the engine would load it and draft garbage",
            "export again from a checkpoint of a run whose loss stayed finite",
        )
        for k in folder.nonfinite
    ]
    trained = (
        (folder.config.get("eagle3kit") or {}).get("drafter_variant")
        if isinstance(folder.config.get("eagle3kit"), dict)
        else None
    )

    def on(flags: dict) -> dict:
        return {k: v for k, v in flags.items() if v}

    if isinstance(trained, dict) and on(trained) != on(variant):
        out.append(
            Finding(
                "variant_mismatch",
                f"the flags {engine} reads give {variant_name(variant)}, but eagle3kit exported this drafter "
                f"as {variant_name(trained)} (eagle3kit.drafter_variant): it would serve another network "
                "than the one trained",
                "export the drafter again with `eagle3kit export` instead of editing config.json's flags",
            )
        )
    return out


def _read_folder(cfg_path: Path, st_path: Path) -> _Folder:
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
    return _Folder(dc, shapes, dtypes, maps, speculators, nonfinite)


def _check_widths(folder: _Folder, fields, tc) -> tuple[list[Finding], bool]:
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


def _is_int(v) -> bool:
    """A JSON whole number (not a bool, a string or a float)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _aux_in_weights(shapes: dict, H_t: int) -> int:
    """How many aux states the weights' ``fc`` takes (its input width over the target's hidden size; 3
    without an fc or with a width that is no multiple, which is named on its own)."""
    fc = shapes.get("fc.weight")
    return fc[1] // H_t if fc is not None and fc[1] % H_t == 0 and fc[1] else 3


def _check_layer_count(pre: dict, shapes: dict) -> list[Finding]:
    """``num_hidden_layers`` (the decoder layers vLLM builds) against the layers in the weights: missing
    (transformers' default), of another type, or another count."""
    out: list[Finding] = []
    layers = int(any(k.startswith("midlayer.") for k in shapes)) + len(
        {k.split(".")[1] for k in shapes if k.startswith("layers.") and k.split(".")[1] != "0"}
    )
    said = pre.get("num_hidden_layers")
    if not _is_int(said):
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


def _check_engine_fields(folder: _Folder, fields, H_t: int, where: str) -> list[Finding]:
    """The fields vLLM builds the drafter from before it reads a weight (its ``llama_eagle3.py``): the
    decoder layers (``num_hidden_layers``), whether ``fc`` exists (``eagle_config.use_aux_hidden_state``),
    and fc's width: ``num_aux_hidden_states``, else the count of ``eagle_config``'s ids, else 3, times
    ``target_hidden_size`` (``H_t``: the drafter's own, as vLLM reads it); and the aux ids the target captures.
    Each against the weights."""
    pre, shapes, out = served_config(folder.config, where), folder.shapes, []
    nested = pre.get("eagle_config") if isinstance(pre.get("eagle_config"), dict) else {}
    out += _check_layer_count(pre, shapes)
    if "use_aux_hidden_state" in nested and nested["use_aux_hidden_state"] is not True:
        out.append(
            Finding(
                "use_aux_hidden_state",
                f"eagle_config.use_aux_hidden_state is {nested['use_aux_hidden_state']!r}: vLLM builds no fc and never "
                "reads the aux states",
                "drop it (or set it true): an EAGLE-3 drafter reads the aux states",
            )
        )
    if "fc.weight" not in shapes or shapes["fc.weight"][1] % H_t:
        return out
    n = _aux_in_weights(shapes, H_t)
    ids = fields.eagle_aux_hidden_state_layer_ids or []
    nested_ids = nested.get("eagle_aux_hidden_state_layer_ids")
    engine_n, why = pre.get("num_aux_hidden_states"), "num_aux_hidden_states"
    if engine_n is not None and not _is_int(engine_n):
        out.append(
            Finding(
                "num_aux_states",
                f"num_aux_hidden_states is {engine_n!r}, not a whole number: vLLM fails to size fc from it",
                f"set num_aux_hidden_states to {n}",
            )
        )
        return out
    if engine_n is None:
        engine_n, why = (len(nested_ids), "eagle_config's ids") if nested_ids else (3, "vLLM's default")
    if engine_n != n:
        out.append(
            Finding(
                "num_aux_states",
                f"vLLM sizes fc for {engine_n} aux states ({why}) × {H_t}, but fc.weight takes {n} × {H_t}: it would "
                "fail to load, or read other layers than trained",
                f"set num_aux_hidden_states to {n}"
                + (" (or drop it and give eagle_config {n} ids)" if why == "num_aux_hidden_states" else ""),
            )
        )
    if ids and len(ids) != n:
        out.append(
            Finding(
                "aux_ids_count",
                f"{len(ids)} aux ids {ids}, but fc.weight takes {n} aux layers × {H_t}: the target would capture "
                f"{len(ids)} states for an fc of {n}",
                f"give exactly the {n} ids the drafter was trained on",
            )
        )
    return out


#: config fields and tensor names of multi-head latent attention (DeepSeek-V2/V3, Kimi)
MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
MLA_TENSORS = ("kv_a_proj_with_mqa", "kv_b_proj", "q_a_proj", "q_b_proj", "kv_a_layernorm")
#: the engine setting that picks the drafter's own attention backend beside a target of another kind
DRAFT_ATTENTION_SETTING = {
    "vllm": '"attention_backend": "FLASH_ATTN" in --speculative-config',
    "sglang": "--speculative-draft-attention-backend fa3",
}


def _check_attention(folder: _Folder, target_raw: dict, engine: str) -> list[Finding]:
    """The drafter's attention (MHA, or MLA by its weights or fields) and the target's, said every time.
    Both engines' EAGLE-3 drafter classes build multi-head attention from q/k/v projections: MLA weights
    cannot be served (error), MLA fields beside q/k/v weights are ignored by the engine (warning); an MHA
    drafter beside an MLA target needs its own attention backend, named per engine (warning)."""
    dc = folder.config
    fields = [
        k for k in MLA_FIELDS if dc.get(k) is not None or (dc.get("transformer_layer_config") or {}).get(k)
    ]
    mla_weights = sorted({t for k in folder.shapes for t in MLA_TENSORS if f".{t}." in f".{k}"})
    target = "MLA" if target_raw and uses_mla(target_raw) else "MHA"
    drafter = "MLA" if mla_weights else "MHA"
    out = [Finding("attention", f"the drafter's {drafter}, the target's {target}", "", "info")]
    if mla_weights:
        out.append(
            Finding(
                "drafter_attention",
                f"the drafter holds MLA weights ({', '.join(mla_weights)}): neither vLLM's nor SGLang's EAGLE-3 "
                "drafter runs MLA (both build q/k/v multi-head attention), so it cannot be served",
                "train an EAGLE-3 drafter with multi-head attention (what eagle3kit trains, for MLA targets too)",
            )
        )
    elif fields:
        out.append(
            Finding(
                "drafter_attention",
                f"the config declares MLA fields ({', '.join(fields)}) but the weights are q/k/v multi-head attention: "
                "the engine ignores the fields and serves MHA",
                "drop the MLA fields from config.json",
                "warning",
            )
        )
    if target == "MLA" and drafter == "MHA":
        out.append(
            Finding(
                "attention_types",
                f"an MHA drafter beside an MLA target: {engine} runs the two with different attention backends; if "
                f"the one it picks for the drafter fails or is slow, set it with {DRAFT_ATTENTION_SETTING[engine]}",
                f"on a GPU build: {DRAFT_ATTENTION_SETTING[engine]}",
                "warning",
            )
        )
    return out


def _check_tensors(folder: _Folder, fields, tc, variant: dict) -> list[Finding]:
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
                range(_aux_in_weights(shapes, H_t))
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


def _check_variant(variant: dict, engine: str, engine_version: str | None, folder: Path) -> list[Finding]:
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


def _check_vocab_maps(folder: _Folder, fields, V: int) -> list[Finding]:
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


_ROPE_KEYS = ("rope_scaling", "rope_parameters", "rope_theta", "partial_rotary_factor")


def _check_positions(dc: dict, fields, tc, max_model_len: int | None) -> list[Finding]:
    """Tied embeddings, max positions against the serving length, rope against the target's."""
    out: list[Finding] = []
    if dc.get("tie_word_embeddings"):
        out.append(
            Finding(
                "tied_embeddings",
                "tie_word_embeddings is true: the engine would use the embedding as lm_head",
                "set tie_word_embeddings false (the drafter's lm_head is [Vd, H])",
            )
        )
    mpe = fields.max_position_embeddings or 0
    target_len = int(getattr(tc, "max_position_embeddings", 0) or 0)
    if max_model_len and mpe < max_model_len:
        out.append(
            Finding(
                "max_positions",
                f"max_position_embeddings {mpe} < the serving length {max_model_len}",
                "export again (it copies the target's) or serve with a shorter --max-model-len",
            )
        )
    elif not max_model_len and target_len and mpe < target_len:
        # the engines serve the target's own length by default; vLLM then caps the drafter at its
        # max_position_embeddings (SpeculativeConfig._maybe_override_draft_max_model_len): no draft past it
        out.append(
            Finding(
                "max_positions",
                f"max_position_embeddings {mpe} < {target_len}, the length the engine serves "
                f"this target at by default (its max_position_embeddings): vLLM starts, and past {mpe} tokens "
                "it drafts nothing (τ 1)",
                f"export again (it copies the target's), or serve with --max-model-len "
                f"{mpe} and pass it to check",
            )
        )
    rope, own = rope_settings(tc), rope_settings(dc)  # every spelling read as the engine reads it
    twice = rope_conflict(dc)
    if twice:
        out.append(
            Finding("rope_twice", f"the drafter's config: {twice}", "keep one spelling (export again)")
        )
    elif not same_rope(own, rope):
        out.append(
            Finding(
                "rope",
                f"the drafter's rope (theta {own['rope_theta']}, scaling {own['rope_scaling']}, as read from "
                f"{', '.join(k for k in _ROPE_KEYS if k in dc) or 'no field'}) "
                f"differs from the target's (theta {rope['rope_theta']}, scaling {rope['rope_scaling']})",
                "export again (it copies the target's)",
            )
        )
    return out


def _check_engine(
    folder: _Folder, target: TargetConfig, tcfg, tc, engine: str, engine_version: str | None
) -> list[Finding]:
    """What the engine supports: the speculators layout by engine and release, SGLang's untabled
    releases, and for vLLM its EAGLE-3 gate, the target class and the target's own config."""
    dc = folder.config
    out: list[Finding] = []
    if folder.speculators:
        if engine == "sglang":
            out.append(
                Finding(
                    "layout",
                    f"a speculators-layout folder (architectures {dc.get('architectures')}): SGLang has no model "
                    "class for it",
                    "serve the dual-engine export (`eagle3kit export`) with SGLang",
                )
            )
        elif engine_version and (parse_version(engine_version) or parse_version("0.10.1")) < parse_version(
            "0.10.1"
        ):
            out.append(
                Finding(
                    "layout",
                    f"vLLM {engine_version} does not read the speculators layout (from 0.10.1 on)",
                    "serve the dual-engine export, or vLLM ≥ 0.10.1",
                )
            )
    if engine == "sglang" and engine_version:
        out.append(
            Finding(
                "engine_support",
                f"SGLang {engine_version}: eagle3kit has no table of SGLang releases; the "
                "per-family aux-id rule checked is SGLang 0.5.23's",
                "check that release's notes",
                "warning",
            )
        )
    if engine == "vllm":
        out += vllm_support_findings(
            target_architectures(tcfg),
            str(getattr(tc, "model_type", "") or getattr(tcfg, "model_type", "")),
            engine_version,
        )
        block = dc.get("eagle3kit") if isinstance(dc.get("eagle3kit"), dict) else {}
        out += vllm_target_config_findings(target, engine_version, block)
    return out


def _check_aux(dc: dict, N: int, tcfg, tc, engine: str) -> list[Finding]:
    out: list[Finding] = []
    ids = dc.get("eagle_aux_hidden_state_layer_ids")
    nested = (dc.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        return [
            Finding(
                "aux_ids_missing",
                "config.json has no eagle_aux_hidden_state_layer_ids: the engine would pick "
                "its default layers, not the ones the drafter was trained on",
                "export again",
            )
        ]
    if sorted(set(ids)) != list(ids) or min(ids) < 1 or max(ids) > N - 1:
        out.append(
            Finding(
                "aux_ids_range",
                f"aux ids {ids} must be distinct, ascending, inside [1, {N - 1}] (HF index)",
                "export again with the ids the drafter was trained on",
            )
        )
    block = dc.get("eagle3kit") if isinstance(dc.get("eagle3kit"), dict) else {}
    trained = (
        block.get("aux_layer_ids", {}).get("ids") if isinstance(block.get("aux_layer_ids"), dict) else None
    )
    if trained and list(trained) != list(ids):
        out.append(
            Finding(
                "aux_ids_trained",
                f"config aux ids {ids} but the features were trained on {trained}",
                f"set eagle_aux_hidden_state_layer_ids to {trained}",
            )
        )
    if nested is not None and [i + 1 for i in nested] != list(ids):
        out.append(
            Finding(
                "aux_ids_conventions",
                f"eagle_config ids {nested} (output of layer j) do not equal the top-level "
                f"{ids} (HF index) minus 1",
                f"set eagle_config.eagle_aux_hidden_state_layer_ids to {[i - 1 for i in ids]}",
            )
        )
    if engine == "sglang":
        cfg_ids = list(nested) if nested is not None else [i - 1 for i in ids]
        got = sglang_captured(cfg_ids, str(getattr(tc, "model_type", getattr(tcfg, "model_type", ""))), N)
        want = list(trained or ids)
        if got != want:
            out.append(
                Finding(
                    "aux_ids_sglang",
                    f"SGLang will capture HF layers {got} on this {tc.model_type} target, not {want}",
                    "export ids that SGLang's rule for this family maps to the trained layers",
                )
            )
        else:
            out.append(
                Finding(
                    "aux_ids_sglang",
                    f"SGLang will capture HF layers {got} (eagle_config ids {cfg_ids} under "
                    f"its {SGLANG_AUX_RULE.get(str(tc.model_type), 'always')!r} rule for {tc.model_type}): the "
                    "trained layers",
                    "",
                    "info",
                )
            )
    return out


def findings_json(findings: list[Finding]) -> str:
    """The findings as JSON (``--json``): ``{"ok": bool, "findings": [...]}``."""
    return json.dumps(
        {"ok": not any(f.severity == "error" for f in findings), "findings": [asdict(f) for f in findings]},
        indent=2,
    )
