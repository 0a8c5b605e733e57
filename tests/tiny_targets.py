"""Tiny random targets of every family eagle3kit supports (docs/families.md), built from config:
Llama, Qwen3, Qwen3-MoE, DeepSeek-V3 (MLA + MoE), Kimi-K2.5 in both wrapper layouts (transformers'
native ``Kimi_K25ForConditionalGeneration``: decoder at ``model.language_model``, ``lm_head`` on
the wrapper; the remote-code ``KimiK25ForConditionalGeneration``: a whole DeepSeek-V3 causal LM
under ``language_model``) and gpt-oss (MoE, sliding-window layers). Hidden size 64, vocab 97 by
default, a few MB each."""

from __future__ import annotations

import torch
from torch import nn

FAMILIES = ("llama", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k25", "kimi_k25_remote", "gpt_oss")

_COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
_DEEPSEEK = dict(
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    moe_intermediate_size=32,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
)


def text_config(family: str, num_layers: int = 8, vocab_size: int = 97):
    """The (text) config of a tiny ``family`` target."""
    import transformers as T

    kw = {**_COMMON, "num_hidden_layers": num_layers, "vocab_size": vocab_size}
    if family == "llama":
        return T.LlamaConfig(head_dim=16, **kw)
    if family == "qwen3":
        return T.Qwen3Config(head_dim=16, **kw)
    if family == "qwen3_moe":
        return T.Qwen3MoeConfig(
            head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **kw
        )
    if family in ("deepseek_v3", "kimi_k25", "kimi_k25_remote"):
        return T.DeepseekV3Config(**{**kw, **_DEEPSEEK})
    if family == "gpt_oss":
        return T.GptOssConfig(
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"] * (num_layers // 2),
            **kw,
        )
    raise ValueError(family)


class KimiK25ForConditionalGeneration(nn.Module):
    """The remote-code Kimi-K2.5 layout: a full DeepSeek-V3 causal LM under ``language_model``
    (beside a vision tower, left out here)."""

    def __init__(self, lm):
        super().__init__()
        self.language_model = lm
        self.config = lm.config

    def get_output_embeddings(self):
        return self.language_model.lm_head

    def forward(self, **kw):
        return self.language_model(**kw)


def build(family: str, num_layers: int = 8, vocab_size: int = 97, seed: int = 0) -> nn.Module:
    """A tiny random ``family`` model in eval mode, float32, with random norm weights."""
    import transformers as T

    torch.manual_seed(seed)
    tc = text_config(family, num_layers, vocab_size)
    if family == "kimi_k25":
        cfg = T.Kimi_K25Config(
            text_config=tc.to_dict(),
            vision_config=dict(
                hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
            ),
        )
        m = T.Kimi_K25ForConditionalGeneration(cfg)
    elif family == "kimi_k25_remote":
        m = KimiK25ForConditionalGeneration(T.AutoModelForCausalLM.from_config(tc))
    else:
        m = T.AutoModelForCausalLM.from_config(tc)
    with torch.no_grad():  # norm weights away from 1, so a norm applied twice shows
        for n, p in m.named_parameters():
            if n.endswith("norm.weight") or "layernorm" in n:
                p.uniform_(0.5, 1.5)
    return m.float().eval()


def unwrapped(model: nn.Module) -> nn.Module:
    """The bare causal LM inside a Kimi-K2.5 wrapper (the model itself otherwise), sharing weights."""
    import transformers as T

    if isinstance(model, KimiK25ForConditionalGeneration):
        return model.language_model
    if type(model).__name__ == "Kimi_K25ForConditionalGeneration":
        lm = T.DeepseekV3ForCausalLM(model.config.text_config).float().eval()
        lm.model = model.model.language_model
        lm.lm_head = model.lm_head
        return lm
    return model
