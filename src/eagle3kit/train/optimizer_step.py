"""One optimizer step of the training loop, for every drafter kind: the step's micro-batches split over
the processes, each process's run one after another (gradient accumulation), the gradients of every
micro-batch of every process summed with its weight and divided by the weights' sum, clipping, AdamW.

A step takes ``train.accumulate`` × processes micro-batches (:func:`step_groups`); process r runs micro-
batches r·A … r·A + A − 1 of it (:func:`rank_micros`). Each micro-batch's loss ℓ_i is a mean over
w_i (its ``weight``: 1 for the EAGLE-3 family, whose loss is the mean of the micro-batches' means;
the supervised slots' summed position weights for a block drafter), and the step descends
Σ_i ℓ_i · w_i ÷ Σ_i w_i over the whole step, so one process with ``accumulate: N`` and N processes with
``accumulate: 1`` take the same step (to float summation order; DistributedDataParallel and FSDP2
average the gradients over the processes, which :func:`optimizer_step` undoes by its factor).
"""

from __future__ import annotations

import contextlib

import torch

from eagle3kit.train.chain_step import tf32_matmuls


def step_groups(micros: list, accumulate: int, world_size: int) -> list[list]:
    """An epoch's micro-batches in optimizer steps of ``accumulate · world_size`` (the last step may be
    short)."""
    g = accumulate * world_size
    return [micros[i : i + g] for i in range(0, len(micros), g)]


def rank_micros(group: list, rank: int, accumulate: int) -> tuple[list, bool]:
    """Process ``rank``'s micro-batches of the step ``group`` and whether it is idle: a process left
    without one by a short last step runs the step's first micro-batch with weight 0 (every process
    runs forward and backward, as DistributedDataParallel needs), so it adds nothing."""
    mine = group[rank * accumulate : (rank + 1) * accumulate]
    return (mine, False) if mine else (group[:1], True)


@contextlib.contextmanager
def grad_sync(model, on: bool):
    """Inside the block, the backward of a data-parallel ``model`` reduces gradients over the
    processes only when ``on`` (the last micro-batch of a step): DistributedDataParallel's
    ``no_sync``, FSDP2's ``set_requires_gradient_sync``; a plain module is unaffected."""
    if on:
        yield
    elif hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def _merge(parts: list[tuple[float, dict]]) -> dict:
    """One process's stats of a step from its micro-batches' ``(weight, stats)``: ``n`` and ``tokens``
    summed, ``acc`` and ``log`` fields averaged by weight (the plain mean when every weight is 0)."""
    total = sum(w for w, _ in parts)
    share = [w / total for w, _ in parts] if total > 0 else [1 / len(parts)] * len(parts)
    first = parts[0][1]
    out = {
        "n": [sum(st["n"][k] for _, st in parts) for k in range(len(first["n"]))],
        "acc": [sum(f * st["acc"][k] for f, (_, st) in zip(share, parts)) for k in range(len(first["acc"]))],
        "tokens": sum(st["tokens"] for _, st in parts),
    }
    for key in ("alpha",):
        if key in first:
            out[key] = [
                sum(f * st[key][k] for f, (_, st) in zip(share, parts)) for k in range(len(first[key]))
            ]
    logs = [st.get("log", {}) for _, st in parts]
    out["log"] = {
        k: round(sum(f * lg.get(k, 0.0) for f, lg in zip(share, logs)), 5)
        for k in logs[0]
        if all(k in lg for lg in logs)
    }
    return out


def optimizer_step(
    kind, model, opt, target, samples, micros: list, idle: bool, speed: dict, cfg, world, draft_ids, seed: int
):
    """One optimizer step: this process's ``micros`` (from :func:`rank_micros`; ``idle``: weight 0)
    through ``kind.loss`` and backward one after another (gradients reduced over the processes only on
    the last), then one collective for the step's Σ weight, Σ loss · weight, supervised positions and
    real tokens; the gradients scaled to Σ_i ∇ℓ_i · w_i ÷ Σ w_i, clipped to ``train.grad_clip``, and
    AdamW's step when any process had a supervised position.

    Args:
        kind: the :class:`~eagle3kit.core.kinds.DrafterKind` (its ``loss``). model: the drafter, in
            DistributedDataParallel or sharded by FSDP2 under torchrun. seed: the step's.
        world: the :class:`~eagle3kit.train.distributed.World`.
    Returns:
        (loss — the step's objective over every process, a 0-dim fp64 tensor —, stats: ``n`` (summed)
        and ``acc`` (weighted by the micro-batches' weights) and ``tokens`` over every process,
        ``log`` of this process's micro-batches).
    """
    drafter = getattr(model, "module", model)
    opt.zero_grad(set_to_none=True)
    parts, weighted = [], 0.0  # (weight, stats) per micro-batch; Σ loss · weight
    for i, micro in enumerate(micros):
        with grad_sync(model, i == len(micros) - 1):
            loss, weight, st = kind.loss(model, target, samples, micro, speed, cfg, draft_ids, seed)
            if idle:
                weight, st = 0.0, dict(st, n=[0] * len(st["n"]), tokens=0)
            with tf32_matmuls(speed.get("tf32", False)):
                (loss * weight).backward()
        value = float(loss.detach())
        weighted += value * weight
        parts.append((weight, st))
    st = _merge(parts)
    mine = sum(w for w, _ in parts)
    # one collective: Σ weight, Σ loss · weight, real tokens, n per position, weight-summed acc
    got = world.sum_floats([mine, weighted, st["tokens"], *st["n"], *(a * mine for a in st["acc"])])
    total, weighted, st["tokens"] = got[0], got[1], int(got[2])
    st["n"] = [int(x) for x in got[3 : 3 + len(st["n"])]]
    if total > 0:
        st["acc"] = [a / total for a in got[3 + len(st["n"]) :]]
    if sum(st["n"]) > 0 and total > 0:
        scale = world.size / total  # the processes' gradients arrive averaged: × size gives their sum
        if scale != 1.0:
            for p in drafter.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.train.grad_clip)
        opt.step()
    step_loss = weighted / total if total > 0 else value
    return torch.tensor(step_loss, dtype=torch.float64), st
