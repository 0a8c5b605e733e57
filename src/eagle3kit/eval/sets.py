"""The evaluation sets and what ``evaluate`` does with them before any drafter runs: the held-out and
configured prompt sets, their overlap with the training prompts, the target's greedy continuations and
where they are written (shared by every drafter kind's evaluation)."""

from __future__ import annotations

from pathlib import Path

from eagle3kit.core.config import Config, ConfigError
from eagle3kit.core.rundir import DataError, RunDir, read_jsonl, write_jsonl
from eagle3kit.core.ui import progress
from eagle3kit.data.generate import generate_completions
from eagle3kit.data.sources import normalize_text, read_source
from eagle3kit.model.target import Target


def eval_sets(cfg: Config, run: RunDir) -> dict[str, list[dict]]:
    """Named evaluation prompt sets: ``evaluate.sets`` or the held-out split of the prompts stage."""
    sets: dict[str, list[dict]] = {}
    if cfg.evaluate.sets:
        for src in cfg.evaluate.sets:
            rows, _ = read_source(src)
            sets[src.label] = rows
    else:
        path = run.require("heldout.jsonl", "prompts")
        sets["heldout"] = [r for _, r in read_jsonl(path)]
        if not sets["heldout"]:
            raise ConfigError(
                f"{path} holds no prompts: rerun `eagle3kit prompts` with prompts.heldout_fraction > 0, "
                "or give evaluate.sets"
            )
    if cfg.evaluate.num_prompts:
        sets = {k: v[: cfg.evaluate.num_prompts] for k, v in sets.items()}
    empty = [k for k, v in sets.items() if not v]
    if empty:
        raise ConfigError(
            f"evaluation sets {empty} hold no prompts after their filters; fix their path, categories or slice"
        )
    return sets


def trained_prompt_rows(run: RunDir) -> list[dict]:
    """Every prompt this run could have trained on: ``prompts.jsonl`` and every row of
    ``conversations.jsonl`` (which may hold rows generated for an earlier prompt set)."""
    rows = []
    for name in ("prompts.jsonl", "conversations.jsonl"):
        if (run / name).exists():
            rows += [
                {"id": r.get("id"), "messages": r["messages"]}
                for _, r in read_jsonl(run / name)
                if isinstance(r, dict) and isinstance(r.get("messages"), list)
            ]
    return rows


def word_set(text: str) -> set[str]:
    """The distinct words of ``text`` after :func:`normalize_text` (what the overlap check compares)."""
    return set(normalize_text(text).split())


def check_overlap(train_rows: list[dict], eval_rows: list[dict], near_threshold: float = 0.9) -> dict:
    """Refuse evaluation prompts that were trained on; flag near-duplicates.

    Exact overlap = same prompt id or same normalized user text. Near-duplicate = word-set
    Jaccard ≥ ``near_threshold`` (reported, not refused).

    Raises:
        DataError: listing up to 5 overlapping prompts.
    """

    def text(r):
        return " ".join(m["content"] for m in r["messages"] if m["role"] == "user")

    train_ids = {r["id"] for r in train_rows}
    train_norm = {normalize_text(text(r)) for r in train_rows}
    exact = [r for r in eval_rows if r["id"] in train_ids or normalize_text(text(r)) in train_norm]
    if exact:
        shown = "; ".join(repr(text(r)[:60]) for r in exact[:5])
        raise DataError(
            f"{len(exact)} evaluation prompts were trained on (exact overlap), e.g. {shown}; "
            "remove them from the training sources or evaluate on another set"
        )
    train_sets = [word_set(text(r)) for r in train_rows]
    near = 0
    for r in eval_rows:
        w = word_set(text(r))
        if any(len(w & t) / max(len(w | t), 1) >= near_threshold for t in train_sets if t):
            near += 1
    return {"exact_overlap": 0, "near_duplicates": near}


def greedy_continuations(
    target: Target,
    prompts: list[list[int]],
    max_new_tokens: int,
    backend: str,
    batch: int,
    engine_args: dict | None = None,
) -> list[list[int]]:
    """The target's greedy continuation of every prompt (batched through the generation backend;
    ``engine_args``: ``generate.engine_args``, for vLLM)."""
    out: list[list[int]] = []
    with progress() as bar:
        task = bar.add_task(f"target greedy ({backend})", total=len(prompts), tokens=0, note="")
        n = 0
        step = batch if backend == "transformers" else max(batch, 64)
        for i in range(0, len(prompts), step):
            got = generate_completions(
                target, prompts[i : i + step], max_new_tokens, backend, engine_args=engine_args
            )
            out.extend(got)
            n += sum(len(g) for g in got)
            bar.update(task, advance=len(got), tokens=n)
    return out


def write_continuations(
    run: RunDir,
    section: str,
    name: str,
    rows: list[dict],
    prompts: list[list[int]],
    continuations: list[list[int]],
    backend: str,
) -> Path:
    """Write the target's greedy continuations that τ was measured on, one JSON row per prompt
    (``id``, ``prompt_ids``, ``continuation_ids``, ``backend``), to ``<run>/evaluate/<section>-<set>.jsonl``
    (replaced atomically), so an engine's outputs on the same prompts can be compared with them."""

    path = run / "evaluate" / f"{section}-{name}.jsonl"
    write_jsonl(
        path,
        (
            {"id": r.get("id"), "prompt_ids": p, "continuation_ids": c, "backend": backend}
            for r, p, c in zip(rows, prompts, continuations)
        ),
    )
    return path


def chosen_sets(cfg: Config, run: RunDir, only_sets: list[str] | None) -> dict:
    """The evaluation sets (:func:`eval_sets`), or those named in ``only_sets``.

    Raises:
        ConfigError: a name the config does not have."""
    sets = eval_sets(cfg, run)
    if only_sets:
        unknown = sorted(set(only_sets) - set(sets))
        if unknown:
            raise ConfigError(f"no evaluation set named {unknown}; the config has {sorted(sets)}")
        sets = {k_: v for k_, v in sets.items() if k_ in only_sets}
    return sets
