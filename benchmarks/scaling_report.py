"""The scaling curve's report (``benchmarks/scaling_curve.py --stages report``): the JSON whose
``points`` list holds ``conversations``, ``tau_k3`` (MT-bench), ``tau_k5``, ``tau_k3_gsm8k`` and
``tau_k5_gsm8k`` per subset, a Markdown table, the PNG plot, the analysis of what limits τ, and a
copy of each run's config, manifest and report."""

from __future__ import annotations

import json
from pathlib import Path

ABLATION = "no_gsm8k"


def write_report(args, work: Path, state: dict, recipe: dict, names: list[str], folder) -> None:
    """Write ``scaling.json``, ``scaling.md``, ``scaling.png`` and ``scaling/<run>/`` under ``args.results``."""
    import shutil

    import torch

    from eagle3kit.core.ui import print_table

    results = Path(args.results)
    out = results / "scaling"
    for src in [work / "pool", *(folder(work, n) for n in names)]:
        for f in ("config.yaml", "manifest.json", "report.json"):
            if (src / f).exists():
                (out / src.name).mkdir(parents=True, exist_ok=True)
                shutil.copy(src / f, out / src.name / f)
    tau = state["tau"]
    keys = {
        "tau_k3": "mt_bench_k3",
        "tau_k5": "mt_bench_k5",
        "tau_k3_gsm8k": "gsm8k_heldout_k3",
        "tau_k5_gsm8k": "gsm8k_heldout_k5",
    }

    def row(name: str) -> dict:
        return {k: tau[name][v]["tau"] for k, v in keys.items()}

    points = [
        {
            "conversations": s,
            **row(str(s)),
            "sources": state["subsets"][str(s)]["sources"],
            **{f"train_{k}": v for k, v in state["train"][str(s)].items()},
        }
        for s in args.sizes
    ]
    rises = {k: all(b[k] > a[k] for a, b in zip(points, points[1:])) for k in keys}
    ablation = None
    if args.ablation and ABLATION in tau:
        ablation = {
            "name": ABLATION,
            "conversations": sum(state["subsets"][ABLATION]["sources"].values()),
            **row(ABLATION),
            "sources": state["subsets"][ABLATION]["sources"],
            **{f"train_{k}": v for k, v in state["train"][ABLATION].items()},
        }
    record = {
        "what": "τ (simulate mode, greedy chain) of drafters trained on nested subsets of SmolLM2's own conversations",
        "target": args.target,
        "recipe": recipe,
        "eval_tokens": args.eval_tokens,
        "smoke": args.smoke,
        "ks": [3, 5],
        "sets": {
            "mt_bench": "80 MT-bench first turns (tau_k3, tau_k5)",
            "gsm8k_heldout": "last 80 GSM8K train questions, never trained on (tau_k3_gsm8k, tau_k5_gsm8k)",
        },
        "tau_formula": tau["untrained"]["mt_bench_k3"]["tau_formula"],
        "machine": state.get("machine"),
        "pool": state["pool"],
        "points": points,
        "untrained": row("untrained"),
        "ablation": ablation,
        "per_position_acceptance": {
            s: {k: tau[s][k]["per_position_acceptance"] for k in tau[s]} for s in tau
        },
        "goals": {
            "rises_at_every_step": rises,
            "tau_k3_gsm8k_at_largest_ge_2": points[-1]["tau_k3_gsm8k"] >= 2.0,
        },
        "analysis": analysis_summary(state, str(args.sizes[-1])),
        "draft_vocab_coverage": {
            "what": "share of the target's greedy continuation tokens inside the run's draft "
            "vocabulary (a token outside it is never accepted)",
            **state.get("vocab_coverage", {}),
        },
        "decode": {k: v for k, v in state.get("decode", {}).items()},
        "stage_seconds": state.get("stage_seconds"),
        "torch": torch.__version__,
    }
    results.mkdir(parents=True, exist_ok=True)
    (results / "scaling.json").write_text(json.dumps(record, indent=2) + "\n")
    head = "| conversations | MT-bench τ K=3 | MT-bench τ K=5 | GSM8K τ K=3 | GSM8K τ K=5 | train tokens |"
    lines = [head, "|---:|---:|---:|---:|---:|---:|"]
    lines += [
        f"| {p['conversations']:,} | {p['tau_k3']:.3f} | {p['tau_k5']:.3f} | {p['tau_k3_gsm8k']:.3f} | "
        f"{p['tau_k5_gsm8k']:.3f} | {p.get('train_tokens') or 0:,} |"
        for p in points
    ]
    u = record["untrained"]
    lines.append(
        f"| untrained | {u['tau_k3']:.3f} | {u['tau_k5']:.3f} | {u['tau_k3_gsm8k']:.3f} | {u['tau_k5_gsm8k']:.3f} | 0 |"
    )
    if ablation:
        a = ablation
        lines.append(
            f"| {a['conversations']:,} without GSM8K | {a['tau_k3']:.3f} | {a['tau_k5']:.3f} | "
            f"{a['tau_k3_gsm8k']:.3f} | "
            f"{a['tau_k5_gsm8k']:.3f} | {a.get('train_tokens') or 0:,} |"
        )
    if args.smoke:
        lines.insert(0, "**SMOKE RUN (`--smoke`): toy sizes, measures nothing.**\n")
    dec = state.get("decode") or {}
    if dec.get("sets"):
        lines.append("")
        lines.append(
            f"Decode mode, drafter of {dec['size']} conversations, K = {dec['k']} ({dec['device']}, {dec['dtype']}): "
            + "; ".join(
                f"{n} τ {v['tau']:.3f}, greedy_identical {str(v['greedy_identical']).lower()}"
                for n, v in dec["sets"].items()
            )
        )
    (results / "scaling.md").write_text("\n".join(lines) + "\n")
    plot(points, record["untrained"], ablation, results / "scaling.png", args.smoke)
    print_table(
        f"scaling curve{' (SMOKE: measures nothing)' if args.smoke else ''}: τ, simulate, greedy chain",
        [
            ("runs", "MT-bench K=3 / K=5 · GSM8K held-out K=3 / K=5"),
            *[
                (
                    f"{p['conversations']:,} conversations",
                    f"{p['tau_k3']:.3f} / {p['tau_k5']:.3f} · "
                    f"{p['tau_k3_gsm8k']:.3f} / {p['tau_k5_gsm8k']:.3f}",
                )
                for p in points
            ],
            (
                "untrained",
                f"{u['tau_k3']:.3f} / {u['tau_k5']:.3f} · {u['tau_k3_gsm8k']:.3f} / {u['tau_k5_gsm8k']:.3f}",
            ),
            *(
                [
                    (
                        f"{ablation['conversations']:,} without GSM8K",
                        f"{ablation['tau_k3']:.3f} / {ablation['tau_k5']:.3f} · "
                        f"{ablation['tau_k3_gsm8k']:.3f} / {ablation['tau_k5_gsm8k']:.3f}",
                    )
                ]
                if ablation
                else []
            ),
            *([("decode greedy_identical", str(dec.get("greedy_identical")))] if dec.get("sets") else []),
            ("written", f"{results / 'scaling.json'}, scaling.md, scaling.png, scaling/<run>/"),
        ],
    )


def analysis_summary(state: dict, name: str) -> dict:
    """Per evaluation set, for drafter ``name``: the target's mean top-1 probability and entropy
    over its own greedy continuation, the share of looping tokens (8-grams seen earlier in the
    same output), τ(K=3) of looping (> 30 %) and other prompts, and τ per MT-bench category."""
    from statistics import mean

    out = {}
    for sname, per in state["analysis"].items():
        taus = state["tau"][name][f"{sname}_k3"]["per_prompt"]
        loop = [t for t, a in zip(taus, per) if a["repeat_share"] > 0.3]
        rest = [t for t, a in zip(taus, per) if a["repeat_share"] <= 0.3]
        cats: dict = {}
        for t, a in zip(taus, per):
            cats.setdefault(a["category"], []).append(t)
        out[sname] = {
            "drafter": name,
            "target_top1_prob": round(mean(a["top1_prob"] for a in per), 4),
            "target_entropy_nats": round(mean(a["entropy"] for a in per), 4),
            "looping_token_share": round(mean(a["repeat_share"] for a in per), 4),
            "hit_max_tokens_share": round(mean(a["tokens"] >= max(x["tokens"] for x in per) for a in per), 4),
            "tau_k3_looping_prompts": [len(loop), round(mean(loop), 4) if loop else None],
            "tau_k3_other_prompts": [len(rest), round(mean(rest), 4) if rest else None],
            "tau_k3_mean_per_prompt": round(mean(taus), 4),
            **(
                {"tau_k3_per_category": {c: round(mean(v), 4) for c, v in sorted(cats.items())}}
                if None not in cats
                else {}
            ),
        }
    return out


def plot(points: list[dict], untrained: dict, ablation: dict | None, path: Path, smoke: bool = False) -> None:
    """τ against conversations (log scale), both sets, both K; the untrained drafter dotted; the
    run without GSM8K as crosses (K = 3)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    x = [p["conversations"] for p in points]
    styles = {
        "tau_k3_gsm8k": ("GSM8K held-out, K=3", "tab:blue", "-"),
        "tau_k5_gsm8k": ("GSM8K held-out, K=5", "tab:blue", "--"),
        "tau_k3": ("MT-bench, K=3", "tab:orange", "-"),
        "tau_k5": ("MT-bench, K=5", "tab:orange", "--"),
    }
    for key, (label, color, ls) in styles.items():
        ax.plot(
            x,
            [p[key] for p in points],
            ls,
            color=color,
            marker="o" if "k3" in key else "s",
            ms=5,
            lw=1.8,
            label=label,
        )
        ax.axhline(untrained[key], color=color, ls=":", lw=0.8, zorder=0)
    if ablation:
        for key, color, name in (("tau_k3", "tab:orange", "MT-bench"), ("tau_k3_gsm8k", "tab:blue", "GSM8K")):
            ax.plot(
                [ablation["conversations"]],
                [ablation[key]],
                "x",
                color=color,
                ms=9,
                mew=2,
                label=f"{name}, K=3: {ablation['conversations']:,} without GSM8K",
            )
    ax.set_xscale("log")
    ax.set_xticks(x, [f"{v:,}" for v in x])
    ax.set_ylim(0.9, None)
    ax.minorticks_off()
    ax.set_xlabel("training conversations (SmolLM2's own replies)")
    ax.set_ylabel("acceptance length τ (simulate, greedy chain)")
    ax.set_title(
        ("SMOKE RUN, measures nothing\n" if smoke else "")
        + "EAGLE-3 drafter for SmolLM2-135M-Instruct: τ against data\n(dotted: untrained drafter)"
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
