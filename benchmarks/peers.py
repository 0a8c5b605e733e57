"""How fast does eagle3kit train an EAGLE-3 drafter against SpecForge 0.2.0's offline trainer, on
the same cached features, the same batch and the same target shape, in one run?

A random target of the chosen shape (``--shape``: ``8b`` Llama-3.1-8B, bf16, draft vocabulary
32,000, 8 × 2048 tokens a step; ``1b`` Llama-3.2-1B; ``smollm2`` SmolLM2-135M, draft vocabulary
8,192, 16 × 512) computes the aux states and the last state of ``--samples`` random sequences
once. They are written once, in SpecForge's offline ``.ckpt`` format
(``benchmarks/peers/specforge_adapter.py``), with the target's embedding and lm_head; every
trainer then runs as its own process on those files, the same samples in batches of the same
size for the same number of epochs, TTT 7, plain EAGLE-3, learning rate 3e-4, gradient clip 0.5:

* ``specforge``: ``python -m specforge.cli train`` (its defaults otherwise: flex attention, bf16
  draft with fp32 master weights, FSDP NO_SHARD on one GPU); steady tokens/s from its own log
  (``perf/global_samples_per_second`` × the sample length, the log records after its first,
  which holds the compilation);
* ``eagle3kit:PATH``: eagle3kit's ``train_step`` on the same files (read with
  ``torch.load(weights_only=True)``, the top-1 taken once at load as ``train`` caches it) under
  ``PATH``: ``auto`` (what ``train`` picks on this GPU: ``resolve_speed``), or one of
  :data:`PATHS`; steady tokens/s over the steps after the first three.

Wall tokens/s is every trained token over the process's whole life (start-up, loading,
compilation included). Peak memory is the GPU's used memory (``nvidia-smi``) above what it was
before the process started. Prints one table and merges rows into ``benchmarks/results/peers.json``
(``rows``: ``tool``, ``shape``, ``mode``, ``path``, ``tokens_per_s_steady``, ``tokens_per_s_wall``,
``peak_gb``); online rows come from ``benchmarks/train_throughput.py`` (``--online``).

    python benchmarks/peers.py --shape 8b [--tools specforge,eagle3kit:auto] [--epochs 5]
    python benchmarks/peers.py --shape smollm2 --tools eagle3kit:auto,eagle3kit:bf16-flex-c4096
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

SHAPES = {
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rope_theta=500000.0,
        tied=False,
        draft_vocab=32000,
        batch=8,
        seq=2048,
        dtype="bfloat16",
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        rope_theta=500000.0,
        tied=True,
        draft_vocab=32000,
        batch=8,
        seq=2048,
        dtype="bfloat16",
    ),
    "tiny": dict(  # a smoke run of the script (CPU: eagle3kit only)
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        rope_theta=10000.0,
        tied=True,
        draft_vocab=128,
        batch=2,
        seq=32,
        dtype="float32",
    ),
    "smollm2": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        rope_theta=100000.0,
        tied=True,
        draft_vocab=8192,
        batch=16,
        seq=512,
        dtype="float32",
    ),
}
# eagle3kit paths: train.attention / precision / loss_chunk
PATHS = {  # name: train's speed settings (``compile``: the drafter layer's torch.compile)
    f"{prec}-{att}-c{chunk}{'-nc' if not comp else ''}": {
        "attention": "flex" if att == "flex" else "reference",
        "bf16": prec == "bf16",
        "tf32": prec == "tf32",
        "loss_chunk": chunk,
        "compile": comp,
    }
    for prec in ("bf16", "tf32")
    for att in ("flex", "ref")
    for chunk in (0, 4096, 8192, 16384)
    for comp in (True, False)
}
TTT, LR, CLIP = 7, 3e-4, 0.5
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def llama_config(shape: dict):
    from transformers import LlamaConfig

    keys = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
    )
    return LlamaConfig(
        **{k: shape[k] for k in keys},
        max_position_embeddings=8192,
        rope_parameters={"rope_theta": shape["rope_theta"], "rope_type": "default"},
        tie_word_embeddings=shape["tied"],
        architectures=["LlamaForCausalLM"],
    )


def draft_ids_of(shape: dict) -> torch.Tensor:
    """A spread-out draft vocabulary (the same ids for both tools)."""
    V, vd = shape["vocab_size"], shape["draft_vocab"]
    return torch.arange(vd) * (V // vd)


def prepare(shape_name: str, work: Path, n: int) -> dict:
    """The random target (its out-of-draft lm_head rows scaled by 0.01, so every position is
    supervised), ``n`` random sequences' features in SpecForge's format, the target folder."""
    from peers import specforge_adapter as sfa
    from transformers import LlamaForCausalLM

    from eagle3kit.model.target import Target, resolve_parts, target_features
    from eagle3kit.train.batches import Sample

    shape = SHAPES[shape_name]
    cfg = llama_config(shape)
    dev = DEV
    torch.manual_seed(0)
    dtype = getattr(torch, shape["dtype"])
    torch.set_default_dtype(dtype)
    with dev:
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    model.requires_grad_(False)
    target = Target(model=model, tokenizer=None, parts=resolve_parts(model), source={})
    draft_ids = draft_ids_of(shape).to(dev)
    with torch.no_grad():
        keep = torch.zeros(cfg.vocab_size, dtype=torch.bool, device=dev)
        keep[draft_ids] = True
        target.parts.lm_head.weight[~keep] *= 0.01
    N = cfg.num_hidden_layers
    aux_ids = (2, N // 2, N - 3)
    g = torch.Generator().manual_seed(100)
    samples = []
    B, T = shape["batch"], shape["seq"]
    for a in range(0, n, B):
        ids = torch.randint(0, cfg.vocab_size, (min(B, n - a), T), generator=g)
        with torch.no_grad():
            aux, last = target_features(target, ids.to(dev), None, aux_ids)
        for i in range(ids.shape[0]):
            samples.append(
                Sample(
                    ids[i], torch.ones(T, dtype=torch.bool), aux[i].bfloat16().cpu(), last[i].bfloat16().cpu()
                )
            )
    vocab_size = cfg.vocab_size
    d2t = draft_ids.cpu() - torch.arange(shape["draft_vocab"])
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids.cpu()] = True
    plan = sfa.prepare_run(
        samples,
        work / "specforge",
        target_config=cfg,
        embed_weight=target.parts.embed.weight.bfloat16(),
        lm_head_weight=None if shape["tied"] else target.parts.lm_head.weight.bfloat16(),
        d2t=d2t,
        t2d=t2d,
        aux_layer_ids=aux_ids,
        pythonpath=os.environ.get("SPECFORGE_PATH") or str(ROOT / ".venv" / "peers"),
        overwrite=True,
        num_epochs=1,
        learning_rate=LR,
        ttt_length=TTT,
        batch_size=B,
        accumulation_steps=1,
        max_length=T,
        seed=0,
        log_interval=5,
        attention_backend="flex_attention" if DEV.type == "cuda" else "sdpa",
    )
    del model, target, samples
    if DEV.type == "cuda":
        torch.cuda.empty_cache()
    return {"plan": plan, "aux_ids": list(aux_ids), "config": cfg.to_dict()}


class MemoryWatch:
    """The GPU's used memory (nvidia-smi, every 0.25 s) while a child runs: peak above the start."""

    def __init__(self) -> None:
        self.base = self.used()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    @staticmethod
    def used() -> float:
        if DEV.type != "cuda":
            return 0.0
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
        ).stdout
        return float(out.split()[0]) / 1024 if out.strip() else 0.0

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            self.peak = max(self.peak, self.used())

    def stop(self) -> float:
        self._stop.set()
        self._t.join()
        return round(self.peak - self.base, 1)


def run_specforge(prep: dict, work: Path, epochs: int, T: int) -> dict:
    """SpecForge's trainer on the prepared folder for ``epochs`` epochs; its log's step rate."""
    from peers import specforge_adapter as sfa

    plan = prep["plan"]
    argv = plan["argv"] + [f"training.num_epochs={epochs}"]
    log = work / "specforge.log"
    watch = MemoryWatch()
    t = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.run(
            argv, env={**os.environ, **plan["env"]}, stdout=fh, stderr=subprocess.STDOUT
        ).returncode
    wall = time.perf_counter() - t
    peak = watch.stop()
    text = log.read_text(errors="replace")
    if rc:
        raise SystemExit(f"SpecForge exited with {rc}; the end of {log}:\n{text[-3000:]}")
    try:
        rate, windows = sfa.steady_samples_per_s(text)
    except ValueError as e:
        raise SystemExit(f"{e}: {log}") from None
    steady = rate * T
    recs = sfa.log_records(text)
    samples = prep["plan"]["manifest"]["samples"] * epochs
    return {
        "tokens_per_s_steady": round(steady),
        "tokens_per_s_wall": round(samples * T / wall),
        "peak_gb": peak,
        "seconds": round(wall, 1),
        "steps_logged": windows + 1,
        "final_loss": recs[-1].get("loss"),
    }


def run_eagle3kit(prep_path: Path, path: str, epochs: int, out: Path) -> dict:
    """This script as a child process training eagle3kit on the prepared folder under ``path``."""
    watch = MemoryWatch()
    t = time.perf_counter()
    rc = subprocess.run(
        [
            sys.executable,
            __file__,
            "--worker",
            str(prep_path),
            "--path",
            path,
            "--epochs",
            str(epochs),
            "--worker-out",
            str(out),
        ],
    ).returncode
    wall = time.perf_counter() - t
    peak = watch.stop()
    if rc:
        raise SystemExit(f"eagle3kit worker ({path}) exited with {rc}")
    got = json.loads(out.read_text())
    got["tokens_per_s_wall"] = round(got["tokens"] / wall)
    got["peak_gb"] = peak
    got["seconds"] = round(wall, 1)
    return got


def worker(prep_path: Path, path: str, epochs: int, out: Path) -> None:
    """eagle3kit's train_step over the prepared samples (the child process of :func:`run_eagle3kit`)."""
    from peers import specforge_adapter as sfa
    from safetensors.torch import load_file
    from torch import nn
    from transformers import LlamaConfig

    from eagle3kit.core.config_train import TrainConfig
    from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter
    from eagle3kit.model.target import Target, TargetParts, teacher_argmax
    from eagle3kit.train.batches import Sample, make_batch
    from eagle3kit.train.chain_step import resolve_speed, train_step
    from eagle3kit.train.stage import WARM_STEPS

    prep = json.loads(prep_path.read_text())
    cfg = LlamaConfig(**prep["config"])
    dev = DEV
    plan = prep["plan"]
    w = load_file(str(Path(plan["target"]) / "model.safetensors"), device=str(dev))
    emb = nn.Embedding.from_pretrained(w[sfa.EMBED_KEY], freeze=True)
    head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=dev, dtype=w[sfa.LM_HEAD_KEY].dtype)
    head.weight = nn.Parameter(w[sfa.LM_HEAD_KEY], requires_grad=False)
    parts = TargetParts(
        decoder=None, layers=nn.ModuleList(), embed=emb, final_norm=nn.Identity(), lm_head=head
    )
    target = Target(model=None, tokenizer=None, parts=parts, source={})
    shape = SHAPES[prep["shape"]]
    files = sorted(Path(plan["features"]).rglob("*.ckpt"))
    samples = []
    for f in files:
        d = torch.load(f, weights_only=True, mmap=True)
        last = d["hidden_state"].squeeze(0)
        pin = (lambda x: x.pin_memory()) if dev.type == "cuda" else (lambda x: x.clone())  # noqa: E731
        s = Sample(
            d["input_ids"],
            torch.ones_like(d["input_ids"], dtype=torch.bool),
            pin(d["aux_hidden_state"].squeeze(0)),
            pin(last),
        )
        with torch.no_grad():
            s.argmax = teacher_argmax(target, last.to(dev), chunk=4096).cpu()
        samples.append(s)
    vd = shape["draft_vocab"]
    draft_ids = draft_ids_of(shape).to(dev)
    B, T = shape["batch"], shape["seq"]
    tc = TrainConfig(ttt_steps=TTT, step_weight=0.8, grad_clip=CLIP, tokens_per_step=B * T)
    speed = resolve_speed(tc, dev, vd) if path == "auto" else PATHS[path]
    torch.manual_seed(1)
    drafter = Eagle3Drafter(
        DrafterConfig.from_target(cfg, vd, tuple(prep["aux_ids"]), vocab_size=cfg.vocab_size)
    ).to(dev)
    if speed.get("compile"):
        drafter.compile_layer()
    drafter.d2t.copy_(draft_ids - torch.arange(vd, device=dev))
    drafter.t2d.zero_()
    drafter.t2d[draft_ids] = True
    opt = torch.optim.AdamW(drafter.parameters(), lr=LR, betas=(0.9, 0.95), fused=dev.type == "cuda")
    steps = [list(range(a, a + B)) for a in range(0, len(samples) - B + 1, B)] * epochs
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    tokens, t0, losses = 0, None, []
    for i, idx in enumerate(steps):
        if i == WARM_STEPS:
            sync()
            t0 = time.perf_counter()
        batch = make_batch(samples, idx, TTT, dev)
        loss, st = train_step(drafter, opt, target, batch, draft_ids, tc, speed)
        losses.append(round(float(loss.detach()), 4))
        tokens += B * T
    sync()
    steady = (len(steps) - WARM_STEPS) * B * T / (time.perf_counter() - t0)
    prof_out = os.environ.get("PEERS_PROFILE")
    if prof_out and dev.type == "cuda":  # two more steps under the profiler: where the time goes
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for idx in steps[:2]:
                train_step(drafter, opt, target, make_batch(samples, idx, TTT, dev), draft_ids, tc, speed)
            sync()
        Path(prof_out).write_text(
            prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=60)
        )
    out.write_text(
        json.dumps(
            {
                "speed": speed,
                "tokens": tokens,
                "steps": len(steps),
                "tokens_per_s_steady": round(steady),
                "torch_peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1)
                if dev.type == "cuda"
                else None,
                "final_loss": losses[-1],
                "first_losses": losses[:3],
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(SHAPES), default="8b")
    ap.add_argument("--tools", default="specforge,eagle3kit:auto")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--work", default="/tmp/peers")
    ap.add_argument("--online", help="benchmarks/train_throughput.py's JSON: add its 8b online row")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "peers.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(Path(args.worker), args.path, args.epochs, Path(args.worker_out))
    from common import expected_time

    expected_time(
        f"peers --shape {args.shape}",
        {
            "8b": "not timed as a whole; on one H200 at --epochs 4 SpecForge's process took 134 s and each "
            "eagle3kit path 62-77 s (results/peers.json, run E), after the features are computed (not timed)",
            "smollm2": "not timed as a whole; on one H200 at --samples 256 --epochs 3 SpecForge's process took "
            "62 s and eagle3kit:auto 47 s (results/peers.json, run F), after the features (not timed)",
        }.get(args.shape, "not timed yet"),
    )
    from eagle3kit.core.ui import print_table

    out = Path(args.out)
    res = json.loads(out.read_text()) if out.exists() else {"rows": []}
    work = Path(args.work) / args.shape
    work.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.shape]
    prep = prepare(args.shape, work, args.samples)
    prep["shape"] = args.shape
    prep_path = work / "prep.json"
    prep_path.write_text(json.dumps(prep, default=str))
    new = []
    for tool in args.tools.split(","):
        name, _, path = tool.partition(":")
        try:
            if name == "specforge":
                got = run_specforge(prep, work, args.epochs, shape["seq"])
            else:
                got = run_eagle3kit(prep_path, path or "auto", args.epochs, work / f"e3k-{path}.json")
        except SystemExit as e:  # one tool's failure is a row, not the end of the run
            got = {"error": str(e)[-2000:]}
        row = {
            "tool": name,
            "shape": args.shape,
            "mode": "cached",
            "path": path or None,
            **got,
            "batch": shape["batch"],
            "seq": shape["seq"],
            "ttt_steps": TTT,
            "draft_vocab": shape["draft_vocab"],
            "samples": args.samples,
            "epochs": args.epochs,
        }
        print(json.dumps(row), flush=True)
        new.append(row)
    if args.online:
        tt = json.loads(Path(args.online).read_text())
        fast = next(r for r in tt["runs"] if r["path"] == "fast")
        new.append(
            {
                "tool": "eagle3kit",
                "shape": "8b",
                "mode": "online",
                "path": "auto",
                "tokens_per_s_steady": round(fast["tokens_per_s"]),
                "tokens_per_s_wall": round(fast.get("tokens_per_s_wall", 0)) or None,
                "peak_gb": fast["peak_memory_gb"],
                "mfu": tt["mfu"],
            }
        )
    keys = {(r["tool"], r["shape"], r["mode"], r.get("path")) for r in new}
    res["rows"] = [
        r for r in res["rows"] if (r["tool"], r["shape"], r["mode"], r.get("path")) not in keys
    ] + new
    res["machine"] = torch.cuda.get_device_name(0) if DEV.type == "cuda" else "cpu"
    res["torch"] = torch.__version__
    sf = {r["shape"]: r for r in res["rows"] if r["tool"] == "specforge" and "tokens_per_s_steady" in r}
    for r in res["rows"]:
        base = sf.get(r["shape"])
        if r["tool"] == "eagle3kit" and r["mode"] == "cached" and base and "tokens_per_s_steady" in r:
            r["vs_specforge_steady"] = round(r["tokens_per_s_steady"] / base["tokens_per_s_steady"], 3)
            r["vs_specforge_wall"] = round(r["tokens_per_s_wall"] / base["tokens_per_s_wall"], 3)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print_table(
        f"peers: tokens/s (steady / wall), peak GB — {res['machine']}",
        [
            (
                f"{r['tool']}{':' + r['path'] if r.get('path') else ''} {r['shape']} {r['mode']}",
                r.get("error", "")[:80]
                or f"{r.get('tokens_per_s_steady')} / {r.get('tokens_per_s_wall')}, {r.get('peak_gb')} GB"
                + (
                    f", ×{r['vs_specforge_steady']} / ×{r['vs_specforge_wall']} SpecForge"
                    if "vs_specforge_steady" in r
                    else ""
                ),
            )
            for r in res["rows"]
        ],
    )


if __name__ == "__main__":
    main()
