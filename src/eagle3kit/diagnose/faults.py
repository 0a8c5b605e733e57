"""The engine-integration faults ``diagnose`` can simulate, each one a change to a copy of the
drafter (or to the layers it reads) that reproduces what an engine with that fault computes.

Every fault here was seen in the field (../shared/cases/field-cases.md) or is a convention two
engines read differently (docs/conventions.md):

==========================  ====================================================================
``aux_ids_plus_1/_minus_1``  the engine captures each aux layer one later / earlier: the HF-index
                             vs "output of layer j" convention (vLLM vs SGLang/SpecForge) applied
                             once too often or not at all
``aux_blocks_swapped``       the drafter reads its first two aux states swapped: trained (or converted)
                             on another order than the engine's (vLLM concatenates in ascending
                             layer order whatever the config lists)
``d2t_missing``              no ``d2t`` reached the engine: vLLM zero-fills it, so draft id i is
                             read as target id i
``d2t_as_ids``               ``d2t`` read as target ids instead of offsets (target = d2t[i])
``fc_missing``               no ``fc.weight``: zero-filled (the engine serves it without a word)
``lm_head_missing``          no ``lm_head.weight``: zero-filled, every draft is draft id 0
``final_norm_twice``         the drafter's final norm applied twice before ``lm_head``
``final_norm_missing``       ``lm_head`` read from the pre-norm state
``norm_before_residual``     the engine reads the other ``norm_before_residual`` (the residual is
                             ``hidden_norm(h)`` instead of ``h``, or the reverse)
``norm_output``              the engine reads the other ``norm_output`` (the state fed back to the
                             next draft step is post-norm instead of pre-norm, or the reverse)
``eagle31_norms_ignored``    an engine that predates EAGLE-3.1 (vLLM < 0.22) ignores
                             ``norm_before_fc``/``fc_norm``/``norm_output``: fc reads the raw aux
                             states and the pre-norm output is fed back
``parallel_drafting_off``    a P-EAGLE drafter served without ``"parallel_drafting": true``: vLLM
                             skips ``mask_hidden`` and drafts a chain, feeding its outputs back
``other_vocab:<name>``       the draft vocabulary (``d2t``) of another build
==========================  ====================================================================

What ``fc_missing``, ``d2t_missing`` simulate was checked against vLLM serving the broken folder
(tests/test_engine_acceptance.py: τ equal to 0.2%).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from eagle3kit.core.config import ConfigError
from eagle3kit.core.rundir import DataError
from eagle3kit.model.draft_vocab import check_maps
from eagle3kit.model.drafter import Eagle3Drafter


@dataclass(frozen=True)
class Fault:
    """One hypothesis: ``name`` (report key), ``what`` the engine does, the ``fix``, and how to
    plant it: ``plant(copy)`` edits a deep copy of the drafter in place (None: nothing to edit),
    ``aux_shift`` moves every aux layer id by that many layers, ``aux_order`` hands the drafter its
    aux states in another order (positions into the trained order)."""

    name: str
    what: str
    fix: str
    plant: Callable[[Eagle3Drafter], None] | None = None
    aux_shift: int = 0
    aux_order: tuple[int, ...] | None = (
        None  # the engine concatenates the aux states in this order of the trained
    )
    needs_d2t: bool = False
    applies: Callable[[Eagle3Drafter], str | None] | None = None  # why it cannot apply to a drafter, or None


def _zero(attr: str) -> Callable[[Eagle3Drafter], None]:
    def plant(d: Eagle3Drafter) -> None:
        with torch.no_grad():
            getattr(d, attr).weight.zero_()

    return plant


def _zero_d2t(d: Eagle3Drafter) -> None:
    d.d2t.zero_()


def _d2t_as_ids(d: Eagle3Drafter) -> None:
    d.d2t.sub_(torch.arange(d.d2t.numel(), device=d.d2t.device))  # id + (d2t − id) = d2t


def _norm_twice(d: Eagle3Drafter) -> None:
    d.norm = nn.Sequential(d.norm, copy.deepcopy(d.norm))


def _norm_missing(d: Eagle3Drafter) -> None:
    d.norm = nn.Identity()


def _flip_nbr(d: Eagle3Drafter) -> None:
    d.norm_before_residual = not d.norm_before_residual


def _flip_norm_output(d: Eagle3Drafter) -> None:
    d.norm_output = not d.norm_output


def _chain(d: Eagle3Drafter) -> str | None:
    return "a P-EAGLE drafter feeds no output back" if d.config.parallel_drafting else None


def _eagle31(d: Eagle3Drafter) -> str | None:
    c = d.config
    return None if (c.norm_before_fc or c.fc_norm or c.norm_output) else "the drafter has no EAGLE-3.1 norms"


def _parallel(d: Eagle3Drafter) -> str | None:
    return None if d.config.parallel_drafting else "the drafter is not a P-EAGLE (parallel-drafting) drafter"


def _drop_eagle31_norms(d: Eagle3Drafter) -> None:
    d.input_norm, d.fc_norm, d.norm_output = None, None, False


def _parallel_off(d: Eagle3Drafter) -> None:
    d.mask_hidden = None
    d.config = dataclasses.replace(d.config, parallel_drafting=False, mask_token_id=None)


AUX_FIX = (
    "serve a folder whose top-level eagle_aux_hidden_state_layer_ids are in vLLM numbering (HF index) and "
    "whose eagle_config ids are HF index − 1 (SGLang): re-export with `eagle3kit export`, or `eagle3kit "
    "import --aux-layer-ids` for a converted drafter; `eagle3kit check --engine ENGINE` shows what the "
    "engine will capture"
)

FAULTS: tuple[Fault, ...] = (
    Fault("aux_ids_plus_1", "the engine captures every aux layer one layer later", AUX_FIX, aux_shift=1),
    Fault("aux_ids_minus_1", "the engine captures every aux layer one layer earlier", AUX_FIX, aux_shift=-1),
    Fault(
        "aux_blocks_swapped",
        "the drafter reads its first two aux states swapped: it was trained (or converted) with them in another "
        "order than the engine concatenates them (vLLM: ascending layer order, whatever order the config lists)",
        "train on the aux states in ascending layer order (eagle3kit does), or convert the drafter's fc columns "
        "to that order",
        aux_order=(1, 0, 2),
    ),
    Fault(
        "d2t_missing",
        "no d2t reached the engine (it zero-fills it: draft id i is proposed as target id i)",
        "serve the folder with its d2t tensor (`eagle3kit check DIR` names a missing one)",
        _zero_d2t,
        needs_d2t=True,
    ),
    Fault(
        "d2t_as_ids",
        "the engine reads d2t as target ids, not as offsets (target id = d2t[i] instead of i + d2t[i])",
        "write d2t as offsets (docs/conventions.md; `eagle3kit import` converts a source that stores ids)",
        _d2t_as_ids,
        needs_d2t=True,
    ),
    Fault(
        "fc_missing",
        "no fc.weight reached the engine (zero-filled)",
        "serve a folder with fc.weight ([H, 3·Ht], no `model.` prefix); `eagle3kit check DIR` names it",
        _zero("fc"),
    ),
    Fault(
        "lm_head_missing",
        "no lm_head.weight reached the engine (zero-filled: every draft is draft id 0)",
        "serve a folder with lm_head.weight [draft_vocab_size, H]; `eagle3kit check DIR` names it",
        _zero("lm_head"),
    ),
    Fault(
        "final_norm_twice",
        "the drafter's final norm is applied twice before lm_head",
        "apply the final norm once (the teacher/last-state convention, docs/conventions.md, layer ids)",
        _norm_twice,
    ),
    Fault(
        "final_norm_missing",
        "lm_head reads the pre-norm state (the final norm is not applied)",
        "apply the drafter's final norm before lm_head once (docs/conventions.md, layer ids)",
        _norm_missing,
    ),
    Fault(
        "norm_before_residual",
        "the engine reads the other norm_before_residual (vLLM assumes true when a speculators config lacks it)",
        "write norm_before_residual as the drafter was trained explicitly in config.json (`eagle3kit export` does)",
        _flip_nbr,
    ),
    Fault(
        "norm_output",
        "the engine feeds back the other state (post-norm instead of pre-norm, or the reverse): a norm_output it "
        "reads otherwise (SpecForge 0.2 writes norm_output: true for its pre-norm feedback)",
        "write norm_output as the drafter was trained (`eagle3kit import` translates SpecForge's)",
        _flip_norm_output,
        applies=_chain,
    ),
    Fault(
        "eagle31_norms_ignored",
        "the engine ignores the EAGLE-3.1 norms (norm_before_fc, fc_norm, norm_output), as vLLM before 0.22 does",
        "serve on vLLM ≥ 0.22 (`eagle3kit check --engine-version` names the release)",
        _drop_eagle31_norms,
        applies=_eagle31,
    ),
    Fault(
        "parallel_drafting_off",
        'the engine drafts this P-EAGLE drafter as a chain (no "parallel_drafting": true in its speculative config)',
        'add "parallel_drafting": true to --speculative-config',
        _parallel_off,
        applies=_parallel,
    ),
)


def other_vocab_fault(path: str | Path, drafter: Eagle3Drafter) -> Fault:
    """The hypothesis "the engine serves the draft vocabulary of another build": ``path`` is a
    ``vocab.safetensors`` (``eagle3kit vocab``) or a drafter folder whose ``d2t`` is read.

    Raises:
        ConfigError: the file is missing or unreadable, holds no ``d2t``, or its size or maps do not
            fit the drafter's draft vocabulary."""
    p = Path(path)
    f = p / "model.safetensors" if p.is_dir() else p
    try:
        t = load_file(str(f))
    except Exception as e:  # missing, truncated, not safetensors
        raise ConfigError(
            f"--other-vocab {path}: cannot read {f} ({' '.join(str(e).split())[:160]})"
        ) from None
    if "d2t" not in t:
        raise ConfigError(
            f"--other-vocab {path}: {f} holds no d2t; give a vocab.safetensors or a drafter folder"
        )
    d2t = t["d2t"].long()
    if d2t.dim() != 1:
        raise ConfigError(
            f"--other-vocab {path}: its d2t has shape {list(d2t.shape)}; a d2t is one row of offsets"
        )
    if d2t.numel() != drafter.d2t.numel():
        raise ConfigError(
            f"--other-vocab {path}: its draft vocabulary has {d2t.numel()} entries, the drafter's "
            f"{drafter.d2t.numel()}; an engine could not serve that pair"
        )
    try:
        check_maps(d2t, None, drafter.config.vocab_size)
    except DataError as e:
        raise ConfigError(f"--other-vocab {path}: {e}") from None
    t2d = torch.zeros(drafter.config.vocab_size, dtype=torch.bool)
    t2d[torch.arange(d2t.numel()) + d2t] = True

    def plant(d: Eagle3Drafter) -> None:
        d.d2t.copy_(d2t)
        d.t2d.copy_(t2d)

    return Fault(
        f"other_vocab:{p.name}",
        f"the engine serves the draft vocabulary of another build ({path})",
        "serve the d2t/t2d written with these weights (export them together; `eagle3kit check` compares the "
        "folder's vocab hash with its provenance)",
        plant,
        needs_d2t=True,
    )


def applicable(fault: Fault, drafter: Eagle3Drafter, num_layers: int) -> str | None:
    """None when ``fault`` can be simulated for ``drafter`` on a target of ``num_layers`` layers,
    else why not (an aux id outside [1, N − 1] after the shift; no d2t when Vd = V; a variant fault
    for a drafter without that variant)."""
    ids = [i + fault.aux_shift for i in drafter.config.aux_layer_ids]
    if fault.aux_shift and (min(ids) < 1 or max(ids) > num_layers - 1):
        return f"layers {ids} are outside [1, {num_layers - 1}]"
    if fault.needs_d2t and drafter.config.draft_vocab_size == drafter.config.vocab_size:
        return "the drafter has no d2t (its draft vocabulary is the whole vocabulary)"
    return fault.applies(drafter) if fault.applies is not None else None


def planted(fault: Fault, drafter: Eagle3Drafter) -> tuple[Eagle3Drafter, list[int]]:
    """A copy of ``drafter`` with ``fault`` planted, and the aux layer ids it reads."""
    d = copy.deepcopy(drafter)
    if fault.plant is not None:
        fault.plant(d)
    ids = [i + fault.aux_shift for i in drafter.config.aux_layer_ids]
    return d.eval(), [ids[j] for j in fault.aux_order] if fault.aux_order else ids


#: the faults :func:`plant_in_folder` can write into a drafter folder, and the tensor each drops
FOLDER_FAULTS = {
    "fc_missing": "fc.weight",
    "d2t_missing": "d2t",
    "lm_head_missing": "lm_head.weight",
    "aux_ids_plus_1": None,
    "aux_ids_minus_1": None,
    "norm_before_residual": None,
}


def plant_in_folder(src: str | Path, out: str | Path, name: str) -> Path:
    """A copy of the dual-engine drafter folder ``src`` in ``out`` with fault ``name`` written into
    it, as a broken converter or a hand-edited config would: a tensor dropped (``fc_missing``,
    ``d2t_missing``, ``lm_head_missing``), every aux id moved by one layer in both numberings
    (``aux_ids_plus_1``/``_minus_1``), or ``norm_before_residual`` flipped. Serving it shows what
    an engine with that fault accepts, and that ``diagnose`` names it.

    Raises:
        ConfigError: ``name`` is not in :data:`FOLDER_FAULTS`, or ``out`` exists."""
    if name not in FOLDER_FAULTS:
        raise ConfigError(f"cannot plant {name!r} in a folder; choose one of {sorted(FOLDER_FAULTS)}")
    src, out = Path(src), Path(out)
    if out.exists():
        raise ConfigError(f"{out} exists: give a new folder for the planted copy")
    out.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    drop = FOLDER_FAULTS[name]
    if drop:
        tensors = load_file(str(src / "model.safetensors"))
        save_file({k: v for k, v in tensors.items() if k != drop}, str(out / "model.safetensors"))
    else:
        (out / "model.safetensors").symlink_to((src / "model.safetensors").resolve())
    if name.startswith("aux_ids_"):
        step = 1 if name.endswith("plus_1") else -1
        cfg["eagle_aux_hidden_state_layer_ids"] = [i + step for i in cfg["eagle_aux_hidden_state_layer_ids"]]
        nested = cfg.get("eagle_config") or {}
        if "eagle_aux_hidden_state_layer_ids" in nested:
            nested["eagle_aux_hidden_state_layer_ids"] = [
                i + step for i in nested["eagle_aux_hidden_state_layer_ids"]
            ]
    if name == "norm_before_residual":
        cfg["norm_before_residual"] = not cfg.get("norm_before_residual", False)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
