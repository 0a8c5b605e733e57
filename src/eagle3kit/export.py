"""Stage ``export``: the drafter folder vLLM (≥ 0.10) and SGLang (≥ 0.5) load unmodified
(DESIGN.md §5): ``config.json`` + ``model.safetensors``, validated before anything is written.

Tensor names (no ``model.`` prefix): ``fc.weight [H, 3·Ht]``,
``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``midlayer.self_attn.{q,k,v}_proj.weight [*, 2H]``, ``midlayer.self_attn.o_proj.weight``,
``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight [Vd, H]``, and only
when Vd < V: ``d2t`` int64 [Vd] (offsets) and ``t2d`` bool [V]. Never ``embed_tokens`` (the drafter
borrows the target's; this version only builds drafters as wide as their target).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import __version__
from .config import Config
from .drafter import DrafterConfig, Eagle3Drafter
from .rundir import RunDir, load_safetensors, set_aside, sha256_tensors
from .vocab import DraftVocab, check_maps


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


def validate_tensors(tensors: dict[str, torch.Tensor], c: DrafterConfig) -> None:
    """Refuse a missing, misshapen or stray tensor and broken vocab maps (DESIGN.md §5, C27, C28).

    Raises:
        ExportError: listing every problem found.
    """
    problems = []
    want = required_shapes(c)
    reduced = c.draft_vocab_size < c.vocab_size
    if reduced:
        want = {**want, "d2t": (c.draft_vocab_size,), "t2d": (c.vocab_size,)}
    for name, shape in want.items():
        if name not in tensors:
            problems.append(f"missing {name} (the engine would create it empty)")
        elif tuple(tensors[name].shape) != shape:
            problems.append(f"{name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    for name in tensors:
        if name not in want:
            problems.append(f"unexpected tensor {name}" + (" (the drafter borrows the target's embedding)" if "embed" in name else ""))
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


def export_drafter(drafter: Eagle3Drafter, out_dir: str | Path, provenance: dict | None = None,
                   dtype: torch.dtype | None = None, overwrite: bool = False) -> Path:
    """Write ``config.json`` + ``model.safetensors``, after :func:`validate_tensors`.

    Raises:
        ExportError: invalid tensors; FileExistsError: ``out_dir`` holds a drafter and not ``overwrite``.
    """
    out = Path(out_dir)
    if (out / "model.safetensors").exists() and not overwrite:
        raise FileExistsError(f"{out} already holds a drafter; pass --overwrite to replace it")
    c = drafter.config
    state = drafter.state_dict()
    dtype = dtype or drafter.fc.weight.dtype
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in state.items() if k in required_shapes(c)}
    if c.draft_vocab_size < c.vocab_size:
        tensors["d2t"] = state["d2t"].cpu().to(torch.int64).contiguous()
        tensors["t2d"] = state["t2d"].cpu().to(torch.bool).contiguous()
    validate_tensors(tensors, c)
    cfg = engine_config(c, str(dtype).replace("torch.", ""), provenance)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def config_from_engine_json(cfg: dict) -> DrafterConfig:
    """Rebuild a :class:`DrafterConfig` from an exported ``config.json``."""
    try:
        return DrafterConfig(
            hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            rms_norm_eps=cfg["rms_norm_eps"], vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg.get("draft_vocab_size", cfg["vocab_size"]),
            target_hidden_size=cfg.get("target_hidden_size", cfg["hidden_size"]),
            aux_layer_ids=cfg["eagle_aux_hidden_state_layer_ids"], rope_theta=cfg.get("rope_theta", 10000.0),
            rope_scaling=cfg.get("rope_scaling"), max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            hidden_act=cfg.get("hidden_act", "silu"),
        )
    except KeyError as e:
        raise ExportError(f"config.json lacks {e.args[0]!r}") from None


def load_exported(folder: str | Path, device="cpu") -> Eagle3Drafter:
    """Load an exported drafter folder strictly (validated like at export)."""
    folder = Path(folder)
    if not (folder / "config.json").exists() or not (folder / "model.safetensors").exists():
        raise FileNotFoundError(f"{folder}: expected config.json and model.safetensors (run `eagle3kit export`)")
    c = config_from_engine_json(json.loads((folder / "config.json").read_text()))
    tensors = load_safetensors(folder / "model.safetensors", "re-export the drafter")
    try:
        validate_tensors(tensors, c)
    except ExportError as e:
        raise ExportError(f"{folder} is not a valid drafter: {str(e).split(':', 1)[1].strip()}") from None
    d = Eagle3Drafter(c)
    if "d2t" not in tensors:
        d.set_vocab(DraftVocab.full(c.vocab_size))
    d.load_state_dict(tensors, strict=False)
    dtype = tensors["fc.weight"].dtype
    return d.to(device=device, dtype=dtype)


def run_export(cfg: Config, run: RunDir, checkpoint: str | None = None, out_dir: str | None = None,
               overwrite: bool = False, set_aside_existing: bool = False) -> dict:
    """Export ``checkpoints/best.safetensors`` (or ``checkpoint``) to ``<run>/drafter`` (or ``out_dir``).

    A folder that already holds the same checkpoint's export is left as it is; another drafter
    there is refused (FileExistsError) unless ``overwrite``, or moved to ``<out>.prev-N`` with
    ``set_aside_existing`` (what ``eagle3kit run`` does)."""
    from .train import checkpoint_provenance, load_drafter_checkpoint
    from .ui import console

    src = Path(checkpoint) if checkpoint else run.require("checkpoints/best.safetensors", "train")
    drafter = load_drafter_checkpoint(src)
    prov = checkpoint_provenance(src)          # what this checkpoint was trained with, not what the run dir says
    prov["checkpoint_sha256"] = sha256_tensors(src)
    out = Path(out_dir or (run / "drafter"))
    if (out / "config.json").exists() and not overwrite:
        old = (json.loads((out / "config.json").read_text()).get("eagle3kit") or {}).get("checkpoint_sha256")
        if old == prov["checkpoint_sha256"]:
            res = {"path": str(out), "up_to_date": True}
            run.record_stage("export", {"checkpoint": prov["checkpoint_sha256"]}, res)
            return res
        if set_aside_existing:
            console.print(f"[yellow]export: {out} held another drafter; moved it to {set_aside(out)}")
    out = export_drafter(drafter, out, prov, overwrite=overwrite)
    res = {"path": str(out), "model_sha256": sha256_tensors(out / "model.safetensors"),
           "draft_vocab_size": drafter.config.draft_vocab_size, "vocab_size": drafter.config.vocab_size}
    run.record_stage("export", {"checkpoint": prov["checkpoint_sha256"]}, res)
    return res
