"""The scaling benchmark's data recipe (benchmarks/scaling_curve.py): nested subsets keep the
pool's mix of sources, and no evaluation prompt (or a near copy of one) reaches a subset."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter

from conftest import REPO, SHARED

sys.path.insert(0, str(REPO / "benchmarks"))
_spec = importlib.util.spec_from_file_location("scaling_curve", REPO / "benchmarks" / "scaling_curve.py")
sc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sc)


def _rows(source: str, n: int) -> list[dict]:
    return [
        {
            "id": f"{source}{i}",
            "source": source,
            "messages": [{"role": "user", "content": f"{source} question {i}"}],
        }
        for i in range(n)
    ]


def test_every_prefix_of_the_stratified_order_keeps_the_pool_mix():
    pool = _rows("gsm8k", 613) + _rows("magpie", 332) + _rows("spec_bench", 41) + _rows("oasst", 14)
    order = sc.stratified_order(pool, seed=0)
    assert sorted(r["id"] for r in order) == sorted(r["id"] for r in pool)  # a permutation
    share = {s: n / len(pool) for s, n in Counter(r["source"] for r in pool).items()}
    for size in (10, 100, 250, 500, 999):
        got = Counter(r["source"] for r in order[:size])
        for s, frac in share.items():
            assert abs(got[s] - size * frac) <= 1, (size, s, got[s], size * frac)
    # a plain shuffle would not hold the mix at small prefixes: the 14 oasst rows must be spread out
    positions = [i for i, r in enumerate(order) if r["source"] == "oasst"]
    assert positions[0] < 1000 / 14 and max(b - a for a, b in zip(positions, positions[1:])) <= 2 * 1000 / 14


def test_evaluation_prompts_and_near_copies_are_dropped_from_the_pool():
    evals = sc.eval_rows(str(SHARED))
    assert len(evals["mt_bench"]) == 80 and len(evals["gsm8k_heldout"]) == 80
    held = evals["gsm8k_heldout"][5]["messages"][0]["content"]
    mt = evals["mt_bench"][0]["messages"][0]["content"]
    pool = (
        _rows("gsm8k", 3)
        + [
            {"id": "a", "source": "gsm8k", "messages": [{"role": "user", "content": held}]},  # exact
            {
                "id": "b",
                "source": "magpie",
                "messages": [{"role": "user", "content": "  " + mt.upper() + " "}],
            },  # normalized
            {
                "id": "c",
                "source": "magpie",
                "messages": [{"role": "user", "content": mt + " please"}],
            },  # near copy
            {
                "id": "d",
                "source": "magpie",
                "messages": [{"role": "user", "content": " ".join(mt.split()[:5])}],
            },  # only related
        ]
    )
    kept = [r["id"] for r in sc.drop_eval_overlap(pool, [r for rs in evals.values() for r in rs])]
    assert kept == ["gsm8k0", "gsm8k1", "gsm8k2", "d"]


def test_repeat_share_counts_tokens_that_close_an_earlier_ngram():
    assert sc.repeat_share([1, 2, 3, 4, 5, 6], n=2) == 0.0
    assert sc.repeat_share([1, 2, 1, 2, 1, 2], n=2) == 3 / 6  # (1,2) at 3 and 5 and (2,1) at 4 are repeats
