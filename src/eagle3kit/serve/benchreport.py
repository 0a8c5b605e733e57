"""What ``eagle3kit bench`` writes: its record's warnings, the JSON with a Markdown table and a PNG plot
beside it (throughput and latency against concurrency, with and without speculation; all three or none,
:func:`write_outputs`), and ``bench --compare`` of two records (a drop beyond a tolerance is flagged)."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3kit.core.rundir import DataError, write_failed

# (key, how to read it, higher is better)
COMPARED = [
    ("output_tokens_per_s", lambda r: r["output_tokens_per_s"], True),
    ("request_throughput", lambda r: r["request_throughput"], True),
    ("tau", lambda r: (r.get("acceptance") or {}).get("tau"), True),
    ("ttft_p50_ms", lambda r: r["ttft_ms"]["p50"], False),
    ("itl_p50_ms", lambda r: r["itl_ms"]["p50"], False),
    ("tpot_p50_ms", lambda r: r["tpot_ms"]["p50"], False),
]


def _fmt(v, digits: int = 1) -> str:
    return "—" if v is None else f"{v:,.{digits}f}"


def markdown(record: dict) -> str:
    """One table per server role, one row per concurrency level."""
    lines = [
        f"# eagle3kit bench: {record['servers']['speculative']['model']}",
        "",
        f"{record['prompts']['count']} prompt{'s' if record['prompts']['count'] != 1 else ''} from "
        f"`{record['prompts']['file']}`, max_tokens {record['max_tokens']}, greedy; started {record['started']}.",
        "",
    ]
    for role, srv in record["servers"].items():
        tc = srv.get("template_check") or {}
        if "skipped" in tc or tc.get("checked") == 0:
            lines += [
                f"**{role}: the chat-template check did not run** ({tc.get('skipped') or tc.get('method')}).",
                "",
            ]
    lines += [f"**warning:** {w}" for w in record.get("warnings", [])] + (
        [""] if record.get("warnings") else []
    )
    for role, srv in record["servers"].items():
        eng = srv["engine"]
        lines += [
            f"## {role}: {eng['name']} {eng.get('version') or ''} at {srv['url']}",
            "",
            "| concurrency | requests | failures | req/s | output tok/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms "
            "| TPOT p50 ms | τ (tokens/verify step) | acceptance rate | speedup |",
            "|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|",
        ]
        for r in srv["results"]:
            acc = r.get("acceptance") or {}
            ttft, itl = r["ttft_ms"], r["itl_ms"]
            lines.append(
                f"| {r['concurrency']} | {r['requests']} | {r['failures']} | {_fmt(r['request_throughput'], 3)} | "
                f"{_fmt(r['output_tokens_per_s'])} | {_fmt(ttft['p50'])} / {_fmt(ttft['p90'])} / {_fmt(ttft['p99'])} | "
                f"{_fmt(itl['p50'])} / {_fmt(itl['p90'])} / {_fmt(itl['p99'])} | {_fmt(r['tpot_ms']['p50'])} | "
                f"{_fmt(acc.get('tau'), 3)} | {_fmt(acc.get('acceptance_rate'), 3)} | {_fmt(r.get('speedup'), 2)} |"
            )
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
        style = {
            "speculative": ("tab:blue", "o", "with speculation"),
            "baseline": ("tab:gray", "s", "baseline (no speculation)"),
        }[role]
        a.plot(x, [r["output_tokens_per_s"] for r in res], marker=style[1], color=style[0], label=style[2])
        b.plot(x, [r["tpot_ms"]["p50"] for r in res], marker=style[1], color=style[0], label=style[2])
        if role == "speculative":
            for r in res:
                tau = (r.get("acceptance") or {}).get("tau")
                if tau:
                    a.annotate(
                        f"τ {tau:.2f}",
                        (r["concurrency"], r["output_tokens_per_s"]),
                        textcoords="offset points",
                        xytext=(0, 7),
                        ha="center",
                        fontsize=8,
                    )
    levels = record["levels"]
    for ax, title, ylabel in (
        (a, "throughput", "output tokens/s"),
        (b, "latency", "TPOT p50 (ms per output token)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)  # from zero, so gaps are not exaggerated
        ax.legend(fontsize=8)
    spec = record["servers"]["speculative"]
    fig.suptitle(
        f"{spec['model']} on {spec['engine']['name']} {spec['engine'].get('version') or ''}, "
        f"max_tokens {record['max_tokens']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


SETTINGS = [
    ("max_tokens", lambda r: r.get("max_tokens")),
    ("prompt file", lambda r: (r.get("prompts") or {}).get("sha256")),
    ("engine", lambda r: r["servers"]["speculative"]["engine"].get("name")),
    ("model", lambda r: r["servers"]["speculative"].get("model")),
    ("hardware", lambda r: (r.get("hardware") or {}).get("label")),
]


def compare(a: dict, b: dict, tolerance: float = 0.05) -> dict:
    """Compare record ``b`` with record ``a`` (the reference) level by level on the speculative
    server: each metric of :data:`COMPARED` whose relative change is worse than ``tolerance``
    (lower throughput or τ, higher latency) is flagged, and so are a τ that B lost (speculation
    off?) and more failed requests. Settings that differ (max_tokens, prompt file, engine, model,
    hardware) and levels present in one record only are named in ``warnings``. Returns
    ``{"rows", "regressions", "warnings", "a", "b"}``.

    Raises:
        BenchError: the records share no concurrency level."""

    def index(rec):
        return {r["concurrency"]: r for r in rec["servers"]["speculative"]["results"]}

    ia, ib = index(a), index(b)
    common = sorted(set(ia) & set(ib))
    if not common:
        raise BenchError(
            f"the two records share no concurrency level (A {sorted(ia)}, B {sorted(ib)}): nothing to compare"
        )
    warnings = [
        f"{name} differs: {ga!r} in A, {gb!r} in B"
        for name, get in SETTINGS
        if (ga := get(a)) != (gb := get(b))
    ]
    only = sorted(set(ia) ^ set(ib))
    if only:
        warnings.append(f"levels {only} are in one record only and are not compared")
    rows, flagged = [], []
    for c in common:
        for key, get, higher in COMPARED:
            va, vb = get(ia[c]), get(ib[c])
            if key == "tau" and va is not None and vb is None:
                row = {
                    "concurrency": c,
                    "metric": key,
                    "a": va,
                    "b": None,
                    "change": None,
                    "regression": True,
                }
            elif va is None or vb is None or va == 0:
                continue
            else:
                change = (vb - va) / abs(va)
                worse = -change if higher else change
                row = {
                    "concurrency": c,
                    "metric": key,
                    "a": va,
                    "b": vb,
                    "change": round(change, 4),
                    "regression": worse > tolerance,
                }
            rows.append(row)
        fa, fb = ia[c].get("failures", 0), ib[c].get("failures", 0)
        rows.append(
            {"concurrency": c, "metric": "failures", "a": fa, "b": fb, "change": None, "regression": fb > fa}
        )
    flagged = [r for r in rows if r["regression"]]

    def who(rec):
        e = rec["servers"]["speculative"]["engine"]
        return {
            "engine": e["name"],
            "version": e.get("version"),
            "drafter": (rec.get("drafter") or {}).get("sha256"),
            "started": rec.get("started"),
        }

    return {
        "tolerance": tolerance,
        "a": who(a),
        "b": who(b),
        "rows": rows,
        "regressions": flagged,
        "warnings": warnings,
    }


def load_record(path: Path) -> dict:
    """A bench JSON record, or a clear error."""

    p = Path(path)
    if not p.is_file():
        what = "is a folder" if p.is_dir() else "does not exist"
        raise BenchError(f"{p} {what}; give two bench.json files written by `eagle3kit bench`")
    try:
        rec = json.loads(p.read_text())
    except ValueError as e:
        raise BenchError(f"{p} is not JSON ({e}); give a bench.json written by `eagle3kit bench`") from None

    def shaped(rec) -> bool:
        srv = rec.get("servers") if isinstance(rec, dict) else None
        spec = srv.get("speculative") if isinstance(srv, dict) else None
        res = spec.get("results") if isinstance(spec, dict) else None
        need = {"concurrency", "output_tokens_per_s", "request_throughput", "ttft_ms", "itl_ms", "tpot_ms"}
        return (
            isinstance(res, list)
            and isinstance(spec.get("engine"), dict)
            and all(isinstance(r, dict) and need <= set(r) for r in res)
        )

    if not shaped(rec):
        raise BenchError(
            f"{p} is not a bench record (servers.speculative.results with per-level numbers); give a "
            "bench.json written by `eagle3kit bench`"
        )
    return rec


class BenchError(DataError):
    """A benchmark that cannot give honest numbers (unreachable server, wrong template, …)."""


def record_warnings(record: dict) -> list[str]:
    """What makes a record doubtful: failed requests, levels where every request failed, a
    speculative server without acceptance beside a baseline with some (swapped URLs?)."""
    out = []
    for role, srv in record["servers"].items():
        for r in srv["results"]:
            if r["requests"] and not r["completed"]:
                out.append(
                    f"{role} c={r['concurrency']}: every request failed ({'; '.join(r['errors'][:2])})"
                )
            elif r["failures"]:
                out.append(f"{role} c={r['concurrency']}: {r['failures']} of {r['requests']} requests failed")
            if r.get("acceptance_error"):
                out.append(f"{role} c={r['concurrency']}: {r['acceptance_error']}")
    spec_acc = any(r.get("acceptance") for r in record["servers"]["speculative"]["results"])
    base_acc = any(r.get("acceptance") for r in record["servers"].get("baseline", {}).get("results", []))
    if base_acc and not spec_acc:
        out.append(
            "the baseline server reports speculative decoding and the speculative one does not: "
            "are --base-url and --baseline-url swapped?"
        )
    return out


def write_outputs(record: dict, out: Path, overwrite: bool = False) -> dict[str, Path]:
    """``bench.json``, ``bench.md`` and ``bench.png`` in ``out``.

    Raises:
        BenchError: one of them exists and ``overwrite`` is False.
        DataError: a write failed (disk full, read-only), naming the file; none of the three is left.
    """

    out = Path(out)
    paths = {"json": out / "bench.json", "md": out / "bench.md", "png": out / "bench.png"}
    there = [str(p) for p in paths.values() if p.exists()]
    if there and not overwrite:
        raise BenchError(f"{', '.join(there)} exist: pass --out to a new folder, or --overwrite")

    out.mkdir(parents=True, exist_ok=True)
    # all three written under temporary names, then renamed: a full disk leaves none of them (an empty
    # bench.md would block the rerun) and the error names the file
    tmps: dict[str, Path] = {}
    current = paths["json"]
    try:
        for key, text in (("json", json.dumps(record, indent=2) + "\n"), ("md", markdown(record))):
            current, tmps[key] = paths[key], paths[key].with_name(paths[key].name + ".tmp")
            tmps[key].write_text(text)
        current, tmps["png"] = paths["png"], out / "bench.tmp.png"
        plot(record, tmps["png"])
        for key, tmp in tmps.items():
            tmp.replace(paths[key])
    except OSError as e:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)
        raise write_failed(current, e) from None
    return paths
