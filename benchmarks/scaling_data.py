"""The scaling benchmark's data recipe: the evaluation sets' first turns, dropping pool rows that
equal or nearly equal an evaluation prompt, and the stratified order whose prefixes are the
nested subsets (``benchmarks/scaling_curve.py``)."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path


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


def write_subset_run(path: Path, take: list[dict], evals: dict, pool_sha: str, seed: int) -> dict:
    """One subset's run folder at ``path`` (its ``config.yaml`` written by the caller): the conversations
    ``take`` and a ``subset`` stage recording the pool and seed it was cut with, its source mix and its
    overlap with the evaluation sets ``evals``, unless the folder holds the subset already; returns the
    ``subset`` report.

    Raises:
        SystemExit: the folder was cut from another pool or seed (subsets must be prefixes of one order).
        ConfigError: a conversation equals an evaluation prompt (``evaluate.check_overlap``)."""
    from eagle3kit.core.rundir import RunDir, sha256_file, write_jsonl
    from eagle3kit.eval.evaluate import check_overlap

    run = RunDir(path)
    made = run.stage_inputs("subset")
    if made and (made["pool"], made["seed"]) != (pool_sha, seed):
        raise SystemExit(
            f"{run.path} was cut from another pool or --seed ({made['seed']}); subsets must be nested "
            "prefixes of one order: use another --work folder, or rerun with the seed it was made with"
        )
    if not made:
        write_jsonl(run / "conversations.jsonl", take)
        overlap = {n: check_overlap(take, rs) for n, rs in evals.items()}  # raises on an exact overlap
        run.record_stage(
            "subset",
            {"pool": pool_sha, "seed": seed, "size": len(take)},
            {
                "conversations": len(take),
                "sources": dict(Counter(r.get("source") for r in take)),
                "overlap_with_eval": overlap,
            },
            {"conversations.jsonl": sha256_file(run / "conversations.jsonl")},
        )
    return run.report["subset"]
