"""Reading a drafter folder of any layout, and writing one atomically (docs/conventions.md, the drafter folder).

Reading (:func:`read_drafter`) accepts these layouts (sources: SafeAILab/EAGLE
``eagle/traineagle3``, sgl-project/SpecForge ``scripts/train_eagle3.py``, vllm-project/speculators
``models/eagle3``, NVIDIA Model-Optimizer ``torch/export/plugins/hf_spec_export.py``; vLLM 0.32's
``llama_eagle3.py`` for what an engine reads):

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

A SafeAILab folder (``pytorch_model.bin``, no ids: its code hard-codes the layers) is read with
EAGLE-3's default, HF indices ``(2, N//2, N−3)`` for a target of N layers. A ``model.safetensors``
folder without ids is SpecForge ≥ 0.2's ``export --to hf``, which does not write the layers the run
captured: it is refused unless the ids are given (``aux_layer_ids``), the message naming SpecForge's
default. SpecForge 0.2's ``norm_output`` means "final norm before ``lm_head``" (its default, true)
and its drafter always feeds back the pre-norm output, while vLLM reads ``norm_output: true`` as
post-norm feedback: such a folder is imported as the network SpecForge trained (``norm_output``
false), said in the notes. The variant fields (``norm_before_residual``, ``norm_before_fc``,
``fc_norm``, ``norm_output``, a P-EAGLE ``mask_hidden`` with its mask token) are read as vLLM reads
them (:func:`eagle3kit.model.contract.engine_variant`). ``t2d`` is synthesized from ``d2t`` when absent;
``d2t`` holds offsets in every layout (target id = draft id + d2t[draft id]). A copy of the
target's embedding (``embed_tokens.weight``) is dropped: the engines borrow the target's. The load
is strict: any key left over after renaming, and any tensor the drafter needs but the source lacks,
is an error that names it.

Writing (:func:`export_drafter`) validates the tensors against :mod:`eagle3kit.model.contract`,
writes ``config.json`` + ``model.safetensors`` into a temporary sibling folder and moves it into
place; a folder that held something else is moved to ``<out>.prev-N``, never mixed or deleted.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3kit.core.rundir import as_umask_allows, set_aside, write_failed
from eagle3kit.core.ui import console
from eagle3kit.model.contract import (
    FORMATS,
    SPECULATORS_LAYER_PREFIX,
    ExportError,
    engine_config,
    required_shapes,
    speculators_config,
    validate_tensors,
)
from eagle3kit.model.drafter import Eagle3Drafter
from eagle3kit.model.folder_read import read_drafter


def drafter_tensors(drafter: Eagle3Drafter, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The drafter's engine tensors in the dual-engine naming, validated (:func:`validate_tensors`):
    weights in ``dtype`` (default: the drafter's), ``d2t`` int64 and ``t2d`` bool only when Vd < V."""
    c = drafter.config
    state = drafter.state_dict()
    dtype = dtype or drafter.fc.weight.dtype
    tensors = {
        k: v.detach().to(dtype).contiguous().cpu() for k, v in state.items() if k in required_shapes(c)
    }
    if c.draft_vocab_size < c.vocab_size:
        tensors["d2t"] = state["d2t"].cpu().to(torch.int64).contiguous()
        tensors["t2d"] = state["t2d"].cpu().to(torch.bool).contiguous()
    validate_tensors(tensors, c)
    return tensors


def export_drafter(
    drafter: Eagle3Drafter,
    out_dir: str | Path,
    provenance: dict | None = None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    fmt: str = "dual",
    verifier: dict | None = None,
    num_speculative_tokens: int = 3,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in ``fmt`` (``dual``: vLLM + SGLang;
    ``speculators``: vLLM's speculators layout, which needs ``verifier``), after
    :func:`validate_tensors`. Weights are cast to ``dtype`` (default: the drafter's).

    Raises:
        ExportError: invalid tensors or format; FileExistsError: ``out_dir`` holds a drafter and not ``overwrite``.
    """
    if fmt not in FORMATS:
        raise ExportError(f"export format {fmt!r} is not one of {FORMATS}")
    out = Path(out_dir)
    check_out_dir(out, overwrite)
    c = drafter.config
    if c.hidden_size != c.target_hidden_size:
        raise ExportError(
            f"a drafter of hidden size {c.hidden_size} for a target of {c.target_hidden_size} needs its own "
            "embed_tokens [V, H] (neither engine shares the target's across widths; docs/conventions.md), and "
            "eagle3kit builds drafters as wide as their target only"
        )
    tensors = drafter_tensors(drafter, dtype)
    dtype_name = str(tensors["fc.weight"].dtype).replace("torch.", "")
    if fmt == "speculators":
        if not verifier:
            raise ExportError("the speculators format names its verifier (the target): pass verifier=")
        tensors = {k.replace("midlayer.", SPECULATORS_LAYER_PREFIX): v for k, v in tensors.items()}
        cfg = speculators_config(drafter.config, dtype_name, verifier, num_speculative_tokens, provenance)
    else:
        cfg = engine_config(drafter.config, dtype_name, provenance)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        as_umask_allows(tmp / "model.safetensors")  # an engine under another user reads it
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        return commit_out_dir(tmp, out)
    except Exception as e:  # OSError, or safetensors' SafetensorError on a full disk
        if not (isinstance(e, OSError) or "os error" in str(e)):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failed(out, e) from None


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse an output folder that is a file, or that holds anything (another drafter, another
    tool's files) unless ``overwrite`` — and even then :func:`commit_out_dir` moves the old folder
    to ``<out>.prev-N`` instead of mixing files or deleting them.

    Raises:
        ExportError: ``out`` is not a folder; FileExistsError: ``out`` is not empty and not ``overwrite``."""
    try:
        resolved = out.resolve()
        held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    except (OSError, RuntimeError) as e:
        raise ExportError(f"--out {out} cannot be used: {e}") from None
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; give a folder")
    for parent in resolved.parents:
        if parent.exists() and not parent.is_dir():
            raise ExportError(f"--out {out}: {parent} is a file, not a folder")
    if held and not overwrite:
        raise FileExistsError(
            f"{out} is not empty (it holds {', '.join(held[:4])}); pass --overwrite to move it to "
            "<out>.prev-N and write a new one, or give another --out"
        )


def commit_out_dir(tmp: Path, out: Path) -> Path:
    """Move the finished folder ``tmp`` to ``out``; an existing non-empty ``out`` (allowed by
    :func:`check_out_dir`) is first moved to ``<out>.prev-N``. Returns ``out``."""

    if out.is_dir() and any(out.iterdir()):
        console.print(f"[yellow]{out} held files; moved them to {set_aside(out)}")
    elif out.is_dir():
        out.rmdir()
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    return out


def load_exported(folder: str | Path, device="cpu", target=None) -> Eagle3Drafter:
    """Load a drafter folder strictly: eagle3kit's dual-engine or speculators export, or any layout
    :mod:`eagle3kit.serve.importer` reads (``target``, a TargetConfig, is needed only for a source that
    names no aux ids). Weights keep their stored dtype.

    Raises:
        FileNotFoundError: no config.json / weights; ExportError: as :func:`eagle3kit.model.folder.read_drafter`."""

    return read_drafter(folder, target=target).drafter.to(device)
