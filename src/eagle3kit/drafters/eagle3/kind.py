"""The EAGLE-3 family (EAGLE-3, EAGLE-3.1, P-EAGLE) as the stages see it
(:class:`eagle3kit.core.kinds.DrafterKind`): a chain drafter reading three target states, drafting from
a draft vocabulary mapped to the target's by d2t/t2d, trained with training-time test (TTT).

Its parts still live in the stage folders (the network in ``model/drafter.py``, TTT in
``train/ttt.py``, the trainer in ``train/stage.py``, its folder layouts in ``model/folder*.py``, its
engine rules in ``serve/check.py``, its faults in ``diagnose/faults.py``); this module is the one
place the stages reach them through."""

from __future__ import annotations

from pathlib import Path

from eagle3kit.core.kinds import DrafterKind
from eagle3kit.diagnose.faults import FAULTS, applicable, other_vocab_fault, planted
from eagle3kit.eval.evaluate import check_drafter_target, evaluate_chain_drafter
from eagle3kit.model.folder import load_exported
from eagle3kit.serve.check import check_chain_folder
from eagle3kit.serve.export import read_chain_checkpoint, write_chain_folder
from eagle3kit.train.acceptance import simulate_sequence
from eagle3kit.train.stage import train_chain_drafter


class Eagle3Kind(DrafterKind):
    name = "eagle3"
    variants = (None, "eagle3", "eagle3.1", "p-eagle")

    def owns_folder(self, config: dict) -> bool:
        return True  # every other layout (its own, speculators', SpecForge's, EAGLE's): read_drafter names a bad one

    def owns_checkpoint(self, path: Path) -> bool:
        return True

    def train(self, cfg, run, target) -> dict:
        return train_chain_drafter(cfg, run, target)

    def read_checkpoint(self, src: Path, target_cfg):
        return read_chain_checkpoint(src, target_cfg)

    def write_folder(
        self, drafter, out: Path, prov: dict, fmt: str, verifier, overwrite: bool, k: int
    ) -> dict:
        return write_chain_folder(drafter, out, prov, fmt, verifier, overwrite, k)

    def check(self, folder: Path, target, engine: str, engine_version, max_model_len, k) -> list:
        return check_chain_folder(folder, target, engine, engine_version, max_model_len, k)

    def evaluate(
        self, cfg, run, target, folder: Path, given: bool, mode: str, k: int, only_sets, section
    ) -> dict:
        return evaluate_chain_drafter(cfg, run, target, folder, given, mode, k, only_sets, section)

    def load(self, folder: Path, target_cfg, target, device):
        drafter = load_exported(folder, device=device, target=target_cfg).eval()
        check_drafter_target(folder, drafter, target, target_cfg.model)
        return drafter

    def aux_ids(self, drafter) -> list[int]:
        return list(drafter.config.aux_layer_ids)

    def draft_vocab_mask(self, drafter):
        c = drafter.config
        return drafter.t2d.cpu() if c.draft_vocab_size < c.vocab_size else None

    def faults(self, drafter, tokenizer, folder: Path, other_vocab) -> list:
        """:data:`eagle3kit.diagnose.faults.FAULTS`, and one fault per ``--other-vocab`` build."""
        return list(FAULTS) + [other_vocab_fault(p, drafter) for p in other_vocab or []]

    def applicable(self, fault, drafter, num_layers: int) -> str | None:
        return applicable(fault, drafter, num_layers)

    def planted(self, fault, drafter):
        d, ids = planted(fault, drafter)
        return d, ids, {}

    def simulate(self, drafter, target, ids, mask, first: int, aux, k: int, device, engine: dict):
        return simulate_sequence(drafter, target, ids, mask, aux, k, device)


KIND = Eagle3Kind()
