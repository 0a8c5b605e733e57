"""The report of ``benchmarks/scaling_kinds.py``: ``scaling_kinds.json`` (a row per run, the mean over seeds per
size and kind, the crossover, the aim), the printed table, ``scaling_kinds.md`` and ``scaling_kinds.png``."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

SETS = ("mt_bench", "gsm8k_heldout")
# the recipe's drafter today at K = 7 (train's default EAGLE-3.1 on its 1,350 conversations, trained on an
# H100; docs/results.md, "DFlash at 7 draft tokens"): the aim is 1.5x these at the largest size
RECIPE_K7 = {"mt_bench": 1.386, "gsm8k_heldout": 2.257}


def means(rows: list[dict], ks: list[int]) -> dict:
    """``{size: {kind: {set: {"k3": mean τ, "k3_spread": max − min over seeds, …}, "seeds": n}}}``."""
    out: dict = {}
    for r in rows:
        out.setdefault(r["conversations"], {}).setdefault(r["kind"], []).append(r)
    res: dict = {}
    for size, kinds in sorted(out.items()):
        for kind, rs in kinds.items():
            cell: dict = {"seeds": len(rs)}
            for s in SETS:
                cell[s] = {}
                for k in ks:
                    vals = [r["tau"][s][f"k{k}"] for r in rs]
                    cell[s][f"k{k}"] = round(statistics.fmean(vals), 4)
                    cell[s][f"k{k}_spread"] = round(max(vals) - min(vals), 4)
            res.setdefault(size, {})[kind] = cell
    return res


def crossover(mean: dict, ks: list[int], a: str = "eagle3.1", b: str = "dflash") -> dict:
    """Per set and K: the sizes where ``b``'s mean τ is at least ``a``'s, and the smallest size from which
    it stays so (None: it never does up to the largest size measured)."""
    out = {}
    for s in SETS:
        for k in ks:
            sizes = [n for n, c in mean.items() if a in c and b in c]
            ahead = [n for n in sizes if c_ge(mean[n], a, b, s, k)]
            stays = next((n for n in sizes if all(m in ahead for m in sizes if m >= n)), None)
            out[f"{s}_k{k}"] = {"dflash_at_least_eagle": ahead, "from": stays}
    return out


def c_ge(cell: dict, a: str, b: str, s: str, k: int) -> bool:
    return cell[b][s][f"k{k}"] >= cell[a][s][f"k{k}"]


def aim(mean: dict) -> dict | None:
    """At the largest size: the better kind's τ at K = 7 over the recipe's today, and DFlash over EAGLE-3.1."""
    if not mean:
        return None
    largest = mean[max(mean)]
    out = {"size": max(mean)}
    for s in SETS:
        got = {kind: c[s].get("k7") for kind, c in largest.items() if c[s].get("k7") is not None}
        if not got:
            return None
        best = max(got, key=got.get)
        out[s] = {
            "better_kind": best,
            "tau_k7": got[best],
            "over_recipe_today": round(got[best] / RECIPE_K7[s], 3),
            "aim_1_5x_met": got[best] >= 1.5 * RECIPE_K7[s],
            "dflash_over_eagle": round(got["dflash"] / got["eagle3.1"], 3)
            if {"dflash", "eagle3.1"} <= set(got)
            else None,
        }
    return out


def stopping_rule(rows: list[dict]) -> str:
    """The rule the rows were trained under, read from the rows (runs trained under different rules are
    named as such, not averaged into one sentence)."""
    rules = sorted({(r.get("epochs_max"), r.get("patience")) for r in rows}, key=str)
    said = [
        f"at most {e} epochs, stopped once validation τ (5% of the subset) has not beaten its best for {p}"
        for e, p in rules
    ]
    head = "" if len(rules) == 1 else f"{len(rules)} rules among the rows (retrained under other options): "
    return head + "; ".join(said) + "; the best epoch's drafter is measured"


def plot(mean: dict, ks: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    sizes = sorted(mean)
    for ax, s in zip(axes, SETS):
        for kind, color in (("eagle3.1", "tab:blue"), ("dflash", "tab:orange")):
            for i, k in enumerate(ks):
                style = ("--", "-.", "-", ":")[i % 4]
                ys = [mean[n][kind][s][f"k{k}"] if kind in mean[n] else None for n in sizes]
                ax.plot(sizes, ys, style, marker="o", color=color, label=f"{kind} K={k}")
        ax.set_xscale("log")
        ax.set_title(s)
        ax.set_xlabel("training conversations")
        ax.set_ylabel("τ (simulated)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(args, state: dict, rows: list[dict]) -> None:
    """Write the JSON, the Markdown table and the plot under ``args.results`` and print the table."""
    from eagle3kit.core.rundir import write_json, write_text

    mean = means(rows, args.ks)
    record = {
        "benchmark": "benchmarks/scaling_kinds.py",
        "what": "τ (simulate mode, greedy chain) of EAGLE-3.1 and DFlash drafters trained on nested subsets of "
        "SmolLM2-135M-Instruct's own conversations, with early stopping on validation τ",
        "machine": state.get("machine"),
        "smoke": bool(args.smoke),
        "stopping_rule": stopping_rule(rows),
        "pool": state.get("pool"),
        "rows": rows,
        "mean_over_seeds": {str(n): c for n, c in mean.items()},
        "crossover": crossover(mean, args.ks),
        "aim": aim(mean) if 7 in args.ks else None,
        "decode": state.get("decode"),
        "stage_seconds": state.get("stage_seconds"),
    }
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "scaling_kinds.json", record)
    head = (
        "| conversations | kind | seeds | epochs run | "
        + " | ".join(f"{s} K={k}" for s in SETS for k in args.ks)
        + " | tokens/s (wall) | GPU-hours |"
    )
    lines = [head, "|" + "---|" * (6 + len(SETS) * len(args.ks))]
    for n, kinds in mean.items():
        for kind, c in kinds.items():
            rs = [r for r in rows if r["conversations"] == n and r["kind"] == kind]
            taus = " | ".join(
                f"{c[s][f'k{k}']:.3f}" + (f" ±{c[s][f'k{k}_spread'] / 2:.3f}" if c["seeds"] > 1 else "")
                for s in SETS
                for k in args.ks
            )
            epochs = ", ".join(str(r["epochs_run"]) for r in rs)
            tps = statistics.fmean(r["tokens_per_s_wall"] or 0 for r in rs)
            gpu = sum(r["gpu_hours"] or 0 for r in rs)
            lines.append(f"| {n:,} | {kind} | {c['seeds']} | {epochs} | {taus} | {tps:,.0f} | {gpu:.3f} |")
    write_text(out / "scaling_kinds.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps({"crossover": record["crossover"], "aim": record["aim"]}, indent=1))
    plot(mean, args.ks, out / "scaling_kinds.png")
    print(f"wrote {out / 'scaling_kinds.json'}, .md and .png")
