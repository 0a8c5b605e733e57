"""Stage ``vocab``: the reduced draft vocabulary and its maps (docs/architecture.md; docs/conventions.md).

The draft vocabulary is the ``draft_vocab_size`` target ids most frequent over loss-masked
positions (ties broken by the smaller id), end-of-turn (and think) tokens always kept, sorted
ascending. When fewer distinct ids occur than the size asks for, the smallest unused ids pad it
(deterministic, unique) and a warning says how many entries never occur.

Maps, in the engines' convention (EAGLE-3 reference code, vLLM ``llama_eagle3.py``):

* ``d2t`` int64 [Vd]: **offsets**, target id = draft id + ``d2t[draft id]``;
* ``t2d`` bool [V]: True where a target id is in the draft vocabulary.

When ``draft_vocab_size == V`` no maps are written (the full vocabulary).
"""

from __future__ import annotations

import warnings

import torch

from eagle3kit.core.config import Config, ConfigError
from eagle3kit.core.kinds import kind_for_config
from eagle3kit.core.lineage import check_inputs
from eagle3kit.core.rundir import DataError, RunDir, require_free, sha256_tensors
from eagle3kit.core.ui import console
from eagle3kit.data.tokenize import load_shard
from eagle3kit.model.draft_vocab import DraftVocab, save_vocab
from eagle3kit.model.target import tokenizer_hash
from eagle3kit.model.target_files import load_tokenizer, model_vocab_size


def build_draft_vocab(
    token_counts: torch.Tensor, draft_vocab_size: int, always_keep: list[int] = ()
) -> tuple[DraftVocab, dict]:
    """Choose the draft vocabulary from supervised-token counts.

    Args:
        token_counts: int64 [V], occurrences of each target id over loss-masked positions.
        draft_vocab_size: Vd, 1 ≤ Vd ≤ V.
        always_keep: ids kept regardless of frequency (end-of-turn, think markers).

    Returns:
        (vocab, stats) with stats ``coverage`` (share of supervised tokens inside the draft
        vocabulary), ``distinct_ids``, ``never_seen_entries``.

    Raises:
        ConfigError: Vd outside [1, V].
    """
    V = int(token_counts.numel())
    if (
        not isinstance(draft_vocab_size, int)
        or isinstance(draft_vocab_size, bool)
        or not 1 <= draft_vocab_size <= V
    ):
        raise ConfigError(
            f"vocab.draft_vocab_size must be an integer in [1, {V}] (the target vocabulary), got {draft_vocab_size!r}"
        )
    counts = token_counts.to(torch.int64).clone()
    keep = sorted({int(i) for i in always_keep if 0 <= int(i) < V})
    if len(keep) > draft_vocab_size:
        raise ConfigError(
            f"vocab.draft_vocab_size {draft_vocab_size} cannot hold the {len(keep)} always-kept tokens {keep}"
        )
    # rank: always-kept first, then by count desc, then id asc (stable sort on ids)
    order = torch.argsort(-counts, stable=True)
    chosen: list[int] = list(keep)
    chosen_set = set(keep)
    for i in order.tolist():
        if len(chosen) >= draft_vocab_size:
            break
        if counts[i] <= 0:
            break
        if i not in chosen_set:
            chosen.append(i)
            chosen_set.add(i)
    never = draft_vocab_size - len(chosen)
    if never > 0:
        pad = (i for i in range(V) if i not in chosen_set)
        for _ in range(never):
            chosen.append(next(pad))
        never_seen = draft_vocab_size - int((counts[torch.tensor(chosen)] > 0).sum())
        warnings.warn(
            f"draft vocabulary of {draft_vocab_size}: {never_seen} entries never occur in the training data "
            f"(padded with the smallest unused ids); a smaller vocab.draft_vocab_size would do",
            stacklevel=2,
        )
    ids = torch.tensor(sorted(chosen), dtype=torch.int64)
    total = int(counts.sum())
    covered = int(counts[ids].sum())
    never_seen = int((counts[ids] == 0).sum())
    stats = {
        "coverage": round(covered / total, 6) if total else 0.0,
        "distinct_ids": int((counts > 0).sum()),
        "never_seen_entries": never_seen,
        "draft_vocab_size": draft_vocab_size,
        "target_vocab_size": V,
    }
    return DraftVocab(ids=ids, vocab_size=V), stats


def run_vocab(cfg: Config, run: RunDir, tokenizer=None) -> dict:
    """Count supervised tokens in ``tokens.safetensors`` and write ``vocab.safetensors``."""

    shard_path = run.require("tokens.safetensors", "tokenize")
    consumed = check_inputs(run, "vocab", ["tokens.safetensors"])
    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg.target)
    V = model_vocab_size(cfg.target, tok)  # t2d has one entry per id the target can emit
    require_free(run.path, 8 * cfg.vocab.draft_vocab_size + V + (1 << 16), "vocab.safetensors")
    counts = torch.zeros(V, dtype=torch.int64)
    for ids, mask in load_shard(shard_path):
        sel = ids[mask]
        if sel.numel() and int(sel.max()) >= V:
            raise DataError(
                f"{shard_path}: token id {int(sel.max())} ≥ the target's vocabulary size {V}; the shard is "
                "from another tokenizer"
            )
        counts += torch.bincount(sel, minlength=V)
    keep = [int(tok.eos_token_id)] if tok.eos_token_id is not None else []
    for marker in ("<think>", "</think>"):
        tid = tok.convert_tokens_to_ids(marker)
        if isinstance(tid, int) and tid != tok.unk_token_id and tid is not None:
            keep.append(tid)
    with warnings.catch_warnings(record=True) as said:  # a console line for the user, not a Python warning
        warnings.simplefilter("always")
        vocab, stats = build_draft_vocab(counts, cfg.vocab.draft_vocab_size, keep)
    kind = kind_for_config(cfg)
    if kind.whole_vocab:
        console.print(
            f"vocab: a {kind.title} drafter predicts over the target's whole vocabulary and does not use this one"
        )
    else:
        for w in said:
            console.print(f"[yellow]vocab: {w.message}")
    meta = {
        "data_sha256": consumed["tokens.safetensors"],
        "tokenizer_sha256": tokenizer_hash(tok),
        "draft_vocab_size": vocab.size,
    }
    out = run / "vocab.safetensors"
    save_vocab(out, vocab, meta)
    vocab_sha = sha256_tensors(out)
    run.record_stage("vocab", meta, stats, {"vocab.safetensors": vocab_sha}, consumed=consumed)
    run.update_manifest(draft_vocab_sha256=vocab_sha)
    return stats
