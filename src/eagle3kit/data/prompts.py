"""Stage ``prompts``: read prompt files or synthesize prompts from the target (Magpie).

Output rows (``prompts.jsonl`` for training, ``heldout.jsonl`` for evaluation)::

    {"id": sha256 of the messages (16 hex), "messages": [{"role": "user", "content": ...}, ...],
     "source": "mt_bench", "category": "writing" | null}

Formats read (``format: auto`` detects them per row): MT-bench ``turns`` (first turn), ShareGPT
``conversations`` (``from``/``value``), OpenAI ``messages`` (``role``/``content``), OpenAssistant
trees (``prompt.text``), a plain JSON string, or an object with a text ``field``. A conversation
is cut after its first user turn (and any system turn before it): generation writes the first
assistant reply. Duplicates (same messages) are dropped and counted.
"""

from __future__ import annotations

import random
from collections import Counter

from eagle3kit.core.config import Config
from eagle3kit.core.rundir import DataError, RunDir, sha256_file, write_jsonl
from eagle3kit.core.ui import console
from eagle3kit.data.magpie import _synthesize_via_server, synthesize
from eagle3kit.data.sources import dedupe, read_source, report_bad_rows
from eagle3kit.model.target import load_target


def run_prompts(cfg: Config, run: RunDir, target=None) -> dict:
    """Build ``prompts.jsonl`` (and ``heldout.jsonl`` when evaluation uses a held-out split).

    Reads every ``prompts.sources`` file, then adds ``prompts.synthesize`` Magpie prompts written by
    the target (loaded when ``target`` is None) or through the generation server; duplicates across
    all of them are dropped. Returns the stage counts written to the report.

    Raises:
        DataError: the sources gave no prompts, or Magpie gave none.
    """
    pc = cfg.prompts
    counts: Counter = Counter()
    inputs: dict = {}
    bad: list[dict] | None = None if pc.on_bad_row == "error" else []
    rows = _from_sources(cfg, run, bad, counts, inputs)
    rows.extend(_from_magpie(cfg, run, target, bool(rows), counts, inputs))
    counts["rows_in"] = len(rows)
    if bad is not None:
        report_bad_rows(bad, run / "prompts_rejected.jsonl")
    rows, ndup, ncut = dedupe(rows)
    counts["dropped_duplicate"] = ndup
    if counts["history_cut"]:
        counts["dropped_duplicate_after_history_cut"] = ncut
    if ncut:
        console.print(
            f"[yellow]prompts: {ncut} row(s) differed from another only in the turns after their first user turn "
            f"(replies, tool calls and results) and were dropped as its duplicates: a prompt is the system and "
            f"first user turn only ({counts['history_cut']} row(s) had such turns cut). To train on a "
            "conversation's own history, bring it as conversations.jsonl"
        )
    rows, heldout = _hold_out(cfg, rows)
    write_jsonl(run / "prompts.jsonl", rows)
    write_jsonl(run / "heldout.jsonl", heldout)
    counts["rows_kept"] = len(rows)
    counts["heldout"] = len(heldout)
    out = {k: int(v) for k, v in counts.items()}
    outputs = {n: sha256_file(run / n) for n in ("prompts.jsonl", "heldout.jsonl")}
    run.record_stage("prompts", inputs, out, outputs, consumed={})
    return out


def _from_sources(cfg: Config, run: RunDir, bad: list | None, counts: Counter, inputs: dict) -> list[dict]:
    """Every prompt file's rows (counted per source, each file's hash in ``inputs``).

    Raises:
        DataError: the files gave no prompt at all."""
    pc = cfg.prompts
    rows: list[dict] = []
    for src in pc.sources:
        inputs[src.label] = {}
        got, dropped = read_source(src, bad, lineage=inputs[src.label])
        counts.update({k if k == "history_cut" else f"dropped_{k}": v for k, v in dropped.items()})
        counts[f"rows_from_{src.label}"] = len(got)
        rows.extend(got)
    if pc.sources and not rows:
        if bad is not None:
            report_bad_rows(bad, run / "prompts_rejected.jsonl")
        raise DataError(
            "the prompts stage produced 0 prompts ("
            + ", ".join(s.origin for s in pc.sources)
            + f"; dropped: {dict(counts) or 'none'}); check the files and their filters"
        )
    if pc.sources and pc.synthesize == 64:
        console.print(
            "[yellow]prompts: prompts.synthesize is 64 beside prompt files, so 64 Magpie prompts are added to "
            "theirs. Run folders made before 2026-11-30 store `synthesize: 64` with their sources, which was "
            "ignored then: set it to 0 in their config.yaml to keep what they had"
        )
    return rows


def _from_magpie(
    cfg: Config, run: RunDir, target, have_rows: bool, counts: Counter, inputs: dict
) -> list[dict]:
    """``prompts.synthesize`` Magpie prompts, through the generation server or the target itself
    (loaded when ``target`` is None); a shortfall is counted and said.

    Raises:
        DataError: Magpie gave none and the files gave none either."""
    pc = cfg.prompts
    if not pc.synthesize:
        return []
    if cfg.generate.backend == "openai":
        made, got = _synthesize_via_server(cfg, run)
        counts.update(got)
        inputs["magpie"] = {
            "server": cfg.generate.base_url,
            "model": cfg.generate.model,
            "n": pc.synthesize,
            "seed": pc.seed,
        }
    else:
        if target is None:
            target = load_target(cfg.target)
        made = synthesize(target, pc.synthesize, pc.synthesize_max_tokens, pc.seed, cfg.generate.batch_size)
        inputs["magpie"] = {"target": cfg.target.model, "n": pc.synthesize, "seed": pc.seed}
    counts["rows_from_magpie"] = len(made)
    if len(made) < pc.synthesize:
        counts["synthesize_shortfall"] = pc.synthesize - len(made)
    if not made and not have_rows:
        raise DataError(
            f"Magpie synthesis produced 0 usable prompts ({dict(counts) or 'no attempts'}): the target "
            "never ended a user turn within prompts.synthesize_max_tokens; raise it, or give prompt files"
        )
    if len(made) < pc.synthesize:
        console.print(
            f"[yellow]prompts: Magpie gave {len(made)} of the {pc.synthesize} prompts asked for (the rest did "
            "not end their turn within prompts.synthesize_max_tokens, were too short or repeated); the "
            "stage goes on with them"
        )
    return made


def _hold_out(cfg: Config, rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """``(training rows, held-out rows)``: a seeded ``prompts.heldout_fraction`` held out for
    evaluation when the config names no evaluation sets.

    Raises:
        DataError: every prompt would be held out."""
    pc = cfg.prompts
    if not (pc.heldout_fraction > 0 and not cfg.evaluate.sets):
        return rows, []
    order = list(range(len(rows)))
    random.Random(pc.seed).shuffle(order)
    n_hold = max(1, round(len(rows) * pc.heldout_fraction)) if rows else 0
    hold = set(order[:n_hold])
    heldout = [r for i, r in enumerate(rows) if i in hold]
    rows = [r for i, r in enumerate(rows) if i not in hold]
    if not rows:
        raise DataError(
            f"all {len(heldout)} prompts were held out for evaluation; give more prompts or lower "
            "prompts.heldout_fraction"
        )
    return rows, heldout
