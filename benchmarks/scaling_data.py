"""The scaling benchmark's data recipe: the evaluation sets' first turns, dropping pool rows that
equal or nearly equal an evaluation prompt, and the stratified order whose prefixes are the
nested subsets (``benchmarks/scaling_curve.py``)."""

from __future__ import annotations

import random


def eval_rows(shared: str) -> dict[str, list[dict]]:
    from common import EVAL_SETS

    from eagle3kit.core.config import PromptSource
    from eagle3kit.data.sources import read_source

    return {
        name: [
            {**r, "messages": r["messages"][:1]}
            for r in read_source(PromptSource(name=name, **{**spec, "path": f"{shared}/{spec['path']}"}))[0]
        ]
        for name, spec in EVAL_SETS.items()
    }


def user_text(row: dict) -> str:
    return " ".join(m["content"] for m in row["messages"] if m["role"] == "user")


def drop_eval_overlap(rows: list[dict], evals: list[dict], near: float = 0.9) -> list[dict]:
    """``rows`` without any whose user text equals an evaluation prompt's (after
    ``prompts.normalize_text``) or shares ≥ ``near`` of its words with one (Jaccard, as
    ``evaluate.check_overlap`` counts near-duplicates)."""
    from eagle3kit.data.sources import normalize_text
    from eagle3kit.eval.sets import word_set

    ev_norm = {normalize_text(user_text(r)) for r in evals}
    ev_words = [w for w in (word_set(user_text(r)) for r in evals) if w]

    def close(r) -> bool:
        w = word_set(user_text(r))
        return any(len(w & e) / len(w | e) >= near for e in ev_words)

    return [r for r in rows if normalize_text(user_text(r)) not in ev_norm and not close(r)]


def stratified_order(rows: list[dict], seed: int) -> list[dict]:
    """The pool in an order whose every prefix keeps the pool's share of each source (± 1 row):
    row j of a source's shuffled rows (n of them) sorts at (j + ½) / n."""
    rng = random.Random(seed)
    by_source: dict[str, list[dict]] = {}
    for r in rows:
        by_source.setdefault(r.get("source") or "?", []).append(r)
    keyed = []
    for src in sorted(by_source):
        group = by_source[src]
        rng.shuffle(group)
        keyed += [((j + 0.5) / len(group), rng.random(), r) for j, r in enumerate(group)]
    return [r for *_, r in sorted(keyed, key=lambda x: (x[0], x[1]))]
