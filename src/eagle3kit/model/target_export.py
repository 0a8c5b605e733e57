"""The folder an engine serves for a target: its own safetensors folder, or the float32 safetensors
export of a GGUF target (vLLM reads no GGUF of these families; docs/families.md)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from eagle3kit.core.config import ConfigError
from eagle3kit.core.rundir import as_umask_allows
from eagle3kit.model.target_files import cache_dir

if TYPE_CHECKING:
    from eagle3kit.model.target import Target


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
