"""Stage ``import``: read an EAGLE-3 drafter written by another tool, strictly, into eagle3kit's
drafter (and from there into the dual-engine folder, docs/conventions.md).

The layouts read (SafeAILab EAGLE, SpecForge, speculators, ModelOpt), their tensor names and aux-id
conventions are the table of :mod:`eagle3kit.model.folder`, which does the reading
(:func:`~eagle3kit.model.folder.read_drafter`). The load is strict: any key left over after
renaming, and any tensor the drafter needs but the source lacks, is an error that names it.
The drafter variants (``norm_before_residual``, EAGLE-3.1's ``norm_before_fc``/``fc_norm``/
``norm_output``, P-EAGLE's ``mask_hidden``) are read as vLLM reads them; biases and more than one
decoder layer are refused by name.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from eagle3kit.core.config import ConfigError
from eagle3kit.model.contract import DrafterImportError
from eagle3kit.model.folder import check_out_dir, commit_out_dir, export_drafter
from eagle3kit.model.folder_read import read_drafter
from eagle3kit.model.target_files import locate_target
from eagle3kit.serve.check import check_drafter


def run_import(
    source: str | Path,
    out_dir: str | Path,
    target,
    layout: str = "auto",
    overwrite: bool = False,
    aux_layer_ids: list[int] | None = None,
) -> dict:
    """``eagle3kit import``: read ``source`` (:func:`read_drafter`; ``aux_layer_ids``: HF indices for
    a source that states none), write the dual-engine folder
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
    imp = read_drafter(source, layout, target, aux_layer_ids=aux_layer_ids)
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
        "variant": c.variant() or "eagle3",
        "notes": imp.notes,
        "findings": found,
    }
