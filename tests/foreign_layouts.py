"""Write a drafter in the layouts other tools save, built by hand from an eagle3kit dual-engine
export (independent of eagle3kit's own speculators exporter), after the sources the importer cites:
SafeAILab EAGLE (``pytorch_model.bin``, ``midlayer.*``, no aux ids, a plain Llama config with a
stale max_position_embeddings 2048), SpecForge (``midlayer.*``, ids nested in ``eagle_config`` as
"output of layer j", sharded safetensors with an index), speculators (``layers.0.*`` plus a copy of
the target's embedding, ``transformer_layer_config``, ``speculators_config``) and ModelOpt
(``layers.0.*`` or ``eagle_module.*``, no ``t2d``, modelopt's ``eagle_config`` flags)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LAYER_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "vocab_size",
)


def write_layout(src: Path, out: Path, layout: str, embed: torch.Tensor | None = None) -> Path:
    """``src``: an eagle3kit dual export; ``layout``: eagle | specforge | speculators | modelopt |
    modelopt_raw | layers0 (the dual layout with ``layers.0.*`` names); ``embed``: the target's
    embedding [V, H] (speculators saves one)."""
    t = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    ids = cfg["eagle_aux_hidden_state_layer_ids"]
    layer = {k: cfg[k] for k in LAYER_FIELDS}
    # a variant drafter's flags, top-level where each tool's config (and vLLM reading it) has them
    flags = {
        k: True for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output") if cfg.get(k)
    }
    out.mkdir(parents=True)
    to_layers0 = {k.replace("midlayer.", "layers.0."): v for k, v in t.items()}
    if layout == "eagle":
        torch.save(t, out / "pytorch_model.bin")
        conf = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            **layer,
            "max_position_embeddings": 2048,
            "draft_vocab_size": cfg["draft_vocab_size"],
            "bos_token_id": 1,
            "eos_token_id": 2,
            "tie_word_embeddings": False,
            "torch_dtype": cfg["torch_dtype"],
            "use_cache": True,
            **flags,
        }
    elif layout == "specforge":
        names = sorted(t)
        half = len(names) // 2
        shards = {
            "model-00001-of-00002.safetensors": names[:half],
            "model-00002-of-00002.safetensors": names[half:],
        }
        for fname, keys in shards.items():
            save_file({k: t[k] for k in keys}, str(out / fname), metadata={"format": "pt"})
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}})
        )
        conf = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            **layer,
            "draft_vocab_size": cfg["draft_vocab_size"],
            "target_hidden_size": cfg["target_hidden_size"],
            "tie_word_embeddings": False,
            "torch_dtype": cfg["torch_dtype"],
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids],
                "use_aux_hidden_state": True,
            },
            **flags,
        }
    elif layout == "speculators":
        assert embed is not None
        save_file(
            {**to_layers0, "embed_tokens.weight": embed.to(t["fc.weight"].dtype).contiguous()},
            str(out / "model.safetensors"),
        )
        conf = {
            "architectures": ["Eagle3Speculator"],
            "model_type": "speculator_model",
            "speculators_model_type": "eagle3",
            "speculators_version": "0.3.0",
            "draft_vocab_size": cfg["draft_vocab_size"],
            "norm_before_residual": False,
            **flags,
            "target_hidden_size": cfg["target_hidden_size"],
            "eagle_aux_hidden_state_layer_ids": ids,
            "transformer_layer_config": {"model_type": "llama", "num_hidden_layers": 1, **layer},
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                "verifier": {"name_or_path": "some/target", "architectures": ["LlamaForCausalLM"]},
            },
        }
    elif layout in ("modelopt", "modelopt_raw"):
        w = {k: v for k, v in to_layers0.items() if k != "t2d"}
        if (
            layout == "modelopt_raw"
        ):  # the in-memory ModelOpt state: eagle_module.* beside the base model's tensors
            w = {
                **{"eagle_module." + k: v for k, v in w.items()},
                "model.norm.weight": torch.ones(layer["hidden_size"]),
            }
        save_file(w, str(out / "model.safetensors"))
        conf = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            **layer,
            "draft_vocab_size": cfg["draft_vocab_size"],
            "tie_word_embeddings": False,
            "torch_dtype": cfg["torch_dtype"],
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids],
                "use_aux_hidden_state": True,
                "use_input_layernorm_in_first_layer": True,
                "use_last_layernorm": True,
                "use_mtp_layernorm": False,
                "next_layer_regular": True,
            },
            **flags,
        }
    elif layout == "layers0":
        save_file(to_layers0, str(out / "model.safetensors"))
        conf = cfg
    else:
        raise ValueError(layout)
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    return out
