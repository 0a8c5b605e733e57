"""The EAGLE-3 training objective: training-time test (TTT) over whole sequences (docs/conventions.md, alignment).

Per TTT step k (0-based), position t is supervised when its input token x_{t+k+1} is a
completion token and the target's argmax at t+k+1 lies in the draft vocabulary; the label is the
target's softmax at t+k+1 restricted to the draft vocabulary (fp32). Loss = Σ_k w^k · CE_k, each
CE_k normalised by its own number of supervised positions (a step with none contributes 0, never
NaN). Source: EAGLE-3 (Li et al., 2025, §3) for the unrolled steps and the draft-vocabulary
target distribution.

Two ways to compute the same loss:

* ``loss_chunk=0`` — the readable reference: teacher and drafter distributions of every
  supervised position of a step exist at once ([n, Vd] fp32 each).
* ``loss_chunk=C`` — C positions at a time, so the memory of the loss no longer grows with the
  batch (at 16K positions and a 32K draft vocabulary the reference keeps about 6 GB a step): for
  ``kl`` with gradients, :class:`FusedDraftCE` (lm_head and loss with the gradients taken in the
  forward pass); otherwise under activation checkpointing, the [C, Vd] teacher softmax, drafter
  logits and log-softmax recomputed in the backward pass at the price of a second lm_head product.

Either way the teacher's draft-vocabulary logits are computed once per batch for every position a
step reads (:class:`TeacherTable`), not once per step: TTT step k reads the teacher at t+k+1, so
the steps share their positions at different shifts.

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

from eagle3kit.model.drafter import compiled_for
from eagle3kit.model.target import Target, embed_tokens, teacher_logits


def shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """x[:, t + k] at t (zero-filled past the end), for [B, T, ...] tensors."""
    out = torch.zeros_like(x)
    if k < x.shape[1]:
        out[:, : x.shape[1] - k] = x[:, k:]
    return out


LOSSES = ("kl", "lk_alpha", "lk_lambda")


class TeacherTable:
    """The teacher of every position a batch's TTT steps read, computed once per batch.

    Step k supervises position t with the teacher at t+k+1, so the seven steps of TTT 7 read the
    same positions at seven shifts; the draft-vocabulary logits are taken once here (one
    [M, Ht] × [Ht, Vd] product, no gradient) instead of once per step and again in the backward
    pass of a checkpointed chunk. Rows are looked up by index (:meth:`rows`).

    Args:
        target: the frozen target (its lm_head; the full vocabulary for ``lse`` when needed).
        last: [B, T, Ht] post-norm target states (any float dtype).
        need: bool [B, T], the positions some step reads.
        draft_ids: int64 [Vd] target ids of the draft vocabulary.
        lse: fp32 [B, T] cached full-vocabulary log-normalisers, or None.
        full: also keep the full-vocabulary normaliser (the LK objectives); computed from ``last``
            when ``lse`` is None.
        chunk: rows per product (bounds the transient [chunk, V] of the full normaliser).
    Memory: ``z`` is fp32 [M, Vd] (M = need.sum(); 2.1 GB at 16K positions and Vd 32,000).
    """

    def __init__(self, target: Target, last, need, draft_ids, lse=None, full=False, chunk=4096):
        self.row = torch.full(need.shape, -1, dtype=torch.long, device=need.device)
        self.row[need] = torch.arange(int(need.sum()), device=need.device)
        src = last[need]
        with torch.no_grad():
            zs = [teacher_logits(target, src[a : a + chunk], draft_ids) for a in range(0, len(src), chunk)]
            self.z = torch.cat(zs) if zs else torch.zeros(0, draft_ids.numel(), device=last.device)
            self.lse_draft = torch.logsumexp(self.z, -1)
            self.lse = None
            if full:
                self.lse = lse[need].float() if lse is not None else full_logsumexp(target, src, chunk)

    def index(self, sup: torch.Tensor, shift_by: int) -> torch.Tensor:
        """int64 [n]: the table rows of the teacher at (b, t + shift_by) for every supervised (b, t)
        of ``sup`` [B, T], in ``sup``'s row-major order (the order of ``x[sup]``)."""
        b, t = sup.nonzero(as_tuple=True)
        return self.row[b, t + shift_by]

    def __call__(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`rows` (the table is the ``teacher`` callable of :func:`draft_ce`)."""
        return self.rows(idx)

    def rows(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 [n, Vd] teacher softmax over the draft vocabulary at table rows ``idx``, and with
        the full normaliser p(v) = exp(z_v − lse), the target's full-vocabulary probabilities of the
        draft tokens (None otherwise)."""
        z = self.z[idx]
        p = torch.exp(z - self.lse_draft[idx, None])
        return p, (torch.exp(z - self.lse[idx, None]) if self.lse is not None else None)


def _topk_probs(vals: torch.Tensor, ids: torch.Tensor, vd: int) -> tuple[torch.Tensor, None]:
    """fp32 [n, Vd]: the softmax over stored top-K logits ``vals`` [n, K] at draft ids ``ids``, 0 elsewhere."""
    p = torch.softmax(vals.float(), dim=-1)
    return torch.zeros(p.shape[0], vd, device=p.device).scatter_(1, ids.long(), p), None


@torch.no_grad()
def full_logsumexp(target: Target, last: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """log Σ_v exp(z_v) over the target's whole vocabulary, fp32 [n], from post-norm states [n, Ht]
    (``chunk`` rows at a time, so no [n, V] matrix is kept)."""
    return torch.cat(
        [torch.logsumexp(teacher_logits(target, last[a : a + chunk]), -1) for a in range(0, len(last), chunk)]
    )


def _ce_chunk(z: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of :class:`FusedDraftCE`: drafter logits ``z`` [c, Vd] (the product's dtype) and
    teacher rows ``p`` fp32 [c, Vd] → (Σ CE fp32 scalar, top-1 agreements int64 scalar, ∂CE/∂z
    [c, Vd] in ``z``'s dtype). The log-normaliser, the softmax and the gradient are taken in fp32."""
    zf = z.float()
    psum = p.sum(-1)
    lse = torch.logsumexp(zf, -1)
    ce = (psum * lse).sum() - (p * zf).sum()
    agree = (zf.argmax(-1) == p.argmax(-1)).sum()
    g = torch.exp(zf - lse[:, None]) * psum[:, None] - p
    return ce, agree, g.to(z.dtype)


def _ce_chunk_table(z, table_z, table_lse, idx):
    """:func:`_ce_chunk` with the teacher rows read from a :class:`TeacherTable` inside the
    kernel: p = exp(table_z[idx] − table_lse[idx]) (``table_z`` fp32 [M, Vd], ``table_lse`` fp32
    [M], ``idx`` int64 [c]), so the [c, Vd] teacher softmax is never written to memory when this
    runs compiled."""
    return _ce_chunk(z, torch.exp(table_z[idx] - table_lse[idx, None]))


class TableRows:
    """The teacher of :class:`FusedDraftCE` as a lookup into a :class:`TeacherTable`: rows ``idx``
    (int64 [n]) of its draft-vocabulary softmax, gathered inside the fused kernel
    (:func:`_ce_chunk_table`)."""

    def __init__(self, table: "TeacherTable", idx: torch.Tensor):
        self.table, self.idx = table, idx


class FusedDraftCE(torch.autograd.Function):
    """The drafter's lm_head product and the soft cross-entropy to the teacher, ``chunk`` positions
    at a time, with the gradients taken in the forward pass (the scheme of Liger-Kernel's fused
    linear cross-entropy, written here for a soft teacher over the draft vocabulary): for logits
    z = x·Wᵀ and teacher p, CE = Σ_rows (Σ_v p_v)·logsumexp(z) − Σ_v p_v·z_v and ∂CE/∂z =
    softmax(z)·Σ_v p_v − p. Nothing of size [n, Vd] outlives a chunk and nothing is recomputed in
    the backward pass, which scales the stored ∂CE/∂x and ∂CE/∂W by the incoming gradient. The
    per-chunk element-wise work is one compiled kernel on CUDA (:func:`_ce_chunk`, through
    :func:`~eagle3kit.model.drafter.compiled_for`: one fused pass over the chunk's logits instead
    of about ten element-wise kernels).

    ``apply(x, weight, teacher, chunk)``: x [n, H] normed drafter states (any float dtype; the
    products run in the autocast dtype when autocast is on, else in x's), weight [Vd, H] the
    lm_head's, ``teacher``: a :class:`TableRows`, or any ``teacher(a, b) -> fp32 [b − a, Vd]``
    giving the teacher rows a..b. Returns (ce_sum fp32 scalar, agree int64 scalar: positions whose
    drafter and teacher top-1 agree).
    """

    @staticmethod
    def forward(ctx, x, weight, teacher, chunk):
        dev = x.device.type
        cd = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        plain, from_table = compiled_for(x.device, _ce_chunk), compiled_for(x.device, _ce_chunk_table)
        with torch.autocast(dev, enabled=False):
            w = weight.to(cd)
            grad_x = torch.empty(x.shape, dtype=cd, device=x.device)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
            ce = torch.zeros((), dtype=torch.float32, device=x.device)
            agree = torch.zeros((), dtype=torch.long, device=x.device)
            for a in range(0, x.shape[0], chunk):
                xc = x[a : a + chunk].to(cd)
                z = xc @ w.T
                b = a + xc.shape[0]
                if isinstance(teacher, TableRows):
                    t = teacher.table
                    c, n_agree, g = from_table(z, t.z, t.lse_draft, teacher.idx[a:b])
                else:
                    c, n_agree, g = plain(z, teacher(a, b))
                ce += c
                agree += n_agree
                grad_x[a:b] = g @ w
                grad_w += (g.T @ xc).float()
        ctx.save_for_backward(grad_x, grad_w)
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return ce, agree

    @staticmethod
    def backward(ctx, g_ce, g_agree):
        grad_x, grad_w = ctx.saved_tensors
        return (grad_x * g_ce).to(ctx.x_dtype), (grad_w * g_ce).to(ctx.w_dtype), None, None


def _fusable(drafter, chunk: int) -> bool:
    """Whether :class:`FusedDraftCE` can stand for the drafter's lm_head + CE: a chunked loss
    with gradients, the lm_head a plain bias-free Linear whose weight is a local tensor (under
    FSDP2 it is a sharded DTensor gathered only inside the module's own forward)."""
    head = drafter.lm_head
    return (
        bool(chunk)
        and torch.is_grad_enabled()
        and isinstance(head, torch.nn.Linear)
        and head.bias is None
        and type(head.weight.data) is torch.Tensor
    )


def draft_ce(
    drafter, hidden: torch.Tensor, teacher, inputs: tuple, chunk: int = 0, fused: bool = False
) -> tuple[torch.Tensor, ...]:
    """Σ over positions of −Σ_v p_teacher(v) · log q_drafter(v), and the number of positions where
    both distributions have the same top-1; with a full-vocabulary normaliser also Σ α and Σ log α,
    α = Σ_v min(p(v), q(v)) (log α taken as 0 where α = 0).

    Args:
        hidden: [n, H] drafter pre-norm outputs at the supervised positions (any float dtype;
            log-softmax is taken in fp32).
        teacher: ``teacher(*inputs) -> (p [n, Vd] fp32, p_full [n, Vd] fp32 or None)`` for the same
            positions (a :class:`TeacherTable`, whose rows the fused path gathers inside its
            kernel, or the top-K softmax).
        inputs: tensors with n rows (sliced with ``hidden`` per chunk).
        chunk: positions per checkpointed chunk (0: all at once, no checkpointing).
        fused: the forward KL by :class:`FusedDraftCE` when it applies (:func:`_fusable`; the
            teacher must give no ``p_full``): the same sums, ``chunk`` positions at a time.
    Returns:
        (ce_sum fp32 scalar with grad, agree int64 scalar), plus (alpha_sum, log_alpha_sum) fp32
        scalars with grad when the teacher gives ``p_full``.
    """

    def part(h, *teacher_in):
        p, p_full = teacher(*teacher_in)
        logq = torch.log_softmax(drafter.logits(h).float(), dim=-1)
        out = (-(p * logq).sum(), (logq.argmax(-1) == p.argmax(-1)).sum())
        if p_full is None:
            return out
        alpha = torch.minimum(p_full, logq.exp()).sum(-1)
        return out + (alpha.sum(), torch.where(alpha > 0, alpha.clamp_min(1e-30).log(), 0.0).sum())

    n = hidden.shape[0]
    if fused and _fusable(drafter, chunk):
        rows = (  # a TeacherTable's rows are gathered inside the fused kernel
            TableRows(teacher, inputs[0])
            if isinstance(teacher, TeacherTable)
            else (lambda a, b: teacher(*(x[a:b] for x in inputs))[0])
        )
        return FusedDraftCE.apply(drafter.head_input(hidden), drafter.lm_head.weight, rows, chunk)
    if not chunk or n <= chunk:
        return part(hidden, *inputs)
    sums = None
    for a in range(0, n, chunk):
        got = checkpoint(
            part, hidden[a : a + chunk], *(x[a : a + chunk] for x in inputs), use_reentrant=False
        )
        sums = got if sums is None else tuple(x + y for x, y in zip(sums, got))
    return sums


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
        batch["aux"].to(_aux_dtype(core)),
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
            "teacher lack them: extract with teacher: last, or train with the target in the step or online"
        )
    sups = [_supervised(batch, k, in_draft) for k in range(steps)]
    table = None if topk else _table(batch, sups, target, draft_ids, lk=loss != "kl")
    counts = torch.stack([s.sum() for s in sups]).tolist()  # one host sync for every step's count
    got = []  # per step (n, objective, agree, alpha): read back once, after every step is queued
    for k in range(steps):
        sup, n = sups[k], int(counts[k])
        if n == 0:
            got.append(None)
            continue
        if topk:
            vd = draft_ids.numel()
            teacher = lambda v, i: _topk_probs(v, i, vd)  # noqa: E731
            inputs = (shift(batch["topk_values"], k + 1)[sup], shift(batch["topk_ids"], k + 1)[sup])
        else:
            teacher, inputs = table, (table.index(sup, k + 1),)
        sums = draft_ce(core, outs[k][sup], teacher, inputs, loss_chunk, fused=loss == "kl")
        obj = step_loss(loss, n, sums, lk_kl_scale, lk_kl_decay)
        total = total + (step_weight**k) * obj
        got.append((n, obj.detach(), sums[1], sums[2].detach() if loss != "kl" else None))
    _read_stats(got, stats, loss)
    return total, stats


def _aux_dtype(core) -> torch.dtype:
    """The dtype the aux states enter the drafter in: under autocast ``fc`` reads them in the
    autocast dtype, so they are cast to it once (the same values as through fp32) unless a norm of
    the variant (``input_norm``, ``fc_norm``) reads them first; else the drafter's weight dtype."""
    dev = core.fc.weight.device.type
    plain_fc = core.input_norm is None and core.fc_norm is None
    return (
        torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) and plain_fc else core.fc.weight.dtype
    )


def _read_stats(got: list, stats: dict, loss: str) -> None:
    """Append every TTT step's (objective, top-1 agreement, α) to ``stats`` from ``got`` (per step
    None or (n, objective, agree, α) as tensors), with one host synchronisation for all of them."""
    live = [g for g in got if g is not None]
    vals = iter(
        torch.stack(
            [
                torch.stack([g[1].float(), g[2].float(), (g[1] if g[3] is None else g[3]).float()])
                for g in live
            ]
        ).tolist()
        if live
        else []
    )
    for g in got:
        if g is None:
            for key in stats:
                stats[key].append(0 if key == "n" else 0.0)
            continue
        v = next(vals)
        stats["loss"].append(v[0])
        stats["acc"].append(v[1] / g[0])
        stats["n"].append(g[0])
        if loss != "kl":
            stats["alpha"].append(v[2] / g[0])


def _supervised(batch: dict, k: int, in_draft: torch.Tensor) -> torch.Tensor:
    """TTT step k's supervised positions, bool [B, T]: a completion input token whose teacher (at
    t + k + 1) has its top-1 inside the draft vocabulary."""
    if "topk_ids" in batch:
        return batch["sup"][k] & shift(batch["top1_in_draft"], k + 1)
    return batch["sup"][k] & in_draft[shift(batch["argmax"], k + 1)]


def _table(batch: dict, sups: list, target: Target, draft_ids: torch.Tensor, lk: bool) -> TeacherTable:
    """The batch's :class:`TeacherTable` over every position a step reads (t + k + 1 for each
    supervised t of step k)."""
    need = torch.zeros_like(sups[0])
    for k, sup in enumerate(sups):
        need |= _unshift(sup, k + 1)
    return TeacherTable(target, batch["last"], need, draft_ids, batch.get("lse"), full=lk)


def _unshift(x: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of :func:`shift` for a bool [B, T] mask: out[:, t + k] = x[:, t]."""
    out = torch.zeros_like(x)
    if k < x.shape[1]:
        out[:, k:] = x[:, : x.shape[1] - k]
    return out


def implied_tau(acc: list[float]) -> float:
    """1 + Σ_k Π_{j≤k} acc_j: the acceptance length per-step top-1 agreement implies (chain, greedy)."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau
