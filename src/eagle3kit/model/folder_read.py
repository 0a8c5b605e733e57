"""Reading a drafter folder of any layout eagle3kit knows of the EAGLE-3 family (its own, speculators',
SpecForge's, EAGLE's): the layout detected from config.json, the weights renamed to eagle3kit's, the aux
ids, variant and vocabulary maps stated or inferred, every tensor checked strictly (read_drafter)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle3kit.core.config import ConfigError
from eagle3kit.core.rundir import DataError, load_safetensors
from eagle3kit.model.contract import (
    _UNSUPPORTED_FLAGS,
    LAYOUTS,
    DrafterFields,
    DrafterImportError,
    contract_mismatches,
    contract_shapes,
    drafter_fields,
    engine_variant,
)
from eagle3kit.model.draft_vocab import DraftVocab, check_maps
from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter
from eagle3kit.model.target import (
    default_aux_layer_ids,
    rope_conflict,
    rope_settings,
    same_rope,
    validate_aux_layer_ids,
)
from eagle3kit.model.target_files import load_target_config


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
        return load_safetensors(
            folder / "model.safetensors", "give the drafter's weights file"
        ), "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
            assert isinstance(wmap, dict)
        except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError):
            raise DrafterImportError(
                f"{index} is not a safetensors index (a JSON object with a weight_map object)"
            ) from None
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
                raise DrafterImportError(
                    f"{shard} holds {extra[:4]}, which {index.name} maps elsewhere or not at all"
                )
        return out, f"{len(loaded)} shards"
    if (folder / "pytorch_model.bin").is_file():
        try:
            sd = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:
            raise DataError(
                f"{folder / 'pytorch_model.bin'} is not a plain tensor state dict ({type(e).__name__}); "
                "convert it to safetensors first"
            ) from None
        if not isinstance(sd, dict):
            raise DrafterImportError(
                f"{folder / 'pytorch_model.bin'} holds a {type(sd).__name__}, not a name → tensor dict"
            )
        odd = [repr(k) for k, v in sd.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
        if odd:
            raise DrafterImportError(
                f"{folder / 'pytorch_model.bin'}: entries that are not named tensors: {odd[:6]}; "
                "save the drafter's state dict alone"
            )
        return dict(sd), "pytorch_model.bin"
    raise FileNotFoundError(
        f"{folder}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin"
    )


def detect_layout(cfg: dict, keys: set[str], source_file: str = "model.safetensors") -> str:
    """The source layout from its config, tensor names and weights file (see the module table)."""
    nested = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    layers0 = any(k.startswith(("layers.", "model.layers.")) for k in keys)
    if "speculators_model_type" in cfg or "speculators_config" in cfg:
        return "speculators"
    if any(k.startswith("eagle_module.") for k in keys) or {
        "use_input_layernorm_in_first_layer",
        "use_last_layernorm",
        "next_layer_regular",
    } & set(nested):
        return "modelopt"
    if cfg.get("eagle_aux_hidden_state_layer_ids"):
        return "eagle3kit"  # top-level ids in HF numbering: eagle3kit's (or any dual-engine) folder
    if nested.get("eagle_aux_hidden_state_layer_ids") is not None:
        return "modelopt" if layers0 else "specforge"
    if layers0:
        return "modelopt"
    return "eagle" if source_file == "pytorch_model.bin" else "specforge"


def _rename(tensors: dict[str, torch.Tensor], notes: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    if any(k.startswith("eagle_module.") for k in tensors):
        base = [k for k in tensors if not k.startswith("eagle_module.")]
        if base:
            notes.append(f"skipped {len(base)} base-model tensors stored beside eagle_module.*")
        tensors = {k[len("eagle_module.") :]: v for k, v in tensors.items() if k.startswith("eagle_module.")}
    renamed = 0
    for k, v in tensors.items():
        new = k[len("model.") :] if k.startswith("model.") else k
        if new.startswith("layers.0."):
            new = "midlayer." + new[len("layers.0.") :]
        elif new.startswith("layers."):
            raise DrafterImportError(
                f"{k}: a drafter with more than one decoder layer; eagle3kit trains and serves one"
            )
        if new in out:
            raise DrafterImportError(f"{k} and another tensor both become {new}")
        renamed += new != k
        out[new] = v
    if renamed:
        notes.append(f"renamed {renamed} tensors to the midlayer.* naming")
    return out


SPECFORGE_DEFAULT = (
    "SpecForge 0.2 captures the outputs of layers [1, N//2 − 1, N − 4] (HF indices [2, N//2, N − 3]) "
    "unless its run set model.aux_hidden_state_layer_ids"
)


def _aux_ids(
    f: DrafterFields,
    nested: list[int] | None,
    layout: str,
    num_layers: int | None,
    notes: list[str],
    given: list[int] | None = None,
) -> list[int]:
    """The HF-index aux ids: the ones the layout states, or ``given`` (which must equal them when
    both exist), or SafeAILab's hard-coded default; see the module docstring."""
    ids = _stated_aux_ids(f, nested, layout, num_layers, notes, given)
    if given is not None:
        if ids is not None and ids != list(given):
            raise DrafterImportError(
                f"--aux-layer-ids {list(given)} contradicts the ids the source states ({ids}, HF indices)"
            )
        if ids is None:
            notes.append(f"aux ids {list(given)} (HF indices) as given: the source states none")
        ids = list(given)
    if ids is None:
        if layout == "specforge":
            N = num_layers if num_layers is not None else "N"
            raise DrafterImportError(
                f"the source (a folder in SpecForge's layout; SpecForge's export --to hf writes none) states no aux "
                f"layer ids, and the layers its run captured cannot be read from the folder: {SPECFORGE_DEFAULT}; "
                f"for this target (N = {N}) give them, e.g. "
                + (
                    f"--aux-layer-ids {','.join(map(str, default_aux_layer_ids(num_layers)))}"
                    if num_layers
                    else "--aux-layer-ids 2,N//2,N-3 with --target"
                )
                + " when the run used SpecForge's default"
            )
        if num_layers is None:
            raise DrafterImportError(
                f"the {layout} source names no aux layer ids: give --target so the default layers "
                "(2, N//2, N−3) of the target's N layers can be used"
            )
        ids = list(default_aux_layer_ids(num_layers))
        notes.append(f"no aux ids in the source: EAGLE-3's default for {num_layers} layers, HF indices {ids}")
    if not ids:
        raise DrafterImportError(
            "the source's aux layer ids are an empty list: an EAGLE-3 drafter reads aux layers"
        )
    if ids != sorted(ids):
        notes.append(f"aux ids {ids} sorted to {sorted(ids)} (engines concatenate aux states in layer order)")
        ids = sorted(ids)
    if num_layers is not None:
        try:
            validate_aux_layer_ids(
                ids, num_layers, count=None
            )  # the engines read any number (fc takes n × hidden)
        except ConfigError as e:
            raise DrafterImportError(str(e)) from None
    return ids


def _stated_aux_ids(
    f: DrafterFields, nested: list[int] | None, layout: str, num_layers: int | None, notes: list[str], given
) -> list[int] | None:
    top = f.eagle_aux_hidden_state_layer_ids
    reads = {
        "eagle3kit": "top",
        "speculators": "top",
        "specforge": "nested",
        "modelopt": "nested",
        "eagle": None,
    }[layout]
    held = [w for w, ids in (("top", top), ("nested", nested)) if ids]
    if held and reads not in held:
        where = {
            "top": "top-level eagle_aux_hidden_state_layer_ids",
            "nested": "eagle_config.eagle_aux_hidden_state_layer_ids",
        }
        raise DrafterImportError(
            f"layout {layout} does not read {where[held[0]]}, which this source holds: the ids "
            "would be lost; use --layout auto or the layout that wrote the folder"
        )
    if reads == "top" and top:
        return list(top)
    if reads == "nested" and nested:
        ids = [int(i) + 1 for i in nested]
        notes.append(f"aux ids {list(nested)} (output of layer j, {layout}) → HF indices {ids}")
        return ids
    return None


def _drafter_config(
    f: DrafterFields, tensors: dict, ids: list[int], target_tc, notes: list[str], variant: dict
) -> DrafterConfig:
    H, heads = f.hidden_size, f.num_attention_heads
    fc, Ht = tensors.get("fc.weight"), f.target_hidden_size or f.hidden_size
    if fc is not None and fc.shape[1] != len(ids) * Ht:
        raise DrafterImportError(
            f"aux ids {ids} name {len(ids)} aux layers, but fc.weight takes {fc.shape[1]} inputs "
            f"({fc.shape[1] / Ht:g} × target hidden {Ht}): give the ids the drafter was trained on"
        )
    Vd = f.draft_vocab_size
    if Vd is None:
        if "lm_head.weight" not in tensors:
            raise DrafterImportError(
                "no draft_vocab_size in config.json and no lm_head.weight: the drafter has no head "
                "(an EAGLE-1 drafter, or a broken export)"
            )
        Vd = int(tensors["lm_head.weight"].shape[0])
    if Vd > f.vocab_size:
        raise DrafterImportError(f"draft_vocab_size {Vd} exceeds vocab_size {f.vocab_size}")
    if H % heads and f.head_dim is None:
        raise DrafterImportError(
            f"hidden_size {H} is not a multiple of num_attention_heads {heads}; give head_dim"
        )

    # read as the target's rope is read
    spelled = {
        "rope_parameters": f.rope_parameters,
        "rope_theta": f.rope_theta,
        "rope_scaling": f.rope_scaling,
    }
    twice = rope_conflict(spelled)
    if twice:
        raise DrafterImportError(
            f"the source's config: {twice}; keep the spelling the drafter was trained with"
        )
    own = rope_settings(spelled)
    rope_theta, rope_scaling = own["rope_theta"], own["rope_scaling"]
    mpe = f.max_position_embeddings or 2048
    if target_tc is not None:
        t_mpe = int(getattr(target_tc, "max_position_embeddings", mpe) or mpe)
        if t_mpe != mpe:
            notes.append(f"max_position_embeddings {mpe} → the target's {t_mpe}")
            mpe = t_mpe
        rope = rope_settings(target_tc)
        if not same_rope(own, rope):
            raise DrafterImportError(
                f"the source's rope (theta {rope_theta}, scaling {rope_scaling}) differs from the target's "
                f"(theta {rope['rope_theta']}, scaling {rope.get('rope_scaling')}): the drafter was "
                "trained with other positions than the target serves; retrain it for this target"
            )
    return DrafterConfig(
        hidden_size=H,
        intermediate_size=f.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=f.num_key_value_heads or heads,
        head_dim=f.head_dim or H // heads,
        rms_norm_eps=float(f.rms_norm_eps),
        vocab_size=f.vocab_size,
        draft_vocab_size=Vd,
        target_hidden_size=f.target_hidden_size or H,
        aux_layer_ids=ids,
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=mpe,
        hidden_act=f.hidden_act,
        **variant,
    )


def read_drafter(
    folder: str | Path, layout: str = "auto", target=None, aux_layer_ids: list[int] | None = None
) -> Imported:
    """Read the drafter in ``folder`` (any layout of the module table), strictly.

    Steps: config.json, the weights and their layout (:func:`_pick_layout`), renamed tensors,
    aux ids and config (checked against ``target`` when given), the vocab maps
    (:func:`_vocab_maps`), the strict load (:func:`_strict_weights`), the provenance.

    Args:
        layout: ``auto`` (detected from config and tensor names) or one of :data:`LAYOUTS`.
        target: a :class:`~eagle3kit.core.config.TargetConfig` (or None). Needed only when the source
            names no aux ids (SafeAILab; SpecForge/ModelOpt without ``eagle_config``); when given,
            the vocabulary, hidden size, layer count, aux ids and rope are checked against it.
        aux_layer_ids: HF indices of the aux layers the drafter was trained on, for a source that
            states none (SpecForge's export); they must equal the source's own when it states some.

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
    layout, found = _pick_layout(folder, cfg, f, set(raw), layout, source_file)
    notes = [f"read {source_file} as layout {layout}" + ("" if layout == found else f" (detected: {found})")]
    unread = unread_keys(cfg)
    if unread:
        notes.append(f"config.json keys no engine reads for this drafter, left out: {', '.join(unread)}")
    tensors = _rename(raw, notes)
    if "embed_tokens.weight" in tensors:
        tensors.pop("embed_tokens.weight")
        notes.append("dropped embed_tokens.weight (the engines use the target's embedding)")
    variant = _variant(folder, cfg, f, tensors, layout, notes)
    tc = load_target_config(target)[1] if target is not None else None
    ids = _aux_ids(
        f, nested, layout, int(tc.num_hidden_layers) if tc is not None else None, notes, aux_layer_ids
    )
    c = _drafter_config(f, tensors, ids, tc, notes, variant)
    _vocab_maps(folder, tensors, c, notes)
    weights = _strict_weights(folder, layout, tensors, c)
    if tc is not None:
        _check_target(c, tc, folder)
    d = Eagle3Drafter(c).to(next(iter(weights.values())).dtype)
    if c.draft_vocab_size >= c.vocab_size:  # a full vocabulary: identity maps
        d.set_vocab(DraftVocab.full(c.vocab_size))
        tensors = {**tensors, "d2t": d.d2t, "t2d": d.t2d}
    d.load_state_dict(tensors, strict=True)
    return Imported(d, layout, notes, _provenance(cfg, ids, layout, folder, notes))


#: config.json keys of a drafter folder that are read (by eagle3kit or an engine) besides DrafterFields'
_READ_KEYS = {
    "architectures", "model_type", "num_hidden_layers", "torch_dtype", "dtype", "tie_word_embeddings",
    "eagle3kit", "speculators_config", "transformer_layer_config", "text_config", "num_aux_hidden_states",
    "use_aux_hidden_state", "embed_tokens", "layer_types", "sliding_window", "use_sliding_window",
}  # fmt: skip


def unread_keys(cfg: dict) -> list[str]:
    """The keys of a drafter's ``config.json`` that neither eagle3kit nor the engines read (neither a
    drafter field, nor a key every transformers Llama config carries), sorted: listed when a folder is
    imported, whoever wrote it."""
    from transformers import LlamaConfig

    known = set(DrafterFields.model_fields) | _READ_KEYS | set(LlamaConfig().to_dict())
    nested = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    read_nested = {"eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state", "norm_before_fc"}
    return sorted(
        [k for k in cfg if k not in known] + [f"eagle_config.{k}" for k in nested if k not in read_nested]
    )


def _variant(folder: Path, cfg: dict, f: DrafterFields, tensors: dict, layout: str, notes: list[str]) -> dict:
    """The source's variant flags as the engine reads them (:func:`engine_variant`), SpecForge's
    ``norm_output`` translated (module docstring), ``mask_hidden`` shaped [1, 1, 3·Ht] (in place)."""
    variant, vnotes = engine_variant(cfg, f, set(tensors), str(folder / "config.json"))
    notes += vnotes
    if layout == "specforge" and f.norm_output is not None and not isinstance(cfg.get("eagle3kit"), dict):
        if not f.norm_output:
            raise DrafterImportError(
                f"{folder}: norm_output: false in a folder of SpecForge's layout means logits without the final norm "
                "(SpecForge's reading); eagle3kit's drafter (like vLLM's) applies it before lm_head"
            )
        variant["norm_output"] = False
        notes.append(
            "norm_output: true is SpecForge 0.2's default (final norm before lm_head, pre-norm output fed back); "
            "vLLM reads it as post-norm feedback, so the folder as it is would serve another network: imported "
            "with norm_output false, the network SpecForge trained"
        )
    mh = tensors.get("mask_hidden")
    if mh is not None:
        n = len(f.eagle_aux_hidden_state_layer_ids or []) or 3
        Ht3 = n * (f.target_hidden_size or f.hidden_size)
        if mh.numel() != Ht3:
            raise DrafterImportError(
                f"mask_hidden has {mh.numel()} values, not {n} aux × target hidden = {Ht3}"
            )
        tensors["mask_hidden"] = mh.reshape(1, 1, Ht3)
    on = {k: v for k, v in variant.items() if v}
    if on:
        notes.append(
            "drafter variant: "
            + ", ".join(
                "P-EAGLE (parallel drafting)"
                if k == "parallel_drafting"
                else f"{k} {v}"
                if k == "mask_token_id"
                else k
                for k, v in on.items()
            )
        )
    return variant


def _pick_layout(
    folder: Path, cfg, f: DrafterFields, names: set[str], layout: str, source_file: str = "model.safetensors"
) -> tuple[str, str]:
    """``(layout used, layout detected)``; refuses an unknown layout, a speculators mismatch and a
    variant eagle3kit does not implement (biases)."""
    found = detect_layout(cfg, names, source_file)
    if layout == "auto":
        layout = found
    elif layout not in LAYOUTS:
        raise DrafterImportError(f"unknown layout {layout!r}; one of auto, {', '.join(LAYOUTS)}")
    elif (layout == "speculators") != (found == "speculators"):
        raise DrafterImportError(
            f"{folder} is {'not ' if layout == 'speculators' else ''}in the speculators layout "
            f"(detected: {found}); use --layout auto"
        )
    on = [k for k in _UNSUPPORTED_FLAGS if getattr(f, k)]
    if on:
        raise DrafterImportError(
            f"{folder}: {', '.join(f'{k}: true' for k in on)} — a drafter variant eagle3kit does not "
            "implement (its drafters have no biases)"
        )
    return layout, found


def _vocab_maps(folder: Path, tensors: dict, c: DrafterConfig, notes: list[str]) -> None:
    """In place: refuse non-integer maps, synthesize ``t2d`` from ``d2t`` when absent, drop all-zero
    maps of a full vocabulary (refuse non-zero ones)."""
    reduced = c.draft_vocab_size < c.vocab_size
    for k, want_dtype in (("d2t", "an integer"), ("t2d", "a bool or integer")):
        t = tensors.get(k)
        if t is not None and (t.dtype.is_floating_point or t.dim() != 1):
            raise DrafterImportError(
                f"{k} must be a 1-D {want_dtype} tensor, got {t.dtype} of shape {list(t.shape)}"
            )
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
                raise DrafterImportError(
                    f"{folder}: draft vocab = target vocab but d2t is not all zero offsets"
                )


def _strict_weights(folder: Path, layout: str, tensors: dict, c: DrafterConfig) -> dict:
    """Every tensor against the contract (none missing, none left over, every shape), one float
    dtype, finite values, valid maps (cast in place to int64/bool); returns the weights (no maps)."""
    want = contract_shapes(c)
    missing, unexpected, misshapen = contract_mismatches(
        {k: tuple(v.shape) for k, v in tensors.items()}, want
    )
    shapes = [f"{k} {list(tensors[k].shape)} ≠ {list(want[k])}" for k in misshapen]
    if missing or unexpected or shapes:
        raise DrafterImportError(
            f"{folder} ({layout}) does not load strictly: missing {missing}, unexpected {unexpected}"
            + (f", shapes {shapes}" if shapes else "")
        )
    weights = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
    dtypes = {str(v.dtype) for v in weights.values()}
    if len(dtypes) != 1 or not next(iter(weights.values())).dtype.is_floating_point:
        raise DrafterImportError(f"weights must share one floating-point dtype, got {sorted(dtypes)}")
    bad = [k for k, v in weights.items() if not bool(torch.isfinite(v).all())]
    if bad:
        raise DrafterImportError(f"non-finite values (NaN or inf) in {bad[:6]}")
    if c.draft_vocab_size < c.vocab_size:
        try:
            check_maps(tensors["d2t"].long(), tensors["t2d"].bool(), c.vocab_size)
        except DataError as e:
            raise DrafterImportError(f"{folder}: {e}") from None
        tensors["d2t"], tensors["t2d"] = tensors["d2t"].long(), tensors["t2d"].bool()
    return weights


def _provenance(cfg: dict, ids: list[int], layout: str, folder: Path, notes: list[str]) -> dict:
    """eagle3kit's own provenance block as written (its trained aux ids must equal the config's),
    or, for another tool's drafter, where it was imported from."""
    block = cfg.get("eagle3kit") if isinstance(cfg.get("eagle3kit"), dict) else {}
    prov = {k: v for k, v in block.items() if k not in ("version", "aux_layer_ids_convention")}
    trained = (
        (prov.get("aux_layer_ids") or {}).get("ids") if isinstance(prov.get("aux_layer_ids"), dict) else None
    )
    if trained is not None and list(trained) != ids:
        raise DrafterImportError(
            f"config aux ids {ids} but its eagle3kit block says the features were trained on {trained}; "
            f"set eagle_aux_hidden_state_layer_ids to {trained}"
        )
    if not prov:  # not written by eagle3kit (whose provenance block is kept as it is)
        prov = {
            "aux_layer_ids": {"convention": "hf_output_hidden_states_index", "ids": ids},
            "imported_from": {"layout": layout, "path": str(folder.resolve()), "notes": notes},
        }
    return prov


def _check_target(c: DrafterConfig, tc, folder: Path) -> None:
    """Widths and vocabulary against the target (the aux ids were checked by :func:`_aux_ids`)."""
    problems = []
    if c.vocab_size != int(tc.vocab_size):
        problems.append(f"vocab_size {c.vocab_size} ≠ the target's {tc.vocab_size}")
    if c.target_hidden_size != int(tc.hidden_size):
        problems.append(f"target hidden size {c.target_hidden_size} ≠ the target's {tc.hidden_size}")
    if c.hidden_size != int(tc.hidden_size):
        problems.append(
            f"drafter hidden size {c.hidden_size} ≠ the target's {tc.hidden_size} (a narrower drafter "
            "needs its own embedding, which eagle3kit does not build)"
        )
    if problems:
        raise DrafterImportError(f"{folder} was made for another target: " + "; ".join(problems))
