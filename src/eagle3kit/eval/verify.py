"""The verify step's acceptance rules: greedy, and lossless sampling for chains and trees.

A draft is a tree (a chain is a tree whose nodes each have one child): node 0 is the root (the
last token the target emitted), ``parents[i]`` is node i's parent (−1 for the root), children
are tried in index order. The target scored every node in one forward, so ``probs[i]`` is its
next-token distribution after node i's prefix.

* **greedy** (temperature 0): follow the child equal to the target's argmax; the bonus token is
  the argmax after the last accepted node. Output equals target-only greedy decoding.
* **sampled draft** (a chain whose i-th draft was *sampled* from the drafter's distribution
  ``q[i]``): speculative sampling (Leviathan et al. 2023, Chen et al. 2023): accept x with
  probability min(1, p(x)/q(x)); on rejection draw from norm(max(0, p − q)).
* **deterministic drafts** (a tree's top-k children, or an argmax chain, ``q`` None): each
  child is a point-mass proposal; accept child x with probability p'(x) under the current
  residual p', else set p'(x) = 0 and renormalise, try the next child; when none is accepted
  draw from p' (the rule of EAGLE-2's ``evaluate_posterior``; SpecInfer's multi-candidate
  rejection with one-hot proposals). P(output = x) = p(x) for every x.

Both sampling rules emit tokens distributed exactly as target-only sampling from ``probs``
(tested by a χ² test in ``tests/test_decoder.py``).
"""

from __future__ import annotations

from typing import Callable

import torch

#: ``accept(tokens, parents, logits, probs, q, generator) -> (accepted node indices, bonus token id)``
AcceptRule = Callable[
    [
        list[int],
        list[int],
        torch.Tensor,
        "torch.Tensor | None",
        "torch.Tensor | None",
        "torch.Generator | None",
    ],
    tuple[list[int], int],
]


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor | None:
    """The target's sampling distribution: softmax(logits / temperature), then nucleus (top-p)
    filtering, renormalised. logits [T, V] → float32 [T, V]; None when temperature is 0 (greedy).
    Same convention as transformers' ``TopPLogitsWarper`` (keep the smallest set whose mass ≥ top_p)."""
    if temperature <= 0:
        return None
    p = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sp, idx = p.sort(dim=-1, descending=True)
        drop = sp.cumsum(-1) - sp > top_p  # tokens after the mass already reached top_p
        sp = sp.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter_(-1, idx, sp)
        p = p / p.sum(-1, keepdim=True)
    return p


def _children(parents: list[int]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for i, par in enumerate(parents):
        if par >= 0:
            kids.setdefault(par, []).append(i)
    return kids


def _draw(p: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(p / p.sum(), 1, generator=gen))


def accept_greedy(tokens: list[int], parents: list[int], logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy verification: logits [N, V] of the tree's nodes → (accepted node indices, root
    excluded, in path order; the bonus token = the target's argmax after the last of them)."""
    preds = logits.argmax(-1).tolist()
    kids = _children(parents)
    path, u = [], 0
    while True:
        nxt = next((c for c in kids.get(u, []) if tokens[c] == preds[u]), None)
        if nxt is None:
            return path, preds[u]
        path.append(nxt)
        u = nxt


def accept_sampled(
    tokens: list[int],
    parents: list[int],
    probs: torch.Tensor,
    q: torch.Tensor | None,
    gen: torch.Generator | None,
) -> tuple[list[int], int]:
    """Lossless verification (module docstring). probs float32 [N, V]: the target's distribution
    after each node; q float32 [N, V] or None: the distribution node i's token was sampled from
    (row i; only for chains, row 0 unused); gen: the random source. Returns the accepted node
    indices (path order) and the bonus token drawn from the residual."""
    kids = _children(parents)
    path, u = [], 0
    while True:
        p = probs[u].clone()
        moved = False
        for c in kids.get(u, []):
            x = tokens[c]
            r = float(torch.rand((), generator=gen, device=p.device))
            if q is not None:  # a draft sampled from q[c]
                if r < min(1.0, float(p[x]) / max(float(q[c, x]), 1e-30)):
                    moved = True
                else:
                    p = torch.clamp(p - q[c], min=0.0)
                    if float(p.sum()) <= 0:  # p == q: any residual is p itself
                        p = probs[u].clone()
            else:  # a point-mass proposal
                if r * float(p.sum()) < float(p[x]):
                    moved = True
                else:
                    p[x] = 0.0
            if moved:
                path.append(c)
                u = c
                break
            if q is not None:
                break  # a sampled chain has one child per node
        if not moved:
            return path, _draw(p, gen)


def accept(
    tokens: list[int],
    parents: list[int],
    logits: torch.Tensor,
    probs: torch.Tensor | None,
    q: torch.Tensor | None,
    gen: torch.Generator | None,
) -> tuple[list[int], int]:
    """Greedy when ``probs`` is None, else :func:`accept_sampled`."""
    if probs is None:
        return accept_greedy(tokens, parents, logits)
    return accept_sampled(tokens, parents, probs, q, gen)
