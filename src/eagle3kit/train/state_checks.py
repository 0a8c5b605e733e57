"""What every reader of target states checks by content before a drafter trains on them (stored
features, capture files, states fetched online): a layer whose states are all zero, or one vector
repeated at every token, is no target's computation. A real target's residual stream differs from
token to token in every layer; an engine that wrote blocks it never filled, a connector that copied
the wrong ones, or a file overwritten by another program gives such states, and training on them
ends at accuracy 0 and τ 1 with exit 0."""

from __future__ import annotations

import torch

#: how far apart two fp8 (e4m3, one scale a token) copies of one vector may dequantize: each element within
#: half of e4m3's 2^-3 relative step of it, so their difference within 2^-3 of its norm, less than this
FP8_REPEAT_TOLERANCE = 0.15


def state_problem(
    states: torch.Tensor, names: list[str], tolerance: float = 1e-6, ids: torch.Tensor | None = None
) -> str | None:
    """The first problem of the states ``states`` [T, n, H] (any float dtype) of one sample, naming the
    state (``names``, one per state of a token) and the token, or None:

    - a NaN or inf value;
    - a token whose vector is all zero (no layer of a target computes one);
    - one vector at every token of the layer (within ``tolerance`` × its norm: 1e-6, or
      :data:`FP8_REPEAT_TOLERANCE` for states that travelled as fp8) while the tokens differ;
    - a token whose vector is exactly the previous token's though its token id differs (``ids`` int64
      [T], when given): a causal target computes one vector at two positions only after identical
      prefixes, so a copy is a block the writer never filled (for fp8 states, whose copies dequantize
      a little apart, such near-copies at half the tokens or more).

    Tokens that are all one id (``[7, 7, 7]``) legitimately give one vector at every position; without
    ``ids`` that case cannot be told apart, and a whole-layer repeat is refused."""
    T = states.shape[0]
    same_tokens = ids is not None and ids.numel() == T and bool((ids == ids[:1]).all())
    for j, name in enumerate(names[: states.shape[1]]):
        x = states[:, j].float()
        if x.numel() == 0:
            continue
        bad = ~torch.isfinite(x).all(-1)
        if bad.any():
            return f"{name} holds NaN or inf at token {int(bad.nonzero()[0])} of {T}"
        zero = (x == 0).all(-1)
        if zero.any():
            t = int(zero.nonzero()[0])
            return (
                f"{name} is all zero at its {T} token(s)"
                if zero.all()
                else (f"{name} is all zero at {int(zero.sum())} of its {T} tokens, the first at token {t}")
            )
        if T < 2 or same_tokens:
            continue
        if float((x - x[:1]).norm(dim=-1).amax()) <= tolerance * float(x[0].norm()):
            return f"{name} is one vector repeated at all {T} tokens"
        if ids is not None and ids.numel() == T:
            differ = ids[1:].to(x.device) != ids[:-1].to(x.device)
            if tolerance < 1e-3:  # exact copies: no two different tokens give bit-equal states
                copy, needed = (x[1:] == x[:-1]).all(-1) & differ, 1
            else:  # fp8: copies dequantize a little apart; only a run over half the tokens is certain
                step = (x[1:] - x[:-1]).norm(dim=-1) <= tolerance * x[:-1].norm(dim=-1)
                copy, needed = step & differ, max(2, T // 2)
            if int(copy.sum()) >= needed:
                t = int(copy.nonzero()[0]) + 1
                return (
                    f"{name} repeats token {t - 1}'s vector at token {t} ({int(copy.sum())} such copies) though "
                    "the tokens differ"
                )
    return None
