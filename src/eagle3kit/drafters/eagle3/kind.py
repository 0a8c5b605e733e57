"""The EAGLE-3 family (EAGLE-3, EAGLE-3.1, P-EAGLE) as the stages see it
(:class:`eagle3kit.core.kinds.DrafterKind`): a chain drafter reading three target states, drafting from
a draft vocabulary mapped to the target's by d2t/t2d, trained with training-time test (TTT).

Its parts still live in the stage folders (the network in ``model/drafter.py``, TTT in
``train/ttt.py``, the trainer in ``train/stage.py``, its folder layouts in ``model/folder*.py``, its
engine rules in ``serve/check.py``, its faults in ``diagnose/faults.py``); this module is the one
place the stages reach them through."""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3kit.core.config import ConfigError
from eagle3kit.core.config_train import variant_name
from eagle3kit.core.kinds import DrafterKind
from eagle3kit.diagnose.faults import FAULTS, applicable, other_vocab_fault, planted
from eagle3kit.drafters.eagle3 import settings
from eagle3kit.eval.evaluate import check_drafter_target, evaluate_chain_drafter
from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter
from eagle3kit.model.folder import load_exported
from eagle3kit.serve.check import check_chain_folder
from eagle3kit.serve.export import read_chain_checkpoint, write_chain_folder
from eagle3kit.train.acceptance import simulate_samples, simulate_sequence
from eagle3kit.train.batches import make_batch
from eagle3kit.train.chain_step import build_drafter, chain_loss, resolve_speed
from eagle3kit.train.checkpoints import save_drafter_checkpoint
from eagle3kit.train.memory import DrafterShape


class Eagle3Kind(DrafterKind):
    name = "eagle3"
    title = "EAGLE-3"
    variants = settings.VARIANTS

    def owns_folder(self, config: dict) -> bool:
        return True  # every other layout (its own, speculators', SpecForge's, EAGLE's): read_drafter names a bad one

    def owns_checkpoint(self, path: Path) -> bool:
        return True

    def check_features(self, cfg, features: dict) -> None:
        tc = cfg.train
        if tc.loss != "kl" and features.get("teacher", "last") != "last":
            raise ConfigError(
                f"train.loss {tc.loss} needs the target's full-vocabulary probabilities, and the features in "
                f"{tc.features} keep only the teacher's {features.get('teacher')}: extract them with "
                "extract.teacher: last, train without train.features (the target in the step, or online), or use "
                "train.loss: kl"
            )

    def speed(self, tc, device, draft_vocab: int) -> dict:
        return resolve_speed(tc, device, draft_vocab)

    def shaped(self, cfg, target, vocab, aux_ids):
        flags = cfg.drafter.flags(target.tokenizer, target.vocab_size, 0)
        dcfg = DrafterConfig.from_target(
            target.config, vocab.size, aux_ids, vocab_size=target.vocab_size, **flags
        )
        with torch.device("meta"):
            shaped = Eagle3Drafter(dcfg)
        return sum(p.numel() for p in shaped.parameters()), DrafterShape.of(shaped)

    def build(self, cfg, target, vocab, aux_ids, samples):
        return build_drafter(target, vocab, aux_ids, cfg.train.seed, cfg.drafter, samples)

    def loss(self, model, target, samples, micro, speed: dict, cfg, draft_ids, seed: int):
        device = next(getattr(model, "module", model).parameters()).device
        b = make_batch(samples, micro, cfg.train.ttt_steps, device)
        loss, st = chain_loss(model, target, b, draft_ids, cfg.train, speed)
        return loss, 1.0, st

    def validate(self, drafter, target, samples, k: int, device):
        return simulate_samples(drafter, target, samples, k, device)

    def save_checkpoint(self, drafter, path: Path, meta: dict, state: dict) -> None:
        save_drafter_checkpoint(drafter, path, meta, state)

    def report(self, cfg, drafter) -> dict:
        return {
            "ttt_steps": cfg.train.ttt_steps,
            "drafter_variant": variant_name(drafter.config.variant()),
            "loss": cfg.train.loss,
        }

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
