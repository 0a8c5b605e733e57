"""The engine-integration faults ``diagnose`` simulates for a DFlash drafter, each what an engine that
reads the folder otherwise computes (docs/dflash.md, serve it):

================================  ================================================================
``target_layer_ids_plus_1/_minus_1``  the engine reads every target layer one later / earlier: a
                                  converter wrote speculators' aux ids (decoder layer ``t``'s output
                                  is aux id ``t + 1``) into ``dflash_config.target_layer_ids``, which
                                  vLLM reads as 0-based decoder layers and adds the 1 itself — or
                                  the reverse
``mask_token:<id>``               the engine fills the block's slots with another token: vLLM takes
                                  ``dflash_config.mask_token_id`` before a top-level
                                  ``mask_token_id``; converters write the tokenizer's mask, pad or
                                  end-of-text token. Tried: every id the folder's config names and
                                  the tokenizer's special tokens, other than the trained one
``block_causal``                  the engine attends causally within the block (each slot sees the
                                  slots before it only): vLLM does so for a config with ``is_causal``
                                  or ``dflash_config.causal`` true, or a speculators config with
                                  ``sliding_window_non_causal: false``; DFlash's block is non-causal
================================  ================================================================

:func:`plant_dflash_in_folder` writes each into a copy of a folder, as a broken converter or
a hand-edited config would, so that serving it shows what an engine with the fault accepts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eagle3kit.core.config import ConfigError
from eagle3kit.drafters.dflash.network import DFlashDrafter


@dataclass(frozen=True)
class DFlashFault:
    """One DFlash hypothesis: ``name`` (report key), ``what`` the engine does, the ``fix``, and how the
    engine differs: ``aux_shift`` layers added to every aux id, the ``mask_token`` it fills the block
    with (None: the trained one), ``causal`` attention within the block."""

    name: str
    what: str
    fix: str
    aux_shift: int = 0
    mask_token: int | None = None
    causal: bool = False


LAYER_FIX = (
    "write dflash_config.target_layer_ids as 0-based decoder layers (vLLM reads decoder layer t's output, "
    "HF index t + 1) and a speculators folder's aux_hidden_state_layer_ids as t + 1: re-export with "
    "`eagle3kit export`; `eagle3kit check DIR` shows the layers the engine will read"
)
MASK_FIX = (
    "write the trained mask token as dflash_config.mask_token_id (vLLM reads it before a top-level "
    "mask_token_id); `eagle3kit export` writes it, `eagle3kit check DIR` names the one the engine will use"
)


def dflash_faults(drafter: DFlashDrafter, tokenizer, folder_config: dict | None = None) -> list[DFlashFault]:
    """The DFlash hypotheses for ``drafter``: the layer shifts, the causal block, and one
    ``mask_token:<id>`` per candidate id other than the trained one (the ids ``folder_config`` names as
    ``mask_token_id`` at the top level or in ``dflash_config``, then the tokenizer's mask, pad,
    end-of-text, begin-of-text and unknown tokens), in that order, each once."""
    faults = [
        DFlashFault(
            "target_layer_ids_plus_1", "the engine reads every target layer one layer later", LAYER_FIX, 1
        ),
        DFlashFault(
            "target_layer_ids_minus_1", "the engine reads every target layer one layer earlier", LAYER_FIX, -1
        ),
        DFlashFault(
            "block_causal",
            "the engine attends causally within the block (a slot sees only the slots before it); DFlash's "
            "block attends both ways",
            "drop is_causal and dflash_config.causal: true from config.json (vLLM makes every draft layer causal "
            "with them) and write sliding_window_non_causal: true in a speculators folder; `eagle3kit check DIR` "
            "names them",
            causal=True,
        ),
    ]
    cfg = folder_config or {}
    named = [cfg.get("mask_token_id"), (cfg.get("dflash_config") or {}).get("mask_token_id")]
    special = [
        getattr(tokenizer, a, None)
        for a in ("mask_token_id", "pad_token_id", "eos_token_id", "bos_token_id", "unk_token_id")
    ]
    seen = {drafter.cfg.mask_token_id}
    for tid in named + special:
        if isinstance(tid, int) and not isinstance(tid, bool) and 0 <= tid < drafter.cfg.vocab_size:
            if tid in seen:
                continue
            seen.add(tid)
            tok = tokenizer.convert_ids_to_tokens(tid)
            faults.append(
                DFlashFault(
                    f"mask_token:{tid}",
                    f"the engine fills the block with token {tid} ({tok!r}), not the trained mask token "
                    f"{drafter.cfg.mask_token_id}",
                    MASK_FIX,
                    mask_token=tid,
                )
            )
    return faults


def dflash_applicable(fault: DFlashFault, drafter: DFlashDrafter, num_layers: int) -> str | None:
    """None when ``fault`` can be simulated on a target of ``num_layers`` layers, else why not (a
    shifted aux id outside [1, N − 1])."""
    ids, _ = dflash_planted(fault, drafter)
    if fault.aux_shift and (min(ids) < 1 or max(ids) > num_layers - 1):
        return f"layers {ids} are outside [1, {num_layers - 1}]"
    return None


def dflash_planted(fault: DFlashFault, drafter: DFlashDrafter) -> tuple[list[int], dict]:
    """What the engine with ``fault`` reads: the aux layer ids, and the :func:`simulate_on` arguments
    that fill and attend the block as it does."""
    ids = [i + fault.aux_shift for i in drafter.cfg.aux_layer_ids]
    return ids, {"mask_token_id": fault.mask_token, "causal": fault.causal}


def plant_dflash_in_folder(src: str | Path, out: str | Path, name: str) -> Path:
    """A copy of the DFlash folder ``src`` (vLLM's layout, ``dflash_config``) in ``out`` with fault ``name``
    written into its config: ``target_layer_ids_plus_1``/``_minus_1`` (every target layer id moved by
    one), ``block_causal`` (``dflash_config.causal: true``) or ``mask_token:<id>``
    (``dflash_config.mask_token_id`` set to ``id``). The weights are linked.

    Raises:
        ConfigError: another name, a folder without ``dflash_config``, or ``out`` exists."""
    src, out = Path(src), Path(out)
    cfg = json.loads((src / "config.json").read_text())
    dc = cfg.get("dflash_config")
    if not isinstance(dc, dict):
        raise ConfigError(f"{src}: no dflash_config (plant faults in vLLM's DFlash layout: RUN/drafter)")
    if name in ("target_layer_ids_plus_1", "target_layer_ids_minus_1"):
        step = 1 if name.endswith("plus_1") else -1
        dc["target_layer_ids"] = [int(t) + step for t in dc["target_layer_ids"]]
    elif name == "block_causal":
        dc["causal"] = True
    elif name.startswith("mask_token:") and name.removeprefix("mask_token:").isdigit():
        dc["mask_token_id"] = int(name.removeprefix("mask_token:"))
    else:
        raise ConfigError(
            f"cannot plant {name!r} in a DFlash folder; choose target_layer_ids_plus_1, target_layer_ids_minus_1, "
            "block_causal or mask_token:<id>"
        )
    if out.exists():
        raise ConfigError(f"{out} exists: give a new folder for the planted copy")
    out.mkdir(parents=True)
    for f in src.glob("*.safetensors"):
        (out / f.name).symlink_to(f.resolve())
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
