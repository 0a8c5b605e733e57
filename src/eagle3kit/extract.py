"""Stage ``extract``: the target's features for training, computed once and stored as safetensors
shards, so that ``train --features DIR`` never runs the target again.

Per token, a shard holds the three aux states (HF indices, DESIGN.md §3) and what the teacher
needs:

=============  ===============================================  =========================
option         stored per token                                 bytes per token
=============  ===============================================  =========================
bf16 (default) aux [3, Ht] bf16 + last [Ht] bf16 (post-norm)    8·Ht (the baseline)
fp8            aux [3, Ht] + last [Ht] float8 e4m3, one fp32     4·Ht + 16
               scale per token and state (amax / 448)
topk:K         aux as above + the target's K largest logits     aux + K·(2 + 2 or 4) + 1
               over the draft vocabulary (bf16 values, int16/
               int32 draft ids) + whether the target's top-1 is
               in the draft vocabulary (bool)
=============  ===============================================  =========================

Shards (``shard-NNNNN.safetensors``) hold whole samples, ``offsets`` [S+1] int64 marking them;
``index.json`` lists the finished shards and the inputs they were made from (token shard, aux
ids, target weights, draft vocabulary, options). Each shard is written to a temporary name and
renamed, then the index is rewritten atomically: after a kill, a rerun skips the finished shards.
Before starting, the projected bytes are compared with the free disk and the stage refuses to
start when they do not fit.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import Config, ConfigError, parse_teacher
from .rundir import RunDir, read_json, sha256_tensors, write_json
from .target import Target, resolve_aux_layer_ids, target_features, teacher_argmax, teacher_logits
from .ui import Timer, console, progress

FP8_MAX = 448.0          # largest finite float8 e4m3fn value


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row float8 e4m3 quantization: x [..., D] → (q float8_e4m3fn [..., D], scale float32 [...])
    with x ≈ q · scale, scale = amax(|x|) / 448 per row (rows of zeros get scale 1)."""
    amax = x.float().abs().amax(-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x.float() / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8` in ``dtype``."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def bytes_per_token(hidden: int, dtype: str, topk: int | None, draft_vocab_size: int) -> int:
    """Bytes a token takes in a shard for these options (the table in the module docstring)."""
    state = hidden * 2 if dtype == "bf16" else hidden + 4
    teacher = state if topk is None else topk * (2 + (2 if draft_vocab_size <= 32767 else 4)) + 1
    return 3 * state + teacher


def _pack(aux: torch.Tensor, last: torch.Tensor, dtype: str, topk: int | None, target: Target,
          draft_ids: torch.Tensor | None, in_draft: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-token tensors of one sample: aux [T, 3·Ht], last [T, Ht] (post-norm) → stored form.
    With ``topk``: ``draft_ids`` int64 [Vd] and ``in_draft`` bool [V] (the draft vocabulary's t2d)."""
    T, H = last.shape
    a = aux.reshape(T, 3, H)
    out: dict[str, torch.Tensor] = {}
    if dtype == "bf16":
        out["aux"] = a.to(torch.bfloat16)
    else:
        out["aux"], out["aux_scale"] = quantize_fp8(a)
    if topk is None:
        if dtype == "bf16":
            out["last"] = last.to(torch.bfloat16)
        else:
            out["last"], out["last_scale"] = quantize_fp8(last)
    else:
        logits = teacher_logits(target, last, draft_ids)                       # fp32 [T, Vd]
        vals, idx = logits.topk(min(topk, logits.shape[-1]), dim=-1)
        out["topk_values"] = vals.to(torch.bfloat16)
        out["topk_ids"] = idx.to(torch.int16 if logits.shape[-1] <= 32767 else torch.int32)
        out["top1_in_draft"] = in_draft[teacher_argmax(target, last).to(in_draft.device)].to(last.device)
    return {k: v.contiguous() for k, v in out.items()}


class ShardBuffer:
    """Host buffers for one shard's per-token tensors, reused from shard to shard.

    ``put`` copies a sample's packed tensors (any device) into the next rows; from a GPU into
    pinned memory, asynchronously, so the next forward runs meanwhile. ``take`` waits for the
    copies and returns views of the rows filled so far; ``reset`` starts the next shard in the
    same memory. Fresh host memory is slow to fill (on the H200 machine 1.1 GB/s against 54 GB/s
    for pinned memory allocated once), so buffers grow (``reserve``) but are never freed early.
    """

    def __init__(self):
        self.bufs: dict[str, torch.Tensor] = {}
        self.n = 0
        self._cap = 0

    def reserve(self, rows: int) -> None:
        """Make room for ``rows`` rows per key (allocated on first ``put`` when keys are unknown)."""
        self._cap = max(self._cap, rows)

    def put(self, item: dict[str, torch.Tensor]) -> None:
        T = next(iter(item.values())).shape[0]
        need = self.n + T
        for k, v in item.items():
            buf = self.bufs.get(k)
            if buf is None or buf.shape[0] < need or buf.dtype != v.dtype or buf.shape[1:] != v.shape[1:]:
                cap = max(need, self._cap, 2 * (buf.shape[0] if buf is not None else 0))
                new = torch.empty((cap, *v.shape[1:]), dtype=v.dtype, pin_memory=v.is_cuda)
                if buf is not None and self.n:
                    if v.is_cuda:
                        torch.cuda.synchronize()
                    new[: self.n].copy_(buf[: self.n])
                self.bufs[k] = new
            self.bufs[k][self.n:need].copy_(v, non_blocking=v.is_cuda)
        self.n = need

    def take(self) -> dict[str, torch.Tensor]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {k: b[: self.n] for k, b in self.bufs.items()}

    def reset(self) -> None:
        self.n = 0


def feature_inputs(tokens_sha256: str, aux_ids, target: Target, vocab_sha256: str | None = None) -> dict:
    """What features are made from, as stored in ``index.json`` and checked by :func:`load_features`:
    the token shard's hash, the aux ids, the target's weights (or its name) and, for top-K
    features, the draft vocabulary's hash."""
    inputs = {"tokens": tokens_sha256, "aux_layer_ids": list(aux_ids),
              "target": target.source.get("weights_fingerprint") or target.source.get("model")}
    if vocab_sha256 is not None:
        inputs["vocab"] = vocab_sha256
    return inputs


def _inputs(cfg: Config, run: RunDir, target: Target, aux_ids, topk: int | None) -> dict:
    vocab = sha256_tensors(run / "vocab.safetensors") if topk is not None else None
    return {**feature_inputs(sha256_tensors(run / "tokens.safetensors"), aux_ids, target, vocab),
            "dtype": cfg.extract.dtype, "teacher": cfg.extract.teacher, "hidden_size": target.hidden_size}


def run_extract(cfg: Config, run: RunDir, target: Target | None = None, out_dir: str | None = None,
                stop_after_shards: int | None = None) -> dict:
    """Extract features for every sample of ``tokens.safetensors`` into ``out_dir`` (default
    ``<run>/features-<dtype>-<teacher>``); resumes after the last finished shard.

    Args:
        stop_after_shards: stop after writing this many new shards (tests use it to emulate a kill).
    Returns:
        ``{"path", "shards", "samples", "tokens", "bytes_per_token", "bytes", "tokens_per_s"}``.
    Raises:
        ConfigError: bad teacher spec, a folder made from other inputs, or not enough free disk
        (both numbers named).
    """
    from .target import load_target, pick_device
    from .tokenize import load_shard
    from .vocab import load_vocab

    ec = cfg.extract
    topk = parse_teacher(ec.teacher)
    rows = load_shard(run.require("tokens.safetensors", "tokenize"))
    if target is None:
        target = load_target(cfg.target, device=pick_device(ec.device))
    aux_ids = resolve_aux_layer_ids(cfg.target, target.num_layers)
    draft_ids = in_draft = None
    if topk is not None:
        vocab, _ = load_vocab(run.require("vocab.safetensors", "vocab"), expected_size=cfg.vocab.draft_vocab_size)
        draft_ids, in_draft = vocab.ids.to(target.device), vocab.t2d.to(target.device)
    tag = f"{ec.dtype}-{ec.teacher.replace(':', '')}"
    out = Path(out_dir or run / f"features-{tag}")
    inputs = _inputs(cfg, run, target, aux_ids, topk)
    index_path = out / "index.json"
    index = read_json(index_path) if index_path.is_file() else None
    if index is not None and index.get("inputs") != inputs:
        changed = sorted(k for k in set(inputs) | set(index.get("inputs", {})) if inputs.get(k) != index["inputs"].get(k))
        raise ConfigError(f"{out} holds features made from other inputs (changed: {', '.join(changed)}); "
                          "give another --out, or move that folder away")
    if index is None:
        if out.exists() and any(out.iterdir()):
            raise ConfigError(f"{out} is not empty and holds no index.json; give another --out")
        index = {"inputs": inputs, "shards": []}
    done = sum(s["samples"] for s in index["shards"])
    lengths = [ids.numel() for ids, _ in rows]
    left_tokens = sum(lengths[done:])
    bpt = bytes_per_token(target.hidden_size, ec.dtype, topk, int(draft_ids.numel()) if draft_ids is not None else 0)
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    need = bpt * left_tokens + 4096 * (1 + left_tokens // max(ec.shard_tokens, 1))
    console.print(f"extract: {len(rows) - done} samples, {left_tokens:,} tokens × {bpt:,} bytes ({ec.dtype}, teacher "
                  f"{ec.teacher}) = {need / 1e9:.3f} GB projected; {free / 1e9:.1f} GB free")
    if need > free:
        raise ConfigError(f"extract needs about {need:,} bytes but {out} has {free:,} free; free disk, choose "
                          "--dtype fp8 or --teacher topk:K, or give another --out")
    timer, new_tokens, new_shards = Timer(), 0, 0
    buf = ShardBuffer()
    with progress() as bar:
        task = bar.add_task("extract", total=len(rows), completed=done, tokens=0, note="")
        i = done
        while i < len(rows):
            j, n = i, 0
            while j < len(rows) and (j == i or n + lengths[j] <= ec.shard_tokens):
                n += lengths[j]
                j += 1
            buf.reset()
            buf.reserve(n)
            for a in range(i, j, max(1, ec.batch_samples)):
                b_rows = rows[a:min(j, a + ec.batch_samples)]
                ids = torch.nn.utils.rnn.pad_sequence([r[0] for r in b_rows], batch_first=True).to(target.device)
                am = torch.nn.utils.rnn.pad_sequence([torch.ones_like(r[0]) for r in b_rows], batch_first=True).to(target.device)
                aux, last = target_features(target, ids, am, aux_ids)
                for k, r in enumerate(b_rows):
                    T = r[0].numel()
                    buf.put(_pack(aux[k, :T], last[k, :T], ec.dtype, topk, target, draft_ids, in_draft))
            shard = dict(buf.take())
            shard["offsets"] = torch.tensor([0] + list(torch.tensor(lengths[i:j]).cumsum(0).tolist()), dtype=torch.int64)
            name = f"shard-{len(index['shards']):05d}.safetensors"
            tmp = out / (name + ".tmp")
            save_file(shard, str(tmp), metadata={"first_sample": str(i)})
            os.replace(tmp, out / name)
            index["shards"].append({"file": name, "first_sample": i, "samples": j - i, "tokens": n})
            write_json(index_path, index)
            new_tokens += n
            new_shards += 1
            bar.update(task, advance=j - i, tokens=new_tokens)
            i = j
            if stop_after_shards is not None and new_shards >= stop_after_shards and i < len(rows):
                break
    total_bytes = sum((out / s["file"]).stat().st_size for s in index["shards"])
    tokens = sum(s["tokens"] for s in index["shards"])
    res = {"path": str(out), "shards": len(index["shards"]), "samples": sum(s["samples"] for s in index["shards"]),
           "tokens": tokens, "bytes_per_token": bpt, "bytes": total_bytes,
           "tokens_per_s": round(new_tokens / timer.seconds, 1) if new_tokens else None}
    if res["samples"] == len(rows):
        run.record_stage(f"extract-{tag}", inputs, res)
    return res


def load_features(folder: str | Path, samples: list, expect: dict, target: Target, device) -> dict:
    """Fill ``aux`` and the teacher fields of every :class:`~eagle3kit.train.Sample` from the
    shards in ``folder`` (dequantized to the target's dtype, on ``device``).

    ``expect`` holds the inputs the training run would use (tokens hash, aux ids, target); a
    mismatch is a ConfigError naming the field. Returns the index's ``inputs``.
    """
    folder = Path(folder)
    index_path = folder / "index.json"
    if not index_path.is_file():
        raise ConfigError(f"{folder} holds no index.json: run `eagle3kit extract` first")
    index = read_json(index_path)
    inputs = index["inputs"]
    bad = [f"{k}: features {inputs.get(k)!r}, this run {v!r}" for k, v in expect.items()
           if inputs.get(k) != v and not (k == "vocab" and k not in inputs)]      # only top-K features depend on the vocab
    if bad:
        raise ConfigError(f"{folder} was extracted from other inputs ({'; '.join(bad)}); rerun `eagle3kit extract`")
    if sum(s["samples"] for s in index["shards"]) != len(samples):
        raise ConfigError(f"{folder} holds {sum(s['samples'] for s in index['shards'])} samples of {len(samples)}: "
                          "rerun `eagle3kit extract` to finish it")
    dt = target.dtype
    for s in index["shards"]:
        t = load_file(str(folder / s["file"]))
        off = t["offsets"].tolist()
        for k in range(s["samples"]):
            a, b = off[k], off[k + 1]
            smp = samples[s["first_sample"] + k]
            if b - a != smp.ids.numel():
                raise ConfigError(f"{folder / s['file']}: sample {s['first_sample'] + k} has {b - a} tokens, the token "
                                  f"shard {smp.ids.numel()}; rerun `eagle3kit extract`")
            aux = t["aux"][a:b] if "aux_scale" not in t else dequantize_fp8(t["aux"][a:b], t["aux_scale"][a:b], dt)
            smp.aux = aux.to(dt).reshape(b - a, -1).to(device)
            if "topk_ids" in t:
                smp.topk_values = t["topk_values"][a:b].float().to(device)
                smp.topk_ids = t["topk_ids"][a:b].long().to(device)
                smp.top1_in_draft = t["top1_in_draft"][a:b].to(device)
                smp.last = smp.argmax = None
            else:
                last = t["last"][a:b] if "last_scale" not in t else dequantize_fp8(t["last"][a:b], t["last_scale"][a:b], dt)
                smp.last = last.to(dt).to(device)
                smp.argmax = teacher_argmax(target, smp.last)
    return inputs
