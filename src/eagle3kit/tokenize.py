"""Stage ``tokenize``: conversations → token shard (``input_ids``, ``loss_mask``).

Per row: prompt ids = the target's chat template over the prompt messages with
``add_generation_prompt=True`` and the row's recorded template flags; completion ids = exactly
the ids the target emitted (``completion_ids``), or, for rows from a source that returned only
text, ``content`` tokenized plus the end-of-turn token. Loss mask = 1 on completion tokens only
(the one-position shift of DESIGN.md §4 is applied in training, not here).

Dropped and counted: empty completions (C25), prompts that reach ``max_length`` (the assistant
turn would start past it, C25), and — with ``tokenize.drop_truncated`` — rows cut at the
generation limit. Kept truncated rows end without an end-of-turn token. Sequences longer than
``max_length`` are cut to it.

Shard (``tokens.safetensors``): ``input_ids`` int32 [total], ``loss_mask`` uint8 [total],
``offsets`` int64 [rows + 1] (row i is ``[offsets[i], offsets[i+1])``).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import Config
from .generate import render_prompt_ids
from .rundir import DataError, RunDir, read_jsonl, sha256_file, sha256_tensors


def build_sample(tokenizer, row: dict, eot_id: int, max_length: int) -> tuple[list[int], list[int], str | None, bool]:
    """One conversation row → (input_ids, loss_mask, drop_reason or None, prompt_mismatch).

    ``prompt_mismatch`` is True when the row carries ``prompt_ids`` that differ from this
    render (the tokenizer or template changed since generation).
    """
    flags = row.get("template_flags") or {}
    prompt = render_prompt_ids(tokenizer, row["messages"], flags)
    mismatch = row.get("prompt_ids") is not None and list(row["prompt_ids"]) != prompt
    if row.get("completion_ids") is not None:
        completion = [int(t) for t in row["completion_ids"]]
    else:
        content = row.get("content") or ""
        completion = tokenizer(content, add_special_tokens=False)["input_ids"] if content else []
        if completion and row.get("finish_reason") != "length":
            completion = completion + [eot_id]
    body = [t for t in completion if t != eot_id]
    if not body or (row.get("content") is not None and not str(row["content"]).strip()):
        return [], [], "empty_completion", mismatch
    if len(prompt) >= max_length - 1:
        return [], [], "prompt_reaches_max_length", mismatch
    ids = (prompt + completion)[:max_length]
    mask = ([0] * len(prompt) + [1] * len(completion))[:max_length]
    return ids, mask, None, mismatch


def untrainable_reason(row: dict) -> str | None:
    """Why a server-generated row must not become a training turn (C02, C04, C06), or None."""
    from .reasoning import UNTRAINABLE_FLAGS

    flags = set(row.get("flags") or [])
    for flag in UNTRAINABLE_FLAGS:
        if flag in flags:
            return flag
    if row.get("reasoning") is not None:
        if row.get("finish_reason") == "length":
            return "truncated_reasoning"
        if row.get("completion_ids") is None:
            return "reasoning_without_token_ids"   # rebuilding the think markers is issue 4
    return None


def save_shard(path: str | Path, samples: list[tuple[list[int], list[int]]], meta: dict | None = None) -> None:
    """Write samples (input_ids, loss_mask) to a safetensors token shard."""
    lengths = [len(s[0]) for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    if samples:
        offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    ids = torch.tensor([t for s in samples for t in s[0]], dtype=torch.int32)
    mask = torch.tensor([t for s in samples for t in s[1]], dtype=torch.uint8)
    save_file({"input_ids": ids, "loss_mask": mask, "offsets": offsets}, str(path),
              metadata={k: str(v) for k, v in (meta or {}).items()})


def load_shard(path: str | Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Read a token shard → list of (input_ids int64 [T], loss_mask bool [T])."""
    from .rundir import load_safetensors

    d = load_safetensors(path, "rerun `eagle3kit tokenize`")
    for k in ("input_ids", "loss_mask", "offsets"):
        if k not in d:
            raise DataError(f"{path}: not a token shard (missing {k}); rerun `eagle3kit tokenize`")
    off = d["offsets"].tolist()
    ids, mask = d["input_ids"].long(), d["loss_mask"].bool()
    return [(ids[off[i]:off[i + 1]], mask[off[i]:off[i + 1]]) for i in range(len(off) - 1)]


def run_tokenize(cfg: Config, run: RunDir, tokenizer=None, eot_id: int | None = None) -> dict:
    """Tokenize ``conversations.jsonl`` into ``tokens.safetensors``; returns stage counts."""
    from .target import load_tokenizer, tokenizer_hash

    src = run.require("conversations.jsonl", "generate")
    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg.target)
    if eot_id is None:
        eot_id = int(tok.eos_token_id)
    counts: Counter = Counter()
    samples = []
    prompts_path = run / "prompts.jsonl"
    current = {r["id"] for _, r in read_jsonl(prompts_path)} if prompts_path.exists() else None
    V = len(tok)
    for n, row in read_jsonl(src):
        counts["rows_in"] += 1
        if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
            raise DataError(f"{src}:{n}: not a conversation row (needs 'messages'); fix or delete that line")
        if current is not None and row.get("id") not in current:
            counts["dropped_not_in_prompts"] += 1   # generated for an earlier prompt set: never trained on
            continue
        unfit = untrainable_reason(row)
        if unfit:
            counts[f"dropped_{unfit}"] += 1
            continue
        bad = [t for t in row.get("completion_ids") or [] if not isinstance(t, int) or not 0 <= t < V]
        if bad:
            raise DataError(f"{src}:{n}: completion_ids holds {bad[:3]} outside the tokenizer's [0, {V}); "
                            "the row comes from another tokenizer or is corrupt")
        if cfg.tokenize.drop_truncated and row.get("finish_reason") == "length":
            counts["dropped_truncated"] += 1
            continue
        ids, mask, reason, mismatch = build_sample(tok, row, eot_id, cfg.tokenize.max_length)
        counts["prompt_render_mismatch"] += mismatch
        if reason:
            counts[f"dropped_{reason}"] += 1
            continue
        counts["truncated_kept"] += row.get("finish_reason") == "length"
        counts["cut_at_max_length"] += len(row.get("prompt_ids") or []) + len(row.get("completion_ids") or []) > len(ids)
        samples.append((ids, mask))
        counts["tokens"] += len(ids)
        counts["supervised_tokens"] += sum(mask)
    counts["rows_kept"] = len(samples)
    counts["truncated_kept_share"] = round(counts["truncated_kept"] / max(len(samples), 1), 4)
    out = run / "tokens.safetensors"
    save_shard(out, samples, {"tokenizer_sha256": tokenizer_hash(tok)})
    res = {k: v for k, v in counts.items()}
    run.record_stage("tokenize", {"conversations.jsonl": sha256_file(src), "tokenizer": tokenizer_hash(tok),
                                  "max_length": cfg.tokenize.max_length}, res, {"tokens.safetensors": sha256_tensors(out)})
    run.update_manifest(tokenizer_sha256=tokenizer_hash(tok))
    return res
