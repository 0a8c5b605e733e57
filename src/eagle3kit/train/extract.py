"""Stage ``extract``: the target's features for training, computed once and stored as safetensors
shards, so that ``train --features DIR`` never runs the target again. The format (what a token
costs in each option, what a shard records about itself) is :mod:`eagle3kit.train.features`.

Each shard is written to a temporary name and renamed, then the index is rewritten atomically:
after a kill, a rerun skips the finished shards; a rerun also checks every listed shard (present,
readable, made from these inputs and these samples) and re-extracts from the first one that is
not. Before starting, the projected bytes are compared with the free disk and the stage refuses
to start when they do not fit. The folder is locked while a stage writes to it. Hidden states
that are not finite (a float16 target overflowing, say) stop the stage, naming the sample.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3kit.core.config import Config, ConfigError, parse_teacher
from eagle3kit.core.engines import installed_vllm, vllm_install_hint
from eagle3kit.core.lineage import check_inputs
from eagle3kit.core.rundir import DataError, RunDir, folder_lock, sha256_tensors, write_json
from eagle3kit.core.ui import Timer, console, progress
from eagle3kit.data.tokenize import load_shard
from eagle3kit.model.draft_vocab import load_vocab
from eagle3kit.model.target import (
    Target,
    load_target,
    pick_device,
    resolve_aux_layer_ids,
    target_features,
    teacher_argmax,
    teacher_logits,
)
from eagle3kit.model.target_files import weights_fingerprint
from eagle3kit.train.features import (
    bytes_per_token,
    quantize_fp8,
    read_index,
    shard_metadata,
    shard_problem,
)


def pack_sample_states(
    aux: torch.Tensor,
    last: torch.Tensor,
    dtype: str,
    topk: int | None,
    target: Target,
    draft_ids: torch.Tensor | None,
    in_draft: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token tensors of one sample: aux [T, 3·Ht], last [T, Ht] (post-norm) → stored form.
    With ``topk``: ``draft_ids`` int64 [Vd] and ``in_draft`` bool [V] (the draft vocabulary's t2d)."""
    T, H = last.shape
    a = aux.reshape(T, 3, H)
    out: dict[str, torch.Tensor] = {}
    plain = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(dtype)
    if plain is not None:
        out["aux"] = a.to(plain)
    else:
        out["aux"], out["aux_scale"] = quantize_fp8(a)
    if topk is None:
        if plain is not None:
            out["last"] = last.to(plain)
        else:
            out["last"], out["last_scale"] = quantize_fp8(last)
    else:
        logits = teacher_logits(target, last, draft_ids)  # fp32 [T, Vd]
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
            self.bufs[k][self.n : need].copy_(v, non_blocking=v.is_cuda)
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
    inputs = {
        "tokens": tokens_sha256,
        "aux_layer_ids": list(aux_ids),
        "target": target.source.get("weights_fingerprint") or target.source.get("model"),
    }
    if vocab_sha256 is not None:
        inputs["vocab"] = vocab_sha256
    return inputs


def _inputs(cfg: Config, run: RunDir, target: Target, aux_ids, topk: int | None) -> dict:
    vocab = sha256_tensors(run / "vocab.safetensors") if topk is not None else None
    out = {
        **feature_inputs(sha256_tensors(run / "tokens.safetensors"), aux_ids, target, vocab),
        "dtype": cfg.extract.dtype,
        "teacher": cfg.extract.teacher,
        "hidden_size": target.hidden_size,
    }
    if cfg.extract.backend == "vllm":  # untagged = the transformers backend (older folders too)
        version = installed_vllm()
        if version is None:
            raise ConfigError(
                f"extract.backend vllm needs vLLM in this environment: {vllm_install_hint(by_url=False)}; "
                "or use extract.backend transformers"
            )
        out["source"] = f"vllm {version} (extract_hidden_states, eagle3kit.train.vllm_capture)"
        out["engine"] = {
            "name": "vllm",
            "version": version,
            "model": cfg.extract.engine_model or "the target",
            "args": dict(sorted(cfg.extract.engine_args.items())),
        }
    return out


def engine_features(target: Target, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An engine's captured states of one sample → what :func:`~eagle3kit.model.target.target_features`
    gives for it: ``states`` [T, n + 1, Ht] (the n aux states — three for the EAGLE-3 family — then the
    pre-norm output of the last layer, vLLM id N) → aux [T, n·Ht] and last [T, Ht] = ``final_norm(h_N)``,
    on the norm's device and in its dtype. The norm is applied once, here (docs/conventions.md, layer ids)."""
    p = next(target.parts.final_norm.parameters())
    h = states.to(p.device, p.dtype)
    with torch.no_grad():
        return h[:, :-1].reshape(h.shape[0], -1), target.parts.final_norm(h[:, -1])


def _write_shard(out: Path, name: str, shard: dict, metadata: dict) -> None:
    """``shard`` → ``out/name`` through a temporary name (readable by everyone, like index.json).

    Raises:
        DataError: the write failed (disk full, read-only folder), naming the file; finished
        shards stay, and a rerun resumes."""
    tmp = out / (name + ".tmp")
    try:
        save_file(shard, str(tmp), metadata=metadata)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out / name)
    except Exception as e:  # OSError, SafetensorError
        tmp.unlink(missing_ok=True)
        raise DataError(
            f"could not write {out / name} ({e}); free disk or give another --out — the "
            "finished shards are kept and a rerun resumes after them"
        ) from None


def _stale_temporaries(out: Path) -> list[Path]:
    """Partial writes a killed extract left in ``out`` (ours, ``*.safetensors.tmp``, and
    safetensors' own ``.tmp*``)."""
    return [
        p
        for p in out.iterdir()
        if p.is_file() and (p.name.endswith(".safetensors.tmp") or p.name.startswith(".tmp"))
    ]


def run_extract(
    cfg: Config,
    run: RunDir,
    target: Target | None = None,
    out_dir: str | None = None,
    stop_after_shards: int | None = None,
) -> dict:
    """Extract features for every sample of ``tokens.safetensors`` into ``out_dir`` (default
    ``<run>/features-<dtype>-<teacher>``); resumes after the last good shard.

    Args:
        stop_after_shards: stop after writing this many new shards (tests use it to emulate a kill).
    Returns:
        ``{"path", "shards", "samples", "tokens", "bytes_per_token", "bytes", "tokens_per_s"}``.
    Raises:
        ConfigError: bad teacher spec (K above the draft vocabulary too), an ``--out`` that is a
            file, a folder made from other inputs, or not enough free disk (both numbers named).
        DataError: no samples, another extract writing to the same folder, a malformed index,
            non-finite hidden states (naming the sample), a failed write.
    """

    ec = cfg.extract
    topk = parse_teacher(ec.teacher)
    tokens_path = run.require("tokens.safetensors", "tokenize")
    fp = target.source.get("weights_fingerprint") if target is not None else weights_fingerprint(cfg.target)
    check_inputs(
        run,
        "extract",
        ["tokens.safetensors"] + (["vocab.safetensors"] if topk is not None else []),
        target=fp,
    )
    rows = load_shard(tokens_path)
    if not rows:
        raise DataError(
            f"{tokens_path} holds no samples; rerun `eagle3kit tokenize` (see its report for what was dropped)"
        )
    draft_ids = in_draft = None
    if topk is not None:
        vocab, _ = load_vocab(
            run.require("vocab.safetensors", "vocab"), expected_size=cfg.vocab.draft_vocab_size
        )
        if topk > vocab.size:
            raise ConfigError(
                f"extract.teacher topk:{topk} asks for more logits than the draft vocabulary holds "
                f"({vocab.size}); choose K ≤ {vocab.size} (16 is plenty)"
            )
    tag, out, index = _out_folder(cfg, run, out_dir)
    if target is None:
        target = load_target(cfg.target, device=pick_device(ec.device))
    if topk is not None:
        draft_ids, in_draft = vocab.ids.to(target.device), vocab.t2d.to(target.device)
    aux_ids = resolve_aux_layer_ids(cfg.target, target.num_layers, cfg.drafter)
    inputs = _inputs(cfg, run, target, aux_ids, topk)
    _same_inputs(out, index, inputs)
    if ec.backend != "vllm" and (ec.engine_model or ec.engine_args):
        console.print(
            "[yellow]extract: extract.engine_model / engine_args apply to backend vllm only; the "
            "transformers backend ignores them"
        )
    out.mkdir(parents=True, exist_ok=True)
    with folder_lock(out, "extract", "give another --out"):
        index = read_index(out)  # again: another extract may have written it before we held the lock
        _same_inputs(out, index, inputs)
        try:
            teacher = (topk, draft_ids, in_draft)
            return _extract_into(
                out,
                index or {"inputs": inputs, "shards": []},
                rows,
                cfg,
                run,
                target,
                aux_ids,
                teacher,
                tag,
                stop_after_shards,
            )
        finally:
            if _ENGINE:
                _ENGINE.pop().close()


def _same_inputs(out: Path, index: dict | None, inputs: dict) -> None:
    """Refuse a feature folder made from other inputs (naming what changed)."""
    if index is not None and index["inputs"] != inputs:
        changed = sorted(
            k for k in set(inputs) | set(index["inputs"]) if inputs.get(k) != index["inputs"].get(k)
        )
        raise ConfigError(
            f"{out} holds features made from other inputs (changed: {', '.join(changed)}); "
            "give another --out, or move that folder away"
        )


_ENGINE: list = []  # the vLLM capture engine of the running extract (started only when samples are left)


def _capture_engine(cfg: Config, target: Target, aux_ids, rows: list, out: Path):
    """The :class:`~eagle3kit.train.vllm_capture.VLLMCapture` for ``extract.backend: vllm``, started once."""
    if not _ENGINE:
        ec = cfg.extract
        dtype = "auto" if ec.engine_model else cfg.target.dtype
        longest = max(r[0].numel() for r in rows)
        _ENGINE.append(
            start_capture(
                target, aux_ids, longest, out / ".vllm-states", dtype, ec.engine_model, ec.engine_args
            )
        )
    return _ENGINE[0]


def start_capture(
    target: Target,
    aux_ids,
    longest: int,
    store: Path,
    dtype: str,
    engine_model: str | None = None,
    engine_args: dict | None = None,
):
    """An in-process vLLM engine capturing ``aux_ids`` and the last layer (the teacher) of samples
    up to ``longest`` tokens, files in ``store`` (:class:`~eagle3kit.train.vllm_capture.VLLMCapture`;
    ``extract --backend vllm`` and ``diagnose`` share it).

    Raises:
        ConfigError: the engine model is not the target's, or a sample does not fit its context."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM reads it on import
    # deferred: vllm_capture imports vLLM (optional, seconds to import), and only after the line above
    from eagle3kit.train.vllm_capture import VLLMCapture, check_engine_model, engine_model_folder  # noqa: PLC0415 (imports vLLM)

    model = engine_model_folder(target, engine_model)
    limit = check_engine_model(model, target)
    if limit and longest >= limit:
        raise ConfigError(
            f"a sample of {longest} tokens does not fit the engine model's context ({limit} tokens, "
            "one more is generated); drop longer samples (tokenize.max_length) or use the "
            "transformers backend"
        )
    console.print(
        f"starting vLLM on {model} to capture layers {list(aux_ids)} + {target.num_layers} (teacher)"
    )
    return VLLMCapture(model, [*aux_ids, target.num_layers], store, longest + 1, dtype, engine_args)


def _resume_point(out: Path, index: dict, rows: list) -> int:
    """The number of samples already extracted: partial writes of a killed run are removed, and
    the index is cut before the first shard that is not whole or not ours (rewritten).

    Raises:
        DataError: the index lists more samples than the run has."""
    index_path = out / "index.json"
    for stale in _stale_temporaries(out):
        console.print(f"[yellow]extract: removing {stale.name}, a partial write of a killed extract")
        stale.unlink()
    for k, entry in enumerate(index["shards"]):  # resume only after shards that are whole and ours
        problem = shard_problem(out, entry, index["inputs"], rows)
        if problem:
            console.print(
                f"[yellow]extract: {entry['file']} {problem}; re-extracting from sample {entry['first_sample']}"
            )
            index["shards"] = index["shards"][:k]
            write_json(index_path, index)
            break
    done = sum(s["samples"] for s in index["shards"])
    if done > len(rows):
        raise DataError(
            f"{index_path} lists {done} samples but the run has {len(rows)}; move {out} away and rerun"
        )
    return done


def _check_disk(
    cfg: Config, out: Path, index: dict, done: int, left_tokens: int, n_rows: int, bpt: int
) -> None:
    """Say what is left and its projected size (``bpt`` bytes a token plus shard headers).

    Raises:
        ConfigError: the folder's disk has less free space than that (both numbers named)."""
    ec = cfg.extract
    free = shutil.disk_usage(out).free
    need = bpt * left_tokens + 4096 * (1 + left_tokens // max(ec.shard_tokens, 1))
    if done == n_rows:
        console.print(
            f"extract: {out} is complete ({done} samples in {len(index['shards'])} shards); nothing to do"
        )
    console.print(
        f"extract: {n_rows - done} samples, {left_tokens:,} tokens × {bpt:,} bytes ({ec.dtype}, teacher "
        f"{ec.teacher}) = {need / 1e9:.3f} GB projected; {free / 1e9:.1f} GB free"
    )
    if need > free:
        raise ConfigError(
            f"extract needs about {need:,} bytes but {out} has {free:,} free; free disk, choose "
            "--dtype fp8 or --teacher topk:K, or give another --out"
        )


def _batch_states(
    cfg: Config, target: Target, aux_ids, rows: list, out: Path, b_rows: list
) -> tuple[list, torch.Tensor]:
    """One batch's ``(aux [n_i, 3·H], last [n_i, H])`` per sample, from the serving engine or the
    target, and one 0-d bool: all finite (not synchronised here)."""
    if cfg.extract.backend == "vllm":
        states = _capture_engine(cfg, target, aux_ids, rows, out).capture([r[0] for r in b_rows])
        per = [engine_features(target, h) for h in states]
        return per, torch.stack([torch.isfinite(x).all() & torch.isfinite(y).all() for x, y in per]).all()
    ids = torch.nn.utils.rnn.pad_sequence([r[0] for r in b_rows], batch_first=True).to(target.device)
    am = torch.nn.utils.rnn.pad_sequence([torch.ones_like(r[0]) for r in b_rows], batch_first=True).to(
        target.device
    )
    aux, last = target_features(target, ids, am, aux_ids)
    ok = torch.isfinite(aux).all() & torch.isfinite(last).all()
    return [(aux[k, : r[0].numel()], last[k, : r[0].numel()]) for k, r in enumerate(b_rows)], ok


def _out_folder(cfg: Config, run: RunDir, out_dir: str | None) -> tuple[str, Path, dict | None]:
    """``(tag, folder, its index or None)``: ``out_dir`` or ``<run>/features-[vllm-]<dtype>-<teacher>``.

    Raises:
        ConfigError: the folder is a file, or holds other files and no index.json."""
    ec = cfg.extract
    tag = ("vllm-" if ec.backend == "vllm" else "") + f"{ec.dtype}-{ec.teacher.replace(':', '')}"
    out = Path(out_dir or run / f"features-{tag}")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder (new, or one `eagle3kit extract` wrote)")
    index = read_index(out) if out.is_dir() else None
    if (
        index is None
        and out.is_dir()
        and any(p.name not in (".extract.lock", ".vllm-states") for p in out.iterdir())
    ):
        raise ConfigError(f"{out} is not empty and holds no index.json; give another --out")
    return tag, out, index


def _result(out: Path, index: dict, bpt: int, new_tokens: int, seconds: float) -> dict:
    """The stage's report: the folder's shards, samples, tokens and bytes; tokens/s of this call."""
    total_bytes = sum((out / s["file"]).stat().st_size for s in index["shards"])
    tokens = sum(s["tokens"] for s in index["shards"])
    return {
        "path": str(out),
        "shards": len(index["shards"]),
        "samples": sum(s["samples"] for s in index["shards"]),
        "tokens": tokens,
        "bytes_per_token": bpt,
        "bytes": total_bytes,
        "tokens_per_s": round(new_tokens / seconds, 1) if new_tokens else None,
    }


def _extract_into(
    out: Path,
    index: dict,
    rows: list,
    cfg: Config,
    run: RunDir,
    target: Target,
    aux_ids,
    teacher: tuple,
    tag: str,
    stop_after_shards: int | None,
) -> dict:
    """The body of :func:`run_extract`, holding the folder's lock; ``teacher`` is ``(topk,
    draft_ids, in_draft)`` (top-K of the draft vocabulary, or None for the argmax teacher)."""
    topk, draft_ids, in_draft = teacher
    if (out / ".vllm-states").exists():  # a killed vLLM capture's files
        shutil.rmtree(out / ".vllm-states", ignore_errors=True)
    ec = cfg.extract
    engine = ec.backend == "vllm"
    step = max(ec.batch_samples, 32) if engine else max(1, ec.batch_samples)  # samples per forward / capture
    inputs = index["inputs"]
    index_path = out / "index.json"
    done = _resume_point(out, index, rows)
    lengths = [ids.numel() for ids, _ in rows]
    bpt = bytes_per_token(
        target.hidden_size, ec.dtype, topk, int(draft_ids.numel()) if draft_ids is not None else 0
    )
    _check_disk(cfg, out, index, done, sum(lengths[done:]), len(rows), bpt)
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
            finite = []  # one flag per batch, read once the shard is done
            for a in range(i, j, step):
                b_rows = rows[a : min(j, a + step)]
                per, ok = _batch_states(cfg, target, aux_ids, rows, out, b_rows)
                finite.append((a, ok))  # no sync here
                for x, y in per:
                    buf.put(pack_sample_states(x, y, ec.dtype, topk, target, draft_ids, in_draft))
                bar.update(task, advance=len(b_rows), tokens=new_tokens + buf.n)
            bad = [a for a, ok in finite if not bool(ok)]
            if bad:
                raise DataError(
                    f"the {'engine' if engine else 'target'}'s hidden states are not finite (NaN or inf) in "
                    f"samples {bad[0]}…{min(j, bad[0] + step) - 1}; check target.dtype (float16 overflows on "
                    "some models: use bfloat16 or float32); the finished shards are kept"
                )
            shard = dict(buf.take())
            shard["offsets"] = torch.tensor(
                [0] + list(torch.tensor(lengths[i:j]).cumsum(0).tolist()), dtype=torch.int64
            )
            name = f"shard-{len(index['shards']):05d}.safetensors"
            _write_shard(out, name, shard, shard_metadata(i, rows[i:j], inputs))
            index["shards"].append({"file": name, "first_sample": i, "samples": j - i, "tokens": n})
            write_json(index_path, index)
            new_tokens += n
            new_shards += 1
            i = j
            if stop_after_shards is not None and new_shards >= stop_after_shards and i < len(rows):
                break
    res = _result(out, index, bpt, new_tokens, timer.seconds)
    if res["samples"] == len(rows) and (new_tokens or run.stage_inputs(f"extract-{tag}") != inputs):
        run.record_stage(
            f"extract-{tag}", inputs, res
        )  # a rerun with nothing to do keeps the measured record
    return res
