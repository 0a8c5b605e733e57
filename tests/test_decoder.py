"""The reference decoder (issue 10): the target's decode forward, chain and tree drafting, and
lossless sampling.

* greedy chain and tree outputs equal target-only greedy (transformers ``generate``), on tiny
  targets (a vocabulary of 8, where a top-k tree accepts often and moves its paths) and on SmolLM2;
* sampling is lossless: the joint distribution of the tokens at positions 2..K+1, over 10,000
  seeded draws, fits the target's exact distribution (χ², p > 0.01), for a sampled chain and a
  top-k tree, and a verifier that accepts every draft fails the same test.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp

import pytest
import torch
from conftest import build_tiny_llama

from eagle3kit.core.config import SpecConfig
from eagle3kit.eval.decoder import greedy_generate, speculative_generate, target_generate, tree_mask
from eagle3kit.eval.verify import target_probs
from eagle3kit.model.draft_vocab import DraftVocab
from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter
from eagle3kit.model.fasttarget import FastTarget
from eagle3kit.model.target import Target, resolve_parts

V = 8
PROMPT = [1, 5, 3, 2, 7]


def tiny_pair(layers: int = 3, dtype=torch.float32, seed: int = 0):
    """A random Llama target with a vocabulary of 8 (peaked: initializer 0.3) and a random drafter
    whose draft vocabulary leaves out tokens 2 and 5 (so d2t has non-zero offsets)."""
    m = build_tiny_llama(
        layers,
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        dtype=dtype,
        tie_word_embeddings=False,
        initializer_range=0.3,
        seed=seed,
    )
    target = Target(model=m, tokenizer=None, parts=resolve_parts(m))
    torch.manual_seed(seed + 1)
    cfg = DrafterConfig(
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        rms_norm_eps=1e-5,
        vocab_size=V,
        draft_vocab_size=6,
        target_hidden_size=16,
        aux_layer_ids=[min(i, layers - 1) for i in range(3)],
    )
    d = Eagle3Drafter(cfg).to(dtype)
    d.set_vocab(DraftVocab(ids=torch.tensor([0, 1, 3, 4, 6, 7]), vocab_size=V))
    return target, d.eval()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fast_target_equals_transformers_on_a_prefix_and_on_every_tree_node(family):
    from tiny_targets import build

    m = build(family, num_layers=4).double()
    parts = resolve_parts(m)
    ids = [3, 17, 42, 5, 9, 60, 11]
    ft = FastTarget(m, parts, [1, 2], 32)
    pos = torch.arange(len(ids))
    logits, aux = ft(torch.tensor(ids), pos, pos, ft.causal_mask(0, len(ids)))
    out = m(input_ids=torch.tensor([ids]), output_hidden_states=True)
    assert torch.allclose(logits, out.logits[0], atol=1e-9)
    assert torch.allclose(aux, torch.cat([out.hidden_states[1][0], out.hidden_states[2][0]], -1), atol=1e-9)
    # a tree after the first 4 tokens: root 5 with children 9 and 70, 9 with child 60; each node's
    # logits equal transformers' on prompt + its path (tree mask, depth positions, slots)
    P, tokens, parents, depths = 4, [5, 9, 70, 60], [-1, 0, 0, 1], [0, 1, 1, 2]
    ft(torch.tensor(ids[:P]), torch.arange(P), torch.arange(P), ft.causal_mask(0, P))
    got, _ = ft(
        torch.tensor(tokens),
        torch.tensor(depths) + P,
        torch.arange(P, P + 4),
        tree_mask(parents, P - 1, 32, "cpu"),
    )
    for node, path in enumerate([[5], [5, 9], [5, 70], [5, 9, 60]]):
        ref = m(input_ids=torch.tensor([ids[:P] + path])).logits[0, -1]
        assert torch.allclose(got[node], ref, atol=1e-9), node


def test_greedy_chain_and_tree_equal_target_greedy_on_a_tiny_target():
    target, d = tiny_pair(dtype=torch.float64)
    specs = [
        SpecConfig(steps=3),
        SpecConfig(steps=5),
        SpecConfig(mode="tree", steps=3, topk=3, num_draft_tokens=8),
        SpecConfig(mode="tree", steps=4, topk=4, num_draft_tokens=40),
    ]
    taus = {s: [] for s in specs}
    for p in ([1, 5, 3, 2, 7], [0, 0, 1], [6, 2, 2, 4, 1, 3, 5, 7, 0, 4]):
        ref = greedy_generate(target, p, 40, eot_ids=[V + 1])
        ft = FastTarget(target.model, target.parts, d.config.aux_layer_ids, 100)
        assert target_generate(ft, p, 40) == ref
        for s in specs:
            res = speculative_generate(target, d, p, 40, s, eot_ids=[V + 1], ft=ft)
            assert res.tokens == ref, (s, p)
            taus[s].append(res.stats)
    # the trees accept deeper than the chains (a top-3 of 6 draft tokens holds the argmax often), so
    # paths other than the first child were accepted and moved
    chain_tau = sum(st.accepted for st in taus[specs[0]]) / sum(st.drafts for st in taus[specs[0]])
    tree_tau = sum(st.accepted for st in taus[specs[2]]) / sum(st.drafts for st in taus[specs[2]])
    print({s.mode + str(s.n_tokens): [st.hist for st in v] for s, v in taus.items()})
    assert tree_tau > chain_tau + 0.2 and max(st.hist[3] for st in taus[specs[3]]) > 0


def test_spec_config_names_and_refuses_impossible_trees():
    assert SpecConfig(steps=3).n_tokens == 4
    with pytest.raises(ValueError, match="outside"):
        SpecConfig(mode="tree", steps=2, topk=2, num_draft_tokens=9)  # at most 1 + 2 + 4 = 7
    with pytest.raises(ValueError, match="outside"):
        SpecConfig(mode="tree", steps=2, topk=2, num_draft_tokens=0)
    with pytest.raises(ValueError, match="chain has topk 1"):
        SpecConfig(steps=3, topk=2)
    for bad, said in (
        (dict(temperature=1e-300), "temperature 1e-300 must be 0"),
        (dict(temperature=float("inf")), "temperature inf must be 0"),
        (dict(temperature=float("nan")), "temperature nan must be 0"),
        (dict(top_p=0.0), r"top_p 0.0 must lie in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p 1.5 must lie in \(0, 1\]"),
        (dict(steps=2.5), r"steps \(2.5\) and topk \(1\) must be integers"),
        (dict(steps=True), r"steps \(True\) and topk \(1\) must be integers"),
    ):
        with pytest.raises(ValueError, match=said):
            SpecConfig(**bad)


def test_a_sure_drafter_ties_parent_and_child_and_the_tree_stays_closed():
    """A drafter sure of its tokens gives children log-prob 0.0, so a child ties its parent's score;
    the tree must still hold every chosen node's parent (attack finding: KeyError before)."""
    target, d = tiny_pair(layers=1, dtype=torch.float64, seed=1)
    with torch.no_grad():
        d.lm_head.weight.mul_(300)
    ref = greedy_generate(target, PROMPT, 24, eot_ids=[V + 1])
    for steps, topk, n in ((4, 3, 6), (4, 3, 9), (3, 2, 5)):
        res = speculative_generate(
            target,
            d,
            PROMPT,
            24,
            SpecConfig(mode="tree", steps=steps, topk=topk, num_draft_tokens=n),
            eot_ids=[V + 1],
        )
        assert res.tokens == ref


def test_decoder_refuses_what_it_cannot_decode():
    from tiny_targets import build

    target, d = tiny_pair()
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(target, d, PROMPT, 0, 3, eot_ids=[])
    with pytest.raises(ValueError, match="non-empty prompt"):
        speculative_generate(target, d, [], 4, 3, eot_ids=[])
    with pytest.raises(ValueError, match="draft vocabulary"):
        speculative_generate(
            target, d, PROMPT, 4, SpecConfig(mode="tree", steps=1, topk=7, num_draft_tokens=3), eot_ids=[]
        )
    import transformers as T

    m = T.MistralForCausalLM(
        T.MistralConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=64,
            sliding_window=16,
        )
    )
    FastTarget(m, resolve_parts(m), [], 16)  # within the window: full attention is exact
    with pytest.raises(NotImplementedError, match="sliding window of 16"):
        FastTarget(m, resolve_parts(m), [], 32)
    with pytest.raises(NotImplementedError):
        FastTarget(build("gpt_oss", 2), resolve_parts(build("gpt_oss", 2)), [], 16)


# ---- lossless sampling: χ² over 5,000 draws ------------------------------------------------
K, DRAWS = 3, 5_000
SAMPLING = {
    "chain": SpecConfig(steps=K, temperature=1.0),
    "tree": SpecConfig(mode="tree", steps=K, topk=2, num_draft_tokens=6, temperature=0.8, top_p=0.95),
    "target_only": None,
}


def accept_always(tokens, parents, logits, probs, q, gen):
    """A broken verifier: every draft of the chain is accepted, then one token from the target."""
    path = list(range(1, len(tokens)))
    return path, int(torch.multinomial(probs[path[-1]], 1, generator=gen))


def _draws(args) -> list[tuple[int, ...]]:
    name, broken, seeds = args
    torch.set_num_threads(1)
    target, d = tiny_pair(layers=1)  # one layer: 5,000 draws in about 15 s per setting
    ft = FastTarget(target.model, target.parts, d.config.aux_layer_ids, 16)
    out = []
    for seed in seeds:
        if SAMPLING[name] is None:
            toks = target_generate(ft, PROMPT, K + 1, temperature=1.0, seed=seed)
        else:
            toks = speculative_generate(
                target,
                d,
                PROMPT,
                K + 1,
                SAMPLING[name],
                eot_ids=[],
                seed=seed,
                ft=ft,
                accept_rule=accept_always if broken else None,
            ).tokens
        out.append(tuple(toks[1 : K + 1]))
    return out


def exact_joint(spec: SpecConfig | None) -> dict[tuple[int, ...], float]:
    """P(x_2..x_{K+1}) under target-only sampling, by enumerating every continuation with
    transformers' forward (not the decoder's)."""
    target, _ = tiny_pair(layers=1)
    temp, top_p = (1.0, 1.0) if spec is None else (spec.temperature, spec.top_p)
    seqs = torch.tensor([PROMPT + list(s) for s in itertools.product(range(V), repeat=K + 1)])
    with torch.no_grad():
        probs = target_probs(target.model(input_ids=seqs).logits.double().reshape(-1, V), temp, top_p)
    probs = probs.reshape(len(seqs), -1, V).double()
    P = len(PROMPT)
    p = torch.ones(len(seqs), dtype=torch.float64)
    for j in range(K + 1):
        p *= probs[torch.arange(len(seqs)), P - 1 + j, seqs[:, P + j]]
    joint: dict = {}
    for s, v in zip(seqs[:, P + 1 :].tolist(), p.tolist()):
        joint[tuple(s)] = joint.get(tuple(s), 0.0) + v
    return joint


def chi2_pvalue(counts: dict, joint: dict, n: int) -> tuple[float, float, int]:
    """Pearson χ² of observed counts against n·P, cells with expected < 5 pooled; p from the
    regularised upper incomplete gamma Q(df/2, χ²/2)."""
    big = [c for c in joint if joint[c] * n >= 5]
    small = [c for c in joint if joint[c] * n < 5]
    obs = [counts.get(c, 0) for c in big] + [sum(counts.get(c, 0) for c in small)]
    exp = [joint[c] * n for c in big] + [sum(joint[c] for c in small) * n]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(exp) - 1
    return (
        chi2,
        float(
            torch.special.gammaincc(
                torch.tensor(df / 2, dtype=torch.float64), torch.tensor(chi2 / 2, dtype=torch.float64)
            )
        ),
        df,
    )


@pytest.fixture(scope="module")
def pool():
    with mp.get_context("fork").Pool(2) as p:
        yield p


@pytest.mark.parametrize(
    "name,broken", [("target_only", False), ("chain", False), ("tree", False), ("chain", True)]
)
def test_sampling_is_lossless_chi2_over_5000_draws(pool, name, broken):
    """Each lossless setting: 5,000 draws agree with the exact joint (p > 0.01). The broken
    verifier (accept every draft) is refused already at 2,000 draws (p < 1e-6; at 10,000, p is 0
    to machine precision), which shows the test has the power to see a lossy decoder."""
    draws = 2_000 if broken else DRAWS
    seeds = list(range(draws))
    parts = pool.map(_draws, [(name, broken, seeds[i::2]) for i in range(2)])
    counts: dict = {}
    for draw in itertools.chain(*parts):
        counts[draw] = counts.get(draw, 0) + 1
    chi2, p, df = chi2_pvalue(counts, exact_joint(SAMPLING[name]), draws)
    print(f"{name}{' (accept always)' if broken else ''}: χ² {chi2:.1f}, df {df}, p {p:.3g}")
    if broken:
        assert p < 1e-6
    else:
        assert p > 0.01
