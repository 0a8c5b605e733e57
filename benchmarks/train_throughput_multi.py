"""Training throughput across the GPUs of one host: ``train_throughput.py`` (the Llama-3.1-8B shape, online
features, TTT 7, 8 × 2048 tokens a GPU) on one GPU, then under ``torchrun`` on each GPU count asked for, with a
DistributedDataParallel and with an FSDP2-sharded drafter, all in the same lease, so the scaling efficiency
(tokens/s on n GPUs ÷ n × one GPU's) compares runs of one machine and one software stack.

NVLink multicast stays off in every process (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
``NVSHMEM_DISABLE_NVLS=1``), as the shared machines require. Each run's own JSON is kept in ``--work``; the
table is printed and ``benchmarks/results/train_throughput_multi.json`` written (machine, date, rows).

    python benchmarks/train_throughput_multi.py                       # 1, 2, 4, 8 GPUs (as many as there are)
    python benchmarks/train_throughput_multi.py --gpus 1,2 --steps 5  # a short check on two
    python benchmarks/train_throughput_multi.py --tiny --gpus 1,2      # a smoke run of the plumbing

The example recipe's drafter trained on every GPU (its τ against the one-GPU run's, within the seed spread):
``torchrun --nproc-per-node N -m eagle3kit run -c examples/smollm2-shared-data.yaml`` with the recipe staged
as ``benchmarks/variants_device.sh`` does; not driven from here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "train_throughput.py"
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def rows_from(results: list[dict]) -> list[dict]:
    """One row per run (``train_throughput.py``'s JSON): GPUs, parallel mode, tokens/s, MFU, peak memory of
    the fast path and the scaling efficiency against the one-GPU run among ``results``.

    Raises:
        ValueError: no one-GPU run among them (efficiency needs one from the same lease)."""
    one = next((r for r in results if r["gpus"] == 1), None)
    if one is None:
        raise ValueError(
            "no one-GPU run among the results: the efficiency compares with one from the same lease"
        )
    rows = []
    for r in sorted(results, key=lambda r: (r["gpus"], r.get("parallel") or "")):
        fast = next(x for x in r["runs"] if x["path"] == "fast")
        rows.append(
            {
                "gpus": r["gpus"],
                "parallel": r.get("parallel") or "none",
                "tokens_per_s": r["tokens_per_s"],
                "mfu": r["mfu"],
                "peak_memory_gb": fast.get("peak_memory_gb"),
                "scaling_efficiency": round(r["tokens_per_s"] / (r["gpus"] * one["tokens_per_s"]), 4),
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    out = [
        "| GPUs | drafter | tokens/s | MFU | peak GB per GPU | scaling efficiency |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['gpus']} | {r['parallel']} | {r['tokens_per_s']:,.0f} | {r['mfu']:.3f} | "
            f"{r['peak_memory_gb']} | {r['scaling_efficiency']:.1%} |"
        )
    return "\n".join(out)


def _run(n: int, parallel: str, work: Path, args, single: Path | None) -> dict:
    out = work / (f"{n}gpu-{parallel}.json" if n > 1 else "1gpu.json")
    common = ["--steps", str(args.steps), "--ref-steps", "0", "--out", str(out)] + (
        ["--tiny"] if args.tiny else []
    )
    if n == 1:
        cmd = [sys.executable, str(SCRIPT), *common]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
               str(SCRIPT), *common, "--parallel", parallel, "--single", str(single)]  # fmt: skip
    print(f"[{time.strftime('%H:%M:%S')}] {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, **NO_MULTICAST})
    return json.loads(out.read_text())


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--gpus", default="1,2,4,8", help="GPU counts, comma-separated (those above the host's are skipped)"
    )
    ap.add_argument("--parallel", default="ddp,fsdp", help="drafter modes for the multi-GPU runs")
    ap.add_argument("--steps", type=int, default=10, help="timed steps of each run")
    ap.add_argument("--tiny", action="store_true", help="a small model: a smoke run of the plumbing")
    ap.add_argument("--work", default="/tmp/train_throughput_multi", help="folder for each run's JSON")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train_throughput_multi.json"))
    args = ap.parse_args()
    from common import expected_time

    expected_time(
        "train_throughput_multi", "not timed yet (one train_throughput.py run per GPU count and mode)"
    )
    have = torch.cuda.device_count()
    counts = sorted({int(g) for g in args.gpus.split(",") if 0 < int(g) <= have} | {1})
    if not have:
        sys.exit("no CUDA GPU: train_throughput.py measures on GPUs only")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    results = [_run(1, "none", work, args, None)]
    for n in counts[1:]:
        for mode in args.parallel.split(","):
            results.append(_run(n, mode, work, args, work / "1gpu.json"))
    rows = rows_from(results)
    record = {
        "benchmark": "train_throughput_multi",
        "machine": f"{have} × {torch.cuda.get_device_name(0)}",
        "date": time.strftime("%Y-%m-%d"),
        "shape": results[0]["target"],
        "seconds": round(time.time() - t0, 1),
        "no_multicast": NO_MULTICAST,
        "rows": rows,
        "runs": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(table(rows))
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
