"""The diagnosis report: what would raise the drafter's τ when the engine is right, and the
report's JSON, Markdown and console lines."""

from __future__ import annotations

import json
import os
from pathlib import Path

from eagle3kit.core.kinds import DrafterKind
from eagle3kit.core.rundir import DataError
from eagle3kit.core.ui import console
from eagle3kit.diagnose.simulate import Sequences, Simulated


def advice(kind: DrafterKind, drafter, ref: Simulated, seqs: Sequences, categories: list[str]) -> dict:
    """Where the drafter (of ``kind``) loses on the served text and what would raise its τ.

    * per position: cumulative a_k and conditional α_k = a_k / a_{k−1} (docs/architecture.md, engines), and the
      draft position where most verify steps stop (from the accepted-count histogram);
    * per category: τ of each prompt category, lowest first (the domains to add training data from);
    * vocabulary: the share of the engine's output tokens inside the draft vocabulary (a token
      outside it can never be drafted).
    Returns a dict of those and ``hints`` (sentences)."""
    a = ref.stats.cumulative_per_position
    alpha = ref.stats.conditional_per_position
    by_cat: dict[str, list] = {}
    for c, st in zip(categories, ref.per_prompt):
        by_cat.setdefault(c, []).append(st)
    cats = {}
    for c, sts in by_cat.items():
        acc, drafts = sum(s.accepted for s in sts), sum(s.drafts for s in sts)
        cats[c] = {"prompts": len(sts), "tau": round(1 + acc / drafts, 4) if drafts else None}
    outs = [seqs.ids[i][seqs.first[i] :] for i in range(len(seqs.ids))]
    total = sum(int(o.numel()) for o in outs)
    t2d = kind.draft_vocab_mask(drafter)  # None: it drafts from the target's whole vocabulary
    inside = sum(int(t2d[o].sum()) for o in outs) if t2d is not None else total
    coverage = inside / total if total else None
    hints = []
    hist = ref.stats.hist
    if ref.stats.drafts:
        # a step that accepted exactly j drafts stopped at draft position j + 1 (all K accepted: none)
        stop = max(range(len(hist) - 1), key=lambda j: hist[j])
        share = hist[stop] / ref.stats.drafts
        why = (
            "the first draft is the weakest: more training data or epochs raise step-0 accuracy"
            if stop == 0
            else kind.later_positions_hint
        )
        hints.append(f"{share:.0%} of verify steps stop at draft position {stop + 1}; {why}")
    if coverage is not None and coverage < 0.98:
        hints.append(
            f"{1 - coverage:.1%} of the served tokens lie outside the draft vocabulary and can never be drafted: "
            "build the vocabulary (and the training data) from text like the served prompts; a larger "
            "vocab.draft_vocab_size helps only when the training data holds those tokens"
        )
    ranked = sorted((v["tau"], c) for c, v in cats.items() if v["tau"] is not None)
    if len(ranked) > 1:
        hints.append(
            f"lowest τ by category: {ranked[0][1]} ({ranked[0][0]:.3f}); add training conversations from that domain"
        )
    hints.append(
        "τ grows with training data (docs/measuring.md: SmolLM2, GSM8K τ 1.857 at 1,500 conversations, 2.266 "
        "at 10,000)"
    )
    return {
        "per_position_acceptance": [round(x, 4) for x in a],
        "conditional_acceptance": [round(x, 4) for x in alpha],
        "per_category": cats,
        "draft_vocab_coverage_of_served_tokens": None if coverage is None else round(coverage, 4),
        "hints": hints,
    }


def hypothesis_rows(report: dict) -> list[tuple[str, dict, bool]]:
    """``(name, comparison, explains the engine)`` per hypothesis, the engine's own states last
    (``other_numerics``, when they were captured)."""
    rows = [(h["name"], h, bool(h.get("explains"))) for h in report["hypotheses"]]
    num = report.get("numerics")
    if num:
        rows.append(
            (
                f"other_numerics (parity {num['parity']}; the drafter on the engine's states)",
                num["simulated_on_engine_states"],
                bool(num["explains"]),
            )
        )
    return rows


def console_lines(report: dict) -> list[str]:
    """One line for the engine, one for the drafter as trained, one per hypothesis, the verdict."""
    eng, ref = report["engine"], report["reference"]
    lines = [
        f"engine ({report['server']['engine']}): τ {eng['tau']:.4f} ({eng['accepted']} draft tokens accepted over "
        f"{eng['drafts']} verify steps, K {report['k']}) over {report['prompts']['count']} prompts",
        f"drafter as trained (simulate on the engine's sequences): τ {ref['tau']:.4f}  Δ {ref['delta']:+.4f}  "
        f"tolerance {ref['tolerance']:.4f}  {'agree' if ref['within'] else 'DISAGREE'}",
    ]
    if report["template"]["mismatch"]:
        lines.append(
            f"hypothesis chat_template: EXPLAINS ({report['template'].get('method')}: other prompt ids)"
        )
    for name, h, explained in hypothesis_rows(report):
        if "skipped" in h:
            lines.append(f"hypothesis {name}: not simulated ({h['skipped']})")
        else:
            mark = (
                "EXPLAINS the engine"
                if explained
                else "same as the drafter as trained here: cannot be told apart"
                if h.get("indistinguishable")
                else ("τ within, per prompt no" if h["within"] else "no")
            )
            lines.append(
                f"hypothesis {name}: τ {h['tau']:.4f}  Δ {h['delta']:+.4f}  per-prompt distance {h['distance']}  {mark}"
            )
    lines.append(f"verdict: {report['verdict']} — {report['finding']}")
    return lines


def markdown(report: dict) -> str:
    """``diagnose.md``: the verdict, the table of the engine, the drafter as trained and every
    hypothesis, parity's layers when the engine's states were captured, where the drafter loses."""
    eng, ref = report["engine"], report["reference"]
    out = [
        "# eagle3kit diagnose",
        "",
        f"Server {report['server']['url']} ({report['server']['engine']} {report['server']['version']}), "
        f"drafter `{report['drafter']}`, target `{report['target']}`, {report['prompts']['count']} prompts × "
        f"{report['max_tokens']} tokens, K = {report['k']}."
        + (
            f" Replayed here from the answers recorded in `{report['replayed_from']}` (no server asked)."
            if report.get("replayed_from")
            else ""
        ),
        "",
        f"**Verdict: {report['verdict']}.** {report['finding']}",
        "",
        f"Noise: {report['noise']}. Match: {report['match_rule']}.",
        "",
        "| what | τ | Δ to the engine | per-prompt distance | reproduces the engine |",
        "|---|---:|---:|---:|---|",
        f"| the engine (its counters) | {eng['tau']:.4f} | | | |",
        f"| the drafter as trained | {ref['tau']:.4f} | {ref['delta']:+.4f} | {ref['distance']} | "
        f"{'yes' if ref['within'] else 'no'} |",
    ]
    if report["template"]["mismatch"]:
        out.append(f"| chat_template ({report['template'].get('method')}) | other prompt ids | | | yes |")
    for name, h, explained in hypothesis_rows(report):
        if "skipped" in h:
            out.append(f"| {name} | not simulated: {h['skipped']} | | | |")
        else:
            out.append(
                f"| {name} | {h['tau']:.4f} | {h['delta']:+.4f} | {h['distance']} | "
                f"{'yes' if explained else 'cannot be told apart here' if h.get('indistinguishable') else 'no'} |"
            )
    num = report.get("numerics")
    if num:
        out += ["", f"Parity of the engine's states with transformers': **{num['parity']}**", ""]
        out += ["| layer | cosine | rel. error | top-1 |", "|---|---:|---:|---:|"]
        out += [
            f"| {k} | {v['cosine']:.6f} | {v['relative_error']:.2e} | {v['top1_agreement']:.3f} |"
            for k, v in num["layers"].items()
        ]
    adv = report["advice"]
    out += ["", "## Where the drafter loses", ""]
    out.append(
        f"Per position (cumulative a_k): {adv['per_position_acceptance']}; "
        f"conditional α_k: {adv['conditional_acceptance']}."
    )
    out.append(
        f"Draft-vocabulary coverage of the served tokens: {adv['draft_vocab_coverage_of_served_tokens']}."
    )
    out += ["", "| category | prompts | τ (simulated) |", "|---|---:|---:|"]
    out += [f"| {c} | {v['prompts']} | {v['tau']} |" for c, v in adv["per_category"].items()]
    out += [""] + [f"* {h}" for h in adv["hints"]]
    if report["check_findings"]:
        out += ["", "## `eagle3kit check` on the drafter folder", ""] + [
            f"* {f}" for f in report["check_findings"]
        ]
    t = report["timings"]
    out += ["", "Wall time: " + ", ".join(f"{k.removesuffix('_s')} {v} s" for k, v in t.items()) + "."]
    return "\n".join(out) + "\n"


def write_report(report: dict, out: Path) -> None:
    """``diagnose.json`` and ``diagnose.md`` in ``out`` (both or neither), and the console lines.

    Raises:
        DataError: a write failed, naming the file and ``--out``."""
    texts = {
        out / "diagnose.json": json.dumps(report, indent=2) + "\n",
        out / "diagnose.md": markdown(report),
    }
    tmps = {p: p.with_name(p.name + ".tmp") for p in texts}
    try:  # both under temporary names first: a failed write leaves neither, and the earlier report as it was
        out.mkdir(parents=True, exist_ok=True)
        for p, text in texts.items():
            tmps[p].write_text(text)
        for p, tmp in tmps.items():
            os.replace(tmp, p)
    except OSError as e:
        for tmp in tmps.values():
            if tmp.is_file():
                tmp.unlink()
        raise DataError(
            f"could not write {e.filename or out}: {e.strerror or e}; give --out a writable folder (the earlier "
            "report, if any, is as it was)"
        ) from None
    for line in console_lines(report):
        console.print(line, markup=False, highlight=False)
    console.print(f"report: {out / 'diagnose.json'}, {out / 'diagnose.md'}", markup=False, highlight=False)
