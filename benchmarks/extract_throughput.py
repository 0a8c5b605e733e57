"""How fast does `extract` turn a big target's forward passes into feature shards?

A Llama-3.1-8B-shaped target with random weights (bf16; 32 layers, hidden 4096, MLP 14336, vocab
128256, GQA 32/8) on one GPU, 2048-token sequences, ``--tokens`` tokens in all (default 256K),
``--batch`` sequences per forward. Measured on the same batches, each after one warm-up batch:

* bare forward: the decoder alone (no hooks, nothing kept), tokens/s;
* extraction into host memory: eagle3kit's capture (forward pre-hooks on aux layers 2, 16, 29,
  the post-norm last state) and packing in the default format (bf16 aux + last), copied
  asynchronously into the pinned shard buffers `extract` reuses from shard to shard (allocated
  during the warm-up batch, reported as host_buffer_alloc_s; timed until the last copy has
  landed), tokens/s, and its ratio to the bare forward (goal ≥ 0.90);
* disk: the packed shard written with safetensors to ``--disk-dir``, bytes/s, timed separately;
* bytes per token of the default format (8 · hidden).

Prints one table and writes benchmarks/results/extract_throughput.json.

    python benchmarks/extract_throughput.py [--tokens 262144] [--batch 8] [--disk-dir /tmp] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3kit.core.ui import print_table
    from eagle3kit.model.target import Target, resolve_parts, target_features
    from eagle3kit.train.extract import ShardBuffer, pack_sample_states
    from eagle3kit.train.features import bytes_per_token

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256 * 1024)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--disk-dir", default="/tmp")
    ap.add_argument("--tiny", action="store_true", help="an 8-layer, hidden-256 model (a smoke run on CPU)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "extract_throughput.json"))
    args = ap.parse_args()
    from common import expected_time

    if args.tiny:
        expected_time("extract_throughput", "not timed yet (--tiny: a CPU smoke run, measures nothing)")
    else:
        expected_time(
            "extract_throughput",
            "not timed as a whole; at the defaults on one H200 its measured parts took about 35 s (two bare "
            "runs of 7.5 s, extraction as long, buffers 4.6 s, disk 6.9 s; results/extract_throughput.json)",
        )
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
    )
    if args.tiny:
        shape.update(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    cfg = LlamaConfig(**shape, tie_word_embeddings=False)
    t0 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    model.requires_grad_(False)
    build_s = time.perf_counter() - t0
    target = Target(model=model, tokenizer=None, parts=resolve_parts(model), source={})
    N = cfg.num_hidden_layers
    aux_ids = (2, N // 2, N - 3)
    g = torch.Generator().manual_seed(0)
    n_batches = max(1, args.tokens // (args.seq * args.batch))
    batches = [
        torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g) for _ in range(n_batches + 1)
    ]

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    @torch.no_grad()
    def bare(ids):
        target.parts.decoder(input_ids=ids.to(dev), use_cache=False)

    @torch.no_grad()
    def extract(ids, buf):
        aux, last = target_features(target, ids.to(dev), None, aux_ids)
        for k in range(ids.shape[0]):
            buf.put(pack_sample_states(aux[k], last[k], "bf16", None, target, None))

    timings = {}
    buf = ShardBuffer()
    for name in ("bare", "extract", "bare_again"):
        if name == "extract":
            buf.reserve(n_batches * args.batch * args.seq)
            t = time.perf_counter()
            extract(batches[0], buf)  # warm-up; also allocates the (reused) shard buffers
            buf.take()
            alloc_s = time.perf_counter() - t
            buf.reset()
            t = time.perf_counter()
            for ids in batches[1:]:
                extract(ids, buf)
            shard = buf.take()  # every copy has landed in host memory
            sync()
        else:
            bare(batches[0])
            sync()
            t = time.perf_counter()
            for ids in batches[1:]:
                bare(ids)
            sync()
        timings[name] = time.perf_counter() - t
    tokens = n_batches * args.batch * args.seq
    nbytes = sum(v.numel() * v.element_size() for v in shard.values())
    path = Path(args.disk_dir) / f"e3k-bench-shard-{os.getpid()}.safetensors"
    t = time.perf_counter()
    save_file(shard, str(path))
    os.sync()
    disk_s = time.perf_counter() - t
    path.unlink()
    bare_s = min(timings["bare"], timings["bare_again"])
    res = {
        "machine": torch.cuda.get_device_name(0)
        if dev.type == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "model": "Llama-3.1-8B shape, random bf16" if not args.tiny else "tiny Llama (smoke)",
        "build_s": round(build_s, 1),
        "tokens": tokens,
        "seq": args.seq,
        "batch": args.batch,
        "aux_ids": list(aux_ids),
        "bare_tokens_per_s": round(tokens / bare_s),
        "extract_tokens_per_s": round(tokens / timings["extract"]),
        "extract_over_bare": round(bare_s / timings["extract"], 4),
        "bytes_per_token": bytes_per_token(cfg.hidden_size, "bf16", None, 0),
        "shard_bytes": nbytes,
        "disk_bytes_per_s": round(nbytes / disk_s),
        "disk_seconds": round(disk_s, 2),
        "bare_runs_s": [round(timings["bare"], 3), round(timings["bare_again"], 3)],
        "host_buffer_alloc_s": round(alloc_s, 2),
    }
    assert nbytes == res["bytes_per_token"] * tokens
    print_table("extract throughput", [(k, v) for k, v in res.items()])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
