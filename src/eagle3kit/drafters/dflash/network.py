"""The DFlash drafter: a block of ``[anchor, MASK × (B − 1)]`` decoded in one non-causal forward of a
few Qwen3-style layers, reading the target's aux hidden states as extra keys and values.

Definitions (DFlash, arXiv 2602.06036; the layout vLLM's ``qwen3_dflash.py`` loads):

- context: the aux states of several target layers, concatenated ``[T, n · Ht]``, projected by ``fc``
  and normalised (``hidden_norm``); every draft layer projects the same context with its own
  ``k_proj``/``v_proj`` (then ``k_norm`` and rope at the context's positions) into extra keys/values;
- query: the block's token embeddings (the target's embedding, frozen): the anchor token at position
  ``p`` (the verify step's bonus token), then the mask token at ``p + 1 … p + B − 1``;
- attention: a block position sees the context before its anchor (positions ``< p``) and every
  position of its own block (non-causal);
- output: ``norm`` then the target's lm_head (frozen, full vocabulary); slot ``k ≥ 1`` drafts the
  token at position ``p + k``. Slot 0 (the anchor) is never a draft.

Target layer ids follow DFlash's convention: ``t`` is the output of decoder layer ``t`` (0-based),
which is Hugging Face ``output_hidden_states`` index (aux id) ``t + 1`` (vLLM adds the 1 when it reads
``dflash_config.target_layer_ids``). This module never copies a peer's code; its forward is compared
with speculators' ``DFlashDraftModel`` in the tests.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from eagle3kit.core.config import ConfigError
from eagle3kit.model.drafter import RMSNorm, Rotary, apply_rotary
from eagle3kit.model.target import rope_settings

#: block size of the newer public DFlash drafters (Kimi-K2.5's, speculators' default); the first used 16
DEFAULT_BLOCK_SIZE = 8
#: draft layers of the public Qwen3-8B drafter (z-lab); Kimi-K2.5's has 6
DEFAULT_LAYERS = 5


def default_target_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """``count`` target layers spread evenly from layer 1 to layer ``N − 3`` (DFlash's choice: for a
    36-layer Qwen3-8B and 5 layers, ``[1, 9, 17, 25, 33]``), in DFlash's 0-based convention.

    Raises:
        ConfigError: a target too shallow for ``count`` distinct layers."""
    first, last = 1, num_target_layers - 3
    if count < 1 or last - first + 1 < count:
        raise ConfigError(
            f"a target of {num_target_layers} layers has no {count} distinct layers between 1 and "
            f"{last}; set drafter.target_layer_ids"
        )
    if count == 1:
        return [(first + last) // 2]
    return [int(round(first + i * (last - first) / (count - 1))) for i in range(count)]


@dataclass
class DFlashConfig:
    """DFlash drafter hyper-parameters. Widths, attention shape, norm eps and rope follow the target
    (the drafter reads the target's embedding, so ``hidden_size`` is the target's)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    target_hidden_size: int
    num_target_layers: int
    target_layer_ids: list[int]  # DFlash convention: decoder layer t's output (aux id t + 1)
    block_size: int
    mask_token_id: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    layer_types: list[str] = field(default_factory=list)  # empty: every layer full attention

    def __post_init__(self) -> None:
        if self.hidden_size != self.target_hidden_size:
            raise ConfigError(
                f"a DFlash drafter reads the target's embedding: its hidden size {self.hidden_size} must be "
                f"the target's {self.target_hidden_size}"
            )
        if self.block_size < 2:
            raise ConfigError(
                f"drafter.block_size {self.block_size}: a block drafts block_size − 1 tokens; use ≥ 2"
            )
        bad = [t for t in self.target_layer_ids if not 0 <= t < self.num_target_layers]
        if bad or len(set(self.target_layer_ids)) != len(self.target_layer_ids) or not self.target_layer_ids:
            raise ConfigError(
                f"drafter.target_layer_ids {self.target_layer_ids}: need distinct decoder layers in "
                f"[0, {self.num_target_layers - 1}] (DFlash's 0-based convention)"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"drafter.mask_token_id {self.mask_token_id} is no id of the target's vocabulary of "
                f"{self.vocab_size} (the block embeds it with the target's embedding)"
            )

    @property
    def aux_layer_ids(self) -> list[int]:
        """The target states read, as Hugging Face ``output_hidden_states`` indices (= vLLM's aux ids)."""
        return [t + 1 for t in self.target_layer_ids]

    @classmethod
    def from_target(
        cls,
        tc,
        mask_token_id: int,
        num_layers: int = DEFAULT_LAYERS,
        block_size: int = DEFAULT_BLOCK_SIZE,
        target_layer_ids: list[int] | None = None,
        intermediate_size: int | None = None,
    ) -> DFlashConfig:
        """From a target text config: widths, heads, eps, rope and max positions copied; target layers
        :func:`default_target_layer_ids` (one per draft layer) unless given."""
        heads = int(tc.num_attention_heads)
        head_dim = int(getattr(tc, "head_dim", None) or tc.hidden_size // heads)
        rope = rope_settings(tc)
        n_target = int(tc.num_hidden_layers)
        return cls(
            hidden_size=int(tc.hidden_size),
            intermediate_size=int(
                intermediate_size or getattr(tc, "intermediate_size", None) or 3 * tc.hidden_size
            ),
            num_hidden_layers=int(num_layers),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(tc, "num_key_value_heads", None) or heads),
            head_dim=head_dim,
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
            vocab_size=int(tc.vocab_size),
            target_hidden_size=int(tc.hidden_size),
            num_target_layers=n_target,
            target_layer_ids=list(target_layer_ids or default_target_layer_ids(n_target, num_layers)),
            block_size=int(block_size),
            mask_token_id=int(mask_token_id),
            rope_theta=float(rope["rope_theta"]),
            rope_scaling=rope["rope_scaling"],
            max_position_embeddings=int(getattr(tc, "max_position_embeddings", 4096) or 4096),
        )

    def to_dict(self) -> dict:
        return asdict(self)


class DFlashAttention(nn.Module):
    """Qwen3 attention (per-head q/k RMSNorm, rope) whose keys/values are the context's then the block's."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        H, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(H, self.heads * d, bias=False)
        self.k_proj = nn.Linear(H, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(H, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, H, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:2], n, self.d).transpose(1, 2)  # [B, n, T, d]

    def forward(
        self, x: torch.Tensor, ctx: torch.Tensor, rope_q, rope_ctx, mask: torch.Tensor
    ) -> torch.Tensor:
        """x [B, Q, H] (block, normed); ctx [B, T, H] (normed fc output); rope_*: (cos, sin) of each's
        positions; mask bool [B, 1, Q, T + Q] (True: may attend) → [B, Q, H]."""
        q = apply_rotary(self.q_norm(self._heads(self.q_proj(x), self.heads)), *rope_q)
        k_blk = apply_rotary(self.k_norm(self._heads(self.k_proj(x), self.kv_heads)), *rope_q)
        k_ctx = apply_rotary(self.k_norm(self._heads(self.k_proj(ctx), self.kv_heads)), *rope_ctx)
        v = torch.cat(
            [self._heads(self.v_proj(ctx), self.kv_heads), self._heads(self.v_proj(x), self.kv_heads)], 2
        )
        k = torch.cat([k_ctx, k_blk], 2)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(self.d), enable_gqa=self.heads != self.kv_heads
        )
        return self.o_proj(o.transpose(1, 2).reshape(*x.shape[:2], self.heads * self.d))


class DFlashLayer(nn.Module):
    """A pre-norm Qwen3 decoder layer around :class:`DFlashAttention` (SwiGLU MLP)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        H, inter = cfg.hidden_size, cfg.intermediate_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(H, inter, bias=False),
                "up_proj": nn.Linear(H, inter, bias=False),
                "down_proj": nn.Linear(inter, H, bias=False),
            }
        )

    def forward(self, x, ctx, rope_q, rope_ctx, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_ctx, mask)
        h = self.post_attention_layernorm(x)
        return x + self.mlp["down_proj"](F.silu(self.mlp["gate_proj"](h)) * self.mlp["up_proj"](h))


class DFlashDrafter(nn.Module):
    """The DFlash network (no embedding, no lm_head: both are the target's). Tensor names are those
    of the layout vLLM loads (``layers.N.…``, ``fc``, ``hidden_norm``, ``norm``)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        if any(t != "full_attention" for t in cfg.layer_types):
            raise ConfigError(
                "drafter.layer_types: only full-attention DFlash layers are trained (vLLM's CPU build refuses "
                "mixed sliding/full drafts)"
            )
        self.cfg = cfg
        n = len(cfg.target_layer_ids)
        self.fc = nn.Linear(n * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)  # reads hidden_size, heads, head_dim, rope and max positions
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B, T, n · Ht] (the target layers' states, in ``target_layer_ids`` order) → [B, T, H]."""
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def forward(
        self,
        ctx: torch.Tensor,
        ctx_pos: torch.Tensor,
        block_embeds: torch.Tensor,
        block_pos: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """One forward over every block at once.

        Args:
            ctx: [B, T, H] from :meth:`context`; ctx_pos: int64 [B, T] its positions.
            block_embeds: [B, Q, H] the blocks' token embeddings (Q = blocks × block size);
            block_pos: int64 [B, Q]; mask: bool [B, 1, Q, T + Q] from :func:`block_mask`.
        Returns: [B, Q, H] post-norm states (the target's lm_head gives the draft logits).
        """
        x = block_embeds.to(ctx.dtype)
        rope_q, rope_ctx = self.rotary(x, block_pos), self.rotary(x, ctx_pos)
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_ctx, mask)
        return self.norm(x)


def block_mask(
    anchors: torch.Tensor, ctx_valid: torch.Tensor, block_size: int, causal: bool = False
) -> torch.Tensor:
    """Who sees what: block ``j`` (anchor ``anchors[b, j]``) sees the valid context positions before
    its anchor and its own ``block_size`` positions; a padding anchor (−1) sees only its own block.
    ``causal``: a slot sees only its block's slots up to itself — not DFlash's pattern, but what an
    engine that builds the draft's attention as for a chain drafter computes (``diagnose`` simulates it).

    Args: anchors int64 [B, A]; ctx_valid bool [B, T]. Returns: bool [B, 1, A·bs, T + A·bs]."""
    B, A = anchors.shape
    T = ctx_valid.shape[1]
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, Q]
    pos = torch.arange(T, device=anchors.device)
    see_ctx = (pos[None, None, :] < q_anchor[:, :, None]) & ctx_valid[:, None, :]
    blk = torch.arange(A * block_size, device=anchors.device) // block_size
    see_blk = blk[:, None] == blk[None, :]
    if causal:
        see_blk = see_blk.tril()
    see_blk = see_blk.expand(B, -1, -1)
    return torch.cat([see_ctx, see_blk], dim=2)[:, None]


def block_inputs(ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """The blocks' token ids and positions: ``[ids[p], MASK, …]`` at ``p, p + 1, …``.

    Args: ids int64 [B, T]; anchors int64 [B, A] (−1: padding, given position 0).
    Returns: (tokens int64 [B, A·bs], positions int64 [B, A·bs])."""
    p = anchors.clamp(min=0)
    tokens = torch.full((*anchors.shape, block_size), mask_token_id, dtype=torch.long, device=ids.device)
    tokens[..., 0] = ids.gather(1, p)
    pos = p[..., None] + torch.arange(block_size, device=ids.device)
    return tokens.flatten(1), pos.flatten(1)
