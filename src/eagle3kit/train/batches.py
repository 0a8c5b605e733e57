"""Batches for training-time test: samples grouped by length or packed into rows, padded, with
the per-step shifted tokens and loss masks (docs/conventions.md, alignment)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass
class Sample:
    """One training sequence and (when cached) its target features.

    ids int64 [T]; mask bool [T] (completion tokens); aux [T, 3·Ht]; last [T, Ht] post-norm;
    argmax int64 [T] target full-vocabulary argmax at each completion token (0 at prompt tokens,
    which no TTT step reads); ``lse`` fp32 [T] its full-vocabulary log-normaliser there, when the
    loss needs it; or, from top-K features,
    ``topk_values``/``topk_ids``/``top1_in_draft`` in place of ``last``/``argmax``."""

    ids: torch.Tensor
    mask: torch.Tensor
    aux: torch.Tensor | None = None
    last: torch.Tensor | None = None
    argmax: torch.Tensor | None = None
    topk_values: torch.Tensor | None = None  # [T, K] fp32 teacher logits (features extracted with topk:K)
    topk_ids: torch.Tensor | None = None  # [T, K] int64 draft ids
    top1_in_draft: torch.Tensor | None = None  # [T] bool: the target's top-1 is in the draft vocabulary
    lse: torch.Tensor | None = (
        None  # [T] fp32 full-vocabulary log-normaliser at completion tokens (LK losses)
    )


# ``mix``: samples are grouped by length within windows of this many batches' tokens
MIX_WINDOW_BATCHES = 8


def length_batches(
    lengths: list[int],
    tokens_per_batch: int,
    shuffle: bool,
    rng: random.Random,
    mix: random.Random | None = None,
) -> list[list[int]]:
    """Group sample indices by similar length so that B · T_max ≤ ``tokens_per_batch`` (a longer
    sample forms a batch of its own); ``shuffle``: the batches' order drawn from ``rng``.

    Without ``mix`` every sample is sorted by length once, so the same samples share a batch every
    epoch. With it the samples are shuffled first (by ``mix``, a generator of their own, so the
    batches' order draws the same numbers either way) and sorted by (length, index) only within
    consecutive windows of :data:`MIX_WINDOW_BATCHES` × ``tokens_per_batch`` tokens: each epoch
    makes new batches, still of similar lengths (the mega-batch idea of Hugging Face's
    ``LengthGroupedSampler``), and a data set that fits in one window gets exactly the batches of
    the sorted grouping. The number of batches can differ by a few between epochs."""
    if mix is None:
        windows = [sorted(range(len(lengths)), key=lambda i: lengths[i])]
    else:
        order = list(range(len(lengths)))
        mix.shuffle(order)
        windows, cur, size = [], [], 0
        for i in order:
            if cur and size + lengths[i] > MIX_WINDOW_BATCHES * tokens_per_batch:
                windows.append(cur)
                cur, size = [], 0
            cur.append(i)
            size += lengths[i]
        windows.append(cur)
        windows = [sorted(w, key=lambda i: (lengths[i], i)) for w in windows if w]
    batches = []
    for window in windows:
        cur, cur_max = [], 0
        for i in window:
            m = max(cur_max, lengths[i])
            if cur and m * (len(cur) + 1) > tokens_per_batch:
                batches.append(cur)
                cur, m = [], lengths[i]
            cur.append(i)
            cur_max = m
        if cur:
            batches.append(cur)
    if shuffle:
        rng.shuffle(batches)
    return batches


def _pad(seqs: list[torch.Tensor], value=0) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=value)


def packed_batches(
    lengths: list[int], tokens_per_step: int, row_len: int, shuffle: bool, rng: random.Random
) -> list[list[list[int]]]:
    """Sequence packing: samples placed first-fit by decreasing length into rows of at most
    ``row_len`` tokens (a longer sample gets a row of its own), rows grouped into batches whose
    padded size (rows × the longest row) stays within ``tokens_per_step`` (a row longer than that
    forms a batch of its own). Returns batches of rows of sample indices."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(max(0, row_len - lengths[i]))
    if shuffle:
        rng.shuffle(rows)
    batches: list[list[list[int]]] = []
    cur: list[list[int]] = []
    widest = 0
    for r in rows:  # rows × the widest row's length ≤ tokens_per_step
        n = sum(lengths[i] for i in r)
        if cur and max(widest, n) * (len(cur) + 1) > tokens_per_step:
            batches.append(cur)
            cur, widest = [], 0
        cur.append(r)
        widest = max(widest, n)
    if cur:
        batches.append(cur)
    return batches


def make_batch(samples: list[Sample], idx: list, steps: int, device) -> dict:
    """Pad a batch and build per-step shifted tokens and masks.

    ``idx``: one sample index per row, or per row a list of sample indices packed into that row
    (each keeps its own rotary positions from 0 and attends only to itself; the batch then holds
    ``doc`` [B, T], the sequence each token belongs to, −1 at padding).

    Returns dict with ``ids`` [B, T], ``aux`` [B, T, 3Ht], ``last`` [B, T, Ht], ``argmax`` [B, T],
    ``key_mask`` [B, T], ``positions`` [B, T] and per step k ``tok[k]`` [B, T] (x_{t+k+1}, 0 past
    the end of its sequence) and ``sup[k]`` [B, T] (that token is a completion token of the same
    sequence, docs/conventions.md, alignment).
    """
    rows = [[i] if isinstance(i, int) else list(i) for i in idx]
    packed = any(len(r) > 1 for r in rows)

    def rowcat(get, value=0):
        # each piece goes to the device first (asynchronous from pinned memory) and is joined
        # there: no [B, T, 3Ht] copy is built in pageable host memory and copied synchronously
        return _pad(
            [torch.cat([get(samples[i]).to(device, non_blocking=True) for i in r]) for r in rows], value
        )

    ids = rowcat(lambda s: s.ids)
    mask = rowcat(lambda s: s.mask, False)
    key_mask = rowcat(lambda s: torch.ones(s.ids.numel(), dtype=torch.bool), False)
    positions = rowcat(lambda s: torch.arange(s.ids.numel()))
    B, T = ids.shape
    doc = None
    if packed:
        doc = _pad(
            [torch.cat([torch.full((samples[i].ids.numel(),), j) for j, i in enumerate(r)]) for r in rows], -1
        ).to(device)
    tok, sup = [], []
    for k in range(steps):
        sh = k + 1
        t_k = torch.zeros_like(ids)
        m_k = torch.zeros_like(mask)
        if sh < T:
            t_k[:, : T - sh] = ids[:, sh:]
            m_k[:, : T - sh] = mask[:, sh:]
            if doc is not None:
                same = doc[:, sh:] == doc[:, : T - sh]
                m_k[:, : T - sh] &= same
                t_k[:, : T - sh] *= same
        tok.append(t_k)
        sup.append(m_k)
    out = {"ids": ids, "key_mask": key_mask, "tok": tok, "sup": sup, "positions": positions}
    if doc is not None:
        out["doc"] = doc
    first = samples[rows[0][0]]
    if first.aux is not None:
        out["aux"] = rowcat(lambda s: s.aux)
        if first.topk_ids is not None:
            out["topk_values"] = rowcat(lambda s: s.topk_values)
            out["topk_ids"] = rowcat(lambda s: s.topk_ids)
            out["top1_in_draft"] = rowcat(lambda s: s.top1_in_draft, False)
        else:
            out["last"] = rowcat(lambda s: s.last)
            out["argmax"] = rowcat(lambda s: s.argmax)
            if first.lse is not None:
                out["lse"] = rowcat(lambda s: s.lse)
    return out


def flat_indices(b) -> list[int]:
    """A batch's sample indices (a packed batch's rows flattened)."""
    return [i for r in b for i in (r if isinstance(r, list) else [r])]


def epoch_batches(train: list[Sample], tc, epoch: int) -> list:
    """The micro-batches of ``epoch`` over every training sample (``train.tokens_per_step`` tokens each;
    packed rows with ``train.pack_length``), seeded by ``train.seed`` + epoch: the same on every
    process, run and resume."""
    lengths = [s.ids.numel() for s in train]
    rng = random.Random(tc.seed + epoch)
    if tc.pack_length:
        return packed_batches(lengths, tc.tokens_per_step, tc.pack_length, True, rng)
    mix = random.Random(f"{tc.seed}:{epoch}:samples") if tc.shuffle == "samples" else None
    return length_batches(lengths, tc.tokens_per_step, True, rng, mix)
