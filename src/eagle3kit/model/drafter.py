"""The EAGLE-3 drafter (docs/conventions.md, alignment), in the layout vLLM's ``LlamaForCausalLMEagle3`` and
SGLang's ``LlamaForCausalLMEagle3`` load.

Shapes (H = drafter hidden, Ht = target hidden, V = target vocab, Vd = draft vocab)::

    fc         Linear(3·Ht → H, no bias)      over [aux_lo, aux_mid, aux_hi] concatenated ascending
    midlayer   one Llama decoder layer; attention input = cat(input_layernorm(embed), hidden_norm(h)),
               width 2H (embedding first); residual = h (un-normed, ``norm_before_residual = false``)
    norm       final RMSNorm;   lm_head Linear(H → Vd)

The token embedding is the target's, frozen and passed in as ``embeds`` (never owned or exported).

Variants (:class:`DrafterConfig` flags, each read by vLLM's ``llama_eagle3.py`` under the same name;
the default of every flag is the 2025 EAGLE-3 drafter above):

==========================  =========================================================================
``norm_before_residual``    the decoder layer's residual is ``hidden_norm(h)``, not ``h``
                            (speculators' trainer writes true)
``norm_before_fc``          one RMSNorm ``input_norm`` [3·Ht] over the concatenated aux states before
                            ``fc`` (EAGLE-3.1, gpt-oss style; vLLM ≥ 0.22)
``fc_norm``                 one RMSNorm per aux state, ``fc_norm.{0,1,2}`` [Ht], before ``fc``
                            (EAGLE-3.1 paper; exclusive with ``norm_before_fc``)
``norm_output``             the state fed back to the next draft step is ``norm(out)``, not the
                            pre-norm output (EAGLE-3.1)
``parallel_drafting``       P-EAGLE: all K drafts from one forward. Draft 1 as usual; drafts 2..K at
                            mask slots t+1..t+K−1 whose input is the token ``mask_token_id`` and the
                            learned aux vector ``mask_hidden`` [1, 1, 3·Ht] (through ``fc``), each
                            slot attending causally to the context and the earlier slots (vLLM ≥ 0.16,
                            ``"parallel_drafting": true`` in the speculative config)
==========================  =========================================================================

P-EAGLE's mask slots see exactly the keys training-time test's step k sees (step-0 keys up to t,
then the slots of steps 1..k at t), at the same rotary positions t+k, with the same labels: the
two share :meth:`Eagle3Drafter.ttt_forward`, which only swaps the inputs of steps ≥ 1.

Two forwards compute the same function:

* :meth:`Eagle3Drafter.ttt_forward` — training-time test over whole sequences: step 0 takes the
  fc feature g_t and the embedding of x_{t+1} at rotary position t; step k feeds back the step-(k−1)
  pre-norm output at the same position with the embedding of x_{t+k+1} at rotary position t+k; at
  step k position t attends to step-0 keys at positions ≤ t plus the step-1..k keys of position t.
* :meth:`Eagle3Drafter.step` — one autoregressive step over a position-indexed KV cache
  (:class:`DraftKVCache`), used by the reference decoder; writing position p overwrites whatever
  was there, so rejected drafts need no rollback.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from eagle3kit.model.target import rope_settings


@dataclass
class DrafterConfig:
    """Drafter hyper-parameters; attention/rope fields default to the target's (docs/conventions.md)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int  # target V
    draft_vocab_size: int  # Vd
    target_hidden_size: int  # Ht
    aux_layer_ids: list[int]  # HF output_hidden_states indices
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    extra: dict = field(default_factory=dict)
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    parallel_drafting: bool = False
    mask_token_id: int | None = None  # P-EAGLE: the input token of the mask slots (a target id)

    def __post_init__(self) -> None:
        if self.norm_before_fc and self.fc_norm:
            raise ValueError(
                "norm_before_fc and fc_norm are exclusive (one norm over the aux states, or one each)"
            )
        if self.parallel_drafting and (
            type(self.mask_token_id) is not int or not 0 <= self.mask_token_id < self.vocab_size
        ):
            raise ValueError(
                f"a parallel-drafting (P-EAGLE) drafter needs a mask_token_id in [0, {self.vocab_size}), "
                f"got {self.mask_token_id!r}"
            )
        if self.parallel_drafting and self.norm_output:
            raise ValueError("norm_output has no effect with parallel_drafting (no output is fed back)")

    @classmethod
    def from_target(
        cls, tc, draft_vocab_size: int, aux_layer_ids, vocab_size: int | None = None, **variant
    ) -> "DrafterConfig":
        """Copy widths, attention shape, norm eps, rope and max positions from a target text config;
        ``variant``: the flags of :data:`VARIANT_FLAGS` and ``mask_token_id``."""

        heads = int(tc.num_attention_heads)
        head_dim = int(getattr(tc, "head_dim", None) or tc.hidden_size // heads)
        rope = rope_settings(tc)
        return cls(
            hidden_size=int(tc.hidden_size),
            intermediate_size=int(tc.intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(tc, "num_key_value_heads", None) or heads),
            head_dim=head_dim,
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
            vocab_size=int(vocab_size or tc.vocab_size),
            draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=int(tc.hidden_size),
            aux_layer_ids=[int(i) for i in aux_layer_ids],
            rope_theta=float(rope["rope_theta"]),
            rope_scaling=rope["rope_scaling"],
            max_position_embeddings=int(getattr(tc, "max_position_embeddings", 2048)),
            **variant,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    def variant(self) -> dict:
        """The variant flags that are on, with ``mask_token_id`` when drafting in parallel
        ({} for the 2025 EAGLE-3 drafter)."""
        on = {k: True for k in VARIANT_FLAGS if getattr(self, k)}
        if self.parallel_drafting:
            on["mask_token_id"] = self.mask_token_id
        return on


VARIANT_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "parallel_drafting")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """Rotary embedding with the target's rope settings, via transformers' rope initialisers
    (so ``llama3``/``yarn``/… scaling matches the target's)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        params = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
        if cfg.rope_scaling:
            params.update(cfg.rope_scaling)
            params.setdefault("rope_type", params.get("type", "default"))
        lc = LlamaConfig(
            hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads,
            head_dim=cfg.head_dim,
            max_position_embeddings=cfg.max_position_embeddings,
            rope_parameters=params,
        )
        self.inner = LlamaRotaryEmbedding(config=lc)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [B, T] → (cos, sin) each [B, T, head_dim] in x's dtype."""
        return self.inner(x, positions)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, d]; cos/sin [B, T, d]."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


def compiled(fn):
    """``torch.compile(fn)`` for code whose shapes change with the batch's length and the TTT step:
    after the first change torch.compile recompiles once with symbolic sizes; the raised recompile
    limit (64) is a margin for what stays static."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(fn)


_COMPILED: dict = {}  # function → its compiled form (CUDA), made once per process


def compiled_for(device: torch.device, fn):
    """``fn`` compiled by :func:`compiled` on CUDA (once per process, then reused), ``fn`` itself
    elsewhere: the CPU tests run the same functions eagerly, without a compiler (flex attention then
    runs its unfused reference, which materializes the scores: fine for the small CPU shapes)."""
    if device.type != "cuda":
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = compiled(fn)
    return _COMPILED[fn]


# (T, steps so far, device) → (BlockMask of unpacked rows, its bytes), least recently used first.
# Length-grouped batches give every batch its own T, so one epoch asks for (batches × TTT steps)
# masks (448 on the SmolLM2 recipe: 64 batches, TTT 7); a cache of 256 was emptied every epoch and
# each step built its masks again (create_block_mask evaluates mask_mod over the whole [T, T·steps]
# grid). A mask's index tensors grow with T² (about 30 KB at T 2048, 7 steps; 7 MB at 32K), so the
# cache is bounded in bytes: thousands of short masks, a few dozen of 32K.
_BLOCK_MASKS: OrderedDict = OrderedDict()
BLOCK_MASK_CACHE_BYTES = 256 << 20


def flex_ttt_attention(
    q: torch.Tensor, keys: list[torch.Tensor], vals: list[torch.Tensor], doc: torch.Tensor | None = None
) -> torch.Tensor:
    """TTT attention of step k = len(keys) − 1 through flex attention.

    Args:
        q: [B, nh, T, d] (rotary applied); keys/vals: per step 0..k, [B, nkv, T, d].
        doc: int64 [B, T] sequence ids of a packed row, or None.
    Returns:
        [B, nh, T, d]: position t attends to step-0 keys at positions ≤ t (of its own sequence)
        and to the step-1..k keys of position t itself — the same function as the dense reference
        in :meth:`Eagle3Drafter.ttt_forward` (EAGLE-3's training-time test, Li et al. 2025, §3.2).
    """
    B, _, T, _ = q.shape
    flex = compiled_for(q.device, flex_attention)  # keys are T·(k+1) long: shapes change every step
    if torch.is_autocast_enabled(q.device.type):  # rotary promotes q/k to fp32: attend in the autocast dtype
        dt = torch.get_autocast_dtype(q.device.type)
        q, keys, vals = q.to(dt), [k.to(dt) for k in keys], [v.to(dt) for v in vals]

    def mask_mod(b, h, qi, ki):
        seg = ki // T
        j = ki - seg * T
        causal = (seg == 0) & (j <= qi)
        if doc is not None:
            causal = causal & (doc[b, qi] == doc[b, j])
        return causal | ((seg > 0) & (j == qi))

    key = (T, len(keys), str(q.device))
    # without packing the mask depends on (T, step) only
    block = _BLOCK_MASKS[key][0] if doc is None and key in _BLOCK_MASKS else None
    if block is not None:
        _BLOCK_MASKS.move_to_end(key)
    else:
        block = create_block_mask(
            mask_mod, B if doc is not None else None, None, T, T * len(keys), device=q.device
        )
        if doc is None:
            size = sum(t.numel() * t.element_size() for t in block.as_tuple() if torch.is_tensor(t))
            _BLOCK_MASKS[key] = (block, size)
            while sum(n for _, n in _BLOCK_MASKS.values()) > BLOCK_MASK_CACHE_BYTES and len(_BLOCK_MASKS) > 1:
                _BLOCK_MASKS.popitem(last=False)
    return flex(
        q,
        torch.cat(keys, dim=2),
        torch.cat(vals, dim=2),
        block_mask=block,
        enable_gqa=q.shape[1] != keys[0].shape[1],
    )


class DraftKVCache:
    """Position-indexed KV cache for one drafter layer: ``k``/``v`` [B, kv_heads, max_len, d].
    Writing position p overwrites slot p; a query at position q sees slots ≤ q."""

    def __init__(self, batch: int, kv_heads: int, head_dim: int, max_len: int, device, dtype):
        self.k = torch.zeros(batch, kv_heads, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, nh, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.d = nh, nkv, d
        self.q_proj = nn.Linear(2 * h, nh * d, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * d, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, h, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, 2H] → q [B, nh, T, d], k/v [B, nkv, T, d] (rotary applied to q and k)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.d).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.d).transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def expand(self, kv: torch.Tensor) -> torch.Tensor:
        """GQA: [B, nkv, …, d] → [B, nh, …, d]."""
        rep = self.nh // self.nkv
        return kv if rep == 1 else kv.repeat_interleave(rep, dim=1)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, nh, T, d] → [B, T, H]."""
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.d))


class Eagle3Layer(nn.Module):
    """The single decoder layer (``midlayer``)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(h, cfg.intermediate_size, bias=False),
                "up_proj": nn.Linear(h, cfg.intermediate_size, bias=False),
                "down_proj": nn.Linear(cfg.intermediate_size, h, bias=False),
            }
        )

    def attn_input(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """cat(input_layernorm(embeds), hidden_norm(hidden)) → [B, T, 2H]."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Residual add, post-attention norm, SwiGLU MLP, residual add → pre-norm output [B, T, H]."""
        h = residual + attn_out
        x = self.post_attention_layernorm(h)
        m = self.mlp
        return h + m["down_proj"](F.silu(m["gate_proj"](x)) * m["up_proj"](x))


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter. Parameters carry the exported names (``fc``, ``midlayer.*``, ``norm``,
    ``lm_head``, and per variant ``input_norm``, ``fc_norm.{0,1,2}``, ``mask_hidden``); buffers
    ``d2t`` int64 [Vd] (offsets) and ``t2d`` bool [V] hold the vocab map.

    The variant flags of the module docstring come from ``cfg``; ``norm_before_residual`` and
    ``norm_output`` are also attributes of the module, which ``diagnose`` flips on a copy to
    simulate an engine that reads the other convention.
    """

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.norm_before_residual = cfg.norm_before_residual
        self.norm_output = cfg.norm_output
        Ht, eps = cfg.target_hidden_size, cfg.rms_norm_eps
        n = self.num_aux = (
            len(cfg.aux_layer_ids) or 3
        )  # eagle3kit trains 3; an imported drafter may have others
        self.input_norm = RMSNorm(n * Ht, eps) if cfg.norm_before_fc else None
        self.fc_norm = nn.ModuleList([RMSNorm(Ht, eps) for _ in range(n)]) if cfg.fc_norm else None
        self.fc = nn.Linear(n * Ht, cfg.hidden_size, bias=False)
        # P-EAGLE's learned aux vector of the mask slots (speculators' shape; randn as speculators initialises it)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, n * Ht)) if cfg.parallel_drafting else None
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = Rotary(cfg)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self._init_weights()

    def _init_weights(self) -> None:
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=0.02)

    def compile_layer(self) -> None:
        """Compile the decoder layer's norm/concat, q/k/v projections with the rotary embedding,
        and residual/MLP pieces with ``torch.compile`` (fuses the element-wise work and the dtype
        casts around the matmuls; the attention has its own kernel)."""
        self.midlayer.attn_input = compiled(self.midlayer.attn_input)
        self.midlayer.self_attn.qkv = compiled(self.midlayer.self_attn.qkv)
        self.midlayer.finish = compiled(self.midlayer.finish)

    def set_vocab(self, vocab) -> None:
        """Install the draft vocabulary's maps (a :class:`eagle3kit.model.draft_vocab.DraftVocab`)."""
        self.d2t.copy_(vocab.d2t)
        self.t2d.copy_(vocab.t2d)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """Aux states [..., n·Ht] (n aux layers, 3 for what eagle3kit trains; ascending layer order) →
        the drafter's feature [..., H]:
        ``input_norm`` or the per-layer ``fc_norm`` when the variant has them, then ``fc`` (vLLM's
        ``combine_hidden_states``)."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, aux.chunk(self.num_aux, dim=-1))], dim=-1)
        return self.fc(aux)

    def feedback(self, out: torch.Tensor) -> torch.Tensor:
        """The state the next draft step reads from a pre-norm output [..., H]: ``norm(out)`` when
        :attr:`norm_output`, else ``out`` itself."""
        return self.norm(out) if self.norm_output else out

    def step_tokens(self, tokens: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each TTT step's input token ids (int64 [B, T] each; step k holds x_{t+k+1} at t): the data
        tokens themselves, or for a parallel-drafting drafter the data tokens at step 0 and
        ``mask_token_id`` at every later step (the mask slots)."""
        if not self.config.parallel_drafting:
            return tokens
        return tokens[:1] + [torch.full_like(tokens[0], self.config.mask_token_id) for _ in tokens[1:]]

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids → target ids (``id + d2t[id]``)."""
        return draft_ids + self.d2t[draft_ids]

    def head_input(self, prenorm: torch.Tensor) -> torch.Tensor:
        """[…, H] pre-norm output → […, H] what the lm_head reads (the final norm)."""
        return self.norm(prenorm)

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """[…, H] pre-norm output → […, Vd] draft logits."""
        return self.lm_head(self.head_input(prenorm))

    # ---- training-time test -------------------------------------------------------------
    def forward(self, *args, **kwargs) -> list[torch.Tensor]:
        """:meth:`ttt_forward` (the module's forward, so DistributedDataParallel sees the training call)."""
        return self.ttt_forward(*args, **kwargs)

    def ttt_forward(
        self,
        aux: torch.Tensor,
        embeds: list[torch.Tensor],
        positions: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        doc: torch.Tensor | None = None,
        attention: str = "reference",
    ) -> list[torch.Tensor]:
        """Unroll ``len(embeds)`` TTT steps over whole sequences (for a parallel-drafting drafter,
        step k ≥ 1 is the k-th mask slot: its feature is ``combine(mask_hidden)``, not step k−1's
        output, and its embedding the mask token's, :meth:`step_tokens`).

        Args:
            aux: [B, T, 3·Ht] target aux states at positions 0..T−1.
            embeds: per step k, [B, T, H] target-embedding of :meth:`step_tokens`' step k at position t
                (the data token x_{t+k+1}, zeros past the end).
            positions: int64 [B, T] rotary position of each token within its own sequence
                (``arange(T)`` per row; restarting at 0 at each sequence of a packed row).
            key_mask: bool [B, T], False at padding (right padding).
            doc: int64 [B, T] which sequence of a packed row each token belongs to (None: one per row);
                a token attends only to earlier tokens of its own sequence.
            attention: ``"reference"`` — dense [T, T] scores plus one diagonal score per earlier
                step, readable, any device; ``"flex"`` — the same function through
                ``torch.nn.attention.flex_attention`` over the concatenated keys [step 0 | step 1 | …]
                with a block mask (causal in the step-0 block, the diagonal in the others), so no
                [T, T·steps] mask or score matrix exists; compiled on CUDA (on CPU it runs flex's
                unfused reference, for tests).

        Returns:
            list over steps of pre-norm outputs [B, T, H]; logits via :meth:`logits`.
        """
        attn = self.midlayer.self_attn
        hidden = self.combine(aux)
        B, T, _ = hidden.shape
        parallel = self.mask_hidden is not None
        if attention == "reference":
            allowed = torch.ones(T, T, dtype=torch.bool, device=hidden.device).tril()[None]
            if key_mask is not None:
                allowed = allowed & key_mask[:, None, :]
            if doc is not None:
                allowed = allowed & (doc[:, :, None] == doc[:, None, :])
            # every position may attend to itself: a padding query has no other key, and an all-masked row
            # would give NaN (which reaches every weight through the backward pass)
            allowed = allowed | torch.eye(T, dtype=torch.bool, device=hidden.device)[None]
        elif attention != "flex":
            raise ValueError(f"attention must be 'reference' or 'flex', not {attention!r}")
        scale = 1.0 / math.sqrt(attn.d)
        keys: list[torch.Tensor] = []  # per step, [B, nkv, T, d]; the reference keeps them GQA-expanded
        vals: list[torch.Tensor] = []
        outs = []
        for k, emb in enumerate(embeds):
            if parallel and k == 1:  # the mask slots: one learned feature at every position and step
                hidden = self.combine(self.mask_hidden.to(aux.dtype)).expand(B, T, -1)
            x = self.midlayer.attn_input(hidden, emb)
            cos, sin = self.rotary(x, positions + k)
            q, kk, vv = attn.qkv(x, cos, sin)
            if attention == "flex":
                keys.append(kk)
                vals.append(vv)
                o = flex_ttt_attention(q, keys, vals, doc)
            else:
                keys.append(attn.expand(kk))
                vals.append(attn.expand(vv))
                s0 = (q @ keys[0].transpose(-1, -2)) * scale  # [B, nh, T, T]
                s0 = s0.masked_fill(~allowed[:, None], float("-inf"))
                sd = [((q * dk).sum(-1, keepdim=True)) * scale for dk in keys[1:]]  # each [B, nh, T, 1]
                p = torch.softmax(torch.cat([s0] + sd, dim=-1).float(), dim=-1).to(q.dtype)
                o = p[..., :T] @ vals[0]
                for j, dv in enumerate(vals[1:]):
                    o = o + p[..., T + j : T + j + 1] * dv
            out = self.midlayer.finish(attn.out(o), self._residual(hidden))
            outs.append(out)
            if not parallel:
                hidden = self.feedback(out)
        return outs

    def _residual(self, hidden: torch.Tensor) -> torch.Tensor:
        """The decoder layer's residual input: the feature itself, or its ``hidden_norm`` when
        :attr:`norm_before_residual` is set."""
        return self.midlayer.hidden_norm(hidden) if self.norm_before_residual else hidden

    # ---- cached autoregressive step -----------------------------------------------------
    def new_cache(self, batch: int, max_len: int, device=None, dtype=None) -> DraftKVCache:
        w = self.fc.weight
        return DraftKVCache(
            batch,
            self.config.num_key_value_heads,
            self.config.head_dim,
            max_len,
            device or w.device,
            dtype or w.dtype,
        )

    def step(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        cache: DraftKVCache,
        slots: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the layer for q new tokens over a position-indexed KV cache (chain or tree drafting).

        Args:
            hidden: [B, q, H] input feature (:meth:`combine` of target aux states, :meth:`feedback` of a
                previous output, or ``combine(mask_hidden)`` at a P-EAGLE mask slot).
            embeds: [B, q, H] target-embedding of the token at each new position's next slot.
            positions: int64 [B, q] rotary positions (the same for every row).
            cache: the drafter's :class:`DraftKVCache` ([B, kv_heads, max_len, d]).
            slots: int64 [q] cache slots the new keys/values are written to (default: the positions).
            mask: bool [q, max_len], True where a new token may attend (default: slots ≤ its own slot,
                i.e. causal); a draft tree passes prefix + ancestors + itself.
        Returns: pre-norm outputs [B, q, H].
        """
        attn = self.midlayer.self_attn
        x = self.midlayer.attn_input(hidden, embeds)
        cos, sin = self.rotary(x, positions)
        q, k, v = attn.qkv(x, cos, sin)
        slots = positions[0] if slots is None else slots
        cache.k.index_copy_(2, slots, k.to(cache.k.dtype))
        cache.v.index_copy_(2, slots, v.to(cache.v.dtype))
        if mask is None:
            mask = torch.arange(cache.k.shape[2], device=q.device)[None, :] <= slots[:, None]
        keys, vals = attn.expand(cache.k.to(q.dtype)), attn.expand(cache.v.to(q.dtype))
        s = (q @ keys.transpose(-1, -2)) / math.sqrt(attn.d)  # softmax in fp32, as in training
        o = torch.softmax(s.float().masked_fill(~mask[None, None], float("-inf")), dim=-1).to(q.dtype) @ vals
        return self.midlayer.finish(attn.out(o), self._residual(hidden))
