"""Stage ``export``: the drafter folder vLLM (≥ 0.10) and SGLang (≥ 0.5) load unmodified
(DESIGN.md §5): ``config.json`` + ``model.safetensors``, validated before anything is written.

Tensor names (no ``model.`` prefix): ``fc.weight [H, 3·Ht]``,
``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``midlayer.self_attn.{q,k,v}_proj.weight [*, 2H]``, ``midlayer.self_attn.o_proj.weight``,
``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight [Vd, H]``, and only
when Vd < V: ``d2t`` int64 [Vd] (offsets) and ``t2d`` bool [V]. Never ``embed_tokens`` (the drafter
borrows the target's; this version only builds drafters as wide as their target).

``--format speculators`` writes vLLM's speculators layout instead (DESIGN.md §5): the same tensors
with ``layers.0.`` in place of ``midlayer.``, and a config with ``speculators_model_type "eagle3"``,
``transformer_layer_config`` and ``speculators_config``.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import __version__
from .config import Config
from .drafter import DrafterConfig, Eagle3Drafter
from .lineage import check_inputs
from .rundir import RunDir, set_aside, sha256_tensors, write_failed
from .vocab import check_maps


class ExportError(ValueError):
    """A drafter that would load wrongly or silently in an engine; the message names the key."""


def required_shapes(c: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the engines create for this config, with its shape (d2t/t2d excluded)."""
    H, I, d = c.hidden_size, c.intermediate_size, c.head_dim
    return {
        "fc.weight": (H, 3 * c.target_hidden_size),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (c.num_attention_heads * d, 2 * H),
        "midlayer.self_attn.k_proj.weight": (c.num_key_value_heads * d, 2 * H),
        "midlayer.self_attn.v_proj.weight": (c.num_key_value_heads * d, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, c.num_attention_heads * d),
        "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,),
        "lm_head.weight": (c.draft_vocab_size, H),
    }


def contract_shapes(c: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """:func:`required_shapes` plus ``d2t`` [Vd] and ``t2d`` [V] when Vd < V: every tensor of an export."""
    want = required_shapes(c)
    if c.draft_vocab_size < c.vocab_size:
        want = {**want, "d2t": (c.draft_vocab_size,), "t2d": (c.vocab_size,)}
    return want


def contract_mismatches(shapes: dict[str, tuple], want: dict[str, tuple]) -> tuple[list[str], list[str], list[str]]:
    """Tensor names against a contract: ``(missing, unexpected, misshapen)``, each in order (the
    contract's for missing and misshapen, ``shapes``' for unexpected)."""
    missing = [k for k in want if k not in shapes]
    misshapen = [k for k, s in want.items() if k in shapes and tuple(shapes[k]) != tuple(s)]
    return missing, [k for k in shapes if k not in want], misshapen


def validate_tensors(tensors: dict[str, torch.Tensor], c: DrafterConfig) -> None:
    """Refuse a missing, misshapen or stray tensor and broken vocab maps (DESIGN.md §5, C27, C28).

    Raises:
        ExportError: listing every problem found.
    """
    want = contract_shapes(c)
    reduced = c.draft_vocab_size < c.vocab_size
    missing, unexpected, misshapen = contract_mismatches({k: tuple(v.shape) for k, v in tensors.items()}, want)
    problems = [f"missing {name} (the engine would create it empty)" for name in missing]
    problems += [f"{name} has shape {tuple(tensors[name].shape)}, expected {want[name]}" for name in misshapen]
    problems += [f"unexpected tensor {name}" + (" (the drafter borrows the target's embedding)" if "embed" in name else "")
                 for name in unexpected]
    if reduced and "d2t" in tensors and "t2d" in tensors and not problems:
        if tensors["d2t"].dtype != torch.int64 or tensors["t2d"].dtype != torch.bool:
            problems.append(f"d2t must be int64 and t2d bool, got {tensors['d2t'].dtype}/{tensors['t2d'].dtype}")
        else:
            try:
                check_maps(tensors["d2t"], tensors["t2d"], c.vocab_size)
            except ValueError as e:
                problems.append(str(e))
    if problems:
        raise ExportError("drafter export refused:\n  " + "\n  ".join(problems))


def engine_config(c: DrafterConfig, torch_dtype: str, provenance: dict | None = None) -> dict:
    """``config.json`` for the dual-engine layout. Aux ids twice: top-level in vLLM numbering
    (= HF index) and nested ``eagle_config`` in SGLang numbering (HF index − 1)."""
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
        "norm_before_residual": False,
        "torch_dtype": torch_dtype,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [i - 1 for i in c.aux_layer_ids]},
        "eagle3kit": {"version": __version__, "aux_layer_ids_convention": "top-level: HF output_hidden_states index "
                      "(= vLLM); eagle_config: output of layer j (= SGLang/SpecForge, HF index - 1)", **(provenance or {})},
    }
    return cfg


FORMATS = ("dual", "speculators")
SPECULATORS_LAYER_PREFIX = "layers.0."     # speculators (and vLLM internally) name the decoder layer so


def speculators_config(c: DrafterConfig, torch_dtype: str, verifier: dict, num_speculative_tokens: int = 3,
                       provenance: dict | None = None) -> dict:
    """``config.json`` for vLLM's speculators layout (DESIGN.md §5): no top-level ``model_type``;
    ``transformer_layer_config`` holds the Llama layer; aux ids top-level in vLLM numbering (HF
    index); ``norm_before_residual: false`` written out (vLLM assumes true when it is missing).

    Args:
        verifier: ``{"name_or_path": str, "architectures": [str]}`` — the target.
        num_speculative_tokens: K of the default greedy proposal method.
    """
    dual = engine_config(c, torch_dtype)
    layer = {k: dual[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                  "head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling",
                                  "max_position_embeddings", "vocab_size", "num_hidden_layers", "tie_word_embeddings",
                                  "attention_bias", "mlp_bias", "torch_dtype")}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **layer},
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "torch_dtype": torch_dtype,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens)}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier["name_or_path"], "architectures": list(verifier["architectures"])},
        },
        "eagle3kit": {**dual["eagle3kit"], "aux_layer_ids_convention": "HF output_hidden_states index (= vLLM)",
                      **(provenance or {})},
    }


def drafter_tensors(drafter: Eagle3Drafter, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The drafter's engine tensors in the dual-engine naming, validated (:func:`validate_tensors`):
    weights in ``dtype`` (default: the drafter's), ``d2t`` int64 and ``t2d`` bool only when Vd < V."""
    c = drafter.config
    state = drafter.state_dict()
    dtype = dtype or drafter.fc.weight.dtype
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in state.items() if k in required_shapes(c)}
    if c.draft_vocab_size < c.vocab_size:
        tensors["d2t"] = state["d2t"].cpu().to(torch.int64).contiguous()
        tensors["t2d"] = state["t2d"].cpu().to(torch.bool).contiguous()
    validate_tensors(tensors, c)
    return tensors


def export_drafter(drafter: Eagle3Drafter, out_dir: str | Path, provenance: dict | None = None,
                   dtype: torch.dtype | None = None, overwrite: bool = False, fmt: str = "dual",
                   verifier: dict | None = None, num_speculative_tokens: int = 3) -> Path:
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
        raise ExportError(f"a drafter of hidden size {c.hidden_size} for a target of {c.target_hidden_size} needs its own "
                          "embed_tokens [V, H] (neither engine shares the target's across widths; DESIGN.md §5), and "
                          "eagle3kit builds drafters as wide as their target only")
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
        raise FileExistsError(f"{out} is not empty (it holds {', '.join(held[:4])}); pass --overwrite to move it to "
                              "<out>.prev-N and write a new one, or give another --out")


def commit_out_dir(tmp: Path, out: Path) -> Path:
    """Move the finished folder ``tmp`` to ``out``; an existing non-empty ``out`` (allowed by
    :func:`check_out_dir`) is first moved to ``<out>.prev-N``. Returns ``out``."""
    from .ui import console

    if out.is_dir() and any(out.iterdir()):
        console.print(f"[yellow]{out} held files; moved them to {set_aside(out)}")
    elif out.is_dir():
        out.rmdir()
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    return out


def load_exported(folder: str | Path, device="cpu", target=None) -> Eagle3Drafter:
    """Load a drafter folder strictly: eagle3kit's dual-engine or speculators export, or any layout
    :mod:`eagle3kit.importer` reads (``target``, a TargetConfig, is needed only for a source that
    names no aux ids). Weights keep their stored dtype.

    Raises:
        FileNotFoundError: no config.json / weights; ExportError: as :func:`eagle3kit.importer.read_drafter`."""
    from .importer import read_drafter

    return read_drafter(folder, target=target).drafter.to(device)


def run_export(cfg: Config, run: RunDir, checkpoint: str | None = None, out_dir: str | None = None,
               overwrite: bool = False, set_aside_existing: bool = False, fmt: str = "dual") -> dict:
    """Export ``checkpoints/best.safetensors`` (or ``checkpoint``) to ``<run>/drafter`` (or
    ``out_dir``; ``<run>/drafter-speculators`` for ``fmt="speculators"``).

    A folder that already holds the same checkpoint's export in the same format is left as it is;
    another drafter there is refused (FileExistsError) unless ``overwrite``, or moved to
    ``<out>.prev-N`` with ``set_aside_existing`` (what ``eagle3kit run`` does)."""
    from .target import load_target_config, locate_target, target_architectures
    from .train import checkpoint_provenance, load_drafter_checkpoint
    from .ui import console

    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    src = Path(checkpoint) if checkpoint else run.require("checkpoints/best.safetensors", "train")
    consumed = check_inputs(run, "export", ["checkpoints/best.safetensors"]) if not checkpoint else None
    if src.is_dir():        # a drafter folder (any layout eagle3kit imports): re-export it
        from .importer import read_drafter

        imp = read_drafter(src, target=cfg.target)
        drafter, prov = imp.drafter, dict(imp.provenance)
    else:
        drafter = load_drafter_checkpoint(src)
        prov = checkpoint_provenance(src)      # what this checkpoint was trained with, not what the run dir says
        prov["checkpoint_sha256"] = sha256_tensors(src)
    out = Path(out_dir or (run / ("drafter" if fmt == "dual" else "drafter-speculators")))
    if out.resolve() == src.resolve() or out.resolve() == Path(locate_target(cfg.target)["path"]).resolve():
        raise ExportError(f"--out {out} is the source drafter or the target folder; give another folder")
    old_cfg = None
    if (out / "config.json").is_file() and not overwrite:
        try:
            old_cfg = json.loads((out / "config.json").read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            old_cfg = None
    if isinstance(old_cfg, dict):
        same_fmt = ("speculators_model_type" in old_cfg) == (fmt == "speculators")
        if same_fmt and prov.get("checkpoint_sha256") and \
                (old_cfg.get("eagle3kit") or {}).get("checkpoint_sha256") == prov["checkpoint_sha256"]:
            res = {"path": str(out), "format": fmt, "up_to_date": True}
            run.record_stage(_stage(fmt), {"checkpoint": prov["checkpoint_sha256"]}, res,
                             *_lineage(run, out, consumed, sha256_tensors(out / "model.safetensors")))
            return res
    if set_aside_existing and out.is_dir() and any(out.iterdir()):
        console.print(f"[yellow]export: {out} held another drafter; moved it to {set_aside(out)}")
    verifier = None
    if fmt == "speculators":
        tcfg, _ = load_target_config(cfg.target)
        loc = locate_target(cfg.target)
        verifier = {"name_or_path": loc["path"], "architectures": target_architectures(tcfg)}
    out = export_drafter(drafter, out, prov, overwrite=overwrite, fmt=fmt, verifier=verifier,
                         num_speculative_tokens=cfg.evaluate.k)
    res = {"path": str(out), "format": fmt, "model_sha256": sha256_tensors(out / "model.safetensors"),
           "draft_vocab_size": drafter.config.draft_vocab_size, "vocab_size": drafter.config.vocab_size}
    run.record_stage(_stage(fmt), {"checkpoint": prov.get("checkpoint_sha256") or str(src)}, res,
                     *_lineage(run, out, consumed, res["model_sha256"]))
    return res


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
