"""The draft vocabulary and its maps (docs/conventions.md): the one convention every stage and engine
shares.

* ``d2t`` int64 [Vd]: **offsets**, target id = draft id + ``d2t[draft id]`` (EAGLE-3 reference
  code, vLLM ``llama_eagle3.py``, SGLang ``llama_eagle3.py``);
* ``t2d`` bool [V]: True where a target id is in the draft vocabulary.

The draft ids are sorted ascending, so ``d2t`` is non-decreasing and every target id appears at
most once. :func:`check_maps` refuses maps that break this. The stage that
builds the vocabulary from token counts is :mod:`eagle3kit.data.vocab`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import safe_open

from eagle3kit.core.config import ConfigError
from eagle3kit.core.rundir import DataError, load_safetensors, write_safetensors


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
    """The invariants of the draft vocabulary (docs/conventions.md): ``arange(Vd) + d2t`` strictly
    increasing, inside [0, V), and equal to ``t2d.nonzero()``; ``t2d`` has V entries.

    Raises:
        DataError: naming the violated invariant (for example a ``d2t`` holding ids, not offsets).
    """
    tid = torch.arange(d2t.numel(), dtype=torch.int64) + d2t.long()
    if tid.numel() and (tid.min() < 0 or tid.max() >= vocab_size):
        raise DataError(
            f"d2t maps outside [0, {vocab_size}): target ids {tid.min().item()}..{tid.max().item()}; "
            "d2t must hold offsets (target id = draft id + d2t[draft id]), not ids"
        )
    if tid.numel() > 1 and not bool((tid[1:] > tid[:-1]).all()):
        raise DataError(
            "arange(Vd) + d2t is not strictly increasing; the draft vocabulary must be sorted ascending"
        )
    if t2d is not None:
        if t2d.numel() != vocab_size:
            raise DataError(f"t2d has {t2d.numel()} entries but the target vocabulary has {vocab_size}")
        nz = t2d.nonzero().flatten()
        if nz.numel() == d2t.numel() and torch.equal(nz, d2t.long()) and bool(d2t.any()):
            raise DataError(
                "d2t holds the target ids themselves, not offsets (target id = draft id + d2t[draft id]); "
                "store d2t = ids − arange(Vd)"
            )
        if nz.numel() != tid.numel() or not torch.equal(nz, tid):
            raise DataError(
                f"t2d marks {nz.numel()} ids but d2t maps {tid.numel()}, or they differ; rebuild the vocab"
            )


def save_vocab(path, vocab: DraftVocab, meta: dict) -> None:
    """``vocab.safetensors``: ``d2t`` int64 [Vd], ``t2d`` bool [V] (also for a full vocabulary, for
    uniformity inside the run directory; export omits them then)."""
    write_safetensors(path, {"d2t": vocab.d2t, "t2d": vocab.t2d}, {k: str(v) for k, v in meta.items()})


def load_vocab(path, expected_size: int | None = None) -> tuple[DraftVocab, dict]:
    """Read ``vocab.safetensors`` and check its invariants; with ``expected_size``, refuse a file
    built for another ``draft_vocab_size``, naming both numbers."""

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
