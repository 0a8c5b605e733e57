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


def state_problem(states: torch.Tensor, names: list[str], tolerance: float = 1e-6) -> str | None:
    """The first of ``names`` (one per state of a token) whose states in ``states`` [T, n, H] (any float
    dtype) are all zero, or one vector repeated at each of the T ≥ 2 tokens: every token's vector within
    ``tolerance`` × the first one's norm of it (1e-6; :data:`FP8_REPEAT_TOLERANCE` for states that travelled
    as fp8). None when every layer varies. A real target's states differ from token to token by a large
    part of their norm in every layer."""
    T = states.shape[0]
    for j, name in enumerate(names[: states.shape[1]]):
        x = states[:, j].float()
        if x.numel() == 0:
            continue
        if float(x.abs().amax()) == 0.0:
            return f"{name} is all zero at its {T} token(s)"
        if T >= 2 and float((x - x[:1]).norm(dim=-1).amax()) <= tolerance * float(x[0].norm()):
            return f"{name} is one vector repeated at all {T} tokens"
    return None
