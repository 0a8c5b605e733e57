"""Does `eagle3kit diagnose` name each fault an engine can be given, and how long does it take?

Serves SmolLM2-135M-Instruct (the float32 export of the package's GGUF) with vLLM's CPU build,
EAGLE-3 K = 3, once per drafter folder: the drafter as trained, and copies of it with one fault
written in (:func:`eagle3kit.diagnose.faults.plant_in_folder`: fc removed, d2t removed, aux ids
one layer later, norm_before_residual flipped); the servers start together. Then runs `eagle3kit
diagnose` (the CLI, given the drafter as trained) against each on held-out GSM8K questions (the
last 80 of gsm8k_train.jsonl), greedy. Prints one table and writes
benchmarks/results/diagnose_faults.json (``--out``). The README's wall time is the run with
``--prompts 20 --faults "" --out benchmarks/results/diagnose_wall_time.json``.

    .venv/bin/python benchmarks/diagnose_faults.py --drafter runs/engine/drafter [--prompts 8] \
        [--max-tokens 64] [--faults fc_missing,d2t_missing,aux_ids_plus_1,norm_before_residual] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eagle3kit.core.config import PromptSource, TargetConfig
from eagle3kit.core.engines import VLLMServer, free_port, start_servers
from eagle3kit.data.sources import read_source
from eagle3kit.diagnose.faults import plant_in_folder
from eagle3kit.model.target import load_target
from eagle3kit.model.target_export import export_fp32_folder

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT.parent / "shared" / "data" / "chats" / "gsm8k_train.jsonl"
FAULTS = "fc_missing,d2t_missing,aux_ids_plus_1,norm_before_residual"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", required=True, help="the drafter as trained (a SmolLM2 drafter folder)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--faults", default=FAULTS, help="comma-separated; empty: the drafter as trained only")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "diagnose_faults.json"))
    args = ap.parse_args()
    from common import expected_time

    n = 1 + len([x for x in args.faults.split(",") if x])
    expected_time(
        "diagnose_faults",
        f"{n} diagnose runs of about 40 s each at --prompts 8 (39-44 s, results/diagnose_faults.json), "
        "74.5 s for one at --prompts 20 (results/diagnose_wall_time.json), on vLLM's CPU build, after "
        f"{n} servers start together (server start not recorded)",
    )
    work = Path(tempfile.mkdtemp(prefix="e3k-diagnose-"))
    drafter = Path(args.drafter).resolve()
    target = export_fp32_folder(load_target(TargetConfig(), device="cpu"))
    folders = {"as trained": drafter}
    for name in [n for n in args.faults.split(",") if n]:
        folders[name] = plant_in_folder(drafter, work / name, name)
    rows, _ = read_source(PromptSource(path=str(GSM8K), start=-80, limit=args.prompts))
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows))
    t0 = time.perf_counter()
    servers = start_servers(
        [
            VLLMServer(
                target,
                free_port(),
                work / f"{i}.log",
                speculative={"method": "eagle3", "model": str(f), "num_speculative_tokens": 3},
            )
            for i, f in enumerate(folders.values())
        ]
    )
    started = time.perf_counter() - t0
    results = []
    try:
        for (name, _), srv in zip(folders.items(), servers):
            out = work / f"report-{len(results)}"
            t1 = time.perf_counter()
            cmd = [
                sys.executable,
                "-m",
                "eagle3kit",
                "diagnose",
                "--base-url",
                srv.url,
                "--drafter",
                str(drafter),
            ]
            cmd += ["--prompts", str(prompts), "--max-tokens", str(args.max_tokens), "--out", str(out)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            rep = json.loads((out / "diagnose.json").read_text())
            named = rep["finding"].split(":")[0] if rep["verdict"] == "fault" else rep["verdict"]
            h = next((x for x in rep["hypotheses"] if x["name"] == named), None)
            results.append(
                {
                    "served": name,
                    "exit_code": done.returncode,
                    "verdict": rep["verdict"],
                    "named": named,
                    "correct": named == ("agree" if name == "as trained" else name),
                    "tau_engine": rep["engine"]["tau"],
                    "tau_as_trained": rep["reference"]["tau"],
                    "tau_named_fault": h["tau"] if h else None,
                    "distance_named": h["distance"] if h else None,
                    "distance_as_trained": rep["reference"]["distance"],
                    "wall_s": round(time.perf_counter() - t1, 1),
                    "timings": rep["timings"],
                }
            )
    finally:
        for srv in servers:
            srv.kill()
    print(
        f"{len(servers)} vLLM servers started together in {started:.0f} s; {args.prompts} prompts × {args.max_tokens}"
    )
    print(
        "| served | verdict (named) | τ vLLM | τ as trained | τ named fault | distance named / as trained | exit | s |"
    )
    print("|---|---|---:|---:|---:|---|---:|---:|")
    for r in results:
        print(
            f"| {r['served']} | {r['verdict']} ({r['named']}) | {r['tau_engine']:.4f} | {r['tau_as_trained']:.4f} | "
            f"{r['tau_named_fault'] if r['tau_named_fault'] is not None else ''} | {r['distance_named']} / "
            f"{r['distance_as_trained']} | {r['exit_code']} | {r['wall_s']} |"
        )
    res = Path(args.out)
    res.write_text(
        json.dumps(
            {
                "drafter": str(drafter),
                "prompts": args.prompts,
                "max_tokens": args.max_tokens,
                "rows": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {res}")


if __name__ == "__main__":
    main()
