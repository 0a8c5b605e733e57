"""The drafter-folder contract (docs/conventions.md): what vLLM (≥ 0.10) and SGLang (≥ 0.5) need to find
in a drafter folder, in one place.

* tensor names and shapes (:func:`required_shapes`, :func:`contract_shapes`,
  :func:`validate_tensors`): no ``model.`` prefix, ``fc.weight [H, 3·Ht]``,
  ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
  ``midlayer.self_attn.{q,k,v}_proj.weight [*, 2H]``, ``midlayer.self_attn.o_proj.weight``,
  ``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight [Vd, H]``, and only
  when Vd < V: ``d2t`` int64 [Vd] (offsets) and ``t2d`` bool [V]. Never ``embed_tokens`` (the
  drafter borrows the target's);
* ``config.json`` fields for the dual-engine layout (:func:`engine_config`, aux ids in both
  numberings) and for vLLM's speculators layout (:func:`speculators_config`);
* the fields read from any tool's ``config.json`` (:class:`DrafterFields`, :func:`drafter_fields`),
  strictly typed, with the variants eagle3kit does not implement refused by name.

Reading and writing whole folders is :mod:`eagle3kit.model.folder`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError

from eagle3kit import __version__
from eagle3kit.model.draft_vocab import check_maps
from eagle3kit.model.drafter import DrafterConfig


class ExportError(ValueError):
    """A drafter that would load wrongly or silently in an engine; the message names the key."""


def required_shapes(c: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the engines create for this config, with its shape (d2t/t2d excluded): the
    EAGLE-3 drafter's (``fc.weight [H, n·Ht]`` for n = the config's aux ids, 3 when it has none), plus per
    variant ``input_norm.weight [n·Ht]`` (norm_before_fc), ``fc_norm.{0…n−1}.weight [Ht]`` (fc_norm) and
    ``mask_hidden [1, 1, n·Ht]`` (parallel drafting; vLLM reads any shape of n·Ht values, speculators this one)."""
    H, inter, d, Ht = c.hidden_size, c.intermediate_size, c.head_dim, c.target_hidden_size
    n = len(c.aux_layer_ids) or 3  # aux states concatenated into fc: 3 for what eagle3kit trains
    variant: dict[str, tuple[int, ...]] = {}
    if c.norm_before_fc:
        variant["input_norm.weight"] = (n * Ht,)
    if c.fc_norm:
        variant |= {f"fc_norm.{i}.weight": (Ht,) for i in range(n)}
    if c.parallel_drafting:
        variant["mask_hidden"] = (1, 1, n * Ht)
    return variant | {
        "fc.weight": (H, n * c.target_hidden_size),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (c.num_attention_heads * d, 2 * H),
        "midlayer.self_attn.k_proj.weight": (c.num_key_value_heads * d, 2 * H),
        "midlayer.self_attn.v_proj.weight": (c.num_key_value_heads * d, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, c.num_attention_heads * d),
        "midlayer.mlp.gate_proj.weight": (inter, H),
        "midlayer.mlp.up_proj.weight": (inter, H),
        "midlayer.mlp.down_proj.weight": (H, inter),
        "norm.weight": (H,),
        "lm_head.weight": (c.draft_vocab_size, H),
    }


def contract_shapes(c: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """:func:`required_shapes` plus ``d2t`` [Vd] and ``t2d`` [V] when Vd < V: every tensor of an export."""
    want = required_shapes(c)
    if c.draft_vocab_size < c.vocab_size:
        want = {**want, "d2t": (c.draft_vocab_size,), "t2d": (c.vocab_size,)}
    return want


def contract_mismatches(
    shapes: dict[str, tuple], want: dict[str, tuple]
) -> tuple[list[str], list[str], list[str]]:
    """Tensor names against a contract: ``(missing, unexpected, misshapen)``, each in order (the
    contract's for missing and misshapen, ``shapes``' for unexpected)."""
    missing = [k for k in want if k not in shapes]
    misshapen = [k for k, s in want.items() if k in shapes and tuple(shapes[k]) != tuple(s)]
    return missing, [k for k in shapes if k not in want], misshapen


def validate_tensors(tensors: dict[str, torch.Tensor], c: DrafterConfig) -> None:
    """Refuse a missing, misshapen or stray tensor and broken vocab maps (docs/conventions.md).

    Raises:
        ExportError: listing every problem found.
    """
    want = contract_shapes(c)
    reduced = c.draft_vocab_size < c.vocab_size
    missing, unexpected, misshapen = contract_mismatches(
        {k: tuple(v.shape) for k, v in tensors.items()}, want
    )
    problems = [f"missing {name} (the engine would create it empty)" for name in missing]
    problems += [
        f"{name} has shape {tuple(tensors[name].shape)}, expected {want[name]}" for name in misshapen
    ]
    problems += [
        f"unexpected tensor {name}"
        + (" (the drafter borrows the target's embedding)" if "embed" in name else "")
        for name in unexpected
    ]
    if reduced and "d2t" in tensors and "t2d" in tensors and not problems:
        if tensors["d2t"].dtype != torch.int64 or tensors["t2d"].dtype != torch.bool:
            problems.append(
                f"d2t must be int64 and t2d bool, got {tensors['d2t'].dtype}/{tensors['t2d'].dtype}"
            )
        else:
            try:
                check_maps(tensors["d2t"], tensors["t2d"], c.vocab_size)
            except ValueError as e:
                problems.append(str(e))
    problems += [
        f"{name} holds non-finite values (NaN or inf): the engine would draft garbage from it"
        for name, t in tensors.items()
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]
    if problems:
        raise ExportError("drafter export refused:\n  " + "\n  ".join(problems))


def variant_fields(c: DrafterConfig, speculators_peagle: bool = False) -> dict:
    """The config fields of the variant flags, every one written out, false included (engines'
    defaults for a missing flag differ), under the names vLLM's ``llama_eagle3.py`` reads
    (``norm_before_fc``, ``fc_norm``, ``norm_output``; a speculators ``peagle`` config only the flags its
    reader copies, ``norm_before_fc``), and for parallel drafting ``mask_token_id`` (vLLM's proposer reads
    it as the mask slots' token) and ``parallel_drafting: true`` (not read by vLLM, which takes it from the
    speculative config: it tells a reader, and eagle3kit's launch helpers, how to serve the folder).
    ``norm_before_residual`` is written by the callers, always (vLLM's speculators path assumes true)."""
    names = ("norm_before_fc",) if speculators_peagle else ("norm_before_fc", "fc_norm", "norm_output")
    out: dict = {k: bool(getattr(c, k)) for k in names}
    if c.parallel_drafting:
        out |= {"parallel_drafting": True, "mask_token_id": c.mask_token_id}
    return out


def engine_config(c: DrafterConfig, torch_dtype: str, provenance: dict | None = None) -> dict:
    """``config.json`` for the dual-engine layout. Aux ids twice: top-level in vLLM numbering
    (= HF index) and nested ``eagle_config`` in SGLang numbering (HF index − 1); the variant's
    fields (:func:`variant_fields`)."""
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "norm_before_residual": c.norm_before_residual,
        **variant_fields(c),
        "torch_dtype": torch_dtype,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        **({"num_aux_hidden_states": len(c.aux_layer_ids)} if len(c.aux_layer_ids) != 3 else {}),
        "eagle_config": {
            "use_aux_hidden_state": True,
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in c.aux_layer_ids],
        },
        "eagle3kit": {
            "version": __version__,
            "aux_layer_ids_convention": "top-level: HF output_hidden_states index "
            "(= vLLM); eagle_config: output of layer j (= SGLang/SpecForge, HF index - 1)",
            # the network trained, so `check` can tell when the flags an engine reads say otherwise
            "drafter_variant": c.variant(),
            **(provenance or {}),
        },
    }
    return cfg


FORMATS = ("dual", "speculators")


SPECULATORS_LAYER_PREFIX = "layers.0."  # speculators (and vLLM internally) name the decoder layer so
#: the Llama layer's fields a speculators ``transformer_layer_config`` holds
SPECULATORS_LAYER_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "vocab_size",
    "num_hidden_layers",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "torch_dtype",
)


def speculators_config(
    c: DrafterConfig,
    torch_dtype: str,
    verifier: dict,
    num_speculative_tokens: int = 3,
    provenance: dict | None = None,
) -> dict:
    """``config.json`` for vLLM's speculators layout (docs/conventions.md): no top-level ``model_type``;
    ``transformer_layer_config`` holds the Llama layer; aux ids top-level in vLLM numbering (HF
    index); ``norm_before_residual`` written out, false included (vLLM assumes true when it is
    missing); the variant's flags by name; a parallel-drafting drafter as speculators'
    ``peagle`` type with its ``mask_token_id`` (vLLM reads it as ``pard_token``).

    Args:
        verifier: ``{"name_or_path": str, "architectures": [str]}`` — the target.
        num_speculative_tokens: K of the default greedy proposal method.
    Raises:
        ExportError: a parallel-drafting drafter with ``fc_norm`` (vLLM 0.32's ``peagle`` reader
        drops the field: it would serve another network; export the dual layout).
    """
    if c.parallel_drafting and c.fc_norm:
        raise ExportError(
            "a P-EAGLE drafter with fc_norm cannot be written in the speculators layout: vLLM's reader of "
            "speculators' peagle type ignores fc_norm; export the dual layout (--format dual)"
        )
    dual = engine_config(c, torch_dtype)
    kind = "peagle" if c.parallel_drafting else "eagle3"
    flags = {
        k: v
        for k, v in variant_fields(c, speculators_peagle=c.parallel_drafting).items()
        if k != "parallel_drafting"
    }
    layer = {k: dual[k] for k in SPECULATORS_LAYER_KEYS}
    return {
        "architectures": ["PEagleSpeculator" if c.parallel_drafting else "Eagle3Speculator"],
        "speculators_model_type": kind,
        "transformer_layer_config": {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            **layer,
            # vLLM's speculators reader sizes fc for 3 aux states unless the layer config says otherwise
            **({"num_aux_hidden_states": len(c.aux_layer_ids)} if len(c.aux_layer_ids) != 3 else {}),
        },
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "norm_before_residual": c.norm_before_residual,
        **flags,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "torch_dtype": torch_dtype,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens)}
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier["name_or_path"],
                "architectures": list(verifier["architectures"]),
            },
        },
        "eagle3kit": {
            **dual["eagle3kit"],
            "aux_layer_ids_convention": "HF output_hidden_states index (= vLLM)",
            **(provenance or {}),
        },
    }


LAYOUTS = ("eagle3kit", "eagle", "specforge", "speculators", "modelopt")


_UNSUPPORTED_FLAGS = ("attention_bias", "mlp_bias", "bias")


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
    parallel_drafting: StrictBool | None = None
    mask_token_id: Annotated[StrictInt, Field(ge=0)] | None = None
    ptd_token_id: Annotated[StrictInt, Field(ge=0)] | None = None
    pard_token: Annotated[StrictInt, Field(ge=0)] | None = None
    speculators_model_type: str | None = None
    transformers_version: str | None = None
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
                raise DrafterImportError(
                    f"{where}: {inner} must be a JSON object, got {type(cfg[inner]).__name__}"
                )
            merged = {**cfg[inner], **{k: v for k, v in cfg.items() if k != inner}}
            if "vocab_size" not in cfg and "vocab_size" in cfg[inner]:
                merged["vocab_size"] = cfg[inner]["vocab_size"]
    try:
        f = DrafterFields.model_validate(merged)
    except ValidationError as e:
        bad = "; ".join(
            f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']} (got {str(err.get('input'))[:40]!r})"
            for err in e.errors()
        )
        raise DrafterImportError(f"{where}: {bad}") from None
    nested = None
    if f.eagle_config is not None:
        nested = f.eagle_config.get("eagle_aux_hidden_state_layer_ids")
        if nested is not None and (not isinstance(nested, list) or not all(type(i) is int for i in nested)):
            raise DrafterImportError(
                f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids must be a list of ints, "
                f"got {nested!r}"
            )
    return f, nested


def served_config(cfg: dict, where: str) -> dict:
    """The config vLLM 0.32 builds a drafter from: the folder's ``config.json`` itself, or for
    speculators' layout its ``transformer_layer_config`` updated with the top-level fields vLLM's
    reader for the type copies (``update_eagle3``: ``norm_before_residual``, default true,
    ``norm_before_fc``, ``fc_norm``, ``norm_output``; ``update_peagle``: ``norm_before_residual``,
    default false, ``norm_before_fc``, and ``mask_token_id`` as ``pard_token``). A field anywhere
    else is not read.

    Raises:
        DrafterImportError: a ``peagle`` config without a top-level ``mask_token_id`` (vLLM fails to
        load it)."""
    kind = cfg.get("speculators_model_type")
    if kind is None:
        return cfg
    pre = dict(cfg.get("transformer_layer_config") or {})
    if kind == "peagle":
        if "mask_token_id" not in cfg:
            raise DrafterImportError(
                f"{where}: a speculators peagle config without a top-level mask_token_id: vLLM's reader fails on it"
            )
        pre |= {
            "norm_before_residual": cfg.get("norm_before_residual", False),
            "norm_before_fc": cfg.get("norm_before_fc", False),
            "pard_token": cfg["mask_token_id"],
        }
    else:
        pre |= {
            "norm_before_residual": cfg.get("norm_before_residual", True),
            "norm_before_fc": cfg.get("norm_before_fc", False),
            "fc_norm": cfg.get("fc_norm", False),
            "norm_output": cfg.get("norm_output", False),
        }
    return pre


def _flag(cfg: dict, key: str, where: str, default: bool = False) -> bool:
    v = cfg.get(key, default)
    if not isinstance(v, bool):
        raise DrafterImportError(f"{where}: {key} must be true or false, got {v!r}")
    return v


def engine_variant(cfg: dict, f: DrafterFields, tensors: set[str], where: str) -> tuple[dict, list[str]]:
    """The variant flags (:class:`~eagle3kit.model.drafter.DrafterConfig` keyword arguments) a
    drafter folder is served with, read from :func:`served_config` as vLLM 0.32's
    ``llama_eagle3.py`` and proposer read them, and notes on what was inferred:

    * ``norm_before_residual``, ``fc_norm``, ``norm_output``: the fields (missing: false);
    * ``norm_before_fc``: ``eagle_config.norm_before_fc``, else the field;
    * parallel drafting: a ``mask_hidden`` tensor, ``parallel_drafting: true`` or speculators'
      ``peagle`` type, the mask token from ``mask_token_id``, ``pard_token`` or ``ptd_token_id`` (the
      proposer's order), inside the target vocabulary.

    Raises:
        DrafterImportError: a flag that is not true/false, both norms before fc, a parallel drafter
        without its mask token or ``mask_hidden`` or with ``parallel_drafting: false`` written, a
        mask token outside the vocabulary."""
    notes: list[str] = []
    if f.speculators_model_type == "eagle3" and f.norm_before_residual is None:
        notes.append("no norm_before_residual in a speculators config: true, as vLLM reads it")
    pre = served_config(cfg, where)
    nested = pre.get("eagle_config") if isinstance(pre.get("eagle_config"), dict) else {}
    for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):  # one value, or refused
        if key in nested and key in pre and _flag(nested, key, where) != _flag(pre, key, where):
            raise DrafterImportError(
                f"{where}: eagle_config.{key} is {str(nested[key]).lower()} and the top-level {key} is "
                f"{str(pre[key]).lower()}: engines read one or the other (vLLM the nested one for norm_before_fc); "
                "write one value in both places"
            )
    for key in ("norm_before_residual", "fc_norm", "norm_output"):  # vLLM reads these at the top level only
        if key in nested and key not in pre and _flag(nested, key, where):
            notes.append(
                f"eagle_config.{key} is true but no engine reads it there (vLLM reads the top-level {key}): "
                f"the drafter is served without it; if it was trained with it, write {key}: true at the top level"
            )
    top_nbf = _flag(pre, "norm_before_fc", where)
    nbf = _flag(nested, "norm_before_fc", where, top_nbf) if "norm_before_fc" in nested else top_nbf
    flags = {
        "norm_before_residual": _flag(pre, "norm_before_residual", where),
        "norm_before_fc": nbf,
        "fc_norm": _flag(pre, "fc_norm", where),
        "norm_output": _flag(pre, "norm_output", where),
    }
    if flags["norm_before_fc"] and flags["fc_norm"]:
        raise DrafterImportError(
            f"{where}: norm_before_fc and fc_norm are both true; a drafter has one or neither"
        )
    token = next(
        (pre.get(k) for k in ("mask_token_id", "pard_token", "ptd_token_id") if pre.get(k) is not None), None
    )
    written = pre.get("parallel_drafting")
    if written is False and "mask_hidden" in tensors:
        raise DrafterImportError(
            f"{where}: parallel_drafting: false, but the folder holds a P-EAGLE mask_hidden; write true "
            '(and serve with "parallel_drafting": true) or drop the tensor'
        )
    if not ("mask_hidden" in tensors or written is True or f.speculators_model_type == "peagle"):
        return flags, notes
    if token is None or "mask_hidden" not in tensors:
        lacks = [
            x
            for x, ok in (
                ("a mask token id (mask_token_id)", token is not None),
                ("mask_hidden", "mask_hidden" in tensors),
            )
            if not ok
        ]
        raise DrafterImportError(
            f"{where}: a parallel-drafting (P-EAGLE) drafter needs a mask token id and the mask_hidden tensor; "
            f"this folder lacks {' and '.join(lacks)}"
        )
    if type(token) is not int or not 0 <= token < f.vocab_size:
        raise DrafterImportError(
            f"{where}: mask token id {token!r} is not a token of the target's vocabulary of {f.vocab_size}"
        )
    return flags | {"parallel_drafting": True, "mask_token_id": token, "norm_output": False}, notes
