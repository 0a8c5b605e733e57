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

Three objectives per step (``loss``), all over the same supervised positions:

* ``kl`` — the soft cross-entropy above (forward KL up to the teacher's entropy);
* ``lk_alpha`` — −mean log α, where α = Σ_v min(p(v), q(v)) over the draft vocabulary is the
  expected acceptance of a draft sampled from q against the target's p (Leviathan et al. 2023,
  Thm. 3.5), with p the target's full-vocabulary softmax restricted to the draft vocabulary
  (not renormalised: a token the draft vocabulary lacks is never proposed);
* ``lk_lambda`` — λ·CE + (1 − λ)·(1 − ᾱ), with ᾱ the step's mean α and λ = scale·exp(−decay·ᾱ)
  taken without gradient: KL while acceptance is low, then acceptance itself.

The LK objectives and their defaults (scale 1, decay 1) are SpecForge 0.2.0's (``core/lk_loss.py``,
the LK losses of Nebius' drafters); ᾱ is logged per step under every objective that computes it.
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


LOSSES = ("kl", "lk_alpha", "lk_lambda")


def _teacher_probs(
    target: Target, draft_ids: torch.Tensor, src: tuple
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 [n, Vd] teacher distribution from ``("last", last [n, Ht])`` (softmax of the target's
    draft-vocabulary logits) or ``("topk", values [n, K], ids [n, K])`` (softmax over the stored
    top-K logits, 0 elsewhere); and for ``("last", last, lse [n])`` also p(v) = exp(z_v − lse), the
    target's full-vocabulary probabilities of the draft tokens (None otherwise)."""
    if src[0] == "topk":
        vals = torch.softmax(src[1].float(), dim=-1)
        return torch.zeros(vals.shape[0], draft_ids.numel(), device=vals.device).scatter_(
            1, src[2].long(), vals
        ), None
    z = teacher_logits(target, src[1], draft_ids)
    return torch.softmax(z, dim=-1), (torch.exp(z - src[2][:, None]) if len(src) > 2 else None)


@torch.no_grad()
def full_logsumexp(target: Target, last: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """log Σ_v exp(z_v) over the target's whole vocabulary, fp32 [n], from post-norm states [n, Ht]
    (``chunk`` rows at a time, so no [n, V] matrix is kept)."""
    return torch.cat(
        [torch.logsumexp(teacher_logits(target, last[a : a + chunk]), -1) for a in range(0, len(last), chunk)]
    )


def draft_ce(
    drafter, target: Target, draft_ids: torch.Tensor, hidden: torch.Tensor, src: tuple, chunk: int = 0
) -> tuple[torch.Tensor, ...]:
    """Σ over positions of −Σ_v p_teacher(v) · log q_drafter(v), and the number of positions where
    both distributions have the same top-1; with a full-vocabulary normaliser in ``src`` also
    Σ α and Σ log α, α = Σ_v min(p(v), q(v)) (log α taken as 0 where α = 0).

    Args:
        hidden: [n, H] drafter pre-norm outputs at the supervised positions (any float dtype;
            log-softmax is taken in fp32).
        src: the teacher's inputs for the same positions (see :func:`_teacher_probs`).
        chunk: positions per checkpointed chunk (0: all at once, no checkpointing).
    Returns:
        (ce_sum fp32 scalar with grad, agree int64 scalar), plus (alpha_sum, log_alpha_sum) fp32
        scalars with grad when ``src`` carries the normaliser.
    """
    lk = len(src) > 2

    def part(h, *teacher_in):
        teacher, p_full = _teacher_probs(target, draft_ids, (src[0], *teacher_in))
        logq = torch.log_softmax(drafter.logits(h).float(), dim=-1)
        out = (-(teacher * logq).sum(), (logq.argmax(-1) == teacher.argmax(-1)).sum())
        if p_full is None:
            return out
        alpha = torch.minimum(p_full, logq.exp()).sum(-1)
        return out + (alpha.sum(), torch.where(alpha > 0, alpha.clamp_min(1e-30).log(), 0.0).sum())

    n = hidden.shape[0]
    if not chunk or n <= chunk:
        return part(hidden, *src[1:])
    sums = None
    for a in range(0, n, chunk):
        got = checkpoint(
            part, hidden[a : a + chunk], *(x[a : a + chunk] for x in src[1:]), use_reentrant=False
        )
        sums = got if sums is None else tuple(x + y for x, y in zip(sums, got))
    return sums if lk else sums[:2]


def step_loss(kind: str, n: int, sums: tuple, scale: float = 1.0, decay: float = 1.0) -> torch.Tensor:
    """One TTT step's objective from :func:`draft_ce`'s sums over its ``n`` supervised positions
    (the module docstring's three objectives; ``scale``/``decay`` are ``lk_lambda``'s λ)."""
    ce = sums[0] / n
    if kind == "kl":
        return ce
    if kind == "lk_alpha":
        return -sums[3] / n
    alpha = sums[2] / n
    lam = scale * torch.exp(-decay * alpha.detach())
    return lam * ce + (1 - lam) * (1 - alpha)


def ttt_loss(
    drafter,
    target: Target,
    batch: dict,
    draft_ids: torch.Tensor,
    steps: int,
    step_weight: float,
    attention: str = "reference",
    loss_chunk: int = 0,
    loss: str = "kl",
    lk_kl_scale: float = 1.0,
    lk_kl_decay: float = 1.0,
) -> tuple[torch.Tensor, dict]:
    """The EAGLE-3 TTT loss on one batch (see module docstring); for a parallel-drafting drafter
    step k ≥ 1 is its k-th mask slot (same positions, labels and weights).

    Args:
        drafter: an :class:`~eagle3kit.model.drafter.Eagle3Drafter`, or one wrapped in DistributedDataParallel.
        batch: from :func:`eagle3kit.train.batches.make_batch` (``aux``, ``tok``/``sup`` per step, ``positions``,
            ``key_mask``, optional ``doc`` for packed rows, and ``last``+``argmax`` or top-K records).
        draft_ids: int64 [Vd] target ids of the draft vocabulary.
        attention: ``"reference"`` or ``"flex"`` (:meth:`Eagle3Drafter.ttt_forward`).
        loss_chunk: positions per checkpointed loss chunk (0: unchunked reference).
        loss: ``kl``, ``lk_alpha`` or ``lk_lambda`` (:data:`LOSSES`; the LK ones need ``last`` teacher
            records: top-K records lack the full-vocabulary normaliser); lk_kl_scale / lk_kl_decay: λ's.
    Returns:
        (loss scalar, stats) where stats holds per step ``loss`` (the step's objective), ``acc``
        (top-1 agreement), ``n`` (supervised positions) and, for the LK objectives, ``alpha`` (mean α).
    Raises:
        ValueError: an unknown ``loss``, or an LK objective on top-K teacher records.
    """
    if loss not in LOSSES:
        raise ValueError(f"loss {loss!r} is not one of {LOSSES}")
    core = getattr(drafter, "module", drafter)  # a DistributedDataParallel wrapper's drafter
    w = core.fc.weight
    embeds = [embed_tokens(target, t, w) for t in core.step_tokens(batch["tok"])]
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
    if core.mask_hidden is not None and torch.is_grad_enabled():  # P-EAGLE: read by steps ≥ 1 only
        total = total + core.mask_hidden.sum() * 0.0
    stats = {"loss": [], "acc": [], "n": []} | ({"alpha": []} if loss != "kl" else {})
    topk = "topk_ids" in batch
    if topk and loss != "kl":
        raise ValueError(
            f"loss {loss} needs the target's full-vocabulary probabilities; features stored with a top-K "
            "teacher lack them: extract with teacher: last, or train online"
        )
    for k in range(steps):
        sup, src = _step_teacher(batch, k, in_draft, target, lk=loss != "kl")
        n = int(sup.sum())
        if n == 0:
            for key in stats:
                stats[key].append(0 if key == "n" else 0.0)
            continue
        sums = draft_ce(core, target, draft_ids, outs[k][sup], src, loss_chunk)
        obj = step_loss(loss, n, sums, lk_kl_scale, lk_kl_decay)
        total = total + (step_weight**k) * obj
        (
            stats["loss"].append(float(obj.detach())),
            stats["acc"].append(float(sums[1]) / n),
            stats["n"].append(n),
        )
        if loss != "kl":
            stats["alpha"].append(float(sums[2].detach()) / n)
    return total, stats


def _step_teacher(batch: dict, k: int, in_draft: torch.Tensor, target: Target, lk: bool) -> tuple:
    """TTT step k's supervised positions (bool [B, T]: a completion input token and a teacher top-1
    inside the draft vocabulary) and the teacher's inputs there (:func:`_teacher_probs`' ``src``;
    with ``lk`` the full-vocabulary normaliser too: the batch's cached ``lse``, else computed)."""
    nxt = k + 1
    if "topk_ids" in batch:
        sup = batch["sup"][k] & shift(batch["top1_in_draft"], nxt)
        return sup, ("topk", shift(batch["topk_values"], nxt)[sup], shift(batch["topk_ids"], nxt)[sup])
    sup = batch["sup"][k] & in_draft[shift(batch["argmax"], nxt)]
    last = shift(batch["last"], nxt)[sup]
    if not lk:
        return sup, ("last", last)
    lse = shift(batch["lse"], nxt)[sup] if "lse" in batch else full_logsumexp(target, last)
    return sup, ("last", last, lse)


def implied_tau(acc: list[float]) -> float:
    """1 + Σ_k Π_{j≤k} acc_j: the acceptance length per-step top-1 agreement implies (chain, greedy)."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau
