"""Stage ``vocab``: the reduced draft vocabulary and its maps (DESIGN.md §1, §5).

The draft vocabulary is the ``draft_vocab_size`` target ids most frequent over loss-masked
positions (ties broken by the smaller id), end-of-turn (and think) tokens always kept, sorted
ascending. When fewer distinct ids occur than the size asks for, the smallest unused ids pad it
(deterministic, unique) and a warning says how many entries never occur (C18).

Maps, in the engines' convention (EAGLE-3 reference code, vLLM ``llama_eagle3.py``):

* ``d2t`` int64 [Vd]: **offsets**, target id = draft id + ``d2t[draft id]``;
* ``t2d`` bool [V]: True where a target id is in the draft vocabulary.

When ``draft_vocab_size == V`` no maps are written (the full vocabulary, C19).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .config import Config, ConfigError
from .lineage import check_inputs
from .rundir import DataError, RunDir, require_free, sha256_tensors, write_safetensors


@dataclass
class DraftVocab:
    """``ids``: int64 [Vd] target ids, ascending; ``vocab_size``: target V."""

    ids: torch.Tensor
    vocab_size: int

    @property
    def size(self) -> int:
        return int(self.ids.numel())

    @property
    def is_full(self) -> bool:
        return self.size == self.vocab_size

    @property
    def d2t(self) -> torch.Tensor:
        """int64 [Vd] offsets: ``ids - arange(Vd)``."""
        return self.ids - torch.arange(self.size, dtype=torch.int64)

    @property
    def t2d(self) -> torch.Tensor:
        """bool [V]."""
        m = torch.zeros(self.vocab_size, dtype=torch.bool)
        m[self.ids] = True
        return m

    @classmethod
    def from_maps(cls, d2t: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int) -> "DraftVocab":
        """Rebuild from stored maps, checking the invariants (:func:`check_maps`)."""
        check_maps(d2t, t2d, vocab_size)
        return cls(ids=torch.arange(d2t.numel(), dtype=torch.int64) + d2t.long(), vocab_size=vocab_size)

    @classmethod
    def full(cls, vocab_size: int) -> "DraftVocab":
        return cls(ids=torch.arange(vocab_size, dtype=torch.int64), vocab_size=vocab_size)


def check_maps(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int) -> None:
    """The invariants of DESIGN.md §5: ``arange(Vd) + d2t`` strictly increasing, inside [0, V),
    and equal to ``t2d.nonzero()``; ``t2d`` has V entries.

    Raises:
        DataError: naming the violated invariant (for example a ``d2t`` holding ids, not offsets).
    """
    tid = torch.arange(d2t.numel(), dtype=torch.int64) + d2t.long()
    if tid.numel() and (tid.min() < 0 or tid.max() >= vocab_size):
        raise DataError(f"d2t maps outside [0, {vocab_size}): target ids {tid.min().item()}..{tid.max().item()}; "
                        "d2t must hold offsets (target id = draft id + d2t[draft id]), not ids")
    if tid.numel() > 1 and not bool((tid[1:] > tid[:-1]).all()):
        raise DataError("arange(Vd) + d2t is not strictly increasing; the draft vocabulary must be sorted ascending")
    if t2d is not None:
        if t2d.numel() != vocab_size:
            raise DataError(f"t2d has {t2d.numel()} entries but the target vocabulary has {vocab_size}")
        nz = t2d.nonzero().flatten()
        if nz.numel() == d2t.numel() and torch.equal(nz, d2t.long()) and bool(d2t.any()):
            raise DataError("d2t holds the target ids themselves, not offsets (target id = draft id + d2t[draft id]); "
                            "store d2t = ids − arange(Vd)")
        if nz.numel() != tid.numel() or not torch.equal(nz, tid):
            raise DataError(f"t2d marks {nz.numel()} ids but d2t maps {tid.numel()}, or they differ; rebuild the vocab")


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
        ConfigError: Vd outside [1, V] (C20).
    """
    V = int(token_counts.numel())
    if not isinstance(draft_vocab_size, int) or isinstance(draft_vocab_size, bool) or not 1 <= draft_vocab_size <= V:
        raise ConfigError(f"vocab.draft_vocab_size must be an integer in [1, {V}] (the target vocabulary), got {draft_vocab_size!r}")
    counts = token_counts.to(torch.int64).clone()
    keep = sorted({int(i) for i in always_keep if 0 <= int(i) < V})
    if len(keep) > draft_vocab_size:
        raise ConfigError(f"vocab.draft_vocab_size {draft_vocab_size} cannot hold the {len(keep)} always-kept tokens {keep}")
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
        warnings.warn(f"draft vocabulary of {draft_vocab_size}: {never_seen} entries never occur in the training data "
                      f"(padded with the smallest unused ids); a smaller vocab.draft_vocab_size would do", stacklevel=2)
    ids = torch.tensor(sorted(chosen), dtype=torch.int64)
    total = int(counts.sum())
    covered = int(counts[ids].sum())
    never_seen = int((counts[ids] == 0).sum())
    stats = {"coverage": round(covered / total, 6) if total else 0.0, "distinct_ids": int((counts > 0).sum()),
             "never_seen_entries": never_seen, "draft_vocab_size": draft_vocab_size, "target_vocab_size": V}
    return DraftVocab(ids=ids, vocab_size=V), stats


def save_vocab(path, vocab: DraftVocab, meta: dict) -> None:
    """``vocab.safetensors``: ``d2t`` int64 [Vd], ``t2d`` bool [V] (also for a full vocabulary, for
    uniformity inside the run directory; export omits them then)."""
    write_safetensors(path, {"d2t": vocab.d2t, "t2d": vocab.t2d}, {k: str(v) for k, v in meta.items()})


def load_vocab(path, expected_size: int | None = None) -> tuple[DraftVocab, dict]:
    """Read ``vocab.safetensors`` and check its invariants; with ``expected_size``, refuse a file
    built for another ``draft_vocab_size`` (C21), naming both numbers."""
    from safetensors import safe_open

    from .rundir import load_safetensors

    d = load_safetensors(path, "rerun `eagle3kit vocab`")
    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata() or {})
    if "d2t" not in d or "t2d" not in d:
        raise DataError(f"{path}: missing d2t/t2d; rerun `eagle3kit vocab`")
    V = d["t2d"].numel()
    try:
        vocab = DraftVocab.from_maps(d["d2t"], d["t2d"], V)
    except DataError as e:
        raise DataError(f"{path}: {e}; rerun `eagle3kit vocab`") from None
    if expected_size is not None and int(d["t2d"].sum()) != expected_size:
        raise ConfigError(
            f"vocab.draft_vocab_size is {expected_size} but {path} has {int(d['t2d'].sum())} entries in t2d "
            f"(d2t length {d['d2t'].numel()}); rerun `eagle3kit vocab` or fix the config"
        )
    return vocab, meta


def run_vocab(cfg: Config, run: RunDir, tokenizer=None) -> dict:
    """Count supervised tokens in ``tokens.safetensors`` and write ``vocab.safetensors``."""
    from .target import load_tokenizer, model_vocab_size, tokenizer_hash
    from .tokenize import load_shard

    shard_path = run.require("tokens.safetensors", "tokenize")
    consumed = check_inputs(run, "vocab", ["tokens.safetensors"])
    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg.target)
    V = model_vocab_size(cfg.target, tok)       # t2d has one entry per id the target can emit
    require_free(run.path, 8 * cfg.vocab.draft_vocab_size + V + (1 << 16), "vocab.safetensors")
    counts = torch.zeros(V, dtype=torch.int64)
    for ids, mask in load_shard(shard_path):
        sel = ids[mask]
        if sel.numel() and int(sel.max()) >= V:
            raise DataError(f"{shard_path}: token id {int(sel.max())} ≥ the target's vocabulary size {V}; the shard is "
                            "from another tokenizer")
        counts += torch.bincount(sel, minlength=V)
    keep = [int(tok.eos_token_id)] if tok.eos_token_id is not None else []
    for marker in ("<think>", "</think>"):
        tid = tok.convert_tokens_to_ids(marker)
        if isinstance(tid, int) and tid != tok.unk_token_id and tid is not None:
            keep.append(tid)
    with warnings.catch_warnings(record=True) as said:      # a console line for the user, not a Python warning
        warnings.simplefilter("always")
        vocab, stats = build_draft_vocab(counts, cfg.vocab.draft_vocab_size, keep)
    if said:
        from .ui import console

        for w in said:
            console.print(f"[yellow]vocab: {w.message}")
    meta = {"data_sha256": consumed["tokens.safetensors"], "tokenizer_sha256": tokenizer_hash(tok), "draft_vocab_size": vocab.size}
    out = run / "vocab.safetensors"
    save_vocab(out, vocab, meta)
    vocab_sha = sha256_tensors(out)
    run.record_stage("vocab", meta, stats, {"vocab.safetensors": vocab_sha}, consumed=consumed)
    run.update_manifest(draft_vocab_sha256=vocab_sha)
    return stats
