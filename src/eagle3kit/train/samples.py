"""What the trainers of every drafter kind share: the target states of every sample from one target pass
(:func:`compute_features`), the parallel-drafting mask token (:func:`mask_token`) and the settings a run's
resume hashes (:func:`trained_settings`)."""

from __future__ import annotations

import math
import random

import torch

from eagle3kit.core.config import Config, ConfigError
from eagle3kit.core.config_train import DrafterVariantConfig
from eagle3kit.core.kinds import kind_for_config, kind_for_variant
from eagle3kit.core.ui import console, progress
from eagle3kit.model.target import (
    Target,
    target_features,
    teacher_top1_lse,
)
from eagle3kit.train.batches import Sample, _pad, length_batches


class HostStates:
    """Pinned host memory for the target states of ``samples``, one block per field, each sample's
    states a view into it (``train.feature_cache: host``): one allocation instead of one per sample
    (the pinned allocator rounds each to a power of two), copied to the device asynchronously by
    :func:`~eagle3kit.train.batches.make_batch`. Pageable memory where pinning is not possible (no
    CUDA, or the pin fails).

    ``widths``: per field (``aux``, ``last``, ``argmax``, ``lse``) its (width per token or 0 for a
    scalar, dtype)."""

    def __init__(self, samples: list[Sample], widths: dict):
        self.start, n = {}, 0
        for s in samples:
            self.start[id(s)] = n
            n += s.ids.numel()
        pin = torch.cuda.is_available()
        self.blocks = {}
        for name, (width, dtype) in widths.items():
            shape = (n, width) if width else (n,)
            try:
                self.blocks[name] = torch.empty(shape, dtype=dtype, pin_memory=pin)
            except RuntimeError:  # pinning refused (a container's locked-memory limit): pageable
                self.blocks[name] = torch.empty(shape, dtype=dtype)
        self.pinned = pin and all(b.is_pinned() for b in self.blocks.values())

    def put(self, sample: Sample, name: str, value: torch.Tensor) -> torch.Tensor:
        """Copy ``value`` [T, ...] into ``sample``'s rows of the ``name`` block; returns the view."""
        a = self.start[id(sample)]
        view = self.blocks[name][a : a + value.shape[0]]
        view.copy_(value)
        return view


@torch.no_grad()
def compute_features(
    target: Target,
    samples: list[Sample],
    aux_ids,
    tokens_per_batch: int,
    device,
    store_device,
    label: str = "target features",
    lse: bool = False,
) -> None:
    """Fill ``aux``, ``last`` and ``argmax`` of every sample with one target pass (in place); with
    ``lse`` also the full-vocabulary log-normaliser at completion tokens (the LK losses').

    ``store_device``: where the states are kept — a device, or ``"host"`` for one pinned host block
    per field (:class:`HostStates`)."""
    store = None
    if store_device == "host":
        dt, ht, n = target.dtype, target.hidden_size, len(aux_ids)
        widths = {"aux": (n * ht, dt), "last": (ht, dt), "argmax": (0, torch.long)}
        store = HostStates(samples, widths | ({"lse": (0, torch.float32)} if lse else {}))

    def keep(s: Sample, name: str, value: torch.Tensor) -> torch.Tensor:
        return store.put(s, name, value) if store is not None else value.to(store_device)

    batches = length_batches([s.ids.numel() for s in samples], tokens_per_batch, False, random.Random(0))
    with progress() as bar:
        task = bar.add_task(label, total=len(samples), tokens=0, note="")
        done_tokens = 0
        for b in batches:
            ids = _pad([samples[i].ids for i in b]).to(device)
            am = _pad([torch.ones_like(samples[i].ids) for i in b]).to(device)
            aux, last = target_features(target, ids, am, aux_ids)
            lengths = [samples[i].ids.numel() for i in b]
            # the full-vocabulary top-1 of the batch's completion tokens (the only ones training reads) in
            # one pass (right padding: row j's first n_j are real), not one small product per sample
            completion = torch.cat([samples[i].mask.bool() for i in b])
            top1, norm = teacher_top1_lse(target, last[am.bool()], where=completion)
            top1, norm = top1.split(lengths), norm.split(lengths)
            for j, (i, n) in enumerate(zip(b, lengths)):
                s = samples[i]
                s.aux, s.last = keep(s, "aux", aux[j, :n]), keep(s, "last", last[j, :n])
                s.argmax = keep(s, "argmax", top1[j])
                s.lse = keep(s, "lse", norm[j]) if lse else None
                done_tokens += n
            bar.update(task, advance=len(b), tokens=done_tokens)


def mask_token(samples: list, tokenizer, vocab_size: int, configured: int | None, ends=()) -> int:
    """The mask token of parallel drafting (P-EAGLE's slots, a block drafter's block): a token the drafter must
    never confuse with text. ``configured`` when it never occurs in ``samples`` (their token ids); else a
    reserved token, as published block drafters take one: the first special or added token of ``tokenizer``
    that the samples never use and that is not its end, begin, padding or unknown token nor one of ``ends``
    (the target's end-of-turn ids: Llama 3 ends turns with <|end_of_text|> and <|eot_id|>) (SmolLM2:
    ``<repo_name>``, id 3). Only a tokenizer with none such falls back to the smallest ordinary id the
    samples never use — text the target may still write (an ordinary id missing from a small training
    set, such as SmolLM2's "!", is one it emits), so that choice is printed.

    Raises:
        ConfigError: ``configured`` occurs in the training data (how often, and what it is), or every
            id occurs (none is left)."""
    counts = torch.bincount(torch.cat([s.ids.reshape(-1) for s in samples]), minlength=vocab_size)
    if configured is not None:
        n = int(counts[configured]) if configured < counts.numel() else 0
        if n:
            raise ConfigError(
                f"drafter.mask_token_id {configured} ({tokenizer.convert_ids_to_tokens(configured)!r}) occurs "
                f"{n} times in the training data: the mask slots would read as that text; leave it unset (an "
                "id the data never uses is picked) or name such an id"
            )
        return configured
    special = set(getattr(tokenizer, "all_special_ids", []) or []) | {
        int(i) for i in getattr(tokenizer, "added_tokens_decoder", {}) or {}
    }
    roles = {getattr(tokenizer, f"{r}_token_id", None) for r in ("eos", "bos", "pad", "unk")} | set(ends)
    reserved = [i for i in sorted(special) if i < vocab_size and i not in roles and not int(counts[i])]
    if reserved:
        return reserved[0]
    free = [i for i in (counts[:vocab_size] == 0).nonzero().flatten().tolist() if i not in special]
    if not free:
        raise ConfigError("every token id occurs in the training data: name drafter.mask_token_id")
    console.print(
        f"[yellow]mask token: {free[0]} ({tokenizer.convert_ids_to_tokens(free[0])!r}), an ordinary id the training "
        "data never uses (the tokenizer has no free reserved token); the target may still write it: name an id "
        "it never writes as drafter.mask_token_id"
    )
    return free[0]


# settings left out of the train-config hash: logistics that do not change what is trained, and
# inputs hashed on their own (the features' and the init drafter's content, not their paths)
_LOGISTICS = {
    "checkpoint_every",
    "tensorboard",
    "wandb_project",
    "features",
    "init_from",
    "parallel",
    "compile",
    "loss_chunk",
    "attention",
    "precision",
    "device",
    "serve_engine",
    "online_from",  # hashed on its own: the producing engine's version and model
    "online_buffer_bytes",
    "online_inflight",
    "online_timeout_s",
    "memory_limit_gib",
    "patience",  # when to stop, not what an epoch trains: a run given another patience resumes where it was
}


# train settings added after runs existed, with the default that leaves what is trained as it was
_LATER = {
    "loss": "kl",
    "lk_kl_scale": 1.0,
    "lk_kl_decay": 1.0,
    "online_transport": "file",
    "shuffle": "batches",
    "accumulate": 1,
}


def trained_settings(cfg: Config) -> dict:
    """The settings that change what is trained, as ``train`` hashes them into a resume's inputs:
    the ``train`` section less :data:`_LOGISTICS`, and the ``drafter`` section. Settings added after
    runs existed (the ``drafter`` section, :data:`_LATER`) count only when they train otherwise than
    those runs did (for the drafter: any flag of plain EAGLE-3's set otherwise, whatever the preset's
    name), so a run made before them resumes when its config says ``drafter: {variant: eagle3}``."""
    out = {
        k: v
        for k, v in cfg.train.model_dump(mode="json", exclude=_LOGISTICS).items()
        if k not in _LATER or v != _LATER[k]
    }
    # where the states live does not change what is trained (the memory plan may move them between runs):
    # hashed as the true every run before it named places had, so those runs resume
    out["feature_cache"] = True
    default = DrafterVariantConfig()
    if kind_for_config(cfg) is not kind_for_variant(default.variant) or cfg.drafter.model_dump(
        exclude={"variant"}
    ) != default.model_dump(exclude={"variant"}):
        out["drafter"] = cfg.drafter.model_dump(mode="json")
    return out


def warmup_cosine(total_steps: int, warmup_ratio: float):
    """The learning-rate factor by optimizer step: linear warm-up over ``ceil(warmup_ratio · total)``
    steps (at least 1), then a cosine from 1 to 0 over the rest (for ``LambdaLR``)."""
    warmup = max(1, math.ceil(warmup_ratio * total_steps))

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total_steps - warmup))))

    return lr_at
