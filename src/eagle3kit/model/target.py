"""The target model: loading, the part resolver, aux-layer ids and feature capture (docs/families.md;
docs/conventions.md).

Layer-id convention (one, everywhere): a layer id is the Hugging Face ``output_hidden_states``
index. Index 0 is the embedding output; index i (1 ≤ i < N) is the residual stream *entering*
decoder layer i, before any norm. Capture is by forward pre-hooks on the resolved decoder layers,
never by asking for all N+1 hidden states.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import nn

from eagle3kit.core.config import ConfigError, TargetConfig
from eagle3kit.core.kinds import kind_for_variant
from eagle3kit.model.target_files import (
    FINGERPRINT_FORMAT,
    fp32_export_of,
    language_model_plan,
    load_target_config,
    load_tokenizer,
    locate_target,
    located_fingerprint,
    text_config,
)


def pick_device(name: str = "auto") -> torch.device:
    """``auto`` → CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device {name!r} is not a torch device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r}: this machine has no CUDA GPU usable by torch; use auto or cpu")
    return dev


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default aux layers as HF indices: ``(2, N//2, N-3)`` (docs/conventions.md, layer ids)."""
    return (2, num_layers // 2, num_layers - 3)


def validate_aux_layer_ids(ids: Sequence[int], num_layers: int, count: int | None = 3) -> tuple[int, ...]:
    """Check aux ids (HF indices) against a target with ``num_layers`` decoder layers.

    They must be ``count`` of them (3, what eagle3kit trains; None: any number, as an imported
    drafter may have), distinct, ascending and inside [1, N−1].

    Raises:
        ConfigError: naming the offending ids (for example a 4-layer target's default (2, 2, 1)).
    """
    ids = tuple(int(i) for i in ids)
    if count is not None and len(ids) != count:
        raise ConfigError(f"target.aux_layer_ids must hold {count} layer ids, got {list(ids)}")
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ConfigError(
            f"aux layer ids {list(ids)} collide (id {dup} repeated) for a target with {num_layers} layers; "
            f"set target.aux_layer_ids to 3 distinct HF indices in [1, {num_layers - 1}]"
        )
    bad = [i for i in ids if not 1 <= i <= num_layers - 1]
    if bad:
        raise ConfigError(
            f"aux layer ids {bad} are outside [1, {num_layers - 1}] for a target with {num_layers} layers "
            f"(HF index N={num_layers} is after the final norm and is not an aux state; 0 is the embedding)"
        )
    if list(ids) != sorted(ids):
        raise ConfigError(
            f"aux layer ids {list(ids)} must be sorted ascending (the fc input order); write {sorted(ids)}"
        )
    return ids


def resolve_aux_layer_ids(cfg: TargetConfig, num_layers: int, drafter=None) -> tuple[int, ...]:
    """The aux ids in HF numbering from the config (default when unset), validated. ``drafter``: the
    run's ``drafter`` section; its kind may read its own layers by default
    (:meth:`eagle3kit.core.kinds.DrafterKind.default_aux_layer_ids`) and any number of them.

    Raises:
        ConfigError: ids outside the target, unsorted, or not as many as the drafter kind reads."""
    kind = kind_for_variant(drafter.variant) if drafter is not None else None
    own = kind.default_aux_layer_ids(drafter, num_layers) if kind is not None else None
    if cfg.aux_layer_ids is None and own is not None:
        return validate_aux_layer_ids(own, num_layers, count=None)
    if cfg.aux_layer_ids is None:
        ids: Sequence[int] = default_aux_layer_ids(num_layers)
    elif cfg.aux_layer_convention == "output_of_layer":
        ids = [i + 1 for i in cfg.aux_layer_ids]
    else:
        ids = cfg.aux_layer_ids
    return validate_aux_layer_ids(ids, num_layers, count=kind.aux_count if kind is not None else 3)


def rope_settings(src) -> dict:
    """The effective rope of a config (a config object or a ``config.json`` dict), read as transformers 5
    (which vLLM builds its configs with) reads it: ``rope_scaling`` when it is a non-empty dict, else
    ``rope_parameters``, taken whole (the two are never merged); ``rope_theta`` inside it over the
    top-level one (10,000 when none says); a top-level ``partial_rotary_factor`` added when the dict has
    none (1.0, the whole head, counts as none); the legacy ``type`` key read as ``rope_type``; a
    ``default`` type with no other field is no scaling (None). Values are kept as written (compare with
    :func:`same_rope`; a config that spells the rope twice, differently, is named by :func:`rope_conflict`).

    Returns:
        ``{"rope_theta": float, "rope_scaling": dict | None}``."""
    get = src.get if isinstance(src, dict) else (lambda key: getattr(src, key, None))
    scaling, params = get("rope_scaling"), get("rope_parameters")
    chosen = scaling if isinstance(scaling, dict) and scaling else params
    merged: dict = dict(chosen) if isinstance(chosen, dict) else {}
    theta = merged.pop("rope_theta", None)
    if theta is None:
        theta = get("rope_theta")
    partial = get("partial_rotary_factor")
    if isinstance(partial, (int, float)) and not isinstance(partial, bool):
        merged.setdefault("partial_rotary_factor", partial)
    if merged.get("partial_rotary_factor") == 1.0:
        merged.pop("partial_rotary_factor")
    if "type" in merged:
        legacy = merged.pop("type")
        merged.setdefault("rope_type", legacy)
    if merged.get("rope_type", "default") == "default" and set(merged) <= {"rope_type"}:
        merged = {}
    return {"rope_theta": float(theta if theta is not None else 10000.0), "rope_scaling": merged or None}


def rope_conflict(config: dict) -> str | None:
    """A message when ``config`` spells its rope in both ``rope_scaling`` and ``rope_parameters`` and the
    two give different positions (transformers reads ``rope_scaling`` and drops the other, so what is
    served depends on which spelling a tool honours); None otherwise."""
    scaling, params = config.get("rope_scaling"), config.get("rope_parameters")
    if not (isinstance(scaling, dict) and scaling and isinstance(params, dict) and params):
        return None
    rest = {k: v for k, v in config.items() if k not in ("rope_scaling", "rope_parameters")}
    a = rope_settings({**rest, "rope_scaling": scaling})
    b = rope_settings({**rest, "rope_parameters": params})
    if same_rope(a, b):
        return None
    return (
        f"rope_scaling {scaling} and rope_parameters {params} give different ropes; transformers (and vLLM) read "
        "rope_scaling and drop rope_parameters"
    )


def same_rope(a: dict, b: dict) -> bool:
    """Whether two :func:`rope_settings` results give the same positions (numbers compared as floats:
    ``factor: 8`` and ``8.0`` are one rope)."""

    def key(r: dict) -> tuple:
        sc = r.get("rope_scaling") or {}
        norm = {
            k: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
            for k, v in sc.items()
        }
        return float(r["rope_theta"]), tuple(sorted(norm.items(), key=lambda kv: kv[0]))

    return key(a) == key(b)


@dataclass
class TargetParts:
    """What the drafter pipeline needs from a target, found through any wrapper."""

    decoder: nn.Module  # the module whose forward runs embedding → layers → final norm
    layers: nn.ModuleList  # decoder layers, length N
    embed: nn.Embedding  # token embedding [V, Ht]
    final_norm: nn.Module
    lm_head: nn.Module  # Linear(Ht → V)


_DECODER_PATHS = (
    "model",
    "model.language_model",
    "language_model.model",
    "language_model",
    "transformer",
    "model.model",
)


def _get(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def resolve_parts(model: nn.Module) -> TargetParts:
    """Find decoder layers, embedding, final norm and lm_head through wrappers
    (``model``, ``model.language_model``, ``language_model.model`` …).

    Raises:
        ConfigError: when no candidate holds a ``layers`` list with ``norm`` and an embedding.
    """
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for path in _DECODER_PATHS:
        dec = _get(model, path)
        if dec is None:
            continue
        layers = getattr(dec, "layers", None) or getattr(dec, "h", None)
        norm = getattr(dec, "norm", None) or getattr(dec, "ln_f", None)
        embed = getattr(dec, "embed_tokens", None) or getattr(dec, "wte", None)
        if isinstance(layers, nn.ModuleList) and norm is not None and embed is not None:
            head = lm_head if lm_head is not None else _get(model, "language_model.lm_head")
            if head is None:
                head = _get(model, "lm_head")
            if head is None:
                raise ConfigError(f"{type(model).__name__}: found the decoder at .{path} but no lm_head")
            return TargetParts(decoder=dec, layers=layers, embed=embed, final_norm=norm, lm_head=head)
    raise ConfigError(
        f"{type(model).__name__}: cannot find the decoder layers (looked under {', '.join(_DECODER_PATHS)}); "
        "this target layout is not supported yet"
    )


@dataclass
class Target:
    """A loaded target with its resolved parts and provenance.

    ``model``: the causal LM; ``tokenizer``: its tokenizer (with chat template);
    ``source``: where it came from (``model`` string, path, GGUF file, content hash).
    """

    model: nn.Module
    tokenizer: object
    parts: TargetParts
    source: dict = field(default_factory=dict)

    @property
    def config(self):
        return text_config(self.model.config)

    @property
    def num_layers(self) -> int:
        return len(self.parts.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.parts.lm_head.weight.shape[0])

    @property
    def device(self) -> torch.device:
        return self.parts.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.parts.lm_head.weight.dtype

    def end_of_turn_ids(self) -> list[int]:
        """Token ids that end an assistant turn (the tokenizer's EOS and the generation config's)."""
        ids: set[int] = set()
        tok = self.tokenizer
        if getattr(tok, "eos_token_id", None) is not None:
            ids.add(int(tok.eos_token_id))
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(i) for i in eos)
        return sorted(ids)


_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


_TIED_HEAD = {"lm_head.weight"}


def load_target(cfg: TargetConfig, device: str | torch.device | None = None) -> Target:
    """Load the target causal LM and tokenizer in ``cfg.dtype`` on ``device`` (``cfg.device``).

    A wrapper (Kimi-K2.5 in its hub or transformers layout, any class whose text model sits in a
    ``text_config``) loads as its language model alone, through :func:`language_model_plan`:
    the vision tower's weights never enter memory. No remote code runs unless
    ``target.trust_remote_code``. A GGUF target loaded in
    float32 reads its float32 export (:func:`export_fp32_folder`) when one of the same GGUF file
    exists: the same tensors bit for bit, without de-quantizing again (SmolLM2: 50 s → 2 s).

    Raises:
        ConfigError: unknown package, missing folder, download needed but not allowed, a target
            with no loadable language model (names its class), a checkpoint missing some of the
            model's weights (they would silently be random; names them).
    Over 80 lines because it is one sequence of loading steps shared by every weight source (GGUF,
    folder, device map, remote-code wrapper); not split yet.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # GGUF de-quantization and weight-loading bars: noise in every stage
    loc = locate_target(cfg)
    dev = pick_device(str(device) if device is not None else cfg.device)
    kw = {"gguf_file": loc["gguf_file"]} if loc["gguf_file"] else {}
    config = plan = None
    if not loc["gguf_file"] and Path(loc["path"]).is_dir():
        config, _ = load_target_config(cfg)  # config faults named before the tokenizer's own errors
    tok = load_tokenizer(cfg)
    if cfg.device_map:
        if "cuda" in cfg.device_map and not torch.cuda.is_available():
            raise ConfigError(
                f"target.device_map {cfg.device_map}: this machine has no CUDA GPU usable by torch; use auto or cpu"
            )
        kw["device_map"] = cfg.device_map  # layers spread over the GPUs; accelerate moves activations
    if config is not None:
        plan = language_model_plan(config, loc["path"])
    if plan is not None:
        kw |= {"config": plan["config"], "key_mapping": plan["key_mapping"]}
    fingerprint = located_fingerprint(loc)
    weights_from = loc["path"]
    if (
        loc["gguf_file"]
        and cfg.dtype == "float32"
        and (export := fp32_export_of(loc, fingerprint)) is not None
    ):
        weights_from = str(export)  # the same tensors, read from safetensors instead of de-quantized again
        kw.pop("gguf_file")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its loading report lists a wrapper's vision tensors; ours names what matters
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            weights_from,
            dtype=_DTYPES[cfg.dtype],
            local_files_only=not cfg.allow_download,
            trust_remote_code=cfg.trust_remote_code,
            output_loading_info=True,
            **kw,
        )
    except RuntimeError as e:
        if "mismatched" not in str(e) and "size mismatch" not in str(e):
            raise
        raise ConfigError(
            f"target {loc['path']}: the checkpoint's tensors have other shapes than its config.json "
            f"describes (model_type {getattr(text_config(kw.get('config') or config), 'model_type', '?')!r}); "
            "give the checkpoint's own config.json"
        ) from None
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = sorted(
        set(info.get("missing_keys") or []) - _TIED_HEAD
        if getattr(model.config, "tie_word_embeddings", False)
        else set(info.get("missing_keys") or [])
    )
    n_layers = int(getattr(text_config(model.config), "num_hidden_layers", 0) or 0)
    # DeepSeek-V3's MTP layer
    n_layers += int(getattr(text_config(model.config), "num_nextn_predict_layers", 0) or 0)
    beyond = sorted(
        k
        for k in info.get("unexpected_keys") or []
        if (m := re.search(r"(?:^|\.)(?:layers|blocks|h)\.(\d+)\.", k))
        and int(m.group(1)) >= n_layers
        and not re.search(r"vision|visual|mm_projector|audio", k)
    )
    if beyond:
        raise ConfigError(
            f"target {loc['path']}: the checkpoint holds decoder layers the config does not "
            f"({', '.join(beyond[:2])}{' …' if len(beyond) > 2 else ''}; config.json says "
            f"num_hidden_layers {n_layers}): the model would load cut short. Give the checkpoint's own "
            "config.json"
        )
    if missing:
        raise ConfigError(
            f"target {loc['path']}: the checkpoint holds no weights for {len(missing)} of the model's tensors "
            f"({', '.join(missing[:4])}{' …' if len(missing) > 4 else ''}): they would be random. The folder's "
            "config.json does not describe its weights; give the checkpoint's own config"
        )
    if not cfg.device_map:
        model.to(dev)
    model.eval()
    model.requires_grad_(False)
    source = dict(loc)
    if plan is not None:
        source["language_model"] = {
            "wrapper": plan["wrapper"],
            "decoder_prefix": plan["decoder_prefix"],
            "lm_head": plan["head"],
        }
    source["weights_fingerprint"] = fingerprint
    source["fingerprint_format"] = FINGERPRINT_FORMAT
    source["revision"] = getattr(model.config, "_commit_hash", None)
    return Target(model=model, tokenizer=tok, parts=resolve_parts(model), source=source)


def tokenizer_hash(tok) -> str:
    """Hash of what turns text into ids: the vocabulary, the special tokens and, for a fast tokenizer,
    its whole pipeline (normalizer, pre-tokenizer, BPE merges, post-processor, decoder) without the
    truncation and padding state a call may set; not the file layout. A tokenizer that keeps its
    vocabulary but merges differently tokenizes the same text to other ids, and hashes differently."""
    vocab = tok.get_vocab()
    payload = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False)
    payload += json.dumps(sorted(map(str, tok.all_special_tokens)))
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        pipeline = json.loads(backend.to_str())
        for key in ("truncation", "padding"):
            pipeline.pop(key, None)
        payload += json.dumps(pipeline, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()


def chat_template_hash(tok) -> str:
    return hashlib.sha256((getattr(tok, "chat_template", None) or "").encode()).hexdigest()


@contextlib.contextmanager
def capture_layer_inputs(
    layers: nn.ModuleList, ids: Sequence[int], final_norm: nn.Module | None = None
) -> Iterator[dict]:
    """Record the hidden state entering each decoder layer in ``ids`` (HF index i = input of
    layer i) and, if ``final_norm`` is given, the pre-norm state entering it (under key ``"final"``).

    Yields a dict filled during the forward: ``{i: Tensor[B, T, Ht]}``.
    """
    store: dict = {}
    handles = []

    def make_hook(key):
        def hook(module, args, kwargs):
            store[key] = args[0] if args else kwargs["hidden_states"]

        return hook

    for i in ids:
        handles.append(layers[i].register_forward_pre_hook(make_hook(i), with_kwargs=True))
    if final_norm is not None:
        handles.append(final_norm.register_forward_pre_hook(make_hook("final"), with_kwargs=True))
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def target_features(
    target: Target, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, aux_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target's decoder once and return what EAGLE-3 training needs.

    Args:
        input_ids: int64 [B, T]; attention_mask: [B, T] (1 = real token; right padding) or None.
        aux_ids: three HF indices.

    Returns:
        aux: [B, T, 3·Ht] in the target dtype, the three aux states concatenated in ascending order.
        last: [B, T, Ht], the final hidden state *after* the final norm (applied once, by the
            model itself); teacher logits are ``lm_head(last)``.
    """
    parts = target.parts
    with capture_layer_inputs(parts.layers, aux_ids) as store:
        out = parts.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    last = out.last_hidden_state
    # under a device_map the aux layers may sit on other GPUs than the final norm: gather on last's
    aux = torch.cat([store[i].to(last.device) for i in aux_ids], dim=-1)
    return aux, last


def teacher_logits(target: Target, last: torch.Tensor, vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Target logits from the post-norm final state: ``last @ W[vocab_ids].T`` (fp32).

    Args:
        last: [..., Ht] post-norm state from :func:`target_features`.
        vocab_ids: int64 [Vd] target ids to keep (the draft vocabulary), or None for all V.
    Returns: float32 [..., Vd or V] on ``last``'s device (the product is taken on the lm_head's,
    which under a ``device_map`` may be another GPU).
    """
    w = target.parts.lm_head.weight
    bias = getattr(target.parts.lm_head, "bias", None)
    if vocab_ids is not None:
        vocab_ids = vocab_ids.to(w.device)
        w, bias = w[vocab_ids], (None if bias is None else bias[vocab_ids])
    x = last.to(w.device, w.dtype)
    # one 2-D product: ``x @ w.T`` on a strided [..., Ht] view (a block's slots) broadcasts w per row
    out = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), w, bias).view(*x.shape[:-1], w.shape[0])
    return out.float().to(last.device)


def embed_tokens(target: Target, ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The target's (frozen) token embedding of ``ids`` int64 [...] → [..., Ht] on ``like``'s
    device and in its dtype, wherever the embedding lives (another GPU under a ``device_map``)."""
    emb = target.parts.embed
    return emb(ids.to(emb.weight.device)).to(like.device, like.dtype)


def teacher_top1_lse(
    target: Target, last: torch.Tensor, chunk: int = 1024, where: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`teacher_argmax` and, from the same logits, log Σ_v exp(z_v) over the whole
    vocabulary (fp32 [T]; 0 where ``where`` is False): the normaliser the LK objectives need
    (:mod:`eagle3kit.train.ttt`), computed once per position instead of at every TTT step."""
    where = torch.ones(last.shape[0], dtype=torch.bool) if where is None else where
    where = where.to(last.device)
    top = torch.zeros(last.shape[0], dtype=torch.long, device=last.device)
    lse = torch.zeros(last.shape[0], dtype=torch.float32, device=last.device)
    if bool(where.any()):
        z = [teacher_logits(target, c) for c in last[where].split(chunk)]
        top[where] = torch.cat([x.argmax(-1) for x in z])
        lse[where] = torch.cat([torch.logsumexp(x, -1) for x in z])
    return top, lse


def teacher_argmax(
    target: Target, last: torch.Tensor, chunk: int = 1024, where: torch.Tensor | None = None
) -> torch.Tensor:
    """The target's full-vocabulary top-1 at each position: ``last`` [T, Ht] post-norm → int64 [T]
    (logits computed ``chunk`` positions at a time, so [T, V] never exists at once).

    ``where`` bool [T]: compute it only there and give 0 elsewhere. Training reads the top-1 only
    at completion tokens (a TTT step supervises position t only when x_{t+k+1} is one, docs/conventions.md,
    alignment), and a prompt is most of a chat's tokens: its [T, V] product is skipped."""
    if where is None:
        return torch.cat([teacher_logits(target, c).argmax(-1) for c in last.split(chunk)])
    where = where.to(last.device)
    out = torch.zeros(last.shape[0], dtype=torch.long, device=last.device)
    if bool(where.any()):
        out[where] = teacher_argmax(target, last[where], chunk)
    return out
