"""Drafter kinds: what a stage asks of a drafter kind, and the registry that finds a kind by name,
by a run's config or by an exported folder.

A kind (the EAGLE-3 family, DFlash) is one package under ``eagle3kit/drafters/``: its network, its
objective and trainer, the folder layouts it writes and reads, its ``check`` rules, its ``evaluate``
simulation and its ``diagnose`` faults. A stage never names a kind: it asks the registry for one
(:func:`kind_for_config`, :func:`kind_for_folder`, :func:`kind_for_checkpoint`) and calls the methods
of :class:`DrafterKind`. The kinds' packages sit above the stages and import them; the stages reach a
kind only through :data:`KINDS` (module paths, imported on first use), so imports still run downward.

Adding a kind: a package under ``drafters/`` whose ``kind.py`` defines ``KIND`` (a :class:`DrafterKind`)
and whose ``settings.py`` (pydantic only, read while a config loads: :func:`kind_settings`) defines
``VARIANTS`` and ``SETTINGS`` (its keys of the ``drafter`` section, or None; a ``check_config(cfg)``
method on it checks the other sections); and one line in :data:`KINDS`.
"""

from __future__ import annotations

import importlib
import json
from abc import ABC, abstractmethod
from functools import cache
from pathlib import Path
from typing import Any

from eagle3kit.core.config_base import ConfigError

#: kind name → the module holding its ``KIND``; asked in this order for a folder or checkpoint (the
#: EAGLE-3 family last: it reads every other layout an engine or a peer writes, naming what it cannot)
KINDS: dict[str, str] = {
    "dflash": "eagle3kit.drafters.dflash.kind",
    "dspark": "eagle3kit.drafters.dspark.kind",
    "eagle3": "eagle3kit.drafters.eagle3.kind",
}


class DrafterKind(ABC):
    """One drafter kind, as the stages use it. ``variants``: the ``drafter.variant`` values it trains
    (None: a ``drafter`` section that names no variant);
    ``aux_count``: how many target states its drafter reads (None: any number); ``whole_vocab``: it
    predicts over the target's whole vocabulary (no draft vocabulary, no d2t/t2d).

    The methods take and return the stages' own objects (``Config``, ``RunDir``, ``Target``,
    ``Finding``, ``AcceptanceStats``); their contracts are the stage functions that call them."""

    name: str
    title: str  # the kind's name in messages ("DFlash")
    variants: tuple[str, ...]
    aux_count: int | None = 3
    whole_vocab: bool = False
    #: checkpoint files an earlier trainer of this kind kept instead of ``train_state.pt`` → why they
    #: cannot be resumed (the loop sets them aside and says so)
    stale_checkpoint_files: dict[str, str] = {}

    # --- config and inputs -------------------------------------------------------------------------
    def default_aux_layer_ids(self, drafter_cfg, num_layers: int) -> list[int] | None:
        """The target states (HF ``output_hidden_states`` indices) the drafter reads when
        ``target.aux_layer_ids`` is unset; None: the target's default three."""
        return None

    # --- stages ------------------------------------------------------------------------------------
    @abstractmethod
    def owns_folder(self, config: dict) -> bool:
        """Whether an exported folder whose ``config.json`` is ``config`` holds this kind's drafter."""

    @abstractmethod
    def owns_checkpoint(self, path: Path) -> bool:
        """Whether the safetensors checkpoint at ``path`` was written by this kind's trainer."""

    @abstractmethod
    def read_checkpoint(self, src: Path, target_cfg) -> tuple[Any, dict]:
        """``(drafter, provenance)`` of a checkpoint of :meth:`train` (or, for a kind that imports
        others' folders, of a drafter folder); the provenance holds ``checkpoint_sha256`` when known."""

    @abstractmethod
    def write_folder(
        self, drafter, out: Path, prov: dict, fmt: str, verifier, overwrite: bool, k: int
    ) -> dict:
        """Write the drafter's serving folder ``out`` in format ``fmt`` (``dual`` or ``speculators``,
        naming ``verifier``; ``k``: the draft length it will be served at); returns what the export
        report adds about it. Raises FileExistsError: another drafter in ``out`` and not ``overwrite``."""

    @abstractmethod
    def check(self, folder: Path, target, engine: str, engine_version, max_model_len, k) -> list:
        """``check``'s findings for the folder (its files exist) beside ``target`` (a ``TargetConfig``)."""

    @abstractmethod
    def evaluate(
        self, cfg, run, target, folder: Path, given: bool, mode: str, k: int, only_sets, section
    ) -> dict:
        """Stage ``evaluate`` (:func:`eagle3kit.eval.evaluate.run_evaluate`) of the drafter in ``folder``."""

    # --- training: the one loop (eagle3kit.train.stage) calls these -----------------------------
    #: the epoch record's name for the accuracy of the first drafted position
    first_accuracy = "step0_accuracy"
    #: how the epoch lines print it
    first_accuracy_label = "step-0 acc"
    #: the export formats it writes (``dual``: its engines' own layout; ``speculators``)
    formats: tuple[str, ...] = ("dual", "speculators")

    def check_training(self, cfg, world_size: int) -> None:
        """Refuse a ``train`` config this kind cannot train on ``world_size`` processes (ConfigError
        naming the key and the fix), before anything is loaded."""

    def check_features(self, cfg, features: dict) -> None:
        """Refuse stored features (``train.features``; ``features`` is their index, with ``teacher``)
        that this kind's objective cannot train from (ConfigError naming the fix)."""

    @abstractmethod
    def speed(self, tc, device, draft_vocab: int) -> dict:
        """The step's settings: ``{"attention", "bf16", "tf32", "loss_chunk", "compile"}``."""

    @abstractmethod
    def shaped(self, cfg, target, vocab, aux_ids) -> tuple[int, Any]:
        """``(parameters, shape)`` of the drafter ``build`` would make: its parameter count, and the
        memory plan's ``DrafterShape`` (None: its activations are not estimated)."""

    @abstractmethod
    def build(self, cfg, target, vocab, aux_ids, samples):
        """A freshly initialised drafter (seeded by ``train.seed``) for the target and its states."""

    @abstractmethod
    def loss(self, model, target, samples, micro, speed: dict, cfg, draft_ids, seed: int):
        """The objective on one micro-batch ``micro`` (sample indices into ``samples``, or packed rows of
        them; states filled), forward only: the training loop runs backward, accumulation over
        micro-batches and processes, clipping and the optimizer step
        (:func:`eagle3kit.train.optimizer_step.optimizer_step`). ``seed``: the step's, the same on
        every process and on a resume; a random draw for a sample depends on it and on the sample's
        index only, so the loss does not depend on which process or micro-batch holds the sample.

        Returns ``(loss, weight, stats)``: the micro-batch's loss (a mean), ``weight`` (float, what the
        mean is over; the step's objective is Σ loss · weight ÷ Σ weight over every micro-batch of
        every process), stats: ``n`` and ``acc`` (lists, first drafted position first), ``tokens``
        (the micro-batch's real tokens) and optionally ``log`` (more fields for the log record)."""

    @abstractmethod
    def validate(self, drafter, target, samples, k: int, device):
        """Simulated greedy acceptance (``AcceptanceStats``) on validation samples (states filled)."""

    @abstractmethod
    def save_checkpoint(self, drafter, path: Path, meta: dict, state: dict) -> None:
        """Write the drafter's weights ``state`` (whole) to ``path`` atomically with ``meta`` and what
        :meth:`read_checkpoint` needs to rebuild it."""

    @abstractmethod
    def report(self, cfg, drafter) -> dict:
        """The ``train`` report's fields about this drafter (``drafter_variant`` and its shape)."""

    # --- diagnose ----------------------------------------------------------------------------------
    @abstractmethod
    def load(self, folder: Path, target_cfg, target, device):
        """The drafter of ``folder`` loaded strictly and checked against the loaded ``target``."""

    @abstractmethod
    def aux_ids(self, drafter) -> list[int]:
        """The target states the drafter reads (HF ``output_hidden_states`` indices)."""

    def max_draft(self, drafter) -> int | None:
        """The most tokens the drafter drafts in one step (None: no limit)."""
        return None

    def draft_vocab_mask(self, drafter):
        """``t2d`` (bool [vocab]) when the drafter drafts from a smaller draft vocabulary, else None."""
        return None

    later_positions_hint = "more TTT steps (train.ttt_steps) train the later positions"

    @abstractmethod
    def faults(self, drafter, tokenizer, folder: Path, other_vocab: list[str] | None) -> list:
        """The engine faults ``diagnose`` simulates for this drafter (each with ``name``, ``what``,
        ``fix``, ``aux_shift``)."""

    @abstractmethod
    def applicable(self, fault, drafter, num_layers: int) -> str | None:
        """None when ``fault`` can be simulated on a target of ``num_layers`` layers, else why not."""

    @abstractmethod
    def planted(self, fault, drafter) -> tuple[Any, list[int], dict]:
        """``(drafter, aux ids, engine)``: what the engine with ``fault`` runs — a drafter (a planted
        copy or the drafter itself), the target states it reads, and :meth:`simulate`'s ``engine``."""

    @abstractmethod
    def simulate(self, drafter, target, ids, mask, first: int, aux, k: int, device, engine: dict):
        """Greedy acceptance (``AcceptanceStats``) of ``drafter`` on one sequence ``ids`` [T] whose
        reply starts at ``first`` (``mask`` [T], 1 on the reply), reading ``aux`` [T, n·Ht], at ``k``
        draft tokens a step, run as an engine with ``engine`` (from :meth:`planted`) would."""


class KindError(ValueError):
    """No registered kind answers (a ``drafter.variant`` or a folder no kind owns)."""


@cache
def kind_named(name: str) -> DrafterKind:
    """The registered kind ``name``.

    Raises:
        KindError: no kind of that name (names the registered ones)."""
    if name not in KINDS:
        raise KindError(f"no drafter kind {name!r}; registered: {', '.join(KINDS)}")
    return importlib.import_module(KINDS[name]).KIND


def all_kinds() -> list[DrafterKind]:
    """Every registered kind, in :data:`KINDS` order."""
    return [kind_named(n) for n in KINDS]


def kind_for_variant(variant: str | None) -> DrafterKind:
    """The kind that trains ``drafter.variant`` (None: the default EAGLE-3 section as written).

    Raises:
        KindError: no kind trains that variant (names every variant that is trained)."""
    return kind_named(_kind_name(variant))


@cache
def kind_settings_modules() -> dict[str, Any]:
    """Each registered kind's ``settings`` module (beside its ``kind`` module), by kind name: light
    modules the config reads while it loads, without importing the kinds themselves."""
    return {
        name: importlib.import_module(path.rsplit(".", 1)[0] + ".settings") for name, path in KINDS.items()
    }


def kind_settings(variant: str | None):
    """The ``settings`` module of the kind that trains ``drafter.variant`` (see :data:`KINDS`).

    Raises:
        KindError: no kind trains that variant (names every variant that is trained)."""
    return kind_settings_modules()[_kind_name(variant)]


def _kind_name(variant: str | None) -> str:
    """The registered kind whose ``settings.VARIANTS`` holds ``variant``. Raises KindError."""
    mods = kind_settings_modules()
    for name, mod in mods.items():
        if variant in mod.VARIANTS:
            return name
    known = [v for m in mods.values() for v in m.VARIANTS if v is not None]
    raise KindError(f"drafter.variant {variant!r} is no drafter eagle3kit trains; one of: {', '.join(known)}")


def variants_reading(key: str) -> list[str]:
    """The ``drafter.variant`` values whose kind's settings have ``key`` (for a message naming them)."""
    return [
        v
        for m in kind_settings_modules().values()
        if m.SETTINGS is not None and key in m.SETTINGS.model_fields
        for v in m.VARIANTS
    ]


def kind_for_config(cfg) -> DrafterKind:
    """The kind of a run's config (its ``drafter.variant``)."""
    return kind_for_variant(cfg.drafter.variant)


def kind_for_folder(folder: str | Path) -> DrafterKind:
    """The kind whose layout ``folder``'s ``config.json`` is (the last kind when none reads or claims it)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    kinds = all_kinds()
    if isinstance(config, dict):
        for k in kinds:
            if k.owns_folder(config):
                return k
    return kinds[-1]


def check_run_kind(found: DrafterKind, variant: str | None, what: str | Path) -> None:
    """Refuse a run's own drafter (its checkpoint or export, ``what``) of another kind than the config's
    ``drafter.variant`` trains: exporting or evaluating it under that config would report the other kind's
    drafter as this config's.

    Raises:
        ConfigError: naming both kinds and the two fixes."""
    want = kind_for_variant(variant)
    if found.name != want.name:
        raise ConfigError(
            f"{what} holds a drafter of kind {found.title}, but the config's drafter.variant "
            f"{variant or 'eagle3'} trains {want.title}: run `eagle3kit train` with this config first, or use "
            "the config that drafter was trained with (or name the folder or checkpoint explicitly)"
        )


def kind_for_checkpoint(path: str | Path) -> DrafterKind:
    """The kind whose trainer wrote the checkpoint at ``path`` (the last kind when none claims it)."""
    kinds = all_kinds()
    for k in kinds[:-1]:
        if k.owns_checkpoint(Path(path)):
            return k
    return kinds[-1]
