"""DSpark as the stages see it (:class:`eagle3kit.core.kinds.DrafterKind`): a block drafter like DFlash
(any number of target layers, the target's whole vocabulary) whose drafts are biased left to right by
a Markov head, served by vLLM's V2 GPU model runner only. What it shares with DFlash is DFlash's code:
the default target layers, the target check, the faults ``diagnose`` plants (layers one off, another
mask token, a causal block); its own are the network, the loss, the block drafting with the Markov
head, the folder and its ``check``.

It trains in the common loop with DFlash's step (anchors, batches, clipping) and its own loss
(:func:`eagle3kit.drafters.dspark.objective.dspark_loss`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from eagle3kit.core.config import Config, ConfigError
from eagle3kit.core.lineage import check_inputs
from eagle3kit.core.metrics import AcceptanceStats
from eagle3kit.core.rundir import RunDir, sha256_tensors
from eagle3kit.core.ui import console
from eagle3kit.data.backends import render_prompt_ids
from eagle3kit.data.generate import check_backend, pick_backend
from eagle3kit.diagnose.record import DiagnoseError
from eagle3kit.drafters.dflash.evaluate import check_dflash_target
from eagle3kit.drafters.dflash.faults import dflash_faults
from eagle3kit.drafters.dflash.kind import DFlashKind
from eagle3kit.drafters.dflash.trainer import (
    dflash_micro_loss,
    dflash_report,
    save_dflash_checkpoint,
)
from eagle3kit.drafters.dspark import settings
from eagle3kit.drafters.dspark.check import check_dspark
from eagle3kit.drafters.dspark.folder import (
    is_dspark_checkpoint,
    is_dspark_config,
    load_dspark_checkpoint,
    read_dspark,
    write_dspark,
)
from eagle3kit.drafters.dspark.network import DSparkConfig, DSparkDrafter
from eagle3kit.drafters.dspark.objective import dspark_block_stats, dspark_loss, simulate_dspark_tau
from eagle3kit.eval.sets import (
    check_overlap,
    chosen_sets,
    greedy_continuations,
    trained_prompt_rows,
    write_continuations,
)
from eagle3kit.model.contract import ExportError
from eagle3kit.model.target import load_target, pick_device
from eagle3kit.model.target_files import load_target_config, weights_fingerprint
from eagle3kit.train.batches import Sample
from eagle3kit.train.samples import compute_features, mask_token

LAYER_FIX = (
    "write dspark_target_layer_ids as 0-based decoder layers (vLLM reads decoder layer t's output, HF index "
    "t + 1) and no eagle_aux_hidden_state_layer_ids or dflash_config.target_layer_ids beside them (vLLM reads "
    "those first): re-export with `eagle3kit export`; `eagle3kit check DIR` shows the layers the engine will read"
)


def dspark_tau(drafter, target, prompts: list[list[int]], continuations: list[list[int]], k: int, device):
    """(pooled greedy stats, per-prompt τ) of DSpark block drafting at ``k`` drafts over (prompt, greedy
    continuation) pairs, from one batched target pass for the aux hidden states."""
    samples = []
    for p, c in zip(prompts, continuations):
        if c:
            mask = torch.zeros(len(p) + len(c), dtype=torch.bool)
            mask[len(p) :] = True
            samples.append(Sample(torch.tensor(p + c, dtype=torch.long), mask))
    compute_features(target, samples, drafter.cfg.aux_layer_ids, 8192, device, device, label="target states")
    pooled, per_prompt = AcceptanceStats(k), []
    for s in samples:
        st = simulate_dspark_tau(drafter, target, [s], k, device)
        pooled.merge(st)
        per_prompt.append(st.tau)
        s.aux = s.last = s.argmax = None
    return pooled, per_prompt


def run_evaluate_dspark(
    cfg: Config, run: RunDir, target, folder: Path, given: bool, k: int, only_sets, section: str
) -> dict:
    """:func:`eagle3kit.eval.evaluate.run_evaluate` for a DSpark folder (simulate mode): the target's
    greedy continuation of every held-out prompt, then DSpark block drafting over it.

    Raises:
        ConfigError: ``k`` past a block's drafts, a drafter of another target.
        StaleInput: the run's own drafter no longer matches its checkpoint or inputs."""
    ec, device = cfg.evaluate, pick_device(cfg.evaluate.device)
    if not given:
        fp = (
            target.source.get("weights_fingerprint")
            if target is not None
            else weights_fingerprint(cfg.target)
        )
        check_inputs(run, "evaluate", ["drafter/model.safetensors", "heldout.jsonl"], target=fp)
    drafter = read_dspark(folder).to(device).eval()
    if not 1 <= k <= drafter.cfg.drafts_per_block:
        raise ConfigError(
            f"k {k}: a DSpark block of {drafter.cfg.block_size} drafts 1 … {drafter.cfg.drafts_per_block}"
        )
    target = target if target is not None else load_target(cfg.target, device=device)
    check_dflash_target(folder, drafter, target, cfg.target.model)
    drafter = drafter.to(target.dtype)
    backend = check_backend(pick_backend(cfg.generate.backend), cfg.generate.backend, target)
    train_rows = trained_prompt_rows(run)
    report: dict = {"mode": "simulate", "k": k, "drafter_kind": "dspark", "max_new_tokens": ec.max_new_tokens,
                    "sets": {}, "drafter": str(folder)}  # fmt: skip
    pooled, n_prompts = AcceptanceStats(k), 0
    for name, rows in chosen_sets(cfg, run, only_sets).items():
        prompts = [render_prompt_ids(target.tokenizer, r["messages"]) for r in rows]
        entry: dict = {"num_prompts": len(rows), **check_overlap(train_rows, rows)}
        conts = greedy_continuations(
            target, prompts, ec.max_new_tokens, backend, cfg.generate.batch_size, cfg.generate.engine_args
        )
        stats, _ = dspark_tau(drafter, target, prompts, conts, k, device)
        entry.update(stats.as_dict())
        entry["continuations"] = str(write_continuations(run, section, name, rows, prompts, conts, backend))
        report["sets"][name] = entry
        pooled.merge(stats)
        n_prompts += len(rows)
        console.print(f"evaluate {name}: τ(K={k}, DSpark block) = {stats.tau:.3f} over {len(rows)} prompts")
    report.update(pooled.as_dict())
    report["num_prompts"] = n_prompts
    run.record_stage(section, {"drafter": str(folder), "mode": "simulate", "k": k}, report)
    return report


class DSparkKind(DFlashKind):
    """DFlash's kind with DSpark's network, loss, block drafting, folder and checks; what it inherits
    (default target layers, training refusals, step settings, aux ids, the faults' applicability and
    planting) is DFlash's because DSpark reads the target and fills its block as DFlash does."""

    name = "dspark"
    title = "DSpark"
    variants = settings.VARIANTS
    later_positions_hint = "a larger drafter.gamma weights the block's later drafts more in training"

    def owns_folder(self, config: dict) -> bool:
        return is_dspark_config(config)

    def owns_checkpoint(self, path: Path) -> bool:
        return path.is_file() and is_dspark_checkpoint(path)

    formats = ("dual",)

    def shaped(self, cfg, target, vocab, aux_ids):
        dc = cfg.drafter
        c = DSparkConfig.from_target(target.config, 0, dc.num_layers, dc.block_size, [a - 1 for a in aux_ids])
        with torch.device("meta"):
            shaped = DSparkDrafter(c)
        return sum(p.numel() for p in shaped.parameters()), None

    def build(self, cfg, target, vocab, aux_ids, samples):
        """A DSpark drafter for ``target`` (DFlash's backbone and mask token, the heads at their defaults:
        Markov rank :data:`~eagle3kit.drafters.dspark.network.DEFAULT_MARKOV_RANK`, drafting from the
        anchor), seeded by ``train.seed``."""
        dc = cfg.drafter
        mask_id = mask_token(
            samples, target.tokenizer, target.vocab_size, dc.mask_token_id, target.end_of_turn_ids()
        )
        c = DSparkConfig.from_target(
            target.config, mask_id, dc.num_layers, dc.block_size, [a - 1 for a in aux_ids]
        )
        torch.manual_seed(cfg.train.seed)
        return DSparkDrafter(c)

    def loss(self, model, target, samples, micro, speed: dict, cfg, draft_ids, seed: int):
        return dflash_micro_loss(model, target, samples, micro, speed, cfg, seed, loss_fn=dspark_loss)

    def validate(self, drafter, target, samples, k: int, device):
        return simulate_dspark_tau(drafter, target, samples, min(k, drafter.cfg.drafts_per_block), device)

    def save_checkpoint(self, drafter, path: Path, meta: dict, state: dict) -> None:
        save_dflash_checkpoint(drafter, path, meta, state, kind="dspark")

    def report(self, cfg, drafter) -> dict:
        c = drafter.cfg
        return {
            **dflash_report(cfg, drafter),
            "drafter_variant": "dspark",
            "markov_rank": c.markov_rank,
            "drafts_per_block": c.drafts_per_block,
        }

    def read_checkpoint(self, src: Path, target_cfg):
        """``(drafter, provenance)`` of a DSpark checkpoint (its hash in the provenance) or of an exported
        DSpark folder (re-exported; the provenance its config records)."""
        if src.is_dir():
            prov = dict(json.loads((src / "config.json").read_text()).get("eagle3kit") or {})
            prov.pop("drafter", None)
            return read_dspark(src), prov
        drafter, prov = load_dspark_checkpoint(src)
        prov["checkpoint_sha256"] = sha256_tensors(src)
        return drafter, prov

    def write_folder(
        self, drafter, out: Path, prov: dict, fmt: str, verifier, overwrite: bool, k: int
    ) -> dict:
        """``dual``: the layout vLLM's ``Qwen3DSparkModel`` loads (float32). ``speculators``: refused with
        ExportError (the pipeline says so and goes on), eagle3kit writes no speculators DSpark layout.

        Raises:
            FileExistsError: ``out`` holds another drafter and not ``overwrite``. ExportError: speculators."""
        if fmt == "speculators":
            raise ExportError(
                "eagle3kit writes DSpark in vLLM's Qwen3DSparkModel layout only (<run>/drafter)"
            )
        if out.is_dir() and any(out.iterdir()) and not overwrite:
            raise FileExistsError(f"{out} holds another drafter; pass --overwrite or another --out")
        write_dspark(drafter, out, torch.float32, provenance=prov)
        c = drafter.cfg
        return {"drafter": "dspark", "block_size": c.block_size, "drafts_per_block": c.drafts_per_block}

    def check(self, folder: Path, target, engine: str, engine_version, max_model_len, k) -> list:
        return check_dspark(folder, load_target_config(target)[1], k, engine)

    def evaluate(
        self, cfg, run, target, folder: Path, given: bool, mode: str, k: int, only_sets, section
    ) -> dict:
        return run_evaluate_dspark(cfg, run, target, folder, given, k, only_sets, section)

    def load(self, folder: Path, target_cfg, target, device):
        drafter = read_dspark(folder).to(device).eval()
        check_dflash_target(folder, drafter, target, target_cfg.model)
        return drafter

    def max_draft(self, drafter) -> int:
        return drafter.cfg.drafts_per_block

    def faults(self, drafter, tokenizer, folder: Path, other_vocab) -> list:
        """DFlash's faults (:func:`eagle3kit.drafters.dflash.faults.dflash_faults`), the layer faults'
        fix naming DSpark's field.

        Raises:
            DiagnoseError: ``other_vocab`` given (no draft vocabulary)."""
        if other_vocab:
            raise DiagnoseError(
                "--other-vocab: a DSpark drafter drafts from the target's whole vocabulary (no d2t); drop it"
            )
        faults = dflash_faults(drafter, tokenizer, json.loads((folder / "config.json").read_text()))
        return [dataclasses.replace(f, fix=LAYER_FIX) if f.aux_shift else f for f in faults]

    def simulate(self, drafter, target, ids, mask, first: int, aux, k: int, device, engine: dict):
        return dspark_block_stats(drafter, target, aux.to(device), ids.to(device), first, k, **engine)


KIND = DSparkKind()
