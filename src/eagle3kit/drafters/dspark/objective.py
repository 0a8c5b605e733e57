"""DSpark's objective and block drafting.

Objective: DFlash's block loss (:func:`eagle3kit.drafters.dflash.objective.dflash_loss`: random anchors,
one non-causal forward over all their blocks, draft ``j`` of a block — the token at ``p + j`` —
weighted ``exp(−(j − 1)/γ)``, only supervised tokens counted) on the base logits plus the Markov bias
of the token before each draft, teacher-forced: the bias of the draft at ``q`` is the head's bias of
the true token at ``q − 1`` (the anchor for ``j = 1``). Plus the confidence head's binary
cross-entropy against whether that draft (the argmax of its biased logits) equals the data's token:
with a true prefix the draft is the one a greedy engine proposes once every earlier draft was
accepted, so the head learns the conditional acceptance probability vLLM's adaptive verification
multiplies along the block. The head reads the draft's state detached: it estimates, it does not
shape the drafts.

Block drafting (vLLM's ``v1/worker/gpu/spec_decode/dspark/speculator.py``, ``_sample_sequential``): one
forward gives every draft's base logits; then left to right, draft ``i`` is the argmax of its base
logits plus the Markov bias of the previous token — the anchor for the first, then the draft just
made (greedy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3kit.core.metrics import AcceptanceStats
from eagle3kit.drafters.dflash.network import block_inputs, block_mask
from eagle3kit.drafters.dflash.objective import accept_blocks, loss_rows
from eagle3kit.drafters.dspark.network import DSparkDrafter
from eagle3kit.model.target import Target, embed_tokens, teacher_logits

#: weight of the confidence head's cross-entropy in the loss (its input is detached, so this scales
#: only the head's own step)
CONFIDENCE_WEIGHT = 1.0
#: anchors whose drafts are decoded left to right at once in simulation (bounds the [A, k, V] logits)
DECODE_CHUNK = 256


def _slots(drafter: DSparkDrafter, batch: dict, anchors: torch.Tensor):
    """Per block position: its draft index ``j`` (1 … drafts per block; ≤ 0 for a slot that drafts
    nothing), the position ``q`` it drafts (clamped into the sequence) and whether it is supervised.

    Returns: (j int64 [B, Q], q int64 [B, Q], sup bool [B, Q], tokens, pos) with Q = A · block_size."""
    c = drafter.cfg
    ids, mask, valid = batch["ids"], batch["mask"], batch["valid"]
    T = ids.shape[1]
    tokens, pos = block_inputs(ids, anchors, c.block_size, c.mask_token_id)
    slot = torch.arange(c.block_size, device=ids.device).repeat(anchors.shape[1])
    j = (slot + c.slot_shift).expand_as(pos)
    q = pos + c.slot_shift
    in_seq = (q < T) & (anchors >= 0).repeat_interleave(c.block_size, 1) & (j >= 1)
    where = q.clamp(max=T - 1)
    sup = in_seq & mask.gather(1, where) & valid.gather(1, where)
    return j, where, sup, tokens, pos


def _block_stats(hit: torch.Tensor, sup: torch.Tensor, j: torch.Tensor, drafter: DSparkDrafter) -> dict:
    """dflash_loss's stats over draft indices 1 … D (D = drafts per block) from ``hit``/``sup`` [B, Q]."""
    c = drafter.cfg
    D, first = c.drafts_per_block, 1 - c.slot_shift  # first: the slot of draft 1
    B = hit.shape[0]
    correct = [int((hit & (j == i)).sum()) for i in range(1, D + 1)]
    count = [int((sup & (j == i)).sum()) for i in range(1, D + 1)]
    drafting_hit = (hit | ~sup).view(B, -1, c.block_size)[..., first:]
    drafting_sup = sup.view(B, -1, c.block_size)[..., first:]
    run = drafting_hit.long().cumprod(-1) * drafting_sup
    return {
        "n": int(sup.sum()),
        "correct": correct,
        "count": count,
        "accepted": int(run.sum()),
        "blocks": int(drafting_sup[..., 0].sum()),
    }


def dspark_loss(
    model,
    target: Target,
    batch: dict,
    anchors: torch.Tensor,
    gamma: float,
    objective: str = "ce",
    chunk: int | str | None = 0,
) -> tuple[torch.Tensor, dict]:
    """The weighted block loss with the Markov bias, plus the confidence head's loss, of one batch
    (formulas: module docstring).

    Args:
        model: the :class:`DSparkDrafter`, or it in DistributedDataParallel (its forward is called
            through ``model``, so that DDP reduces the gradients).
        batch: ``ids`` int64 [B, T], ``mask`` bool [B, T] (supervised tokens), ``valid`` bool [B, T]
            (real, not padding), ``aux`` [B, T, n · Ht] (the target layers' aux hidden states), and for
            ``objective: kl`` ``last`` [B, T, Ht] (the target's post-norm final state).
        anchors: int64 [B, A] from :func:`eagle3kit.drafters.dflash.objective.pick_anchors` (−1: none).
        gamma: the position weights' decay (draft 1 weighs 1); objective: ``ce`` or ``kl``.
    Returns:
        (loss scalar fp32 = block loss + :data:`CONFIDENCE_WEIGHT` · confidence loss, stats) with
        :func:`~eagle3kit.drafters.dflash.objective.dflash_loss`'s keys — ``n`` supervised drafts, ``weight``,
        ``correct``/``count`` per draft index 1 … D (D = ``drafts_per_block``), ``accepted`` (Σ per
        block of the run of correct drafts), ``blocks`` (blocks whose first draft is supervised) — and
        ``block_loss``, ``confidence_loss`` (floats; 0.0 without a confidence head)."""
    drafter = getattr(model, "module", model)
    ids = batch["ids"]
    B, T = ids.shape
    j, where, sup, tokens, pos = _slots(drafter, batch, anchors)
    ctx = drafter.context(batch["aux"])
    with torch.no_grad():
        emb = embed_tokens(target, tokens, ctx)
    mask = block_mask(anchors, batch["valid"], drafter.cfg.block_size)
    hidden = model(ctx, torch.arange(T, device=ids.device).expand(B, T), emb, pos, mask)[sup]
    labels = ids.gather(1, where)[sup]
    prev = ids.gather(1, (where - 1).clamp(min=0))[sup]  # the true token before each draft
    markov = drafter.markov_head.embed(prev)
    w = torch.exp(-(j[sup] - 1).float() / gamma)
    before = None
    if objective == "kl":
        last = batch["last"]
        before = last.gather(1, (where - 1).clamp(min=0)[..., None].expand(-1, -1, last.shape[-1]))[sup]
    # fp32 [N, V]: the target head's logits plus the Markov bias, in checkpointed chunks when asked
    per, top = loss_rows(target, hidden, labels, objective, before, markov, drafter.markov_head.bias, chunk)
    block = (per * w).sum() / w.sum().clamp(min=1e-9)
    with torch.no_grad():
        hit_sup = top == labels
    conf = block.new_zeros(())
    if (
        drafter.confidence_head is not None
    ):  # in the graph on every process, as DDP needs, even without a draft
        conf_logit = drafter.confidence_head(hidden.detach(), markov.detach())
        conf = (
            F.binary_cross_entropy_with_logits(conf_logit, hit_sup.float())
            if hit_sup.numel()
            else conf_logit.sum() * 0.0
        )
    hit = torch.zeros_like(sup)
    hit[sup] = hit_sup
    stats = _block_stats(hit, sup, j, drafter)
    stats.update(
        block_loss=float(block.detach()), confidence_loss=float(conf.detach()), weight=float(w.sum())
    )
    return block + CONFIDENCE_WEIGHT * conf, stats


def _check_draft_length(drafter: DSparkDrafter, k: int) -> None:
    """ValueError when ``k`` drafts do not fit a block (at most ``drafts_per_block``)."""
    if not 1 <= k <= drafter.cfg.drafts_per_block:
        raise ValueError(
            f"{k} draft tokens from a DSpark block of {drafter.cfg.block_size} (1 … "
            f"{drafter.cfg.drafts_per_block} with sample_from_anchor {drafter.cfg.sample_from_anchor})"
        )


@torch.no_grad()
def block_hidden(
    drafter: DSparkDrafter,
    target: Target,
    aux: torch.Tensor,
    ids: torch.Tensor,
    first: int,
    k: int,
    mask_token_id: int | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """The post-norm states of the ``k`` drafting slots of the block a server drafting ``k`` tokens
    builds at every bonus position ``p`` in ``[first, T − 1)``, in one forward: ``[ids[p], MASK × (k −
    1)]`` anchor-as-first (vLLM queries ``num_speculative_tokens`` slots), ``[ids[p], MASK × k]`` in the
    fill-in layout, each reading the context before ``p`` only.

    Args: aux [T, n · Ht]; ids int64 [T]; mask_token_id, causal: as in
        :func:`eagle3kit.drafters.dflash.objective.block_drafts` (to simulate an engine that differs).
    Returns: [T − 1 − first, k, H] (row p − first; slot i drafts the token at p + 1 + i).
    Raises: ValueError: ``k`` outside 1 … drafts per block."""
    _check_draft_length(drafter, k)
    c, T = drafter.cfg, ids.numel()
    width = k + 1 - c.slot_shift
    anchors = torch.arange(first, T - 1, device=ids.device)[None]
    tokens, pos = block_inputs(
        ids[None], anchors, width, c.mask_token_id if mask_token_id is None else mask_token_id
    )
    ctx = drafter.context(aux[None])
    mask = block_mask(anchors, torch.ones(1, T, dtype=torch.bool, device=ids.device), width, causal)
    hidden = drafter(
        ctx, torch.arange(T, device=ids.device)[None], embed_tokens(target, tokens, ctx), pos, mask
    )
    return hidden.view(anchors.shape[1], width, -1)[:, 1 - c.slot_shift :]


@torch.no_grad()
def markov_decode(
    drafter: DSparkDrafter, target: Target, hidden: torch.Tensor, anchor_ids: torch.Tensor
) -> torch.Tensor:
    """Greedy left-to-right drafting from the drafting slots' states: draft ``i`` is
    ``argmax(base_i + bias(prev))`` with ``prev`` the anchor for ``i = 0``, then draft ``i − 1``
    (vLLM's ``DSparkSpeculator._sample_sequential`` with greedy sampling, dense over the vocabulary).

    Args: hidden [A, k, H] from :func:`block_hidden`; anchor_ids int64 [A] the anchors' tokens.
    Returns: int64 [A, k] target ids."""
    out = []
    for h, prev in zip(hidden.split(DECODE_CHUNK), anchor_ids.split(DECODE_CHUNK)):
        base = teacher_logits(target, h)  # fp32 [a, k, V]
        drafts = []
        for i in range(h.shape[1]):
            bias = drafter.markov_head.bias(drafter.markov_head.embed(prev)).float()
            prev = (base[:, i] + bias).argmax(-1)
            drafts.append(prev)
        out.append(torch.stack(drafts, 1))
    return torch.cat(out)


@torch.no_grad()
def dspark_block_drafts(
    drafter: DSparkDrafter,
    target: Target,
    aux: torch.Tensor,
    ids: torch.Tensor,
    first: int,
    k: int,
    mask_token_id: int | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """The ``k`` greedy DSpark drafts from every bonus position ``p`` in ``[first, T − 1)``:
    :func:`block_hidden` then :func:`markov_decode`. Args as :func:`block_hidden`.
    Returns: int64 [T − 1 − first, k] (row p − first: the drafts for p + 1 … p + k)."""
    hidden = block_hidden(drafter, target, aux, ids, first, k, mask_token_id, causal)
    return markov_decode(drafter, target, hidden, ids[first : ids.numel() - 1])


@torch.no_grad()
def dspark_block_stats(
    drafter: DSparkDrafter,
    target: Target,
    aux: torch.Tensor,
    ids: torch.Tensor,
    first: int,
    k: int,
    mask_token_id: int | None = None,
    causal: bool = False,
) -> AcceptanceStats:
    """Greedy acceptance of DSpark block drafting along one sequence whose tokens from ``first`` on are
    the target's greedy output: :func:`dspark_block_drafts` verified by
    :func:`eagle3kit.drafters.dflash.objective.accept_blocks` (no step when nothing follows ``first``).

    Args: aux [T, n · Ht] and ids int64 [T] on the drafter's device; the rest as :func:`block_hidden`."""
    if first >= ids.numel() - 1:
        return AcceptanceStats(k)
    drafts = dspark_block_drafts(drafter, target, aux, ids, first, k, mask_token_id, causal).tolist()
    return accept_blocks(drafts, ids.tolist(), first, k)


@torch.no_grad()
def simulate_dspark_tau(
    drafter: DSparkDrafter, target: Target, samples: list, k: int, device
) -> AcceptanceStats:
    """Greedy τ of DSpark block drafting on samples whose completion is the target's greedy output
    (each sample's ``aux`` filled), from the first completion token on (as
    :func:`eagle3kit.drafters.dflash.objective.simulate_block_tau` for DFlash)."""
    stats = AcceptanceStats(k)
    for s in samples:
        first = int(s.mask.long().argmax())
        stats.merge(dspark_block_stats(drafter, target, s.aux.to(device), s.ids.to(device), first, k))
    return stats
