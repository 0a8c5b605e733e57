"""The feature-store format that ``extract`` writes and ``train --features`` reads.

A features folder holds ``index.json`` and shards ``shard-NNNNN.safetensors``. Per token, a shard
holds the three aux states (HF indices, docs/conventions.md, layer ids) and what the teacher needs:

=============  ===============================================  =========================
option         stored per token                                 bytes per token
=============  ===============================================  =========================
bf16 (default) aux [3, Ht] bf16 + last [Ht] bf16 (post-norm)    8·Ht (the baseline)
fp32           aux [3, Ht] fp32 + last [Ht] fp32 (post-norm)    16·Ht (a float32 engine's
                                                                exact states)
fp8            aux [3, Ht] + last [Ht] float8 e4m3, one fp32     4·Ht + 16
               scale per token and state (amax / 448)
topk:K         aux as above + the target's K largest logits     aux + K·(2 + 2 or 4) + 1
               over the draft vocabulary (bf16 values, int16/
               int32 draft ids) + whether the target's top-1 is
               in the draft vocabulary (bool)
=============  ===============================================  =========================

Shards hold whole samples, ``offsets`` [S+1] int64 marking them. Each shard's metadata names
the samples it holds (``first_sample``, ``samples``), the hash of the inputs it was made from
(``inputs_sha256``, the index's ``inputs``) and the hash of its samples' token ids
(``tokens_sha256``), so a shard copied in from another run, a damaged file or a shard whose
index entry was edited is found by name before anything trains on it. ``index.json`` lists the
finished shards in order; their samples are contiguous from 0.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from eagle3kit.core.config import ConfigError
from eagle3kit.core.rundir import DataError, read_json, sha256_json
from eagle3kit.model.target import teacher_argmax
from eagle3kit.train.state_checks import FP8_REPEAT_TOLERANCE, state_problem

FP8_MAX = 448.0  # largest finite float8 e4m3fn value


SHARD_NAME = re.compile(r"shard-\d{5}\.safetensors")


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row float8 e4m3 quantization: x [..., D] → (q float8_e4m3fn [..., D], scale float32 [...])
    with x ≈ q · scale, scale = amax(|x|) / 448 per row (rows of zeros get scale 1).
    ``x`` must be finite (``extract`` checks before packing)."""
    amax = x.float().abs().amax(-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x.float() / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8` in ``dtype``."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def bytes_per_token(hidden: int, dtype: str, topk: int | None, draft_vocab_size: int) -> int:
    """Bytes a token takes in a shard for these options (the table in the module docstring)."""
    state = {"bf16": hidden * 2, "fp32": hidden * 4}.get(dtype, hidden + 4)
    teacher = state if topk is None else topk * (2 + (2 if draft_vocab_size <= 32767 else 4)) + 1
    return 3 * state + teacher


class ShardEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    file: str
    first_sample: int = Field(ge=0)
    samples: int = Field(ge=1)
    tokens: int = Field(ge=0)


class IndexFile(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    inputs: dict
    shards: list[ShardEntry]


def read_index(folder: Path) -> dict | None:
    """``folder/index.json`` validated (None when absent).

    Raises:
        DataError: not JSON, wrong structure, a shard name other than ``shard-NNNNN.safetensors``
        (no paths), or samples that are not contiguous from 0 — naming the entry and the fix.
    """
    path = folder / "index.json"
    if not path.is_file():
        return None
    fix = f"move {folder} away (or delete it) and rerun `eagle3kit extract --out {folder}`"
    raw = read_json(path)
    try:
        index = IndexFile.model_validate(raw).model_dump()
    except ValidationError as e:
        first = e.errors()[0]
        raise DataError(
            f"{path} is not an eagle3kit feature index ({'.'.join(map(str, first['loc']))}: "
            f"{first['msg']}); {fix}"
        ) from None
    at = 0
    for k, s in enumerate(index["shards"]):
        if not SHARD_NAME.fullmatch(s["file"]):
            raise DataError(
                f"{path}: shard entry {k} names {s['file']!r}, not a shard-NNNNN.safetensors file of this "
                f"folder; {fix}"
            )
        if s["first_sample"] != at:
            raise DataError(
                f"{path}: shard entry {k} ({s['file']}) starts at sample {s['first_sample']}, the entries "
                f"before it end at {at}; {fix}"
            )
        at += s["samples"]
    return index


def tokens_digest(rows: list) -> str:
    """SHA-256 of the token ids of consecutive samples (``rows``: (ids, mask) pairs or ids)."""
    h = hashlib.sha256()
    for r in rows:
        ids = r[0] if isinstance(r, tuple) else r
        h.update(ids.to(torch.int64).contiguous().numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()


def shard_metadata(first: int, rows: list, inputs: dict) -> dict[str, str]:
    """What a shard records about itself (module docstring)."""
    return {
        "first_sample": str(first),
        "samples": str(len(rows)),
        "inputs_sha256": sha256_json(inputs),
        "tokens_sha256": tokens_digest(rows),
    }


def shard_problem(folder: Path, entry: dict, inputs: dict, rows: list) -> str | None:
    """Why the shard of index ``entry`` cannot be used for ``rows`` (all of the run's samples), or
    None: missing, unreadable, or its metadata naming other samples, tokens or inputs."""

    path = folder / entry["file"]
    if not path.is_file():
        return "is missing"
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            keys = set(f.keys())
    except (SafetensorError, OSError, ValueError) as e:
        return f"is damaged ({e})"
    first, n = entry["first_sample"], entry["samples"]
    if "offsets" not in keys or "aux" not in keys:
        return "is not a feature shard (no offsets or aux)"
    if meta.get("first_sample") != str(first) or meta.get("samples") != str(n):
        return (
            f"holds samples {meta.get('first_sample')}…+{meta.get('samples')} by its own metadata, the index says "
            f"{first}…+{n}"
        )
    if meta.get("inputs_sha256") != sha256_json(inputs):
        return "was made from other inputs than this folder's index (another run's shard?)"
    if first + n > len(rows) or meta.get("tokens_sha256") != tokens_digest(rows[first : first + n]):
        return "holds other tokens than this run's samples (another run's shard?)"
    return None


def _expect(t: dict, name: str, shape: tuple, dtypes: tuple, path: Path) -> torch.Tensor:
    x = t.get(name)
    if x is None or tuple(x.shape) != shape or x.dtype not in dtypes:
        got = "missing" if x is None else f"{tuple(x.shape)} {x.dtype}"
        raise DataError(
            f"{path}: tensor {name} is {got}, expected {shape} {' or '.join(map(str, dtypes))}; "
            f"rerun `eagle3kit extract` into a new --out"
        )
    return x


def load_features(folder: str | Path, samples: list, expect: dict, target, device) -> dict:
    """Fill ``aux`` and the teacher fields of every :class:`~eagle3kit.train.batches.Sample` from the
    shards in ``folder`` (dequantized to the target's dtype, on ``device``).

    Args:
        samples: every sample of the run's token shard, in order.
        expect: the inputs the training run would use (tokens hash, aux ids, target, vocab).
    Returns:
        The index's ``inputs``.
    Raises:
        ConfigError: the folder does not exist, holds no index, was made from other inputs
            (naming the field) or holds fewer samples than the run.
        DataError: a shard is missing, damaged, from another run, of the wrong shape, or holds
            NaN/inf — naming the shard and the fix.
    Over 80 lines because it is one pass of checks over the feature folder's index and shards, each
    naming the file; not split yet.
    """

    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(
            f"train.features {folder} is not a folder; give the folder `eagle3kit extract` wrote"
        )
    index = read_index(folder)
    if index is None:
        raise ConfigError(f"{folder} holds no index.json: run `eagle3kit extract --out {folder}` first")
    inputs = index["inputs"]
    bad = [
        f"{k}: features {inputs.get(k)!r}, this run {v!r}"
        for k, v in expect.items()
        if inputs.get(k) != v and not (k == "vocab" and k not in inputs)
    ]  # only top-K features depend on the vocab
    if bad:
        raise ConfigError(
            f"{folder} was extracted from other inputs ({'; '.join(bad)}); rerun `eagle3kit extract`"
        )
    have = sum(s["samples"] for s in index["shards"])
    if have != len(samples):
        raise ConfigError(
            f"{folder} holds {have} samples of {len(samples)}: rerun `eagle3kit extract --out {folder}` "
            "to finish it"
        )
    rows = [s.ids for s in samples]
    dt = target.dtype
    H = int(inputs.get("hidden_size") or target.hidden_size)
    topk = inputs.get("teacher", "last") != "last"
    fp8 = inputs.get("dtype") == "fp8"
    state_dtypes = (
        (torch.float8_e4m3fn,)
        if fp8
        else ((torch.float32,) if inputs.get("dtype") == "fp32" else (torch.bfloat16,))
    )
    fix = f"rerun `eagle3kit extract --out {folder}` (it re-extracts bad shards)"
    for s in index["shards"]:
        path = folder / s["file"]
        problem = shard_problem(folder, s, inputs, rows)
        if problem:
            raise DataError(f"{path} {problem}; {fix}")
        try:
            t = load_file(str(path))
        except Exception as e:  # SafetensorError, OSError
            raise DataError(f"{path} is damaged ({e}); {fix}") from None
        n_tok = s["tokens"]
        off = _expect(t, "offsets", (s["samples"] + 1,), (torch.int64,), path).tolist()
        if off[0] != 0 or off[-1] != n_tok or any(b < a for a, b in zip(off, off[1:])):
            raise DataError(f"{path}: offsets do not cover its {n_tok} tokens; {fix}")
        aux_t = _expect(t, "aux", (n_tok, 3, H), state_dtypes, path)
        if topk:
            K = _expect(
                t,
                "topk_values",
                (n_tok, t.get("topk_values", torch.empty(0, 0)).shape[-1]),
                (torch.bfloat16,),
                path,
            ).shape[-1]
            _expect(t, "topk_ids", (n_tok, K), (torch.int16, torch.int32), path)
            _expect(t, "top1_in_draft", (n_tok,), (torch.bool,), path)
        else:
            _expect(t, "last", (n_tok, H), state_dtypes, path)
        if fp8:
            _expect(t, "aux_scale", (n_tok, 3), (torch.float32,), path)
            if not topk:
                _expect(t, "last_scale", (n_tok,), (torch.float32,), path)
        # dequantized once per shard (fp32), checked, then sliced per sample
        aux_all = dequantize_fp8(aux_t, t["aux_scale"], torch.float32) if fp8 else aux_t
        last_all = (
            None
            if topk
            else (dequantize_fp8(t["last"], t["last_scale"], torch.float32) if fp8 else t["last"])
        )
        if not all(bool(torch.isfinite(x).all()) for x in (aux_all, t["topk_values"] if topk else last_all)):
            raise DataError(f"{path} holds NaN or inf values; {fix}")
        for k in range(s["samples"]):
            a, b = off[k], off[k + 1]
            smp = samples[s["first_sample"] + k]
            if b - a != smp.ids.numel():
                raise DataError(
                    f"{path}: sample {s['first_sample'] + k} has {b - a} tokens, the token shard "
                    f"{smp.ids.numel()}; {fix}"
                )
            names = [f"aux layer {i}" for i in inputs.get("aux_layer_ids", [])] or ["aux 0", "aux 1", "aux 2"]
            tol = FP8_REPEAT_TOLERANCE if fp8 else 1e-6
            problem = state_problem(aux_all[a:b], names, tol, smp.ids) or (
                None
                if topk
                else state_problem(last_all[a:b, None], ["the last layer (teacher)"], tol, smp.ids)
            )
            if problem:
                raise DataError(
                    f"{path}: sample {s['first_sample'] + k}: {problem}, which no target computes (a damaged or "
                    f"foreign shard); {fix}"
                )
            smp.aux = aux_all[a:b].to(dt).reshape(b - a, -1).to(device)
            if topk:
                smp.topk_values = t["topk_values"][a:b].float().to(device)
                smp.topk_ids = t["topk_ids"][a:b].long().to(device)
                smp.top1_in_draft = t["top1_in_draft"][a:b].to(device)
                smp.last = smp.argmax = None
            else:
                smp.last = last_all[a:b].to(dt).to(device)
                smp.argmax = teacher_argmax(target, smp.last, where=smp.mask.bool())
    return inputs
