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

import torch

from .config import ConfigError
from .drafter import DrafterConfig, Eagle3Drafter
from .export import ExportError, required_shapes
from .rundir import DataError, load_safetensors
from .vocab import check_maps

LAYOUTS = ("eagle3kit", "eagle", "specforge", "speculators", "modelopt")
_UNSUPPORTED_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "attention_bias", "mlp_bias", "bias")


class DrafterImportError(ExportError):
    """A source drafter that cannot be read exactly; the message names the key or field and the fix."""


@dataclass
class Imported:
    """An imported drafter: ``drafter`` (weights in the source's dtype), ``layout`` it was read as,
    ``notes`` (what was renamed, converted, synthesized or dropped) and ``provenance`` (the
    ``eagle3kit`` block for the exported config)."""

    drafter: Eagle3Drafter
    layout: str
    notes: list[str] = field(default_factory=list)
    provenance: dict = field(default_factory=dict)


def read_weights(folder: Path) -> tuple[dict[str, torch.Tensor], str]:
    """All tensors of a drafter folder and the file(s) they came from: ``model.safetensors``, a
    sharded ``model.safetensors.index.json``, or ``pytorch_model.bin`` (``weights_only=True``).

    Raises:
        FileNotFoundError: none of those files; DataError: an unreadable file."""
    if (folder / "model.safetensors").is_file():
        return load_safetensors(folder / "model.safetensors", "give the drafter's weights file"), "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for s in shards:
            out.update(load_safetensors(folder / s, f"{s} is listed in {index.name}; restore it"))
        return out, f"{len(shards)} shards"
    if (folder / "pytorch_model.bin").is_file():
        try:
            sd = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:
            raise DataError(f"{folder / 'pytorch_model.bin'} is not a plain tensor state dict ({type(e).__name__}); "
                            "convert it to safetensors first") from None
        return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}, "pytorch_model.bin"
    raise FileNotFoundError(f"{folder}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def detect_layout(cfg: dict, keys: set[str]) -> str:
    """The source layout from its config and tensor names (see the module table)."""
    nested = cfg.get("eagle_config") or {}
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
        renamed += new != k
        out[new] = v
    if renamed:
        notes.append(f"renamed {renamed} tensors to the midlayer.* naming")
    return out


def _aux_ids(cfg: dict, layout: str, num_layers: int | None, notes: list[str]) -> list[int]:
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if layout in ("eagle3kit", "speculators") and top:
        return [int(i) for i in top]
    if layout in ("specforge", "modelopt") and nested:
        ids = sorted(int(i) + 1 for i in nested)
        notes.append(f"aux ids {list(nested)} (output of layer j, {layout}) → HF indices {ids}")
        return ids
    if num_layers is None:
        raise DrafterImportError(f"the {layout} source names no aux layer ids: give --target so the default layers "
                           "(2, N//2, N−3) of the target's N layers can be used")
    from .target import default_aux_layer_ids

    ids = list(default_aux_layer_ids(num_layers))
    notes.append(f"no aux ids in the source: EAGLE-3's default for {num_layers} layers, HF indices {ids}")
    return ids


def _drafter_config(cfg: dict, layout: str, tensors: dict, ids: list[int], target_tc, notes: list[str]) -> DrafterConfig:
    layer = dict(cfg.get("transformer_layer_config") or {}) if layout == "speculators" else cfg
    if layout != "speculators" and "text_config" in cfg:
        layer = {**cfg["text_config"], **{k: v for k, v in cfg.items() if k != "text_config"}}
    try:
        H, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
        V = int(layer.get("vocab_size") or cfg.get("vocab_size"))
        Vd = int(cfg.get("draft_vocab_size") or layer.get("draft_vocab_size") or tensors["lm_head.weight"].shape[0])
        rope_theta = layer.get("rope_theta") or (layer.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        rope_scaling = layer.get("rope_scaling")
        if rope_scaling is None and (layer.get("rope_parameters") or {}).get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in layer["rope_parameters"].items() if k != "rope_theta"}
        mpe = int(layer.get("max_position_embeddings") or 2048)
        if target_tc is not None:
            t_mpe = int(getattr(target_tc, "max_position_embeddings", mpe) or mpe)
            if t_mpe != mpe:
                notes.append(f"max_position_embeddings {mpe} → the target's {t_mpe}")
                mpe = t_mpe
        return DrafterConfig(
            hidden_size=H, intermediate_size=int(layer["intermediate_size"]), num_attention_heads=heads,
            num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or H // heads), rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            vocab_size=V, draft_vocab_size=Vd,
            target_hidden_size=int(cfg.get("target_hidden_size") or layer.get("target_hidden_size") or H),
            aux_layer_ids=ids, rope_theta=float(rope_theta), rope_scaling=rope_scaling, max_position_embeddings=mpe,
            hidden_act=str(layer.get("hidden_act", "silu")))
    except KeyError as e:
        where = "transformer_layer_config" if layout == "speculators" else "config.json"
        raise DrafterImportError(f"{where} lacks {e.args[0]!r}, which the drafter's shape needs") from None


def read_drafter(folder: str | Path, layout: str = "auto", target=None) -> Imported:
    """Read the drafter in ``folder`` (any layout of the module table), strictly.

    Args:
        layout: ``auto`` (detected from config and tensor names) or one of :data:`LAYOUTS`.
        target: a :class:`~eagle3kit.config.TargetConfig` (or None). Needed only when the source
            names no aux ids (SafeAILab; SpecForge/ModelOpt without ``eagle_config``); when given,
            the vocabulary, hidden size and layer count are checked against it.

    Returns:
        :class:`Imported`; weights keep the source dtype, ``d2t`` int64 [Vd], ``t2d`` bool [V].

    Raises:
        FileNotFoundError: no config.json / weights. DrafterImportError: unknown layout, unsupported
        variant, missing or unexpected tensors, shapes that contradict the config, broken vocab
        maps, or a drafter made for another target.
    """
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no config.json (give the drafter folder)")
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise DrafterImportError(f"{folder / 'config.json'} is not JSON ({e})") from None
    raw, source_file = read_weights(folder)
    found = detect_layout(cfg, set(raw))
    if layout == "auto":
        layout = found
    elif layout not in LAYOUTS:
        raise DrafterImportError(f"unknown layout {layout!r}; one of auto, {', '.join(LAYOUTS)}")
    layer_cfg = cfg.get("transformer_layer_config") or {}
    flags = {k: cfg.get(k, layer_cfg.get(k)) for k in _UNSUPPORTED_FLAGS}
    if layout == "speculators" and "norm_before_residual" not in cfg:
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
    ids = _aux_ids(cfg, layout, int(tc.num_hidden_layers) if tc is not None else None, notes)
    c = _drafter_config(cfg, layout, tensors, ids, tc, notes)
    reduced = c.draft_vocab_size < c.vocab_size
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
    want = dict(required_shapes(c))
    if reduced:
        want.update({"d2t": (c.draft_vocab_size,), "t2d": (c.vocab_size,)})
    missing = [k for k in want if k not in tensors]
    unexpected = [k for k in tensors if k not in want]
    shapes = [f"{k} {list(tensors[k].shape)} ≠ {list(s)}" for k, s in want.items() if k in tensors and tuple(tensors[k].shape) != s]
    if missing or unexpected or shapes:
        raise DrafterImportError(f"{folder} ({layout}) does not load strictly: missing {missing}, unexpected {unexpected}"
                           + (f", shapes {shapes}" if shapes else ""))
    if reduced:
        try:
            check_maps(tensors["d2t"].long(), tensors["t2d"].bool(), c.vocab_size)
        except DataError as e:
            raise DrafterImportError(f"{folder}: {e}") from None
        tensors["d2t"], tensors["t2d"] = tensors["d2t"].long(), tensors["t2d"].bool()
    if tc is not None:
        _check_target(c, tc, folder)
    dtype = tensors["fc.weight"].dtype
    d = Eagle3Drafter(c).to(dtype)
    if not reduced:
        from .vocab import DraftVocab

        d.set_vocab(DraftVocab.full(c.vocab_size))
        tensors = {**tensors, "d2t": d.d2t, "t2d": d.t2d}
    d.load_state_dict(tensors, strict=True)
    prov = {k: v for k, v in (cfg.get("eagle3kit") or {}).items() if k not in ("version", "aux_layer_ids_convention")}
    if not prov:        # not written by eagle3kit (whose provenance block is kept as it is)
        prov = {**prov, "aux_layer_ids": {"convention": "hf_output_hidden_states_index", "ids": ids},
                "imported_from": {"layout": layout, "path": str(folder.resolve()), "notes": notes}}
    return Imported(d, layout, notes, prov)


def _check_target(c: DrafterConfig, tc, folder: Path) -> None:
    N = int(tc.num_hidden_layers)
    problems = []
    if c.vocab_size != int(tc.vocab_size):
        problems.append(f"vocab_size {c.vocab_size} ≠ the target's {tc.vocab_size}")
    if c.target_hidden_size != int(tc.hidden_size):
        problems.append(f"target hidden size {c.target_hidden_size} ≠ the target's {tc.hidden_size}")
    if c.hidden_size != int(tc.hidden_size):
        problems.append(f"drafter hidden size {c.hidden_size} ≠ the target's {tc.hidden_size} (a narrower drafter "
                        "needs its own embedding, which eagle3kit does not build)")
    if max(c.aux_layer_ids) > N - 1 or min(c.aux_layer_ids) < 1:
        problems.append(f"aux ids {c.aux_layer_ids} outside [1, {N - 1}] for a target of {N} layers")
    if problems:
        raise DrafterImportError(f"{folder} was made for another target: " + "; ".join(problems))


def run_import(source: str | Path, out_dir: str | Path, target, layout: str = "auto", overwrite: bool = False) -> dict:
    """``eagle3kit import``: read ``source`` (:func:`read_drafter`) and write the dual-engine folder
    to ``out_dir`` (:func:`eagle3kit.export.export_drafter`, same dtype); returns a summary.

    Raises:
        as :func:`read_drafter`; FileExistsError: ``out_dir`` holds a drafter and not ``overwrite``."""
    from .export import export_drafter

    out = Path(out_dir)
    if Path(source).resolve() == out.resolve():
        raise ConfigError("--out must differ from the source folder (import never overwrites its source)")
    imp = read_drafter(source, layout, target)
    export_drafter(imp.drafter, out, imp.provenance, overwrite=overwrite)
    c = imp.drafter.config
    return {"path": str(out), "layout": imp.layout, "aux_layer_ids": c.aux_layer_ids, "draft_vocab_size": c.draft_vocab_size,
            "vocab_size": c.vocab_size, "dtype": str(imp.drafter.fc.weight.dtype).replace("torch.", ""), "notes": imp.notes}
