"""The target's forward for the reference decoder, in the style of gpt-fast.

A :class:`FastTarget` runs the target's own weights (the transformers modules of a loaded
:class:`eagle3kit.model.target.Target`, shared, not copied) through a forward written for decoding:

* one KV cache for all layers, ``k``/``v`` [L, 1, kv_heads, max_len, head_dim], indexed by
  *slot*: a forward writes token i's keys and values at ``slots[i]`` and never crops or rolls
  back; a later forward simply overwrites the slots of rejected drafts;
* rotary position ``positions[i]`` apart from the slot, and an explicit boolean attention mask
  [T, max_len] (True = may attend), so that one forward verifies a whole draft tree (a node sees
  the prefix and its ancestors, docs/measuring.md);
* the aux hidden states (the input of each decoder layer in ``aux_layer_ids``, the convention of
  :func:`eagle3kit.model.target.capture_layer_inputs`) returned beside the logits;
* on CUDA, ``compile=True`` wraps the fixed-shape forwards (one token, one verify step) in
  ``torch.compile(mode="reduce-overhead")``: CUDA graphs, as gpt-fast does. Prefill runs eager.

Supported layouts: the Llama family (Llama, Mistral, Qwen2 with q/k/v biases, Qwen3 with q/k
norms, SmolLM2) with full attention. Other layouts raise :class:`NotImplementedError`.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from eagle3kit.model.drafter import apply_rotary


class FastTarget(nn.Module):
    """A decode-oriented forward over a Llama-family target's modules.

    Args:
        model: the transformers causal LM; parts: its :class:`eagle3kit.model.target.TargetParts`;
        aux_layer_ids: layers whose input is returned as aux hidden states (may be empty);
        max_len: cache length in slots (tokens); compile: CUDA graphs via ``torch.compile``.
    Raises:
        NotImplementedError: for a layout other than the Llama family, or sliding-window layers.
    """

    def __init__(
        self, model: nn.Module, parts, aux_layer_ids: Sequence[int], max_len: int, compile: bool = False
    ):
        super().__init__()
        cfg = getattr(model.config, "text_config", None) or model.config
        layer_types = getattr(cfg, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise NotImplementedError(
                f"{type(model).__name__}: the reference decoder supports full-attention layers only "
                f"(layer types {sorted(set(layer_types))})"
            )
        window = getattr(cfg, "sliding_window", None)
        if window and getattr(cfg, "use_sliding_window", True) and max_len > window:
            raise NotImplementedError(
                f"{type(model).__name__} attends within a sliding window of {window} tokens, and "
                f"this cache holds {max_len}: the reference decoder has full attention only"
            )
        for i, layer in enumerate(parts.layers):
            a = getattr(layer, "self_attn", None)
            if (
                a is None
                or not all(hasattr(a, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
                or not hasattr(layer, "post_attention_layernorm")
                or hasattr(layer, "pre_feedforward_layernorm")
            ):
                raise NotImplementedError(
                    f"{type(model).__name__} layer {i}: not a Llama-family layout; the reference "
                    "decoder supports Llama, Mistral, Qwen2, Qwen3 and SmolLM2 targets"
                )
        self.embed, self.layers, self.norm, self.lm_head = (
            parts.embed,
            parts.layers,
            parts.final_norm,
            parts.lm_head,
        )
        self.rotary = parts.decoder.rotary_emb
        self.nh, self.nkv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
        self.hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.scale = float(getattr(parts.layers[0].self_attn, "scaling", self.hd**-0.5))
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.max_len = max_len
        w = self.lm_head.weight
        shape = (len(parts.layers), 1, self.nkv, max_len, self.hd)
        self.register_buffer("k", torch.zeros(shape, device=w.device, dtype=w.dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=w.device, dtype=w.dtype), persistent=False)
        self._compiled = (
            torch.compile(self._forward, mode="reduce-overhead", fullgraph=True) if compile else None
        )

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor):
        T = ids.shape[0]
        x = self.embed(ids)[None]
        cos, sin = self.rotary(x, positions[None])
        aux = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_layer_ids:
                aux[i] = x
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(1, T, self.nh, self.hd)
            k = a.k_proj(h).view(1, T, self.nkv, self.hd)
            v = a.v_proj(h).view(1, T, self.nkv, self.hd).transpose(1, 2)
            if hasattr(a, "q_norm"):  # Qwen3
                q, k = a.q_norm(q), a.k_norm(k)
            q = apply_rotary(q.transpose(1, 2), cos, sin)
            k = apply_rotary(k.transpose(1, 2), cos, sin)
            self.k[i].index_copy_(2, slots, k)
            self.v[i].index_copy_(2, slots, v)
            o = F.scaled_dot_product_attention(
                q,
                self.k[i],
                self.v[i],
                attn_mask=mask[None, None],
                scale=self.scale,
                enable_gqa=self.nh != self.nkv,
            )
            x = x + a.o_proj(o.transpose(1, 2).reshape(1, T, self.nh * self.hd))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = self.lm_head(self.norm(x))[0]
        return logits, (torch.cat([aux[i] for i in self.aux_layer_ids], dim=-1)[0] if aux else x[0, :, :0])

    @torch.no_grad()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        mask: torch.Tensor,
        eager: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over T new tokens.

        Args:
            ids, positions, slots: int64 [T] (token ids, rotary positions, cache slots);
            mask: bool [T, max_len], True where token i may attend to a slot (its own included);
            eager: skip the compiled path (prefill, whose length varies).
        Returns: logits [T, V] and aux hidden states [T, len(aux_layer_ids)·H], in the model's dtype
        (copies, safe to keep across calls).
        """
        if self._compiled is not None and not eager:
            logits, aux = self._compiled(ids, positions, slots, mask)
            return logits.clone(), aux.clone()
        return self._forward(ids, positions, slots, mask)

    def causal_mask(self, start: int, n: int) -> torch.Tensor:
        """bool [n, max_len]: token i (in slot start+i) sees slots 0 … start+i."""
        dev = self.k.device
        return (
            torch.arange(self.max_len, device=dev)[None, :]
            <= torch.arange(start, start + n, device=dev)[:, None]
        )

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the cached keys/values of slots ``src`` to slots ``dst`` (int64 [n]) in every layer:
        an accepted tree path is moved into consecutive slots (the rest is overwritten later)."""
        self.k[:, :, :, dst] = self.k[:, :, :, src]
        self.v[:, :, :, dst] = self.v[:, :, :, src]
