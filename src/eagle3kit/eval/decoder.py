"""The reference speculative decoder: chain and tree drafting, greedy or lossless sampling
(docs/measuring.md), in the style of gpt-fast.

The target runs through :class:`eagle3kit.model.fasttarget.FastTarget` and the drafter through
:meth:`eagle3kit.model.drafter.Eagle3Drafter.step`; both keep a KV cache indexed by slot. Nothing is
ever rolled back: a verify step writes its drafts' keys after the accepted prefix, the accepted
path is moved into consecutive slots, and everything else is overwritten by the next step.

One speculative step (:func:`speculative_step`), with the target's last token ``x`` at position
t+1 and the drafter's output ``h`` at position t:

1. **draft** (:func:`draft`): chain — K drafter steps, each feeding its own output back with the
   embedding of its draft (a parallel-drafting, P-EAGLE drafter instead drafts 2..K in one call
   over K−1 mask slots); tree (EAGLE-2's dynamic tree) — at every depth the ``topk`` best
   nodes by cumulative log-probability are expanded into ``topk`` children each; after
   ``steps`` depths the ``num_draft_tokens − 1`` best nodes (root excluded) form the tree;
2. **verify**: one target forward over [x, drafts] with a tree attention mask;
3. **accept** (:mod:`eagle3kit.eval.verify`): the longest path the target agrees with, plus one
   token from the target (greedy, or rejection sampling so the output is the target's
   distribution);
4. **refresh**: the drafter re-reads the target's aux hidden states of the accepted tokens.

Parameters are named as SGLang names them: ``steps`` (``--speculative-num-steps``, the depth),
``topk`` (``--speculative-eagle-topk``), ``num_draft_tokens`` (``--speculative-num-draft-tokens``,
root included). A chain of K drafts is steps = K, topk = 1, num_draft_tokens = K + 1 (vLLM's
``num_speculative_tokens`` = K).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eagle3kit.core.config import SpecConfig
from eagle3kit.core.metrics import AcceptanceStats
from eagle3kit.eval.verify import AcceptRule, accept, target_probs
from eagle3kit.model.drafter import Eagle3Drafter
from eagle3kit.model.fasttarget import FastTarget
from eagle3kit.model.target import Target


@dataclass
class Draft:
    """A draft tree: ``tokens`` int64 [N] target ids on the device (node 0 = root), ``parents`` [N]
    (−1 for the root), ``depths`` [N], ``q`` float32 [N, V] the distributions a sampled chain drew
    from, else None."""

    tokens: torch.Tensor
    parents: list[int]
    depths: list[int]
    q: torch.Tensor | None = None


@dataclass
class DecodeResult:
    """``tokens``: the new token ids; ``stats``: pooled acceptance counters (K = steps)."""

    tokens: list[int]
    stats: AcceptanceStats
    verify_steps: int = 0
    timings: dict = field(default_factory=dict)


class _DraftRunner(torch.nn.Module):
    """The drafter's cached step, its embedding lookup and its draft log-probabilities, with the
    KV cache as buffers (static addresses for CUDA graphs)."""

    def __init__(self, drafter: Eagle3Drafter, embed: torch.nn.Module, max_len: int):
        super().__init__()
        self.d, self.embed = drafter, embed
        c = drafter.new_cache(1, max_len)
        self.register_buffer("k", c.k, persistent=False)
        self.register_buffer("v", c.v, persistent=False)

    def forward(self, x, tokens, positions, slots, mask, from_aux: bool):
        """x: [q, 3·Ht] target aux states or P-EAGLE's ``mask_hidden`` (``from_aux``), or [q, H] states
        fed back; tokens, positions, slots int64 [q]; mask bool [q, max_len] → (the states to feed
        back [q, H] (:meth:`Eagle3Drafter.feedback`), draft log-probs float32 [q, Vd])."""
        hidden = self.d.combine(x.to(self.d.fc.weight.dtype)) if from_aux else x
        emb = self.embed(tokens).to(hidden.dtype)
        h = self.d.step(hidden[None], emb[None], positions[None], self, slots, mask)[0]
        return self.d.feedback(h), torch.log_softmax(self.d.logits(h).float(), dim=-1)


class DrafterState:
    """The EAGLE-3 proposer: the drafter, its cache, and the drafter's last output ``h`` and its
    draft log-probabilities ``logp`` (position t, from which the next draft starts).

    ``max_len``: cache slots (tokens); the expansion nodes of a tree live in the slots after the
    prefix and are overwritten by the next refresh. ``compile``: CUDA graphs for the fixed-shape
    calls. Any object with ``propose`` and ``accepted`` can stand in for it (:class:`OracleProposer`)."""

    def __init__(
        self,
        drafter: Eagle3Drafter,
        embed: torch.nn.Module,
        max_len: int,
        spec: "SpecConfig",
        vocab_size: int,
        gen: torch.Generator | None = None,
        compile: bool = False,
    ):
        self.d, self.max_len, self.spec, self.vocab_size, self.gen = drafter, max_len, spec, vocab_size, gen
        self.runner = _DraftRunner(drafter, embed, max_len)
        self._compiled = (
            torch.compile(self.runner, mode="reduce-overhead", fullgraph=True) if compile else None
        )
        self.slots = torch.arange(max_len, device=drafter.fc.weight.device)
        self.h: torch.Tensor | None = None
        self.logp: torch.Tensor | None = None

    def propose(self, root: int, t: int) -> "Draft":
        """The draft tree below ``root`` (the target's last token, at position t+1)."""
        return draft(self, root, t, self.spec, self.vocab_size, self.gen)

    def accepted(self, aux: torch.Tensor, new: list[int], start: int) -> None:
        """After a verify step: aux [n, 3H] of the root and the accepted drafts, ``new`` their next
        tokens (the accepted drafts and the target's token), written at positions start …"""
        h, logp = self.refresh(aux, torch.tensor(new, device=aux.device), start)
        self.h, self.logp = h[-1], logp[-1]

    def run(
        self,
        x: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        mask: torch.Tensor,
        from_aux: bool = False,
        eager: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter call (see :class:`_DraftRunner`); outputs are copies, safe across calls."""
        if self._compiled is not None and not eager:
            torch.compiler.cudagraph_mark_step_begin()
            h, logp = self._compiled(x, tokens, positions, slots, mask, from_aux)
            return h.clone(), logp.clone()
        return self.runner(x, tokens, positions, slots, mask, from_aux)

    def refresh(
        self, aux: torch.Tensor, next_tokens: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write target features: aux [n, 3H] at positions start … start+n−1 with the embedding of
        each one's next token; returns outputs [n, H] and log-probs [n, Vd] (the last row drafts
        next). After a verify step (n ≤ steps + 1) the call is padded to steps + 1 rows, one shape
        for CUDA graphs; the padding's slots lie past the prefix and are overwritten before use."""
        n = aux.shape[0]
        eager = n > self.spec.steps + 1  # the prompt's prefill
        if not eager and n < self.spec.steps + 1:
            pad = self.spec.steps + 1 - n
            aux = torch.cat([aux, aux.new_zeros(pad, aux.shape[1])])
            next_tokens = torch.cat([next_tokens, next_tokens.new_zeros(pad)])
        pos = self.slots[start : start + aux.shape[0]]
        h, logp = self.run(
            aux, next_tokens, pos, pos, self.slots[None, :] <= pos[:, None], from_aux=True, eager=eager
        )
        return h[:n], logp[:n]

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.d.draft_to_target(draft_ids)


class OracleProposer:
    """A stand-in drafter for measuring the decoder itself: it proposes the target's own greedy
    continuation ``reference`` (token ids after the prompt) with exactly ``correct`` right drafts
    of ``k`` per step (the next one is made wrong), so τ = correct + 1 while the reference lasts."""

    def __init__(self, reference: list[int], k: int, correct: int, vocab_size: int, device="cpu"):
        self.ref, self.k, self.correct, self.vocab, self.device = reference, k, correct, vocab_size, device
        self.emitted = 1  # the prefill's token

    def propose(self, root: int, t: int) -> "Draft":
        drafts = (self.ref[self.emitted : self.emitted + self.k] + [0] * self.k)[: self.k]
        if self.correct < self.k:
            drafts[self.correct] = (drafts[self.correct] + 1) % self.vocab
        return Draft(
            torch.tensor([root] + drafts, device=self.device),
            list(range(-1, self.k)),
            list(range(self.k + 1)),
        )

    def accepted(self, aux: torch.Tensor, new: list[int], start: int) -> None:
        self.emitted += len(new)


def draft(
    ds: DrafterState, root: int, t: int, spec: SpecConfig, vocab_size: int, gen: torch.Generator | None
) -> Draft:
    """Propose a draft tree below ``root`` (the target's last token, at position t+1) from the
    drafter's state at position t. Stays on the device: a chain needs no host sync, a tree one."""
    dev = ds.h.device
    prefix = ds.slots <= t  # [max_len]
    h, lp = ds.h[None], ds.logp[None]  # [1, H], [1, Vd]
    if spec.mode == "chain":
        tokens, q_rows = [torch.tensor([root], device=dev)], []
        if ds.d.config.parallel_drafting and spec.steps > 1:  # P-EAGLE: drafts 2..K from the mask slots
            slots = ds.slots[t + 1 : t + spec.steps]
            mask_rows = ds.d.mask_hidden.reshape(1, -1).expand(spec.steps - 1, -1)
            mask_ids = torch.full((spec.steps - 1,), ds.d.config.mask_token_id, device=dev)
            _, slot_lp = ds.run(mask_rows, mask_ids, slots, slots, ds.slots[None, :] <= slots[:, None], True)
        for j in range(spec.steps):
            if j and ds.d.config.parallel_drafting:
                lp = slot_lp[j - 1 : j]
            elif j:
                slot = ds.slots[t + j : t + j + 1]
                h, lp = ds.run(h, tokens[-1], slot, slot, (ds.slots <= t + j)[None])
            if spec.temperature > 0:  # sample the draft, keep q for verification
                qd = torch.softmax(lp[0] / spec.temperature, -1)
                tokens.append(ds.to_target(torch.multinomial(qd, 1, generator=gen)))
                q_rows.append(
                    torch.zeros(vocab_size, device=dev).index_copy_(
                        0, ds.to_target(torch.arange(len(qd), device=dev)), qd
                    )
                )
            else:
                tokens.append(ds.to_target(lp[0].argmax(-1, keepdim=True)))
        q = torch.stack([q_rows[0]] + q_rows) if q_rows else None  # row 0 (root) unused
        return Draft(torch.cat(tokens), list(range(-1, spec.steps)), list(range(spec.steps + 1)), q)

    # tree (EAGLE-2): candidates kept on the device; score = cumulative log-prob, parents by global index
    k = spec.topk
    top = lp[0].topk(k)
    scores, toks = [top.values], [ds.to_target(top.indices)]
    parents = [torch.zeros(k, dtype=torch.long, device=dev)]
    depths = [1] * k
    front = torch.arange(1, k + 1, device=dev)  # global ids of the frontier (root = 0)
    fscore, ftok, hidden = top.values, toks[0], h.expand(k, -1).contiguous()
    fmask = prefix.expand(k, -1).clone()  # each frontier node's mask row
    ar = torch.arange(k, device=dev)
    for depth in range(1, spec.steps):
        slots = ds.slots[t + 1 + (depth - 1) * k : t + 1 + depth * k]
        fmask[ar, slots] = True
        out, lp = ds.run(hidden, ftok, torch.full((k,), t + depth, device=dev), slots, fmask)
        ctop = lp.topk(k)  # [k, k]
        total = (fscore[:, None] + ctop.values).flatten()
        ctok = ds.to_target(ctop.indices).flatten()
        base = 1 + sum(len(x) for x in scores)
        scores.append(total), toks.append(ctok), parents.append(front.repeat_interleave(k))
        depths += [depth + 1] * (k * k)
        best = total.topk(k).indices
        rows = best // k
        front, fscore, ftok = base + best, total[best], ctok[best]
        hidden, fmask = out[rows], fmask[rows]
    # a child's score is ≤ its parent's (log-probs ≤ 0) and parents are created first, so a stable
    # sort keeps every chosen node's parent ahead of it, ties included (a sure drafter adds 0.0)
    order = torch.sort(torch.cat(scores), descending=True, stable=True).indices
    chosen = order[: spec.n_tokens - 1].sort().values  # creation order: parents first
    ids, tok, par = torch.stack([chosen + 1, torch.cat(toks)[chosen], torch.cat(parents)[chosen]]).tolist()
    index = {0: 0} | {g: i + 1 for i, g in enumerate(ids)}
    return Draft(
        torch.tensor([root] + tok, device=dev),
        [-1] + [index[p] for p in par],
        [0] + [depths[g - 1] for g in ids],
    )


def tree_mask(parents: list[int], t: int, max_len: int, device) -> torch.Tensor:
    """bool [N, max_len]: node i (in slot t+1+i) sees slots 0 … t and its ancestors and itself."""
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    mask = torch.zeros(n, max_len, dtype=torch.bool)
    mask[:, : t + 1] = True
    mask[:, t + 1 : t + 1 + n] = anc
    return mask.to(device)


@torch.no_grad()
def speculative_step(
    ft: FastTarget,
    proposer,
    root: int,
    t: int,
    spec: SpecConfig,
    gen: torch.Generator | None,
    accept_rule: AcceptRule | None = None,
) -> tuple[list[int], list[int]]:
    """One draft–verify–accept–refresh step from the target's last token ``root`` at position
    t+1. Returns (accepted drafts, new tokens = accepted drafts + the target's token)."""
    dev = ft.k.device
    d = proposer.propose(root, t)
    n = len(d.parents)
    slots = torch.arange(t + 1, t + 1 + n, device=dev)
    chain = d.depths == list(range(n))
    mask = ft.causal_mask(t + 1, n) if chain else tree_mask(d.parents, t, ft.max_len, dev)
    logits, aux = ft(d.tokens, slots if chain else torch.tensor(d.depths, device=dev) + t + 1, slots, mask)
    probs = target_probs(logits, spec.temperature, spec.top_p)
    tokens = d.tokens.tolist()  # the step's one host sync (greedy)
    path, bonus = (accept_rule or accept)(tokens, d.parents, logits, probs, d.q, gen)
    if path != list(range(1, len(path) + 1)):  # a tree path: move it behind the root
        ft.move_slots(slots[torch.tensor(path, device=dev)], slots[1 : len(path) + 1])
    new = [tokens[i] for i in path] + [bonus]
    proposer.accepted(aux[torch.tensor([0] + path, device=dev)], new, t + 1)
    return new[:-1], new


def prefill(
    ft: FastTarget, prompt_ids: list[int], spec: SpecConfig, gen: torch.Generator | None
) -> tuple[int, torch.Tensor]:
    """The target's forward over the prompt (eager): its first new token (argmax, or sampled)
    and the prompt's aux hidden states [P, 3H]."""
    P = len(prompt_ids)
    pos = torch.arange(P, device=ft.k.device)
    logits, aux = ft(torch.tensor(prompt_ids, device=ft.k.device), pos, pos, ft.causal_mask(0, P), eager=True)
    probs = target_probs(logits[-1:], spec.temperature, spec.top_p)
    first = int(logits[-1].argmax()) if probs is None else int(torch.multinomial(probs[0], 1, generator=gen))
    return first, aux


@torch.no_grad()
def speculative_generate(
    target: Target | None,
    drafter: Eagle3Drafter,
    prompt_ids: list[int],
    max_new_tokens: int,
    spec: SpecConfig | int = 3,
    eot_ids: list[int] | None = None,
    seed: int | None = None,
    accept_rule: AcceptRule | None = None,
    ft: FastTarget | None = None,
    ds: DrafterState | None = None,
) -> DecodeResult:
    """Speculative decoding of one prompt.

    Args:
        target: the loaded target; prompt_ids: the rendered prompt (P ids); max_new_tokens: output
        limit (tokens); spec: a :class:`SpecConfig`, or K for a greedy chain of K drafts;
        eot_ids: ids that end generation (default: the target's); seed: the sampling seed;
        accept_rule: replaces :func:`eagle3kit.eval.verify.accept` (tests use a broken one);
        ft, ds: a prepared :class:`FastTarget` and :class:`DrafterState` (reused across prompts,
        so compiled graphs are kept; the cache must hold P + max_new_tokens + num_draft_tokens + 1 slots).
    Returns: :class:`DecodeResult`. Greedy output equals target-only greedy decoding; sampled
    output is distributed as target-only sampling (lossless).
    Raises: ValueError when a prepared cache is too short for this prompt.
    """
    spec = SpecConfig(steps=spec) if isinstance(spec, int) else spec
    P = len(prompt_ids)
    if P < 1 or max_new_tokens < 1:
        raise ValueError(
            f"speculative_generate needs a non-empty prompt and max_new_tokens ≥ 1 (got {P} prompt ids, "
            f"max_new_tokens {max_new_tokens})"
        )
    if spec.mode == "tree" and drafter.config.parallel_drafting:
        raise ValueError("a parallel-drafting (P-EAGLE) drafter drafts a chain: use draft chain, not tree")
    if spec.topk > drafter.config.draft_vocab_size:
        raise ValueError(
            f"topk {spec.topk} exceeds the drafter's draft vocabulary ({drafter.config.draft_vocab_size} tokens)"
        )
    need = P + max_new_tokens + spec.n_tokens + 1
    ft = ft or FastTarget(target.model, target.parts, drafter.config.aux_layer_ids, need)
    if ft.max_len < need:
        raise ValueError(f"the target cache holds {ft.max_len} slots; this prompt needs {need}")
    if ds is not None and ds.max_len < need + spec.steps * spec.topk:
        raise ValueError(
            f"the drafter cache holds {ds.max_len} slots; this prompt and spec need {need + spec.steps * spec.topk}"
        )
    eot = set(eot_ids if eot_ids is not None else target.end_of_turn_ids())
    gen = torch.Generator(device=ft.k.device).manual_seed(seed) if seed is not None else None
    ds = ds or DrafterState(
        drafter, ft.embed, ft.max_len + spec.steps * spec.topk + 1, spec, ft.lm_head.weight.shape[0]
    )
    ds.spec, ds.gen = spec, gen
    first, aux = prefill(ft, prompt_ids, spec, gen)
    ds.accepted(aux, list(prompt_ids[1:]) + [first], 0)
    return decode_loop(ft, ds, [first], P - 1, max_new_tokens, spec, eot, gen, accept_rule)


def decode_loop(
    ft: FastTarget,
    proposer,
    out: list[int],
    t: int,
    max_new_tokens: int,
    spec: SpecConfig,
    eot: set[int],
    gen: torch.Generator | None = None,
    accept_rule: AcceptRule | None = None,
) -> DecodeResult:
    """Speculative steps after the prefill until ``max_new_tokens`` or an end-of-turn id; ``out``
    holds the first token (from the prefill), at position t+1."""
    stats = AcceptanceStats(spec.steps)
    while len(out) < max_new_tokens and out[-1] not in eot:
        accepted, new = speculative_step(ft, proposer, out[-1], t, spec, gen, accept_rule)
        t += len(new)
        keep = new[: max_new_tokens - len(out)]
        cut = next((i + 1 for i, tok in enumerate(keep) if tok in eot), len(keep))
        keep = keep[:cut]
        stats.add(min(len(accepted), len(keep)))
        out.extend(keep)
    return DecodeResult(tokens=out, stats=stats, verify_steps=stats.drafts)


@torch.no_grad()
def target_generate(
    ft: FastTarget,
    prompt_ids: list[int],
    max_new_tokens: int,
    eot_ids: list[int] | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
) -> list[int]:
    """Target-only decoding, one token per forward, with the same cache and compilation as the
    speculative decoder (the speedup's baseline; greedy when temperature is 0)."""
    eot = set(eot_ids or [])
    dev = ft.k.device
    gen = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None
    P = len(prompt_ids)
    if P < 1 or max_new_tokens < 1:
        raise ValueError(
            f"target_generate needs a non-empty prompt and max_new_tokens ≥ 1 (got {P}, {max_new_tokens})"
        )
    out = [prefill(ft, prompt_ids, SpecConfig(temperature=temperature, top_p=top_p), gen)[0]]
    while len(out) < max_new_tokens and out[-1] not in eot:
        p = torch.tensor([P + len(out) - 1], device=dev)
        logits, _ = ft(torch.tensor(out[-1:], device=dev), p, p, ft.causal_mask(P + len(out) - 1, 1))
        probs = target_probs(logits, temperature, top_p)
        out.append(
            int(logits[-1].argmax()) if probs is None else int(torch.multinomial(probs[0], 1, generator=gen))
        )
    return out


@torch.no_grad()
def greedy_generate(
    target: Target, prompt_ids: list[int], max_new_tokens: int, eot_ids: list[int] | None = None
) -> list[int]:
    """Target-only greedy decoding with transformers' ``generate`` (the losslessness reference)."""
    eot = eot_ids if eot_ids is not None else target.end_of_turn_ids()
    ids = torch.tensor([prompt_ids], device=target.device)
    out = target.model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eot,
        pad_token_id=eot[0],
        top_k=None,
    )
    gen = out[0, len(prompt_ids) :].tolist()
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
        return (
            None
            if len(a) == len(b)
            else {"position": n, "reason": "length differs", "len_a": len(a), "len_b": len(b)}
        )
    ids = torch.tensor([list(prompt_ids) + a[:idx]], device=target.device)
    logits = target.model(input_ids=ids).logits[0, -1].float()
    top = logits.topk(2)
    return {
        "position": idx,
        "spec_token": a[idx],
        "reference_token": b[idx],
        "top2_margin": float(top.values[0] - top.values[1]),
        "top2_ids": top.indices.tolist(),
    }
