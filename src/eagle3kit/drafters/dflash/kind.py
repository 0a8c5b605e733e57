"""DFlash as the stages see it (:class:`eagle3kit.core.kinds.DrafterKind`): a block drafter that reads
any number of target layers and predicts over the target's whole vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3kit.core.config import ConfigError
from eagle3kit.core.kinds import DrafterKind
from eagle3kit.core.rundir import sha256_tensors
from eagle3kit.diagnose.record import DiagnoseError
from eagle3kit.drafters.dflash import settings
from eagle3kit.drafters.dflash.check import check_dflash
from eagle3kit.drafters.dflash.evaluate import check_dflash_target, run_evaluate_dflash
from eagle3kit.drafters.dflash.faults import dflash_applicable, dflash_faults, dflash_planted
from eagle3kit.drafters.dflash.folder import is_dflash_config, read_dflash, write_dflash
from eagle3kit.drafters.dflash.network import DFlashConfig, DFlashDrafter, default_target_layer_ids
from eagle3kit.drafters.dflash.objective import block_stats, simulate_block_tau
from eagle3kit.drafters.dflash.trainer import (
    build_dflash,
    dflash_micro_loss,
    dflash_report,
    is_dflash_checkpoint,
    load_dflash_checkpoint,
    save_dflash_checkpoint,
)
from eagle3kit.model.target_files import load_target_config


class DFlashKind(DrafterKind):
    name = "dflash"
    title = "DFlash"
    variants = settings.VARIANTS
    aux_count = None
    whole_vocab = True
    stale_checkpoint_files = {
        "dflash_state.pt": "written by the earlier DFlash trainer, which kept dflash_state.pt"
    }
    later_positions_hint = "a larger drafter.gamma weights the block's later slots more in training"

    def default_aux_layer_ids(self, drafter_cfg, num_layers: int) -> list[int]:
        """``drafter.target_layer_ids`` + 1 (DFlash counts layer outputs from 0), by default one layer per
        draft layer spread over the target (:func:`default_target_layer_ids`)."""
        t = drafter_cfg.target_layer_ids or default_target_layer_ids(num_layers, drafter_cfg.num_layers)
        return [i + 1 for i in t]

    def owns_folder(self, config: dict) -> bool:
        return is_dflash_config(config)

    def owns_checkpoint(self, path: Path) -> bool:
        return path.is_file() and is_dflash_checkpoint(path)

    first_accuracy = "slot1_accuracy"
    first_accuracy_label = "slot-1 acc"

    def check_features(self, cfg, features: dict) -> None:
        if cfg.drafter.objective == "kl" and features.get("teacher", "last") != "last":
            raise ConfigError(
                f"drafter.objective kl distils the target's whole distribution, and the features in "
                f"{cfg.train.features} keep only its {features.get('teacher')}: extract them with extract.teacher: "
                "last, or use drafter.objective: ce"
            )

    def speed(self, tc, device, draft_vocab: int) -> dict:
        if tc.precision == "tf32" and device.type != "cuda":
            raise ConfigError(f"train.precision: tf32 needs a CUDA device; {device.type} has no tensor cores")
        bf16 = tc.precision == "bf16" or (tc.precision == "auto" and device.type == "cuda")
        # unset: chunked on CUDA when the block loss would not fit a quarter of the device (objective.loss_rows)
        chunk = tc.loss_chunk if tc.loss_chunk is not None else ("auto" if device.type == "cuda" else 0)
        return {"attention": "sdpa", "bf16": bf16, "tf32": False, "loss_chunk": chunk, "compile": False}

    def shaped(self, cfg, target, vocab, aux_ids):
        dc = cfg.drafter
        dcfg = DFlashConfig.from_target(
            target.config, 0, dc.num_layers, dc.block_size, [a - 1 for a in aux_ids]
        )
        with torch.device("meta"):
            shaped = DFlashDrafter(dcfg)
        return sum(p.numel() for p in shaped.parameters()), None

    def build(self, cfg, target, vocab, aux_ids, samples):
        return build_dflash(cfg, target, aux_ids, samples)

    def loss(self, model, target, samples, micro, speed: dict, cfg, draft_ids, seed: int):
        return dflash_micro_loss(model, target, samples, micro, speed, cfg, seed)

    def validate(self, drafter, target, samples, k: int, device):
        return simulate_block_tau(drafter, target, samples, k, device)

    def save_checkpoint(self, drafter, path: Path, meta: dict, state: dict) -> None:
        save_dflash_checkpoint(drafter, path, meta, state)

    def report(self, cfg, drafter) -> dict:
        return dflash_report(cfg, drafter)

    def read_checkpoint(self, src: Path, target_cfg):
        """``(drafter, provenance)`` of a DFlash checkpoint (float32, its hash in the provenance), or of
        an exported DFlash folder (re-exported; the provenance its config records)."""
        if src.is_dir():
            prov = dict(json.loads((src / "config.json").read_text()).get("eagle3kit") or {})
            prov.pop("drafter", None)
            return read_dflash(src).float(), prov
        drafter, prov = load_dflash_checkpoint(src)
        prov["checkpoint_sha256"] = sha256_tensors(src)
        return drafter, prov

    def write_folder(
        self, drafter, out: Path, prov: dict, fmt: str, verifier, overwrite: bool, k: int
    ) -> dict:
        """``dual``: the layout vLLM's ``DFlashDraftModel`` loads (z-lab's); ``speculators``: speculators'
        DFlash layout naming its verifier (:mod:`eagle3kit.drafters.dflash.folder`).

        Raises:
            FileExistsError: ``out`` holds another drafter and not ``overwrite``."""
        if out.is_dir() and any(out.iterdir()) and not overwrite:
            raise FileExistsError(f"{out} holds another drafter; pass --overwrite or another --out")
        layout = "vllm" if fmt == "dual" else "speculators"
        write_dflash(drafter, out, layout, torch.float32, verifier=verifier, provenance=prov)
        return {"drafter": "dflash", "block_size": drafter.cfg.block_size}

    def check(self, folder: Path, target, engine: str, engine_version, max_model_len, k) -> list:
        return check_dflash(folder, load_target_config(target)[1], k, engine)

    def evaluate(
        self, cfg, run, target, folder: Path, given: bool, mode: str, k: int, only_sets, section
    ) -> dict:
        return run_evaluate_dflash(cfg, run, target, folder, given, k, only_sets, section)

    def load(self, folder: Path, target_cfg, target, device):
        drafter = read_dflash(folder).to(device).eval()
        check_dflash_target(folder, drafter, target, target_cfg.model)
        return drafter

    def aux_ids(self, drafter) -> list[int]:
        return list(drafter.cfg.aux_layer_ids)

    def max_draft(self, drafter) -> int:
        return drafter.cfg.block_size - 1

    def faults(self, drafter, tokenizer, folder: Path, other_vocab) -> list:
        if other_vocab:
            raise DiagnoseError(
                "--other-vocab: a DFlash drafter drafts from the target's whole vocabulary (no d2t); drop it"
            )
        return dflash_faults(drafter, tokenizer, json.loads((folder / "config.json").read_text()))

    def applicable(self, fault, drafter, num_layers: int) -> str | None:
        return dflash_applicable(fault, drafter, num_layers)

    def planted(self, fault, drafter):
        ids, engine = dflash_planted(fault, drafter)
        return drafter, ids, engine

    def simulate(self, drafter, target, ids, mask, first: int, aux, k: int, device, engine: dict):
        return block_stats(drafter, target, aux.to(device), ids.to(device), first, k, **engine)


KIND = DFlashKind()
