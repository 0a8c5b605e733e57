"""The DSpark drafter: DFlash's network (:class:`eagle3kit.drafters.dflash.network.DFlashDrafter`) plus
a Markov head and a confidence head, with the tensor names and shapes vLLM's
``model_executor/models/qwen3_dspark.py`` loads.

Definitions (vLLM's ``qwen3_dspark.py`` and ``v1/worker/gpu/spec_decode/dspark/speculator.py``):

- backbone: DFlash's — the block ``[anchor, MASK × (B − 1)]`` at positions ``p … p + B − 1`` reads the
  aux hidden states of the target's positions ``< p`` and its own block (non-causal), then ``norm``;
  the target's lm_head (frozen, whole vocabulary) gives the base logits.
- which slot drafts what (``sample_from_anchor``, vLLM's default true): every slot ``s`` (0 … B − 1)
  drafts the token at ``p + s + 1`` — the anchor itself drafts the first token, B drafts a block. False
  is DFlash's fill-in layout: slot ``s ≥ 1`` drafts the token at ``p + s``, B − 1 drafts a block.
- Markov head (low rank ``r``): ``markov_w1`` Embedding ``[V, r]`` embeds the token before the drafted
  one (the anchor for the first draft, then each draft in turn), ``markov_w2`` ``[Vd, r]`` (no bias)
  projects it to a bias over the draft vocabulary, added to the base logits of that draft. The draft
  vocabulary here is the target's whole vocabulary (``Vd = V``).
- confidence head: ``proj`` ``[1, H (+ r)]`` with a bias, float32, over the draft's post-norm state
  (concatenated with its Markov embedding when ``confidence_with_markov``); its sigmoid is the draft's
  acceptance probability given the drafts before it accepted (vLLM's adaptive verification ranks
  drafts by the running product, ``v1/worker/gpu/spec_decode/adaptive_verification.py``).

Target layer ids are DFlash's 0-based decoder-layer outputs (aux id ``t + 1``; vLLM adds the 1 when it
reads ``dspark_target_layer_ids``, ``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eagle3kit.core.config import ConfigError
from eagle3kit.drafters.dflash.network import DEFAULT_LAYERS, DFlashConfig, DFlashDrafter

#: Markov rank eagle3kit trains by default (our choice: 2 · 256 · V parameters, small beside the layers)
DEFAULT_MARKOV_RANK = 256
#: block size by default: 7 drafts from the anchor, as the checkpoint vLLM's ``config/speculative.py``
#: names (``deepseek-ai/dspark_qwen3_8b_block7``)
DEFAULT_BLOCK_SIZE = 7


@dataclass
class DSparkConfig(DFlashConfig):
    """DFlash's hyper-parameters (:class:`DFlashConfig`) and the heads': ``markov_rank`` (``r``),
    ``sample_from_anchor`` (which slot drafts what, module docstring), ``confidence_head`` (whether the
    drafter has one) and ``confidence_with_markov`` (its input is ``[hidden, Markov embedding]``)."""

    markov_rank: int = DEFAULT_MARKOV_RANK
    sample_from_anchor: bool = True
    confidence_head: bool = True
    confidence_with_markov: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.markov_rank < 1:
            raise ConfigError(f"markov_rank {self.markov_rank}: the Markov head needs a rank ≥ 1")

    @property
    def slot_shift(self) -> int:
        """1 when slot ``s`` drafts the token at ``p + s + 1`` (anchor-as-first), 0 when at ``p + s``."""
        return int(self.sample_from_anchor)

    @property
    def drafts_per_block(self) -> int:
        """The most tokens one block drafts: ``B`` anchor-as-first, ``B − 1`` in the fill-in layout."""
        return self.block_size - 1 + self.slot_shift

    @classmethod
    def from_target(
        cls,
        tc,
        mask_token_id: int,
        num_layers: int = DEFAULT_LAYERS,
        block_size: int = DEFAULT_BLOCK_SIZE,
        target_layer_ids: list[int] | None = None,
        intermediate_size: int | None = None,
        markov_rank: int = DEFAULT_MARKOV_RANK,
        sample_from_anchor: bool = True,
    ) -> DSparkConfig:
        """From a target text config as :meth:`DFlashConfig.from_target`, with the heads' settings.

        Raises:
            ConfigError: what :class:`DFlashConfig` refuses, or a Markov rank below 1."""
        base = super().from_target(
            tc, mask_token_id, num_layers, block_size, target_layer_ids, intermediate_size
        )
        return dataclasses.replace(base, markov_rank=int(markov_rank), sample_from_anchor=sample_from_anchor)


class DSparkMarkovHead(nn.Module):
    """``markov_w1`` (Embedding ``[V, r]``) and ``markov_w2`` (``[Vd, r]``, no bias): the bias the token
    before a draft adds to its logits (vLLM's ``DSparkMarkovHead``). ``markov_w2`` starts at zero, so an
    untrained head adds nothing."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=rank**-0.5)
        nn.init.zeros_(self.markov_w2.weight)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        """int64 [...] target ids of the tokens before the drafts → [..., r]."""
        return self.markov_w1(prev)

    def bias(self, markov_embed: torch.Tensor) -> torch.Tensor:
        """[..., r] → [..., Vd] the bias added to the drafts' base logits (no scale: vLLM's
        ``logit_scale`` defaults to 1 and eagle3kit writes none)."""
        return self.markov_w2(markov_embed)


class DSparkConfidenceHead(nn.Module):
    """``proj`` (``[1, H + r]`` or ``[1, H]``, with bias), run in float32 whatever the drafter's dtype,
    as vLLM's ``DSparkConfidenceHead`` (its ``ReplicatedLinear`` is created float32)."""

    def __init__(self, input_dim: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(input_dim, 1, bias=True)
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (the draft's post-norm state), markov_embed [..., r] → fp32 [...] logits
        (the sigmoid is the acceptance probability)."""
        x = torch.cat([hidden, markov_embed.to(hidden.dtype)], -1) if self.with_markov else hidden
        with torch.autocast(x.device.type, enabled=False):  # float32 under a bf16 autocast too
            return F.linear(x.float(), self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    """DFlash's network (``layers.N.…``, ``fc``, ``hidden_norm``, ``norm``) with ``markov_head`` and
    ``confidence_head`` (None when ``cfg.confidence_head`` is false), named as vLLM loads them."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__(cfg)
        self.cfg: DSparkConfig = cfg
        self.markov_head = DSparkMarkovHead(cfg.vocab_size, cfg.vocab_size, cfg.markov_rank)
        width = cfg.hidden_size + (cfg.markov_rank if cfg.confidence_with_markov else 0)
        self.confidence_head = (
            DSparkConfidenceHead(width, cfg.confidence_with_markov) if cfg.confidence_head else None
        )

    def confidence(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The acceptance probability (fp32 [...], in [0, 1]) of the drafts whose post-norm states are
        ``hidden`` [..., H] and whose preceding tokens are ``prev`` int64 [...].

        Raises:
            ValueError: the drafter has no confidence head."""
        if self.confidence_head is None:
            raise ValueError("this DSpark drafter has no confidence head (enable_confidence_head false)")
        return torch.sigmoid(self.confidence_head(hidden, self.markov_head.embed(prev)))
