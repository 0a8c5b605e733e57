"""Which precision and attention path trains a small drafter fastest on this GPU, and how far
does each one's loss and gradient move from the fp32 reference?

A SmolLM2-135M-shaped target with random fp32 weights (30 layers, hidden 576, vocabulary 49,152;
its lm_head rows outside the draft vocabulary scaled by 0.01 so every position is supervised),
its drafter (hidden 576, draft vocabulary 8,192), TTT 7, ``--rows`` × ``--seq`` tokens a step
(default 16 × 512 = 8,192, the examples recipe's step). The features are computed once and
reused, so the timed steps are the drafter's alone (cached-feature training). Paths
(``train.attention`` / ``train.precision`` / ``train.loss_chunk``):

* ``fp32``: reference / fp32 / 4096 — what benchmarks/variants.py used until now;
* ``tf32``: reference / tf32 / 4096 (fp32 tensors, matrix products on TF32 tensor cores);
* ``tf32-unchunked``: reference / tf32 / 0;
* ``bf16``: reference / bf16 / 4096;
* ``default``: flex / bf16 / 4096 (``auto`` on CUDA).

For each: steady tokens/s over ``--steps`` steps after ``--warmup``, peak memory, and the relative
difference of the first step's loss and gradient from the ``fp32`` path's on the same batch and
weights. Prints one table and writes ``benchmarks/results/step_precision.json``.

    python benchmarks/step_precision.py [--steps 10] [--warmup 3] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PATHS = {
    "fp32": {"attention": "reference", "bf16": False, "tf32": False, "loss_chunk": 4096},
    "tf32": {"attention": "reference", "bf16": False, "tf32": True, "loss_chunk": 4096},
    "tf32-unchunked": {"attention": "reference", "bf16": False, "tf32": True, "loss_chunk": 0},
    "bf16": {"attention": "reference", "bf16": True, "tf32": False, "loss_chunk": 4096},
    "default": {"attention": "flex", "bf16": True, "tf32": False, "loss_chunk": 4096},
}


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3kit.core.config_train import TrainConfig
    from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter
    from eagle3kit.model.target import Target, resolve_parts, target_features, teacher_argmax
    from eagle3kit.train.batches import Sample, make_batch
    from eagle3kit.train.chain_step import train_step

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--tiny", action="store_true", help="4 layers, few tokens (a smoke run)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_precision.json"))
    args = ap.parse_args()
    from common import expected_time

    expected_time(
        "step_precision",
        "not timed as a whole (on one H200 its timed steps ran at 48K-108K tokens/s, seconds a path, "
        "results/step_precision.json; model build and compilation not timed)",
    )
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layers = 4 if args.tiny else 30
    cfg = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with dev:
        model = LlamaForCausalLM(cfg).eval()
    model.requires_grad_(False)
    target = Target(model=model, tokenizer=None, parts=resolve_parts(model), source={})
    V, vd, S, T, B = cfg.vocab_size, args.draft_vocab, args.ttt, args.seq, args.rows
    aux_ids = (2, layers // 2, layers - 3)
    draft_ids = torch.arange(vd, device=dev) * (V // vd)
    t2d = torch.zeros(V, dtype=torch.bool, device=dev)
    t2d[draft_ids] = True
    with torch.no_grad():
        target.parts.lm_head.weight[~t2d] *= 0.01
    g = torch.Generator().manual_seed(100)
    ids = torch.randint(0, V, (B, T), generator=g).to(dev)
    with torch.no_grad():
        aux, last = target_features(target, ids, None, aux_ids)
        argmax = teacher_argmax(target, last.reshape(-1, cfg.hidden_size), chunk=4096).view(B, T)
    samples = [
        Sample(ids[i], torch.ones(T, dtype=torch.bool, device=dev), aux[i], last[i], argmax[i])
        for i in range(B)
    ]
    batch = make_batch(samples, list(range(B)), S, dev)
    tc = TrainConfig(ttt_steps=S, step_weight=0.8, grad_clip=0.5)

    def new_drafter():
        torch.manual_seed(1)
        d = Eagle3Drafter(DrafterConfig.from_target(cfg, vd, aux_ids, vocab_size=V)).to(dev)
        d.d2t.copy_(draft_ids - torch.arange(vd, device=dev))
        d.t2d.copy_(t2d)
        return d

    def first_step(speed: dict) -> tuple[float, torch.Tensor]:
        d = new_drafter()
        opt = torch.optim.SGD(d.parameters(), lr=0.0)
        loss, _ = train_step(d, opt, target, batch, draft_ids, tc, speed)
        return float(loss.detach()), torch.cat(
            [p.grad.flatten() for p in d.parameters() if p.grad is not None]
        )

    ref_loss, ref_grad = first_step(PATHS["fp32"])
    rows = []
    for name in args.paths.split(","):
        speed = PATHS[name]
        if speed["attention"] == "flex" and dev.type != "cuda":
            continue
        loss, grad = first_step(speed)
        d = new_drafter()
        opt = torch.optim.AdamW(d.parameters(), lr=1e-4, fused=dev.type == "cuda")
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t_wall = time.perf_counter()
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
            train_step(d, opt, target, batch, draft_ids, tc, speed)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        end = time.perf_counter()
        tokens = B * T
        rows.append(
            {
                "path": name,
                **speed,
                "tokens_per_s_steady": round(tokens * args.steps / (end - t0)),
                "tokens_per_s_wall": round(tokens * (args.warmup + args.steps) / (end - t_wall)),
                "peak_gb": round(torch.cuda.max_memory_allocated(dev) / 1e9, 2)
                if dev.type == "cuda"
                else None,
                "loss_rel_diff_vs_fp32": abs(loss - ref_loss) / abs(ref_loss),
                "grad_rel_diff_vs_fp32": float((grad - ref_grad).norm() / ref_grad.norm()),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    out = {
        "benchmark": "benchmarks/step_precision.py",
        "machine": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "target": f"SmolLM2-135M shape, random fp32, {layers} layers",
        "tokens_per_step": B * T,
        "ttt_steps": S,
        "draft_vocab": vd,
        "rows": rows,
    }
    if not args.tiny:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    from rich.console import Console
    from rich.table import Table

    table = Table(title="train step by path (cached features, one process)")
    for col in ("path", "tokens/s steady", "tokens/s wall", "peak GB", "loss Δ vs fp32", "grad Δ vs fp32"):
        table.add_column(col, justify="left" if col == "path" else "right")
    for r in rows:
        table.add_row(
            r["path"],
            str(r["tokens_per_s_steady"]),
            str(r["tokens_per_s_wall"]),
            str(r["peak_gb"]),
            f"{r['loss_rel_diff_vs_fp32']:.1e}",
            f"{r['grad_rel_diff_vs_fp32']:.1e}",
        )
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
