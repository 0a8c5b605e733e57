"""The acceptance simulation: the greedy-chain τ a drafter reaches on sequences whose continuation is the
target's own greedy output, drafting K tokens a verify step from the aux states it is given (the
training's validation, ``evaluate`` and ``diagnose`` share it; docs/measuring.md)."""

from __future__ import annotations

import torch

from eagle3kit.core.metrics import AcceptanceStats, match_runs, walk_chain
from eagle3kit.model.drafter import Eagle3Drafter
from eagle3kit.model.target import Target, embed_tokens
from eagle3kit.train.batches import Sample, make_batch


@torch.no_grad()
def simulate_samples(
    drafter: Eagle3Drafter, target: Target, samples: list[Sample], k: int, device
) -> AcceptanceStats:
    """Greedy-chain τ on samples whose completion is the target's greedy output (TTT unroll with
    the data tokens, docs/measuring.md). Each sample's chain starts at its last prompt position."""
    stats = AcceptanceStats(k)
    drafter.eval()
    for s in samples:
        simulate_sequence(drafter, target, s.ids, s.mask, s.aux, k, device, stats)
    return stats


@torch.no_grad()
def simulate_sequence(
    drafter: Eagle3Drafter,
    target: Target,
    ids: torch.Tensor,
    mask: torch.Tensor,
    aux: torch.Tensor,
    k: int,
    device,
    stats: AcceptanceStats | None = None,
) -> AcceptanceStats:
    """Greedy-chain acceptance of one sequence (:func:`simulate_samples`' unit) from its aux states.

    Args:
        ids: int64 [T], prompt + the target's greedy continuation; mask: bool [T], True on the
            continuation; aux: [T, 3·Ht], the aux states the drafter reads (any source: the target
            here, an engine's capture, another layer set).
        stats: the :class:`AcceptanceStats` to add to (a new one when None).
    Returns: ``stats`` with this sequence's verify steps added."""
    stats = stats if stats is not None else AcceptanceStats(k)
    b = make_batch([Sample(ids, mask)], [0], k, device)
    embeds = [embed_tokens(target, t, drafter.fc.weight) for t in drafter.step_tokens(b["tok"])]
    # forward: FSDP hooks
    outs = drafter(aux[None].to(device, drafter.fc.weight.dtype), embeds, b["positions"], b["key_mask"])
    draft = torch.stack([drafter.draft_to_target(drafter.logits(o[0]).argmax(-1)) for o in outs], dim=1).cpu()
    runs = match_runs(draft, ids.cpu())
    first = int(mask.long().argmax())
    return walk_chain(runs, first - 1, ids.numel(), k, stats)
