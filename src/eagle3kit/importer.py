"""Stage ``import``: read an EAGLE-3 drafter written by another tool, strictly, into eagle3kit's
drafter (and from there into the dual-engine folder of DESIGN.md §5).

Layouts (sources: SafeAILab/EAGLE ``eagle/traineagle3``, sgl-project/SpecForge
``scripts/train_eagle3.py``, vllm-project/speculators ``models/eagle3``, NVIDIA Model-Optimizer
``torch/export/plugins/hf_spec_export.py``; vLLM 0.32's ``llama_eagle3.py`` for what an engine reads):

============  =========================  ===========================  =============================
layout        weights                    tensor names                 aux layer ids → HF index
============  =========================  ===========================  =============================
eagle3kit     model.safetensors          ``midlayer.*``               top level, HF index (as is)
eagle         pytorch_model.bin or       ``midlayer.*``               none: hard-coded, captured
(SafeAILab)   model.safetensors                                       before layers {2, N//2, N−3}
specforge     model.safetensors          ``midlayer.*``, no embed     ``eagle_config``: output of
              (maybe sharded + index)                                 layer j → j + 1
speculators   model.safetensors          ``layers.0.*`` + embed       top level, HF index (as is)
modelopt      model.safetensors          ``layers.0.*`` (or           ``eagle_config``: output of
                                         ``eagle_module.`` prefix),   layer j → j + 1
                                         no ``t2d``
============  =========================  ===========================  =============================

A missing id list means EAGLE-3's default, HF indices ``(2, N//2, N−3)`` for a target of N layers
(every tool above defaults to those same states). ``t2d`` is synthesized from ``d2t`` when absent;
``d2t`` holds offsets in every layout (target id = draft id + d2t[draft id]). A copy of the
target's embedding (``embed_tokens.weight``) is dropped: the engines borrow the target's. The load
is strict: any key left over after renaming, and any tensor the drafter needs but the source lacks,
is an error that names it. Variants eagle3kit does not implement (``norm_before_residual: true``,
``fc_norm``, ``norm_before_fc``, biases, more than one decoder layer) are refused by name.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError

from .config import ConfigError
from .drafter import DrafterConfig, Eagle3Drafter
from .export import ExportError, contract_mismatches, contract_shapes
from .rundir import DataError, load_safetensors
from .vocab import check_maps

LAYOUTS = ("eagle3kit", "eagle", "specforge", "speculators", "modelopt")
_UNSUPPORTED_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "attention_bias", "mlp_bias", "bias")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


class DrafterImportError(ExportError):
    """A source drafter that cannot be read exactly; the message names the key or field and the fix."""


_Pos = Annotated[StrictInt, Field(gt=0)]
_PosNum = Annotated[StrictFloat | StrictInt, Field(gt=0)]


class DrafterFields(BaseModel):
    """The fields of a drafter's ``config.json`` that decide its shape and numerics, type-checked
    (strict: no string, float or bool where an int belongs). ``hidden_act`` must be ``silu``:
    eagle3kit's drafter (and what it trains and evaluates) uses SiLU."""

    model_config = ConfigDict(extra="ignore")
    hidden_size: _Pos
    intermediate_size: _Pos
    num_attention_heads: _Pos
    num_key_value_heads: _Pos | None = None
    head_dim: _Pos | None = None
    rms_norm_eps: _PosNum = 1e-6
    vocab_size: _Pos
    draft_vocab_size: _Pos | None = None
    target_hidden_size: _Pos | None = None
    rope_theta: _PosNum | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    max_position_embeddings: _Pos | None = None
    hidden_act: Literal["silu"] = "silu"
    eagle_aux_hidden_state_layer_ids: list[StrictInt] | None = None
    eagle_config: dict | None = None
    norm_before_residual: StrictBool | None = None
    norm_before_fc: StrictBool | None = None
    fc_norm: StrictBool | None = None
    norm_output: StrictBool | None = None
    attention_bias: StrictBool | None = None
    mlp_bias: StrictBool | None = None
    bias: StrictBool | None = None


def drafter_fields(cfg, where: str) -> tuple[DrafterFields, list[int] | None]:
    """Validate a drafter ``config.json`` (any layout: a speculators ``transformer_layer_config``
    and a nested ``text_config`` are merged with the top level) into :class:`DrafterFields`, plus
    the nested ``eagle_config`` ids (or None).

    Raises:
        DrafterImportError: naming ``where``, every bad field and what it must be."""
    if not isinstance(cfg, dict):
        raise DrafterImportError(f"{where}: the top level must be a JSON object, got {type(cfg).__name__}")
    merged = dict(cfg)
    for inner in ("transformer_layer_config", "text_config"):
        if inner in cfg:
            if not isinstance(cfg[inner], dict):
                raise DrafterImportError(f"{where}: {inner} must be a JSON object, got {type(cfg[inner]).__name__}")
            merged = {**cfg[inner], **{k: v for k, v in cfg.items() if k != inner}}
            if "vocab_size" not in cfg and "vocab_size" in cfg[inner]:
                merged["vocab_size"] = cfg[inner]["vocab_size"]
    try:
        f = DrafterFields.model_validate(merged)
    except ValidationError as e:
        bad = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']} (got {str(err.get('input'))[:40]!r})"
                        for err in e.errors())
        raise DrafterImportError(f"{where}: {bad}") from None
    nested = None
    if f.eagle_config is not None:
        nested = f.eagle_config.get("eagle_aux_hidden_state_layer_ids")
        if nested is not None and (not isinstance(nested, list) or not all(type(i) is int for i in nested)):
            raise DrafterImportError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids must be a list of ints, "
                                     f"got {nested!r}")
    return f, nested


@dataclass
class Imported:
    """An imported drafter: ``drafter`` (weights in the source's dtype), ``layout`` it was read as,
    ``notes`` (what was renamed, converted, synthesized or dropped) and ``provenance`` (the
    ``eagle3kit`` block for the exported config)."""

    drafter: Eagle3Drafter
    layout: str
    notes: list[str] = field(default_factory=list)
    provenance: dict = field(default_factory=dict)


def _shard_name(folder: Path, name, index: Path) -> Path:
    if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
        raise DrafterImportError(f"{index}: shard {name!r} is not a file name inside {folder}")
    p = folder / name
    if not p.is_file():
        raise DrafterImportError(f"{index} lists {name}, which is missing; restore it")
    return p


def read_weights(folder: Path) -> tuple[dict[str, torch.Tensor], str]:
    """All tensors of a drafter folder and the file(s) they came from: ``model.safetensors``, a
    sharded ``model.safetensors.index.json`` (each tensor read from the shard its ``weight_map``
    names; a tensor in no or several shards is an error), or ``pytorch_model.bin`` (a plain
    name → tensor dict, read with ``weights_only=True``).

    Raises:
        FileNotFoundError: none of those files; DataError / DrafterImportError: an unreadable file."""
    if (folder / "model.safetensors").is_file():
        return load_safetensors(folder / "model.safetensors", "give the drafter's weights file"), "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
            assert isinstance(wmap, dict)
        except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError):
            raise DrafterImportError(f"{index} is not a safetensors index (a JSON object with a weight_map object)") from None
        out: dict[str, torch.Tensor] = {}
        loaded: dict[str, dict] = {}
        for name, shard in wmap.items():
            path = _shard_name(folder, shard, index)
            if shard not in loaded:
                loaded[shard] = load_safetensors(path, f"{shard} is listed in {index.name}; restore it")
            if name not in loaded[shard]:
                raise DrafterImportError(f"{index} puts {name} in {shard}, which does not hold it")
            out[name] = loaded[shard][name]
        for shard, tensors in loaded.items():
            extra = [k for k in tensors if wmap.get(k) != shard]
            if extra:
                raise DrafterImportError(f"{shard} holds {extra[:4]}, which {index.name} maps elsewhere or not at all")
        return out, f"{len(loaded)} shards"
    if (folder / "pytorch_model.bin").is_file():
        try:
            sd = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:
            raise DataError(f"{folder / 'pytorch_model.bin'} is not a plain tensor state dict ({type(e).__name__}); "
                            "convert it to safetensors first") from None
        if not isinstance(sd, dict):
            raise DrafterImportError(f"{folder / 'pytorch_model.bin'} holds a {type(sd).__name__}, not a name → tensor dict")
        odd = [repr(k) for k, v in sd.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
        if odd:
            raise DrafterImportError(f"{folder / 'pytorch_model.bin'}: entries that are not named tensors: {odd[:6]}; "
                                     "save the drafter's state dict alone")
        return dict(sd), "pytorch_model.bin"
    raise FileNotFoundError(f"{folder}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def detect_layout(cfg: dict, keys: set[str]) -> str:
    """The source layout from its config and tensor names (see the module table)."""
    nested = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    layers0 = any(k.startswith(("layers.", "model.layers.")) for k in keys)
    if "speculators_model_type" in cfg or "speculators_config" in cfg:
        return "speculators"
    if any(k.startswith("eagle_module.") for k in keys) \
            or {"use_input_layernorm_in_first_layer", "use_last_layernorm", "next_layer_regular"} & set(nested):
        return "modelopt"
    if cfg.get("eagle_aux_hidden_state_layer_ids"):
        return "eagle3kit"      # top-level ids in HF numbering: eagle3kit's (or any dual-engine) folder
    if nested.get("eagle_aux_hidden_state_layer_ids") is not None:
        return "modelopt" if layers0 else "specforge"
    return "modelopt" if layers0 else "eagle"


def _rename(tensors: dict[str, torch.Tensor], notes: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    if any(k.startswith("eagle_module.") for k in tensors):
        base = [k for k in tensors if not k.startswith("eagle_module.")]
        if base:
            notes.append(f"skipped {len(base)} base-model tensors stored beside eagle_module.*")
        tensors = {k[len("eagle_module."):]: v for k, v in tensors.items() if k.startswith("eagle_module.")}
    renamed = 0
    for k, v in tensors.items():
        new = k[len("model."):] if k.startswith("model.") else k
        if new.startswith("layers.0."):
            new = "midlayer." + new[len("layers.0."):]
        elif new.startswith("layers."):
            raise DrafterImportError(f"{k}: a drafter with more than one decoder layer; eagle3kit trains and serves one")
        if new in out:
            raise DrafterImportError(f"{k} and another tensor both become {new}")
        renamed += new != k
        out[new] = v
    if renamed:
        notes.append(f"renamed {renamed} tensors to the midlayer.* naming")
    return out


def _aux_ids(f: DrafterFields, nested: list[int] | None, layout: str, num_layers: int | None, notes: list[str]) -> list[int]:
    top = f.eagle_aux_hidden_state_layer_ids
    reads = {"eagle3kit": "top", "speculators": "top", "specforge": "nested", "modelopt": "nested", "eagle": None}[layout]
    held = [w for w, ids in (("top", top), ("nested", nested)) if ids]
    if held and reads not in held:
        where = {"top": "top-level eagle_aux_hidden_state_layer_ids", "nested": "eagle_config.eagle_aux_hidden_state_layer_ids"}
        raise DrafterImportError(f"layout {layout} does not read {where[held[0]]}, which this source holds: the ids "
                                 "would be lost; use --layout auto or the layout that wrote the folder")
    if reads == "top" and top:
        ids = list(top)
    elif reads == "nested" and nested:
        ids = [int(i) + 1 for i in nested]
        notes.append(f"aux ids {list(nested)} (output of layer j, {layout}) → HF indices {ids}")
    else:
        if num_layers is None:
            raise DrafterImportError(f"the {layout} source names no aux layer ids: give --target so the default layers "
                                     "(2, N//2, N−3) of the target's N layers can be used")
        from .target import default_aux_layer_ids

        ids = list(default_aux_layer_ids(num_layers))
        notes.append(f"no aux ids in the source: EAGLE-3's default for {num_layers} layers, HF indices {ids}")
    if len(ids) != 3:
        raise DrafterImportError(f"aux ids {ids}: an EAGLE-3 drafter reads exactly 3 aux layers (fc takes 3 × hidden)")
    if ids != sorted(ids):
        notes.append(f"aux ids {ids} sorted to {sorted(ids)} (engines concatenate aux states in layer order)")
        ids = sorted(ids)
    if num_layers is not None:
        from .target import validate_aux_layer_ids

        try:
            validate_aux_layer_ids(ids, num_layers)
        except ConfigError as e:
            raise DrafterImportError(str(e)) from None
    return ids


def _drafter_config(f: DrafterFields, tensors: dict, ids: list[int], target_tc, notes: list[str]) -> DrafterConfig:
    H, heads = f.hidden_size, f.num_attention_heads
    Vd = f.draft_vocab_size
    if Vd is None:
        if "lm_head.weight" not in tensors:
            raise DrafterImportError("no draft_vocab_size in config.json and no lm_head.weight: the drafter has no head "
                                     "(an EAGLE-1 drafter, or a broken export)")
        Vd = int(tensors["lm_head.weight"].shape[0])
    if Vd > f.vocab_size:
        raise DrafterImportError(f"draft_vocab_size {Vd} exceeds vocab_size {f.vocab_size}")
    if H % heads and f.head_dim is None:
        raise DrafterImportError(f"hidden_size {H} is not a multiple of num_attention_heads {heads}; give head_dim")
    from types import SimpleNamespace

    from .target import rope_settings

    own = rope_settings(SimpleNamespace(rope_parameters=f.rope_parameters, rope_theta=f.rope_theta or 10000.0,
                                        rope_scaling=f.rope_scaling))   # read as the target's rope is read
    rope_theta, rope_scaling = own["rope_theta"], own["rope_scaling"]
    mpe = f.max_position_embeddings or 2048
    if target_tc is not None:
        t_mpe = int(getattr(target_tc, "max_position_embeddings", mpe) or mpe)
        if t_mpe != mpe:
            notes.append(f"max_position_embeddings {mpe} → the target's {t_mpe}")
            mpe = t_mpe
        rope = rope_settings(target_tc)
        if float(rope_theta) != float(rope["rope_theta"]) or (rope_scaling or None) != (rope.get("rope_scaling") or None):
            raise DrafterImportError(f"the source's rope (theta {rope_theta}, scaling {rope_scaling}) differs from the target's "
                                     f"(theta {rope['rope_theta']}, scaling {rope.get('rope_scaling')}): the drafter was "
                                     "trained with other positions than the target serves; retrain it for this target")
    return DrafterConfig(
        hidden_size=H, intermediate_size=f.intermediate_size, num_attention_heads=heads,
        num_key_value_heads=f.num_key_value_heads or heads, head_dim=f.head_dim or H // heads,
        rms_norm_eps=float(f.rms_norm_eps), vocab_size=f.vocab_size, draft_vocab_size=Vd,
        target_hidden_size=f.target_hidden_size or H, aux_layer_ids=ids, rope_theta=float(rope_theta),
        rope_scaling=rope_scaling, max_position_embeddings=mpe, hidden_act=f.hidden_act)


def read_drafter(folder: str | Path, layout: str = "auto", target=None) -> Imported:
    """Read the drafter in ``folder`` (any layout of the module table), strictly.

    Args:
        layout: ``auto`` (detected from config and tensor names) or one of :data:`LAYOUTS`.
        target: a :class:`~eagle3kit.config.TargetConfig` (or None). Needed only when the source
            names no aux ids (SafeAILab; SpecForge/ModelOpt without ``eagle_config``); when given,
            the vocabulary, hidden size, layer count, aux ids and rope are checked against it.

    Returns:
        :class:`Imported`; weights keep the source dtype, ``d2t`` int64 [Vd], ``t2d`` bool [V].

    Raises:
        FileNotFoundError: no config.json / weights. DrafterImportError: unknown layout, a
        malformed config (every bad field named), an unsupported variant, missing or unexpected
        tensors, shapes that contradict the config, non-float or non-finite weights, broken vocab
        maps, or a drafter made for another target.
    """
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no config.json (give the drafter folder)")
    try:
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DrafterImportError(f"{folder / 'config.json'} is not UTF-8 JSON ({e})") from None
    f, nested = drafter_fields(cfg, str(folder / "config.json"))
    raw, source_file = read_weights(folder)
    found = detect_layout(cfg, set(raw))
    if layout == "auto":
        layout = found
    elif layout not in LAYOUTS:
        raise DrafterImportError(f"unknown layout {layout!r}; one of auto, {', '.join(LAYOUTS)}")
    elif (layout == "speculators") != (found == "speculators"):
        raise DrafterImportError(f"{folder} is {'not ' if layout == 'speculators' else ''}in the speculators layout "
                                 f"(detected: {found}); use --layout auto")
    flags = {k: getattr(f, k) for k in _UNSUPPORTED_FLAGS}
    if layout == "speculators" and f.norm_before_residual is None:
        flags["norm_before_residual"] = True     # vLLM's default for a speculators config (algos.update_eagle3)
    on = [k for k, v in flags.items() if v]
    if on:
        raise DrafterImportError(f"{folder}: {', '.join(f'{k}: true' for k in on)} — a drafter variant eagle3kit does not "
                                 "implement (it builds norm_before_residual false, no extra norms, no biases)")
    notes = [f"read {source_file} as layout {layout}" + ("" if layout == found else f" (detected: {found})")]
    tensors = _rename(raw, notes)
    if "embed_tokens.weight" in tensors:
        tensors.pop("embed_tokens.weight")
        notes.append("dropped embed_tokens.weight (the engines use the target's embedding)")
    tc = None
    if target is not None:
        from .target import load_target_config

        _, tc = load_target_config(target)
    ids = _aux_ids(f, nested, layout, int(tc.num_hidden_layers) if tc is not None else None, notes)
    c = _drafter_config(f, tensors, ids, tc, notes)
    reduced = c.draft_vocab_size < c.vocab_size
    for k, want_dtype in (("d2t", "an integer"), ("t2d", "a bool or integer")):
        t = tensors.get(k)
        if t is not None and (t.dtype.is_floating_point or t.dim() != 1):
            raise DrafterImportError(f"{k} must be a 1-D {want_dtype} tensor, got {t.dtype} of shape {list(t.shape)}")
    if reduced and "d2t" in tensors and "t2d" not in tensors:
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        tid = torch.arange(tensors["d2t"].numel()) + tensors["d2t"].long()
        if tid.numel() and 0 <= int(tid.min()) and int(tid.max()) < c.vocab_size:
            t2d[tid] = True
        tensors["t2d"] = t2d
        notes.append("synthesized t2d from d2t")
    if not reduced:
        for k in ("d2t", "t2d"):
            t = tensors.pop(k, None)
            if k == "d2t" and t is not None and bool(t.any()):
                raise DrafterImportError(f"{folder}: draft vocab = target vocab but d2t is not all zero offsets")
    want = contract_shapes(c)
    missing, unexpected, misshapen = contract_mismatches({k: tuple(v.shape) for k, v in tensors.items()}, want)
    shapes = [f"{k} {list(tensors[k].shape)} ≠ {list(want[k])}" for k in misshapen]
    if missing or unexpected or shapes:
        raise DrafterImportError(f"{folder} ({layout}) does not load strictly: missing {missing}, unexpected {unexpected}"
                                 + (f", shapes {shapes}" if shapes else ""))
    weights = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
    dtypes = {str(v.dtype) for v in weights.values()}
    if len(dtypes) != 1 or not next(iter(weights.values())).dtype.is_floating_point:
        raise DrafterImportError(f"weights must share one floating-point dtype, got {sorted(dtypes)}")
    bad = [k for k, v in weights.items() if not bool(torch.isfinite(v).all())]
    if bad:
        raise DrafterImportError(f"non-finite values (NaN or inf) in {bad[:6]}")
    if reduced:
        try:
            check_maps(tensors["d2t"].long(), tensors["t2d"].bool(), c.vocab_size)
        except DataError as e:
            raise DrafterImportError(f"{folder}: {e}") from None
        tensors["d2t"], tensors["t2d"] = tensors["d2t"].long(), tensors["t2d"].bool()
    if tc is not None:
        _check_target(c, tc, folder)
    d = Eagle3Drafter(c).to(next(iter(weights.values())).dtype)
    if not reduced:
        from .vocab import DraftVocab

        d.set_vocab(DraftVocab.full(c.vocab_size))
        tensors = {**tensors, "d2t": d.d2t, "t2d": d.t2d}
    d.load_state_dict(tensors, strict=True)
    block = cfg.get("eagle3kit") if isinstance(cfg.get("eagle3kit"), dict) else {}
    prov = {k: v for k, v in block.items() if k not in ("version", "aux_layer_ids_convention")}
    trained = (prov.get("aux_layer_ids") or {}).get("ids") if isinstance(prov.get("aux_layer_ids"), dict) else None
    if trained is not None and list(trained) != ids:
        raise DrafterImportError(f"config aux ids {ids} but its eagle3kit block says the features were trained on {trained}; "
                                 f"set eagle_aux_hidden_state_layer_ids to {trained}")
    if not prov:        # not written by eagle3kit (whose provenance block is kept as it is)
        prov = {"aux_layer_ids": {"convention": "hf_output_hidden_states_index", "ids": ids},
                "imported_from": {"layout": layout, "path": str(folder.resolve()), "notes": notes}}
    return Imported(d, layout, notes, prov)


def _check_target(c: DrafterConfig, tc, folder: Path) -> None:
    """Widths and vocabulary against the target (the aux ids were checked by :func:`_aux_ids`)."""
    problems = []
    if c.vocab_size != int(tc.vocab_size):
        problems.append(f"vocab_size {c.vocab_size} ≠ the target's {tc.vocab_size}")
    if c.target_hidden_size != int(tc.hidden_size):
        problems.append(f"target hidden size {c.target_hidden_size} ≠ the target's {tc.hidden_size}")
    if c.hidden_size != int(tc.hidden_size):
        problems.append(f"drafter hidden size {c.hidden_size} ≠ the target's {tc.hidden_size} (a narrower drafter "
                        "needs its own embedding, which eagle3kit does not build)")
    if problems:
        raise DrafterImportError(f"{folder} was made for another target: " + "; ".join(problems))


def run_import(source: str | Path, out_dir: str | Path, target, layout: str = "auto", overwrite: bool = False) -> dict:
    """``eagle3kit import``: read ``source`` (:func:`read_drafter`), write the dual-engine folder
    (:func:`eagle3kit.export.export_drafter`, same dtype) to a temporary folder, run
    :func:`eagle3kit.check.check_drafter` on it against ``target``, and only when nothing is wrong
    move it to ``out_dir``. Returns a summary, with ``notes`` (what was converted) and ``findings``
    (``check``'s warnings and info lines).

    Raises:
        as :func:`read_drafter`; ConfigError: ``out_dir`` is the source or the target folder;
        FileExistsError: ``out_dir`` is not empty and not ``overwrite``; DrafterImportError:
        ``check`` found errors (listed; nothing is written)."""
    import os
    import shutil

    from .check import check_drafter
    from .export import check_out_dir, commit_out_dir, export_drafter
    from .target import locate_target

    out = Path(out_dir)
    try:
        same = {out.resolve()} & {Path(source).resolve(), Path(locate_target(target)["path"]).resolve()}
    except (OSError, RuntimeError) as e:
        raise ConfigError(f"cannot resolve {source} or --out {out}: {e}") from None
    if same:
        raise ConfigError(f"--out {out} is the source folder or the target folder; import never writes into either")
    check_out_dir(out, overwrite)
    imp = read_drafter(source, layout, target)
    tmp = out.with_name(f".{out.name}.import-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    export_drafter(imp.drafter, tmp, imp.provenance)
    found = check_drafter(tmp, target)
    errors = [f for f in found if f.severity == "error"]
    if errors:
        shutil.rmtree(tmp)
        raise DrafterImportError(f"{source} imports, but would not serve beside {target.model}; nothing written:\n  "
                                 + "\n  ".join(f"{f.code}: {f.message} (fix: {f.fix})" for f in errors))
    commit_out_dir(tmp, out)
    c = imp.drafter.config
    return {"path": str(out), "layout": imp.layout, "aux_layer_ids": c.aux_layer_ids, "draft_vocab_size": c.draft_vocab_size,
            "vocab_size": c.vocab_size, "dtype": str(imp.drafter.fc.weight.dtype).replace("torch.", ""), "notes": imp.notes,
            "findings": found}
