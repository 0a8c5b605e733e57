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

import os
import shutil
from pathlib import Path

from eagle3kit.core.config import ConfigError
from eagle3kit.model.contract import DrafterImportError
from eagle3kit.model.folder import check_out_dir, commit_out_dir, export_drafter, read_drafter
from eagle3kit.model.target import locate_target
from eagle3kit.serve.check import check_drafter


def run_import(
    source: str | Path, out_dir: str | Path, target, layout: str = "auto", overwrite: bool = False
) -> dict:
    """``eagle3kit import``: read ``source`` (:func:`read_drafter`), write the dual-engine folder
    (:func:`eagle3kit.model.folder.export_drafter`, same dtype) to a temporary folder, run
    :func:`eagle3kit.serve.check.check_drafter` on it against ``target``, and only when nothing is wrong
    move it to ``out_dir``. Returns a summary, with ``notes`` (what was converted) and ``findings``
    (``check``'s warnings and info lines).

    Raises:
        as :func:`read_drafter`; ConfigError: ``out_dir`` is the source or the target folder;
        FileExistsError: ``out_dir`` is not empty and not ``overwrite``; DrafterImportError:
        ``check`` found errors (listed; nothing is written)."""

    out = Path(out_dir)
    try:
        same = {out.resolve()} & {Path(source).resolve(), Path(locate_target(target)["path"]).resolve()}
    except (OSError, RuntimeError) as e:
        raise ConfigError(f"cannot resolve {source} or --out {out}: {e}") from None
    if same:
        raise ConfigError(
            f"--out {out} is the source folder or the target folder; import never writes into either"
        )
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
        raise DrafterImportError(
            f"{source} imports, but would not serve beside {target.model}; nothing written:\n  "
            + "\n  ".join(f"{f.code}: {f.message} (fix: {f.fix})" for f in errors)
        )
    commit_out_dir(tmp, out)
    c = imp.drafter.config
    return {
        "path": str(out),
        "layout": imp.layout,
        "aux_layer_ids": c.aux_layer_ids,
        "draft_vocab_size": c.draft_vocab_size,
        "vocab_size": c.vocab_size,
        "dtype": str(imp.drafter.fc.weight.dtype).replace("torch.", ""),
        "notes": imp.notes,
        "findings": found,
    }
