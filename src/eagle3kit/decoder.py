"""The reference speculative decoder: greedy chain drafting in PyTorch (DESIGN.md §7).

Both the target and the drafter keep a KV cache indexed by position: the target a transformers
``StaticCache`` whose write pointer is set to the first position of each verify step (so the
slots of rejected drafts are simply overwritten, as in gpt-fast), the drafter a
:class:`eagle3kit.drafter.DraftKVCache`. No cache is ever cropped or copied.

One verify step at origin t (the target has produced tokens up to x_{t+1}):

1. draft: the drafter's pre-norm output at t gives d_1; then K−1 cached steps at positions
   t+1 … t+K−1 feed back their own outputs with the embedding of the previous draft;
2. verify: one target forward over [x_{t+1}, d_1 … d_K] at positions t+1 … t+K+1;
3. accept the longest prefix of drafts equal to the target's argmax, plus one target token;
4. the drafter's cache is refreshed with the target's aux states of the accepted positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .drafter import Eagle3Drafter
from .metrics import AcceptanceStats
from .target import Target, capture_layer_inputs


def _seek(cache, position: int) -> None:
    """Set every layer's write pointer of a transformers ``StaticCache`` to ``position``."""
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            raise NotImplementedError("the reference decoder does not support sliding-window layers yet")
        layer.cumulative_length.fill_(position)


@dataclass
class DecodeResult:
    """``tokens``: the new token ids; ``stats``: pooled acceptance counters of this prompt."""

    tokens: list[int]
    stats: AcceptanceStats


@torch.no_grad()
def speculative_generate(
    target: Target, drafter: Eagle3Drafter, prompt_ids: list[int], max_new_tokens: int, k: int,
    eot_ids: list[int] | None = None,
) -> DecodeResult:
    """Greedy chain speculative decoding of one prompt.

    Args:
        prompt_ids: the rendered prompt (P ids); max_new_tokens: output limit (tokens);
        k: draft tokens per verify step; eot_ids: ids that end generation (default: the target's).
    Returns: :class:`DecodeResult`; its tokens equal target-only greedy decoding (lossless).
    """
    from transformers import StaticCache

    model, parts = target.model, target.parts
    aux_ids = drafter.config.aux_layer_ids
    eot = set(eot_ids if eot_ids is not None else target.end_of_turn_ids())
    dev = target.device
    P = len(prompt_ids)
    max_len = P + max_new_tokens + k + 2
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    dcache = drafter.new_cache(1, max_len)
    dtype = drafter.fc.weight.dtype
    embed = parts.embed

    def target_forward(ids: list[int], start: int):
        pos = torch.arange(start, start + len(ids), device=dev)[None]
        with capture_layer_inputs(parts.layers, aux_ids) as store:
            out = model(input_ids=torch.tensor([ids], device=dev), position_ids=pos, past_key_values=cache, use_cache=True)
        return out.logits[0].argmax(-1).tolist(), torch.cat([store[i] for i in aux_ids], dim=-1)

    def draft_prefill(aux: torch.Tensor, next_tokens: list[int], start: int) -> torch.Tensor:
        pos = torch.arange(start, start + len(next_tokens), device=dev)[None]
        emb = embed(torch.tensor([next_tokens], device=dev)).to(dtype)
        h = drafter.step(drafter.fc(aux.to(dtype)), emb, pos, dcache)
        return h[:, -1:]

    def pick(h: torch.Tensor) -> int:
        return int(drafter.draft_to_target(drafter.logits(h[0, -1]).argmax(-1)))

    preds, aux = target_forward(list(prompt_ids), 0)
    out = [preds[-1]]
    h = draft_prefill(aux, list(prompt_ids[1:]) + [out[0]], 0)
    t = P - 1
    stats = AcceptanceStats(k)
    while len(out) < max_new_tokens and out[-1] not in eot:
        drafts = [pick(h)]
        hc = h
        for j in range(1, k):
            hc = drafter.step(hc, embed(torch.tensor([[drafts[-1]]], device=dev)).to(dtype),
                              torch.tensor([[t + j]], device=dev), dcache)
            drafts.append(pick(hc))
        _seek(cache, t + 1)
        preds, aux = target_forward([out[-1]] + drafts, t + 1)
        a = 0
        while a < k and drafts[a] == preds[a]:
            a += 1
        remaining = max_new_tokens - len(out)
        a = min(a, remaining)
        accepted = drafts[:a]
        for i, tok in enumerate(accepted):
            if tok in eot:
                a = i + 1
                accepted = accepted[:a]
                break
        stats.add(a)
        new = accepted + ([preds[a]] if a < remaining and not (accepted and accepted[-1] in eot) else [])
        out.extend(new)
        if len(out) >= max_new_tokens or out[-1] in eot:
            break
        h = draft_prefill(aux[:, : a + 1], new, t + 1)
        t += a + 1
    return DecodeResult(tokens=out[:max_new_tokens], stats=stats)


@torch.no_grad()
def greedy_generate(target: Target, prompt_ids: list[int], max_new_tokens: int, eot_ids: list[int] | None = None) -> list[int]:
    """Target-only greedy decoding with transformers' ``generate`` (the losslessness reference)."""
    eot = eot_ids if eot_ids is not None else target.end_of_turn_ids()
    ids = torch.tensor([prompt_ids], device=target.device)
    out = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=eot, pad_token_id=eot[0], top_k=None)
    gen = out[0, len(prompt_ids):].tolist()
    for i, tok in enumerate(gen):
        if tok in eot:
            return gen[: i + 1]
    return gen


@torch.no_grad()
def first_divergence(target: Target, prompt_ids: list[int], a: list[int], b: list[int]) -> dict | None:
    """Where two outputs first differ, with the target's top-2 logit margin there (None if equal)."""
    n = min(len(a), len(b))
    idx = next((i for i in range(n) if a[i] != b[i]), None)
    if idx is None:
        return None if len(a) == len(b) else {"position": n, "reason": "length differs", "len_a": len(a), "len_b": len(b)}
    ids = torch.tensor([list(prompt_ids) + a[:idx]], device=target.device)
    logits = target.model(input_ids=ids).logits[0, -1].float()
    top = logits.topk(2)
    return {"position": idx, "spec_token": a[idx], "reference_token": b[idx],
            "top2_margin": float(top.values[0] - top.values[1]), "top2_ids": top.indices.tolist()}
