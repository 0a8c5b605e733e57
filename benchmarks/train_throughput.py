"""How fast does eagle3kit train an EAGLE-3 drafter with online features, and how much of the GPU
does it use?

A Llama-3.1-8B-shaped target with random bf16 weights (32 layers, hidden 4096, MLP 14336, GQA
32/8, vocab 128256), online features (the target runs inside every step), a drafter of hidden
4096 with a 32,000-token draft vocabulary, TTT 7 steps, ``--batch`` × ``--seq`` tokens a step
(default 8 × 2048). The target's lm_head rows outside the draft vocabulary are scaled by 0.01 so
its argmax always lies in the draft vocabulary: every position is supervised at every step
(the supervised fraction is reported), so the loss FLOPs the formula counts are all spent.

Two paths, measured in the same run with the same data:

* fast: what ``train`` does on CUDA (``eagle3kit.train.chain_step.train_step``): flex attention with a block
  mask (compiled), the loss unchunked when it fits (``train.loss_chunk`` unset; ``--loss-chunk`` to
  force chunks), the teacher's logits once per batch, bf16 autocast
  over fp32 master weights, fused AdamW;
* reference: the same step with the dense TTT attention and the unchunked fp32 loss (the
  readable CPU path), at the largest batch that fits (halved from ``--batch`` on out-of-memory).

Model FLOP utilisation (printed with the result)::

    MFU = (2·P_target + 3·2·P_drafter·S + A) × tokens/s ÷ R

P: matmul parameters (every nn.Linear weight, lm_heads included, embeddings excluded);
S: TTT steps; A: attention FLOPs per token, causal, 2·n_layers·n_heads·head_dim·T for the
target's forward and 3·2·n_heads·head_dim·T·S for the drafter's step-0 attention (forward and
backward; the diagonal terms of steps ≥ 1 are negligible); R: the bf16 matmul rate measured in
the same run (8192³ torch.matmul). Under ``torchrun`` every rank runs the fast path on its own
GPU with its own target replica and a DistributedDataParallel (``--parallel fsdp``: FSDP2) drafter;
tokens/s is the sum over ranks and, with ``--single JSON`` (a one-GPU result), the scaling efficiency is printed.

Prints one table and writes benchmarks/results/train_throughput.json (key ``mfu``).

    python benchmarks/train_throughput.py [--steps 10] [--tiny]
    torchrun --nproc-per-node 2 benchmarks/train_throughput.py --single benchmarks/results/train_throughput.json \\
        --out benchmarks/results/train_throughput_ddp2.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


def matmul_rate(dev, n: int = 8192, iters: int = 30) -> float:
    """Measured bf16 matmul FLOP/s on ``dev`` (n³ products)."""
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    torch.cuda.synchronize(dev)
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize(dev)
    return 2 * n**3 * iters / (time.perf_counter() - t)


def linear_params(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3kit.core.config_train import TrainConfig
    from eagle3kit.core.ui import print_table
    from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter
    from eagle3kit.model.target import Target, resolve_parts, target_features, teacher_argmax
    from eagle3kit.train.batches import Sample, make_batch
    from eagle3kit.train.chain_step import resolve_speed, train_step
    from eagle3kit.train.distributed import World

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10, help="timed steps of the fast path")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ref-steps", type=int, default=3, help="timed steps of the reference path (0: skip it)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--loss-chunk", type=int, default=None, help="default: what train picks (resolve_speed)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument(
        "--tiny", action="store_true", help="a small model and few tokens (a smoke run of the script)"
    )
    ap.add_argument(
        "--compile-flipped",
        action="store_true",
        help="also measure the fast path with train.compile the other way round from what train picks",
    )
    ap.add_argument(
        "--parallel", choices=["ddp", "fsdp"], default="ddp", help="under torchrun: DDP or FSDP2 drafter"
    )
    ap.add_argument("--single", help="a one-GPU result JSON: print the scaling efficiency against it")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train_throughput.json"))
    args = ap.parse_args()
    from common import expected_time

    if int(os.environ.get("RANK", "0")) == 0:
        expected_time(
            "train_throughput",
            "not timed yet (--tiny: a smoke run)"
            if args.tiny
            else "not timed as a whole; on one H200 its 10 timed fast steps took 10.8 s "
            "(results/train_throughput.json), building the target, compiling and the reference path not timed",
        )

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        torch.distributed.init_process_group("nccl")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(dev)
    rate = matmul_rate(dev)
    shape = dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=args.layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
    )
    if args.tiny:
        shape.update(
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
        )
    cfg = LlamaConfig(**shape, tie_word_embeddings=False)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with dev:
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    model.requires_grad_(False)
    target = Target(model=model, tokenizer=None, parts=resolve_parts(model), source={})
    V, vd, S, T, B = cfg.vocab_size, args.draft_vocab, args.ttt, args.seq, args.batch
    N = cfg.num_hidden_layers
    aux_ids = (2, N // 2, N - 3)
    draft_ids = torch.arange(vd, device=dev) * (V // vd)  # a spread-out draft vocabulary
    t2d = torch.zeros(V, dtype=torch.bool, device=dev)
    t2d[draft_ids] = True
    with torch.no_grad():
        target.parts.lm_head.weight[~t2d] *= 0.01  # argmax always in the draft vocabulary

    def new_drafter():
        torch.manual_seed(1)
        d = Eagle3Drafter(DrafterConfig.from_target(cfg, vd, aux_ids, vocab_size=V)).to(dev)
        d.d2t.copy_(draft_ids - torch.arange(vd, device=dev))
        d.t2d.copy_(t2d)
        return d

    g = torch.Generator().manual_seed(100 + rank)

    def batch_of(b: int) -> dict:
        ids = torch.randint(0, V, (b, T), generator=g).to(dev)
        with torch.no_grad():
            aux, last = target_features(target, ids, None, aux_ids)
            argmax = teacher_argmax(target, last.reshape(-1, cfg.hidden_size), chunk=4096).view(b, T)
        samples = [
            Sample(ids[i], torch.ones(T, dtype=torch.bool, device=dev), aux[i], last[i], argmax[i])
            for i in range(b)
        ]
        return make_batch(samples, list(range(b)), S, dev)

    tc = TrainConfig(
        ttt_steps=S, step_weight=0.8, grad_clip=0.5, tokens_per_step=B * T, loss_chunk=args.loss_chunk
    )
    auto = resolve_speed(tc, dev, vd)  # the fast path: what train picks on this GPU

    def run(drafter, path: str, b: int, steps: int, warmup: int) -> dict:
        fast = path.startswith("fast")
        speed = auto if fast else {"attention": "reference", "bf16": False, "loss_chunk": 0, "compile": False}
        if path == "fast-compile-flipped":
            speed = {**auto, "compile": not auto["compile"]}
        if speed["compile"]:
            drafter.compile_layer()
        model_ = World(rank, world, dev).wrap(drafter, args.parallel)
        opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=True)
        losses, sup = [], []
        torch.cuda.reset_peak_memory_stats(dev)
        torch.cuda.synchronize(dev)
        t_wall = time.perf_counter()
        for i in range(warmup + steps):
            if i == warmup:
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
            batch = batch_of(b)
            loss, st = train_step(model_, opt, target, batch, draft_ids, tc, speed)
            losses.append(round(float(loss.detach()), 4))
            sup.append(sum(st["n"]) / (S * b * T))
        torch.cuda.synchronize(dev)
        sec = time.perf_counter() - t0
        return {
            "path": path,
            "batch": b,
            "steps": steps,
            "seconds": round(sec, 3),
            "tokens_per_s": b * T * steps / sec * world,
            "tokens_per_s_wall": b * T * (warmup + steps) / (time.perf_counter() - t_wall) * world,
            "speed": speed,
            "losses": losses,
            "supervised_fraction": round(sum(sup) / len(sup), 4),
            "peak_memory_gb": round(torch.cuda.max_memory_allocated(dev) / 1e9, 1),
        }

    def agreement(b: int = 2) -> dict:
        """The GPU formulation (flex attention, chunked loss) against the reference on one batch,
        both in fp32: relative difference of the loss and of the gradient."""
        from eagle3kit.train.ttt import ttt_loss

        batch = batch_of(b)
        got = []
        for attention, chunk in (("reference", 0), ("flex", auto["loss_chunk"] or 4096)):
            d = new_drafter()
            loss, _ = ttt_loss(d, target, batch, draft_ids, S, 0.8, attention=attention, loss_chunk=chunk)
            loss.backward()
            got.append((float(loss.detach()), torch.cat([p.grad.flatten() for p in d.parameters()])))
            del d
        (l0, g0), (l1, g1) = got
        return {
            "tokens": b * T,
            "loss_reference": l0,
            "loss_flex_chunked": l1,
            "loss_rel_diff": abs(l1 - l0) / abs(l0),
            "grad_rel_diff": float((g1 - g0).norm() / g0.norm()),
        }

    agree = agreement() if args.ref_steps else None
    drafter = new_drafter()
    p_target = linear_params(model)
    p_drafter = linear_params(drafter)
    nh_hd = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    attn = 2 * N * nh_hd * T + 3 * 2 * nh_hd * T * S
    flops_per_token = 2 * p_target + 3 * 2 * p_drafter * S + attn
    fast = run(drafter, "fast", B, args.steps, args.warmup)
    results = [fast]
    if args.compile_flipped:
        d = new_drafter()
        results.append(run(d, "fast-compile-flipped", B, args.steps, args.warmup))
        del d
    if args.ref_steps and world == 1:
        b = B
        while b >= 1:
            try:
                results.append(run(new_drafter(), "reference", b, args.ref_steps, 1))
                break
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                print(f"reference path: out of memory at batch {b}; halving", flush=True)
                b //= 2
    mfu = flops_per_token * fast["tokens_per_s"] / (rate * world)
    out = {
        "machine": f"{world} × {torch.cuda.get_device_name(dev)}",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gpus": world,
        "target": "Llama-3.1-8B shape, random bf16" if not args.tiny else "tiny Llama (smoke)",
        "parallel": args.parallel if world > 1 else None,
        "seq": T,
        "batch_per_gpu": B,
        "ttt_steps": S,
        "draft_vocab": vd,
        "drafter_hidden": cfg.hidden_size,
        "p_target": p_target,
        "p_drafter": p_drafter,
        "attention_flops_per_token": attn,
        "flops_per_token": flops_per_token,
        "matmul_tflops_measured": round(rate / 1e12, 1),
        "formula": "MFU = (2*P_target + 3*2*P_drafter*S + A) * tokens_per_s / (R * gpus)",
        "tokens_per_s": round(fast["tokens_per_s"], 1),
        "mfu": round(mfu, 4),
        "runs": results,
    }
    if args.compile_flipped:
        out["compile_flipped_tokens_per_s"] = round(results[1]["tokens_per_s"], 1)
    if any(r["path"] == "reference" for r in results):
        ref = next(r for r in results if r["path"] == "reference")
        out["reference_tokens_per_s"] = round(ref["tokens_per_s"], 1)
        out["speedup_over_reference"] = round(fast["tokens_per_s"] / ref["tokens_per_s"], 2)
    if agree:
        out["fp32_agreement"] = agree
    if args.single:
        one = json.loads(Path(args.single).read_text())
        out["single_gpu_tokens_per_s"] = one["tokens_per_s"]
        out["scaling_efficiency"] = round(fast["tokens_per_s"] / (world * one["tokens_per_s"]), 4)
    if rank == 0:
        rows = [(k, v) for k, v in out.items() if k != "runs"]
        rows += [
            (
                f"{r['path']} (batch {r['batch']})",
                f"{r['tokens_per_s']:.0f} tok/s, peak {r['peak_memory_gb']} GB, "
                f"supervised {r['supervised_fraction']}",
            )
            for r in results
        ]
        print_table("train throughput", rows)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
