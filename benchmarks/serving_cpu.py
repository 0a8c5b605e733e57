"""Serving speed on vLLM's CPU build: the target alone, with an EAGLE-3.1 drafter and with a DFlash drafter,
both trained on the same conversations, served with K draft tokens.

SmolLM2-135M-Instruct writes its replies to 240 GSM8K questions (64 tokens each); `eagle3kit run` trains
EAGLE-3.1 (TTT K) on them, then DFlash (2 layers, blocks of K + 1) on the same tokens and vocabulary. Three
vLLM servers (no speculation, ``{"method": "eagle3", …}``, ``{"method": "dflash", …}``, each
``num_speculative_tokens`` K) run at once; `eagle3kit bench` measures each drafter's server against the
plain one at concurrency 1 and 4 on the last 20 GSM8K train questions (never trained on), greedy.
DFlash's case: one draft forward per block instead of one per token.

    python benchmarks/serving_cpu.py --work /tmp/serving_cpu --shared ../shared [--k 7] [--seeds 0,1,2]

About 15 minutes on the 2-core CPU machine (it says so up front): 2 to generate, 5 to train EAGLE-3.1 at
TTT 7, 5 for DFlash, 1 to start the servers, 2 to bench. Resumable: a run that finished
is not trained again, a bench record already written is kept. ``--seeds`` trains each drafter once per
training seed on the same data (about 10 more minutes of training and 4 of serving per extra seed) and gives
the spread of τ and of speedup across seeds. Writes ``benchmarks/results/serving_cpu.json`` (one row per
drafter and seed: τ from vLLM's counters and from `evaluate`, output tokens/s with and without the drafter,
speedup, per concurrency; ``spread``: per drafter, the lowest and highest of each across seeds) and prints
one table.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "serving_cpu.json"

CONFIG = """run_dir: {run}
prompts:
  sources: [{{path: {gsm8k}, name: gsm8k, stop: -80, limit: 240}}]
  heldout_fraction: 0.0
generate: {{max_new_tokens: 64}}
vocab: {{draft_vocab_size: 2048}}
{drafter}
evaluate:
  k: {k}
  max_new_tokens: 64
  num_prompts: 20
  sets: [{{path: {gsm8k}, name: gsm8k_heldout, start: -80}}]
"""
DRAFTERS = {  # name: (drafter and train sections, vLLM's method)
    "eagle3.1": (
        "drafter: {{variant: eagle3.1}}\ntrain: {{ttt_steps: {k}, epochs: 6, tokens_per_step: 2048, precision: bf16}}",
        "eagle3",
    ),
    "dflash": (
        "drafter: {{variant: dflash, num_layers: 2, block_size: {block}, max_anchors: 32}}\n"
        "train: {{epochs: 5, tokens_per_step: 1024, lr: 0.001, betas: [0.9, 0.95]}}",
        "dflash",
    ),
}


def gsm8k_file(args) -> Path:
    """The GSM8K chats of ``--shared``: the training prompts, the held-out questions of `evaluate` and
    the bench prompts (the last 20)."""
    return Path(args.shared).resolve() / "data" / "chats" / "gsm8k_train.jsonl"


def run_name(name: str, seed: int) -> str:
    """The folder of one drafter's run for one training seed: ``eagle3.1``, ``dflash`` for seed 0 (the
    names the first runs had), ``eagle3.1-seed1`` and so on for the others."""
    return name if seed == 0 else f"{name}-seed{seed}"


def train(args, name: str, seed: int = 0) -> Path:
    """``<work>/<name>[-seed<s>]/run``: `eagle3kit run` of one drafter with ``train.seed`` = ``seed``;
    every run but seed 0's EAGLE-3.1 copies that run's data stages (prompts, replies, tokens, vocabulary:
    up to date there, so only train, export and evaluate run), so all train on the same tokens. A run is
    done when ``<name>[-seed<s>]/trained.json`` and its drafter folder exist."""
    from eagle3kit.core.config import load_config
    from eagle3kit.pipeline import run_all

    d = Path(args.work) / run_name(name, seed)
    run, done = d / "run", d / "trained.json"
    if done.exists() and (run / "drafter").is_dir():
        return run
    d.mkdir(parents=True, exist_ok=True)
    if (name, seed) != ("eagle3.1", 0):
        keep = shutil.ignore_patterns("checkpoints", "drafter*", "evaluate", "tensorboard", "train_log.jsonl")
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(train(args, "eagle3.1"), run, ignore=keep)
    section = DRAFTERS[name][0].format(k=args.k, block=args.k + 1)
    section = section.replace("train: {", f"train: {{seed: {seed}, ", 1)
    (d / "config.yaml").write_text(CONFIG.format(run=run, gsm8k=gsm8k_file(args), drafter=section, k=args.k))
    run_all(load_config(d / "config.yaml"))
    # written last: a run stopped before this point is trained again (the copied report.json still holds
    # seed 0's EAGLE-3.1 τ until this run's evaluate replaces it, so that τ cannot say "done")
    done.write_text(json.dumps({"drafter": name, "seed": seed, "tau_evaluate": evaluate_tau(run)}) + "\n")
    return run


def evaluate_tau(run: Path) -> float | None:
    """τ that `eagle3kit evaluate` wrote for the held-out set at the run's K (``report.json``'s
    ``evaluate`` section)."""
    rep = run / "report.json"
    if not rep.exists():
        return None
    sets = (json.loads(rep.read_text()).get("evaluate") or {}).get("sets") or {}
    got = (sets.get("gsm8k_heldout") or {}).get("tau")
    return round(got, 4) if isinstance(got, (int, float)) else None


def bench(args, name: str, spec, plain, prompts: Path, drafter: Path) -> dict:
    """`eagle3kit bench` of one drafter's server against the plain one (concurrency 1 and 4); ``name`` is
    the run's folder name (``bench-<name>`` holds the record)."""
    out = Path(args.work) / f"bench-{name}"
    if not (out / "bench.json").exists():
        cmd = [sys.executable, "-m", "eagle3kit", "bench", "--base-url", spec.url, "--baseline-url",
               plain.url + "/v1", "--prompts", str(prompts), "--concurrency", "1,4", "--max-tokens",
               str(args.max_tokens), "--drafter", str(drafter), "--hardware", "2-core CPU",
               "--out", str(out)]  # fmt: skip
        subprocess.run(cmd, check=True)
    return json.loads((out / "bench.json").read_text())


def row(name: str, seed: int, record: dict, tau_eval: float | None) -> dict:
    """One drafter's row from its bench record: per concurrency, output tokens/s with and without it."""
    spec, base = record["servers"]["speculative"]["results"], record["servers"]["baseline"]["results"]
    levels = {}
    for s, b in zip(spec, base, strict=True):
        levels[str(s["concurrency"])] = {
            "output_tokens_per_s": s["output_tokens_per_s"],
            "plain_output_tokens_per_s": b["output_tokens_per_s"],
            "speedup": s.get("speedup"),
            "tau_vllm": (s.get("acceptance") or {}).get("tau"),
        }
    return {"drafter": name, "seed": seed, "tau_evaluate": tau_eval, "levels": levels}


def serve_seed(args, target: Path, prompts: Path, seed: int) -> list[dict]:
    """One seed's rows: a plain server and one server per drafter trained with ``seed``, run at once and
    benched; a seed whose bench records are all written starts no server."""
    from eagle3kit.core.engines import VLLMServer, free_port, start_servers

    work = Path(args.work)
    names = {name: run_name(name, seed) for name in DRAFTERS}
    benched = all((work / f"bench-{n}" / "bench.json").exists() for n in names.values())
    if benched:  # train nothing, serve nothing: the records are read back
        runs = {name: work / names[name] / "run" for name in DRAFTERS}
    else:
        runs = {name: train(args, name, seed) for name in DRAFTERS}
    servers = {}
    if not benched:
        servers["plain"] = VLLMServer(target, free_port(), work / f"plain-seed{seed}.log")
        for name, run in runs.items():
            spec = {
                "method": DRAFTERS[name][1],
                "model": str(run / "drafter"),
                "num_speculative_tokens": args.k,
            }
            extra = ["--speculative-config", json.dumps(spec)]
            servers[name] = VLLMServer(target, free_port(), work / f"{names[name]}.log", extra_args=extra)
        start_servers(list(servers.values()), 900)
    try:
        return [
            row(name, seed, bench(args, names[name], servers.get(name), servers.get("plain"), prompts,
                                  run / "drafter"), evaluate_tau(run))
            for name, run in runs.items()
        ]  # fmt: skip
    finally:
        for s in servers.values():
            s.kill()


def spread(rows: list[dict]) -> dict:
    """Per drafter, across its seeds: ``[lowest, highest]`` of τ from `evaluate`, of τ from vLLM's
    counters and of speedup at each concurrency, and the seeds. A value some seed lacks (missing, None,
    not a finite number) makes that span None: a span over fewer seeds than listed is no seed spread."""
    out: dict = {}
    for name in dict.fromkeys(r["drafter"] for r in rows):
        mine = [r for r in rows if r["drafter"] == name]

        def span(values):
            vals = list(values)
            if not vals or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                                   for v in vals):  # fmt: skip
                return None
            return [round(min(vals), 4), round(max(vals), 4)]

        def level(r, c):
            return (r.get("levels") or {}).get(c) or {}

        entry = {
            "seeds": [r["seed"] for r in mine],
            "tau_evaluate": span(r.get("tau_evaluate") for r in mine),
        }
        for c in ("1", "4"):
            entry[f"tau_vllm_c{c}"] = span(level(r, c).get("tau_vllm") for r in mine)
            entry[f"speedup_c{c}"] = span(level(r, c).get("speedup") for r in mine)
        out[name] = entry
    return out


MAX_SEED = (
    2**32 - 1
)  # torch.manual_seed takes 64 bits; DFlash's anchor generator seeds with seed · 1000 + epoch


def parse_seeds(text: str) -> list[int]:
    """``--seeds``: comma-separated training seeds, each an integer from 0 to :data:`MAX_SEED`, none twice.

    Raises:
        SystemExit: naming the bad entry and the form wanted."""
    if not text.strip():
        raise SystemExit("--seeds '': no seed given; give non-negative integers, e.g. 0,1,2")
    seeds = []
    for part in text.split(","):
        part = part.strip()
        bad = not (part.isascii() and part.isdigit()) or (len(part) > 1 and part.startswith("0"))
        if bad or len(part) > len(str(MAX_SEED)) or int(part) > MAX_SEED:
            raise SystemExit(
                f"--seeds {text!r}: {part!r} is not a seed; give integers from 0 to {MAX_SEED}, e.g. 0,1,2"
            )
        if int(part) in seeds:
            raise SystemExit(f"--seeds {text!r}: seed {part} is given twice")
        seeds.append(int(part))
    return seeds


def check_args(args) -> None:
    """Refuse bad options before anything runs; ``<work>/settings.json`` keeps the first run's K and
    max tokens, so a resumed run cannot mix runs and bench records made with other values (seeds may be
    added to a resumed run)."""
    if args.k < 1:
        raise SystemExit(f"--k {args.k}: give at least 1 draft token a verify step (the default is 7)")
    if args.max_tokens < 1:
        raise SystemExit(f"--max-tokens {args.max_tokens}: give at least 1 output token (the default is 64)")
    args.seed_list = parse_seeds(args.seeds)
    gsm8k = gsm8k_file(args)
    if not gsm8k.is_file():
        raise SystemExit(f"--shared {args.shared}: {gsm8k} is missing; pass the shared folder holding it")
    work = Path(args.work)
    if work.exists() and not work.is_dir():
        raise SystemExit(f"--work {work}: exists and is not a folder; pass a new folder or an earlier run's")
    settings, path = {"k": args.k, "max_tokens": args.max_tokens}, work / "settings.json"
    if path.exists():
        from common import read_json_object

        before = read_json_object(path, "delete it or use another --work")
        if before != settings:
            raise SystemExit(
                f"--work {work} holds a run with k={before.get('k')}, max_tokens={before.get('max_tokens')}; "
                f"this one asks k={args.k}, max_tokens={args.max_tokens}: use another --work (or the same values)"
            )
    else:
        work.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings) + "\n")


def print_table(k: int, rows: list[dict]) -> None:
    """The one table: a line per drafter and seed."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"serving on vLLM's CPU build, K = {k}: output tokens/s (plain) and speedup")
    for col in ("drafter", "seed", "τ vLLM c=1", "τ evaluate", "c=1 tok/s (plain)", "speedup c=1",
                "c=4 tok/s (plain)", "speedup c=4"):  # fmt: skip
        table.add_column(col, justify="left" if col == "drafter" else "right")
    for r in rows:
        c1, c4 = r["levels"].get("1", {}), r["levels"].get("4", {})
        table.add_row(
            r["drafter"],
            str(r["seed"]),
            f"{c1.get('tau_vllm') or 0:.3f}",
            f"{r['tau_evaluate'] or 0:.3f}",
            f"{c1.get('output_tokens_per_s', 0):.1f} ({c1.get('plain_output_tokens_per_s', 0):.1f})",
            f"{c1.get('speedup') or 0:.2f}",
            f"{c4.get('output_tokens_per_s', 0):.1f} ({c4.get('plain_output_tokens_per_s', 0):.1f})",
            f"{c4.get('speedup') or 0:.2f}",
        )
    Console(width=150).print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True, help="working folder (runs, bench records, server logs)")
    ap.add_argument("--shared", required=True, help="the shared folder holding data/chats")
    ap.add_argument("--k", type=int, default=7, help="draft tokens a verify step (DFlash blocks of K + 1)")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument(
        "--seeds", default="0", help="training seeds, comma-separated (each drafter once per seed)"
    )
    ap.add_argument("--out", default=str(OUT), help="the results JSON")
    args = ap.parse_args()
    check_args(args)
    from common import expected_time

    n = len(args.seed_list)
    expected_time(
        "serving_cpu",
        f"about {15 * n} minutes on a 2-core CPU ({n} seed(s); each: train 10, servers 1, bench 2; "
        f"generate 2 once); K = {args.k}, results to {args.out}",
    )
    from eagle3kit.core.config import PromptSource, TargetConfig
    from eagle3kit.data.sources import read_source
    from eagle3kit.model.target import load_target
    from eagle3kit.model.target_export import export_fp32_folder

    t0 = time.time()
    train(args, "eagle3.1")  # the data stages every run copies
    # the float32 folder the runs' export made (cached; vLLM cannot load the GGUF)
    target = export_fp32_folder(load_target(TargetConfig(), device="cpu"))
    rows, _ = read_source(PromptSource(path=str(gsm8k_file(args)), start=-20))
    prompts = Path(args.work) / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows))
    out_rows = [r for seed in args.seed_list for r in serve_seed(args, target, prompts, seed)]
    result = {
        "benchmark": "benchmarks/serving_cpu.py",
        "command": " ".join(["python", "benchmarks/serving_cpu.py", *sys.argv[1:]]),
        "k": args.k,
        "max_tokens": args.max_tokens,
        "prompts": len(rows),
        "hardware": "2-core CPU, vLLM CPU build, float32",
        "date": time.strftime("%Y-%m-%d"),
        "seconds": round(time.time() - t0),
        "rows": out_rows,
        "spread": spread(out_rows),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print_table(args.k, out_rows)


if __name__ == "__main__":
    main()
