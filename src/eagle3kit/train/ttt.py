"""The EAGLE-3 training objective: training-time test (TTT) over whole sequences (DESIGN.md §4).

Per TTT step k (0-based), position t is supervised when its input token x_{t+k+1} is a
completion token and the target's argmax at t+k+1 lies in the draft vocabulary; the label is the
target's softmax at t+k+1 restricted to the draft vocabulary (fp32). Loss = Σ_k w^k · CE_k, each
CE_k normalised by its own number of supervised positions (a step with none contributes 0, never
NaN). Source: EAGLE-3 (Li et al., 2025, §3) for the unrolled steps and the draft-vocabulary
target distribution.

Two ways to compute the same loss:

* ``loss_chunk=0`` — the readable reference: teacher and drafter distributions of every
  supervised position of a step exist at once ([n, Vd] fp32 each).
* ``loss_chunk=C`` — C positions at a time under activation checkpointing: the [C, Vd] teacher
  softmax, drafter logits and log-softmax are recomputed in the backward pass instead of being
  kept, so the memory of the loss no longer grows with the batch (at 16K positions and a 32K draft
  vocabulary the reference keeps about 6 GB a step).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from eagle3kit.model.target import Target, embed_tokens, teacher_logits


def shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """x[:, t + k] at t (zero-filled past the end), for [B, T, ...] tensors."""
    out = torch.zeros_like(x)
    if k < x.shape[1]:
        out[:, : x.shape[1] - k] = x[:, k:]
    return out


def _teacher_probs(target: Target, draft_ids: torch.Tensor, src: tuple) -> torch.Tensor:
    """fp32 [n, Vd] teacher distribution from ``("last", last [n, Ht])`` (softmax of the target's
    draft-vocabulary logits) or ``("topk", values [n, K], ids [n, K])`` (softmax over the stored
    top-K logits, 0 elsewhere)."""
    if src[0] == "topk":
        vals = torch.softmax(src[1].float(), dim=-1)
        return torch.zeros(vals.shape[0], draft_ids.numel(), device=vals.device).scatter_(
            1, src[2].long(), vals
        )
    return torch.softmax(teacher_logits(target, src[1], draft_ids), dim=-1)


def draft_ce(
    drafter, target: Target, draft_ids: torch.Tensor, hidden: torch.Tensor, src: tuple, chunk: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ over positions of −Σ_v p_teacher(v) · log q_drafter(v), and the number of positions where
    both distributions have the same top-1.

    Args:
        hidden: [n, H] drafter pre-norm outputs at the supervised positions (any float dtype;
            log-softmax is taken in fp32).
        src: the teacher's inputs for the same positions (see :func:`_teacher_probs`).
        chunk: positions per checkpointed chunk (0: all at once, no checkpointing).
    Returns:
        (ce_sum fp32 scalar with grad, agree int64 scalar).
    """

    def part(h, *teacher_in):
        teacher = _teacher_probs(target, draft_ids, (src[0], *teacher_in))
        logq = torch.log_softmax(drafter.logits(h).float(), dim=-1)
        return -(teacher * logq).sum(), (logq.argmax(-1) == teacher.argmax(-1)).sum()

    n = hidden.shape[0]
    if not chunk or n <= chunk:
        return part(hidden, *src[1:])
    ce, agree = (
        hidden.new_zeros((), dtype=torch.float32),
        torch.zeros((), dtype=torch.int64, device=hidden.device),
    )
    for a in range(0, n, chunk):
        c, g = checkpoint(
            part, hidden[a : a + chunk], *(x[a : a + chunk] for x in src[1:]), use_reentrant=False
        )
        ce, agree = ce + c, agree + g
    return ce, agree


def ttt_loss(
    drafter,
    target: Target,
    batch: dict,
    draft_ids: torch.Tensor,
    steps: int,
    step_weight: float,
    attention: str = "reference",
    loss_chunk: int = 0,
) -> tuple[torch.Tensor, dict]:
    """The EAGLE-3 TTT loss on one batch (see module docstring).

    Args:
        drafter: an :class:`~eagle3kit.model.drafter.Eagle3Drafter`, or one wrapped in DistributedDataParallel.
        batch: from :func:`eagle3kit.train.batches.make_batch` (``aux``, ``tok``/``sup`` per step, ``positions``,
            ``key_mask``, optional ``doc`` for packed rows, and ``last``+``argmax`` or top-K records).
        draft_ids: int64 [Vd] target ids of the draft vocabulary.
        attention: ``"reference"`` or ``"flex"`` (:meth:`Eagle3Drafter.ttt_forward`).
        loss_chunk: positions per checkpointed loss chunk (0: unchunked reference).
    Returns:
        (loss scalar, stats) where stats holds per step ``loss``, ``acc`` (top-1 agreement) and
        ``n`` (supervised positions).
    """
    core = getattr(drafter, "module", drafter)  # a DistributedDataParallel wrapper's drafter
    w = core.fc.weight
    embeds = [embed_tokens(target, t, w) for t in batch["tok"]]
    outs = drafter(
        batch["aux"].to(w.dtype),
        embeds,
        batch["positions"],
        batch["key_mask"],
        doc=batch.get("doc"),
        attention=attention,
    )
    in_draft = core.t2d
    # 0 × a value that touches every parameter: the loss always has a graph, so every process of a
    # distributed run calls backward (and all-reduces) even on a batch with nothing supervised
    total = (
        core.logits(outs[0][:, :1]).float().sum() * 0.0 if torch.is_grad_enabled() else outs[0].new_zeros(())
    )
    stats = {"loss": [], "acc": [], "n": []}
    topk = "topk_ids" in batch
    for k in range(steps):
        nxt = k + 1
        if topk:
            sup = batch["sup"][k] & shift(batch["top1_in_draft"], nxt)
        else:
            sup = batch["sup"][k] & in_draft[shift(batch["argmax"], nxt)]
        n = int(sup.sum())
        if n == 0:
            stats["loss"].append(0.0), stats["acc"].append(0.0), stats["n"].append(0)
            continue
        if topk:
            src = ("topk", shift(batch["topk_values"], nxt)[sup], shift(batch["topk_ids"], nxt)[sup])
        else:
            src = ("last", shift(batch["last"], nxt)[sup])
        ce_sum, agree = draft_ce(core, target, draft_ids, outs[k][sup], src, loss_chunk)
        ce = ce_sum / n
        total = total + (step_weight**k) * ce
        stats["loss"].append(float(ce.detach())), stats["acc"].append(float(agree) / n), stats["n"].append(n)
    return total, stats


def implied_tau(acc: list[float]) -> float:
    """1 + Σ_k Π_{j≤k} acc_j: the acceptance length per-step top-1 agreement implies (chain, greedy)."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau
