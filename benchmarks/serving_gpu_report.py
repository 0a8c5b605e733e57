"""The printed table and the plot of benchmarks/serving_gpu.py, and the online row's lines."""

from __future__ import annotations

from pathlib import Path


def print_table(rows: list[dict], levels: list[int], title: str) -> None:
    """The one table: a line per drafter and K."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    cols = ["drafter", "K", "τ served", "τ simulated", "verdict"]
    cols += [f"speedup c={c}" for c in levels] + ["overhead ms (target step)"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("drafter", "verdict") else "right")
    for r in rows:
        cost = r.get("cost") or {}
        table.add_row(
            r["drafter"], str(r["k"]), f"{r['tau_served'] or 0:.3f}", f"{r['tau_simulated'] or 0:.3f}",
            str(r["verdict"]), *[f"{(r['levels'].get(str(c)) or {}).get('speedup') or 0:.2f}" for c in levels],
            f"{cost.get('overhead_ms', 0):.2f} ({cost.get('target_step_ms', 0):.2f})",
        )  # fmt: skip
    Console(width=160).print(table)


def plot(rows: list[dict], levels: list[int], path: Path) -> None:
    """Speedup against concurrency, a line per drafter and K."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ys = [(r["levels"].get(str(c)) or {}).get("speedup") for c in levels]
        run = f" {r['run']}" if r.get("run") else ""
        ax.plot(
            levels, ys, marker="o", label=f"{r['drafter']} K={r['k']} (τ {r['tau_served'] or 0:.2f}){run}"
        )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s over plain decoding")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def print_online(rec: dict) -> None:
    """The colocated online row beside the offline one (serving_gpu_online.py), or why it failed."""
    if "failed" in rec:
        print(f"online training: failed ({rec['failed']})")
        return
    print(
        "| training | tokens/s steady | tokens/s wall | MFU steady | wait for states s | read states s "
        "| final loss | τ K3 MT-bench | τ K3 GSM8K |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rec["rows"].items():
        m, tau = rec["mfu"].get(name) or {}, r["tau_k3"]
        feed = r.get("online") or {}
        cells = [
            name,
            r["tokens_per_s_steady"],
            r["tokens_per_s_wall"],
            m.get("steady"),
            feed.get("wait_s"),
            feed.get("read_s"),
            r["final_loss"],
        ]
        cells += [tau.get("mt_bench"), tau.get("gsm8k_heldout")]
        print("| " + " | ".join(map(str, cells)) + " |")
