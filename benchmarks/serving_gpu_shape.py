"""``bench`` and ``diagnose`` against vLLM serving a large target on one GPU: the Llama-3.1-8B-shaped
target of benchmarks/recipe_shape.py (Llama-3.1-8B's hub config key for key, the real Llama 3 tokenizer
and chat template, RANDOM bf16 weights: no model hub is reachable from the GPU machine) with the drafter
examples/llama3.1-8b.yaml trains on it (recipe_shape.py's ``llama8b_cache`` run: the example's training
settings, the data scaled to ``--run-prompts``).

Stages, each resumable in ``--work`` (a finished run, diagnosis or bench record is read back):

1. The target (made once on the GPU) and ``eagle3kit run`` of the 8B recipe (generate with transformers).
2. vLLM serving the target in bf16 with the drafter (EAGLE-3 method, ``--k`` draft tokens), in
   ``--gpu-share`` of the GPU; ``eagle3kit diagnose`` against it with the run's own evaluate sets
   (no ``--prompts``), the target loaded on the GPU in bf16 with ``--device-map auto``.
3. A second vLLM server without speculation, then ``eagle3kit bench`` against both at every
   ``--concurrency``, its prompts again the run's evaluate sets.

Random weights: the replies are text no one would train on and the drafter learns little from them, so
τ here measures the pipeline at the shape (engine and simulation agreeing on the same outputs), not a
drafter; the speeds are the shape's (an 8B model's step on the card) with that τ.

    here:        python benchmarks/recipe_shape.py pack --out .gpudata/data   (then only shapes/llama8b-*
                 and prompts/ need to travel: about 14 MB)
    on the GPU:  bash benchmarks/serving_gpu_device.sh shape DATA [options]   (after tools/stage_vllm_gpu.sh)
    directly:    python benchmarks/serving_gpu_shape.py --data DATA --work /tmp/sgs --out FILE
                 [--k 3] [--prompts 10] [--max-tokens 128] [--concurrency 1,4,16] [--smoke]

``--smoke`` rehearses on the CPU with vLLM's CPU build and recipe_shape's tiny Llama (float32 server).
Writes ``benchmarks/results/serving_gpu_8b_shape.json`` (``--out``) and prints one table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from serving_gpu import cli, parse_list, row, server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "serving_gpu_8b_shape.json"
NAME = "llama8b-shape"  # the served model name


def trained(args) -> tuple[Path, dict]:
    """The 8B-shaped target and its drafter: recipe_shape.py's ``llama8b_cache`` task in a child process
    (its GPU memory freed when it ends); returns the run folder and that task's result entry.

    Raises:
        SystemExit: the run failed (its log named)."""
    rs = Path(args.work) / "rs"
    results = rs / "results.json"
    entry = lambda: json.loads(results.read_text()).get("llama8b_cache", {}) if results.exists() else {}  # noqa: E731
    got = entry()
    if got.get("rc") != 0:
        cmd = [sys.executable, str(ROOT / "benchmarks" / "recipe_shape.py"), "device", "--data", args.data,
               "--work", str(rs), "--tasks", "llama8b_cache", "--prompts", str(args.run_prompts),
               "--max-new-tokens", str(args.run_tokens), "--eval-prompts", str(args.prompts),
               "--generate-backend", "transformers", "--scale", "tiny" if args.smoke else "full"]  # fmt: skip
        with open(Path(args.work) / "run.log", "w") as fh:
            subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT)
        got = entry()
    if got.get("rc") != 0:
        raise SystemExit(
            f"the 8B-shaped run failed: see {Path(args.work) / 'run.log'} and {rs}/llama8b_cache.log"
        )
    return rs / "runs" / "llama8b", got


def started(srv) -> float:
    """Start ``srv`` (a vLLM server) and return the seconds it took to answer."""
    t0 = time.time()
    srv.start(1200)
    return round(time.time() - t0, 1)


def measure(args, run: Path) -> dict:
    """diagnose against the drafter's server, then bench against it and a plain server; the records in
    ``<work>/diagnose`` and ``<work>/bench``; returns their exit codes, the servers' start times and the
    records."""
    work, drafter = Path(args.work), run / "drafter"
    target = work / "rs" / "targets" / "llama8b"
    times_path = work / "servers.json"
    times = json.loads(times_path.read_text()) if times_path.exists() else {}
    spec_cfg = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": args.k}
    diag_done = (work / "diagnose" / "diagnose.json").exists()
    bench_done = (work / "bench" / "bench.json").exists()
    spec = plain = None
    try:
        if not (diag_done and bench_done):
            spec = server(args, target, work / "spec.log", spec_cfg, NAME)
            times["speculative_start_s"] = started(spec)
        if not diag_done:
            t0 = time.time()
            times["diagnose_exit"] = cli(["diagnose", "--base-url", spec.url, "--drafter", str(drafter),
                                          "--num-prompts", str(args.prompts), "--max-tokens", str(args.max_tokens),
                                          "--device-map", "auto", "--out", str(work / "diagnose"), "--overwrite"],
                                         work / "diagnose.log")  # fmt: skip
            times["diagnose_s"] = round(time.time() - t0, 1)
        if not bench_done:
            plain = server(args, target, work / "plain.log", None, NAME)
            times["plain_start_s"] = started(plain)
            t0 = time.time()
            times["bench_exit"] = cli(["bench", "--base-url", spec.url, "--baseline-url", plain.url + "/v1",
                                       "--concurrency", ",".join(map(str, args.levels)), "--max-tokens",
                                       str(args.max_tokens), "--num-prompts", str(2 * args.prompts), "--drafter",
                                       str(drafter), "--hardware", args.hardware, "--out", str(work / "bench"),
                                       "--overwrite"], work / "bench.log")  # fmt: skip
            times["bench_s"] = round(time.time() - t0, 1)
        times_path.write_text(json.dumps(times, indent=1) + "\n")
    finally:
        for srv in (plain, spec):
            if srv is not None:
                srv.kill()
    read = lambda p: json.loads(p.read_text()) if p.exists() else None  # noqa: E731
    return {"times": times, "diagnose": read(work / "diagnose" / "diagnose.json"),
            "bench": read(work / "bench" / "bench.json")}  # fmt: skip


def summary(got: dict) -> dict:
    """What the table and JSON give: serving_gpu.row's τ served and simulated, verdict, per-level speeds
    and concurrency-1 cost model, with each command's exit code and the prompts it used."""
    diag, rec = got["diagnose"] or {}, got["bench"] or {}
    r = row("eagle3.1", 0, {"diagnose": diag, "bench": rec}, {}) if rec else {"levels": {}}
    return {
        "diagnose": {
            "exit_code": got["times"].get("diagnose_exit"),
            "verdict": diag.get("verdict"),
            "tau_served": (diag.get("engine") or {}).get("tau"),
            "tau_simulated": (diag.get("reference") or {}).get("tau"),
            "prompts": diag.get("prompts"),
            "server": diag.get("server"),
            "timings": diag.get("timings"),
        },
        "bench": {
            "exit_code": got["times"].get("bench_exit"),
            "prompts": rec.get("prompts"),
            "levels": r["levels"],
            "cost": r.get("cost"),
        },  # fmt: skip
    }


def print_table(result: dict) -> None:
    """One table: a line per concurrency level, the diagnosis above it."""
    d = result["diagnose"]
    print(f"\n8B-shaped target (random weights) served by vLLM {result['machine'].get('vllm')} on "
          f"{result['machine'].get('hardware')}, EAGLE-3.1 drafter, K {result['k']}")  # fmt: skip
    print(f"diagnose: exit {d['exit_code']}, {d['verdict']}, τ served {d['tau_served']}, "
          f"simulated {d['tau_simulated']}")  # fmt: skip
    head = ("conc", "tok/s", "plain", "speedup", "τ vLLM", "TTFT ms", "TPOT ms", "plain TPOT")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (5, 9, 9, 8, 7, 8, 8, 10), strict=True)))
    for c, v in result["bench"]["levels"].items():
        print(f"{c:>5} {v['output_tokens_per_s']:>9.1f} {v['plain_output_tokens_per_s']:>9.1f} "
              f"{(v['speedup'] or 0):>8.2f} {(v['tau_vllm'] or 0):>7.3f} {v['ttft_ms_p50']:>8.1f} "
              f"{v['tpot_ms_p50']:>8.2f} {v['plain_tpot_ms_p50']:>10.2f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="a folder recipe_shape.py pack wrote (shapes/, prompts/)")
    ap.add_argument("--work", required=True, help="working folder (the run, servers' logs, records)")
    ap.add_argument("--out", default=str(OUT), help="the results JSON")
    ap.add_argument("--k", type=int, default=3, help="draft tokens a verify step")
    ap.add_argument("--prompts", type=int, default=10, help="prompts per evaluate set (diagnose and bench)")
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens per request, greedy")
    ap.add_argument("--concurrency", default="1,4,16", help="bench levels, comma-separated")
    ap.add_argument("--run-prompts", type=int, default=64, help="prompts the 8B recipe's run generates from")
    ap.add_argument("--run-tokens", type=int, default=256, help="reply length in that run")
    ap.add_argument(
        "--gpu-share", type=float, default=0.35, help="vLLM's --gpu-memory-utilization per server"
    )
    ap.add_argument("--hardware", default="1x GPU", help="the card, as the records name it")
    ap.add_argument("--smoke", action="store_true", help="rehearse on vLLM's CPU build: the tiny Llama")
    args = ap.parse_args()
    args.levels = parse_list(args.concurrency, "concurrency", low=1)
    if not 1 <= args.k <= 7:
        raise SystemExit(f"--k {args.k}: the drafter trains 7 TTT steps: give 1 to 7")
    if min(args.prompts, args.max_tokens, args.run_prompts, args.run_tokens) < 1:
        raise SystemExit("--prompts, --max-tokens, --run-prompts and --run-tokens: give at least 1 each")
    if not 0.05 <= args.gpu_share <= 0.45:
        raise SystemExit(f"--gpu-share {args.gpu_share}: give 0.05 to 0.45 (two servers share the GPU)")
    if not (
        Path(args.data) / "shapes" / f"llama8b-{'tiny' if args.smoke else 'full'}" / "config.json"
    ).is_file():
        raise SystemExit(f"--data {args.data}: no shapes/llama8b-* there; make it with recipe_shape.py pack")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    from common import expected_time

    expected_time("serving_gpu_shape", "not timed yet on a GPU (an estimate: about 12 minutes on one H100)")
    from recipe_shape import machine
    from serving_gpu import machine as engine_machine

    t0 = time.time()
    run, run_row = trained(args)
    got = measure(args, run)
    result = {
        "benchmark": "benchmarks/serving_gpu_shape.py",
        "command": " ".join(["python", "benchmarks/serving_gpu_shape.py", *sys.argv[1:]]),
        "what": "Llama-3.1-8B's architecture with RANDOM bf16 weights (no model hub on the GPU machine) and the "
        "Llama 3 tokenizer, served by vLLM in bf16 with the EAGLE-3.1 drafter examples/llama3.1-8b.yaml trained on "
        f"it ({args.run_prompts} prompts x {args.run_tokens} tokens); tau measures the pipeline, not a drafter",
        "machine": {**machine(), **engine_machine(args)},
        "k": args.k,
        "gpu_share": args.gpu_share,
        "run": run_row,
        "servers": got["times"],
        **summary(got),
        "seconds": round(time.time() - t0, 1),
    }
    from eagle3kit.core.rundir import write_text

    write_text(Path(args.out), json.dumps(result, indent=1) + "\n")
    print_table(result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
