"""What ``eagle3kit bench`` writes beside its JSON: a Markdown table, a PNG plot (throughput and
latency against concurrency, with and without speculation), and ``bench --compare`` of two
records (C36: a drop beyond a tolerance is flagged)."""
from __future__ import annotations

import json
from pathlib import Path

# (key, how to read it, higher is better)
COMPARED = [("output_tokens_per_s", lambda r: r["output_tokens_per_s"], True),
            ("request_throughput", lambda r: r["request_throughput"], True),
            ("tau", lambda r: (r.get("acceptance") or {}).get("tau"), True),
            ("ttft_p50_ms", lambda r: r["ttft_ms"]["p50"], False),
            ("itl_p50_ms", lambda r: r["itl_ms"]["p50"], False),
            ("tpot_p50_ms", lambda r: r["tpot_ms"]["p50"], False)]


def _fmt(v, digits: int = 1) -> str:
    return "—" if v is None else f"{v:,.{digits}f}"


def markdown(record: dict) -> str:
    """One table per server role, one row per concurrency level."""
    lines = [f"# eagle3kit bench: {record['servers']['speculative']['model']}", "",
             f"{record['prompts']['count']} prompts from `{record['prompts']['file']}`, max_tokens {record['max_tokens']}, "
             f"greedy; started {record['started']}.", ""]
    for role, srv in record["servers"].items():
        eng = srv["engine"]
        lines += [f"## {role}: {eng['name']} {eng.get('version') or ''} at {srv['url']}", "",
                  "| concurrency | requests | failures | req/s | output tok/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms "
                  "| TPOT p50 ms | τ (tokens/verify step) | acceptance rate | speedup |",
                  "|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|"]
        for r in srv["results"]:
            acc = r.get("acceptance") or {}
            ttft, itl = r["ttft_ms"], r["itl_ms"]
            lines.append(f"| {r['concurrency']} | {r['requests']} | {r['failures']} | {_fmt(r['request_throughput'], 3)} | "
                         f"{_fmt(r['output_tokens_per_s'])} | {_fmt(ttft['p50'])} / {_fmt(ttft['p90'])} / {_fmt(ttft['p99'])} | "
                         f"{_fmt(itl['p50'])} / {_fmt(itl['p90'])} / {_fmt(itl['p99'])} | {_fmt(r['tpot_ms']['p50'])} | "
                         f"{_fmt(acc.get('tau'), 3)} | {_fmt(acc.get('acceptance_rate'), 3)} | {_fmt(r.get('speedup'), 2)} |")
        lines.append("")
    lines += ["Formulas:", ""] + [f"* `{k}`: {v}" for k, v in record["formulas"].items()]
    return "\n".join(lines) + "\n"


def plot(record: dict, path: Path) -> None:
    """Output tokens/s and TPOT p50 against concurrency (log scale), speculative and baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    for role, srv in record["servers"].items():
        res = srv["results"]
        x = [r["concurrency"] for r in res]
        style = {"speculative": ("tab:blue", "o", "with speculation"), "baseline": ("tab:gray", "s", "baseline (no speculation)")}[role]
        a.plot(x, [r["output_tokens_per_s"] for r in res], marker=style[1], color=style[0], label=style[2])
        b.plot(x, [r["tpot_ms"]["p50"] for r in res], marker=style[1], color=style[0], label=style[2])
        if role == "speculative":
            for r in res:
                tau = (r.get("acceptance") or {}).get("tau")
                if tau:
                    a.annotate(f"τ {tau:.2f}", (r["concurrency"], r["output_tokens_per_s"]), textcoords="offset points",
                               xytext=(0, 7), ha="center", fontsize=8)
    levels = record["levels"]
    for ax, title, ylabel in ((a, "throughput", "output tokens/s"), (b, "latency", "TPOT p50 (ms per output token)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    spec = record["servers"]["speculative"]
    fig.suptitle(f"{spec['model']} on {spec['engine']['name']} {spec['engine'].get('version') or ''}, "
                 f"max_tokens {record['max_tokens']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def compare(a: dict, b: dict, tolerance: float = 0.05) -> dict:
    """Compare record ``b`` with record ``a`` (the reference) level by level on the speculative
    server: each metric of :data:`COMPARED` whose relative change is worse than ``tolerance``
    (lower throughput or τ, higher latency) is flagged. Returns ``{"rows", "regressions",
    "a", "b"}`` where ``a``/``b`` name each record's engine and version."""
    def index(rec):
        return {r["concurrency"]: r for r in rec["servers"]["speculative"]["results"]}

    ia, ib = index(a), index(b)
    rows, flagged = [], []
    for c in sorted(set(ia) & set(ib)):
        for key, get, higher in COMPARED:
            va, vb = get(ia[c]), get(ib[c])
            if va is None or vb is None or va == 0:
                continue
            change = (vb - va) / abs(va)
            worse = -change if higher else change
            row = {"concurrency": c, "metric": key, "a": va, "b": vb, "change": round(change, 4),
                   "regression": worse > tolerance}
            rows.append(row)
            if row["regression"]:
                flagged.append(row)

    def who(rec):
        e = rec["servers"]["speculative"]["engine"]
        return {"engine": e["name"], "version": e.get("version"), "drafter": (rec.get("drafter") or {}).get("sha256"),
                "started": rec.get("started")}

    return {"tolerance": tolerance, "a": who(a), "b": who(b), "rows": rows, "regressions": flagged}


def load_record(path: Path) -> dict:
    """A bench JSON record, or a clear error."""
    from .bench import BenchError

    p = Path(path)
    if not p.is_file():
        raise BenchError(f"{p} does not exist; give two bench.json files written by `eagle3kit bench`")
    try:
        rec = json.loads(p.read_text())
    except ValueError as e:
        raise BenchError(f"{p} is not JSON ({e}); give a bench.json written by `eagle3kit bench`") from None
    if not isinstance(rec, dict) or "speculative" not in rec.get("servers", {}):
        raise BenchError(f"{p} is not a bench record (no servers.speculative); give a bench.json written by `eagle3kit bench`")
    return rec
