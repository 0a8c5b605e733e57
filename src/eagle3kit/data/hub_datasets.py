"""Prompt sources from Hugging Face ``datasets``: a dataset by a name eagle3kit knows, by hub id, or
saved locally, read row by row as the prompt files are (:func:`eagle3kit.data.sources.read_source`).

The known names follow the hub datasets the peers' recipes train on (speculators' and SpecForge's
data configs name the same ones):

========== ======================================== ========= =========== ==========================
name       hub id                                   subset    split       prompt
========== ======================================== ========= =========== ==========================
sharegpt   Aeala/ShareGPT_Vicuna_unfiltered                   train       ``conversations``
ultrachat  HuggingFaceH4/ultrachat_200k                       train_sft   ``messages``
gsm8k      openai/gsm8k                             main      train       field ``question``
magpie     Magpie-Align/Magpie-Llama-3.1-Pro-300K-Filtered    train       field ``instruction``
========== ======================================== ========= =========== ==========================

A local folder is always read from disk (never from the hub): one written by ``save_to_disk``
(a ``Dataset``, or a ``DatasetDict`` whose ``split`` is taken), else a folder of data files
(JSON, JSONL, CSV, Parquet), which ``load_dataset`` reads.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from eagle3kit.core.config import DATASET_NAMES, PromptSource
from eagle3kit.core.rundir import DataError


@dataclass(frozen=True)
class KnownDataset:
    """A dataset eagle3kit knows by name: where it lies on the hub and where its prompt is."""

    hub_id: str
    subset: str | None
    split: str
    field: str | None = None


KNOWN_DATASETS = {
    "sharegpt": KnownDataset("Aeala/ShareGPT_Vicuna_unfiltered", None, "train"),
    "ultrachat": KnownDataset("HuggingFaceH4/ultrachat_200k", None, "train_sft"),
    "gsm8k": KnownDataset("openai/gsm8k", "main", "train", "question"),
    "magpie": KnownDataset("Magpie-Align/Magpie-Llama-3.1-Pro-300K-Filtered", None, "train", "instruction"),
}
assert tuple(KNOWN_DATASETS) == DATASET_NAMES  # the config's bare names are these


def resolve_dataset(src: PromptSource) -> tuple[str, str | None, str | None, str | None]:
    """``(dataset, subset, split, field)`` to load for ``src``: a known name (``gsm8k``) as its hub id
    with its subset, split and prompt field (each overridden by what ``src`` writes); a local folder
    as given (split and field as written, or None); anything else as a hub id (split default ``train``).

    Raises:
        DataError: ``src.dataset`` is written as a path (``/…``, ``./…``, ``~…``) and nothing is there,
            or is a file (a JSONL file is a ``path:`` source)."""

    known = KNOWN_DATASETS.get(src.dataset.lower())
    if known is not None:
        return known.hub_id, src.subset or known.subset, src.split or known.split, src.field or known.field
    p = Path(src.dataset).expanduser()
    if p.is_file():
        raise DataError(
            f"{src.label}: dataset {src.dataset} is a file; give a prompt file as path: {src.dataset}"
        )
    if p.is_dir():
        return str(p), src.subset, src.split, src.field
    if src.dataset.startswith(("/", ".", "~")):
        raise DataError(
            f"{src.label}: dataset {src.dataset}: no such folder (a local dataset is a folder saved with "
            "datasets' save_to_disk, or a folder of data files)"
        )
    return src.dataset, src.subset, src.split or "train", src.field


def category_key(value) -> str | None:
    """A row's ``category`` as a config names it: None, or text (a number or a list as JSON)."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, default=str)


class DatasetRows:
    """The rows of one dataset split, sliced by the source's ``start``/``stop``, read lazily.

    Iterating yields ``(row number, row dict)`` with 1-based numbers in the whole split (as a
    file's line numbers), so a message names the row. ``categories`` is the set of the split's
    ``category`` values (empty when it has no such column). ``sha256`` (after iterating) hashes
    every row read, in order, as canonical JSON: the source's content in the run's lineage."""

    def __init__(self, ds, start: int | None, stop: int | None):
        self.ds = ds
        self.range = range(len(ds))[slice(start, stop)]
        self._hash = hashlib.sha256()

    @property
    def categories(self) -> set:
        """The split's ``category`` values, each a string (as the config names them), or None."""
        if "category" not in self.ds.column_names:
            return set()
        return {None if c is None else category_key(c) for c in self.ds["category"]}

    def __iter__(self):
        for chunk in range(0, len(self.range), 1024):
            idx = self.range[chunk : chunk + 1024]
            for i, row in zip(idx, self.ds.select(idx)):
                self._hash.update(json.dumps(row, sort_keys=True, default=str).encode() + b"\n")
                yield i + 1, row

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()


def open_dataset(src: PromptSource) -> tuple[DatasetRows, str | None]:
    """The rows of ``src.dataset`` (:class:`DatasetRows`) and the prompt field to read (the known
    name's, or ``src.field``).

    Raises:
        DataError: ``datasets`` could not load it (not on the hub or not reachable, a split or subset
            it does not have), naming the dataset and how to give it from disk instead.
    """
    import datasets

    name, subset, split, field = resolve_dataset(src)
    local = Path(name).is_dir()
    try:
        if local and any((Path(name) / f).is_file() for f in ("state.json", "dataset_dict.json")):
            ds = _from_disk(datasets, name, subset, split, src.label)
        else:
            ds = datasets.load_dataset(name, subset, split=split or "train")
    except DataError:
        raise
    except Exception as e:  # datasets raises many kinds: no such dataset, no network, a bad split
        fix = (
            "check the folder's files"
            if local
            else "check the name, subset and split; on a machine without the hub, save it elsewhere with "
            f"datasets.load_dataset({name!r}{', ' + repr(subset) if subset else ''}).save_to_disk(DIR) and give "
            "dataset: DIR"
        )
        raise DataError(
            f"{src.label}: could not load dataset {name}"
            + (f" ({subset})" if subset else "")
            + f" [{split or 'train'}]: {type(e).__name__}: {str(e)[:200]}; {fix}"
        ) from None
    return DatasetRows(ds, src.start, src.stop), field


def _from_disk(datasets, name: str, subset: str | None, split: str | None, label: str):
    """A ``save_to_disk`` folder's rows: a ``Dataset`` as it is, a ``DatasetDict``'s ``split`` (default
    ``train``). Raises DataError for a subset (a saved dataset has none), a split a ``Dataset`` does
    not have (it has one, unnamed) or a ``DatasetDict`` lacks."""
    if subset is not None:
        raise DataError(
            f"{label}: dataset {name} was saved with save_to_disk and has no subsets: drop subset: {subset}"
        )
    ds = datasets.load_from_disk(name)
    if isinstance(ds, datasets.DatasetDict):
        split = split or "train"
        if split not in ds:
            raise DataError(
                f"dataset {name} has no split {split!r} (it has {', '.join(ds)}); set split: on the source"
            )
        return ds[split]
    if split is not None:
        raise DataError(f"{label}: dataset {name} is one saved split with no name: drop split: {split}")
    return ds
