"""``evaluate`` for a DFlash drafter folder: the target's greedy continuation of every held-out prompt,
then block drafting over it (:func:`eagle3kit.drafters.dflash.objective.simulate_block_tau`): each verify step drafts
``k`` tokens in one forward from the bonus token and the context before it, and accepts the run that
equals the target's own greedy tokens — the τ a lossless greedy engine gets on the same prompts (the
states are causal, so one target pass over the finished sequence gives those the engine computed step
by step)."""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3kit.core.config import Config, ConfigError
from eagle3kit.core.lineage import check_inputs
from eagle3kit.core.metrics import AcceptanceStats
from eagle3kit.core.rundir import RunDir
from eagle3kit.core.ui import console
from eagle3kit.data.backends import render_prompt_ids
from eagle3kit.data.generate import check_backend, pick_backend
from eagle3kit.drafters.dflash.folder import read_dflash
from eagle3kit.drafters.dflash.objective import simulate_block_tau
from eagle3kit.eval.sets import (
    check_overlap,
    chosen_sets,
    greedy_continuations,
    trained_prompt_rows,
    write_continuations,
)
from eagle3kit.model.target import load_target, pick_device
from eagle3kit.model.target_files import weights_fingerprint
from eagle3kit.train.batches import Sample
from eagle3kit.train.samples import compute_features


def block_taus(
    drafters: list, target, prompts: list[list[int]], continuations: list[list[int]], ks, device
) -> list[dict]:
    """For each drafter (the same target layers: a trained one and its untrained baseline) and each draft
    length in ``ks``: pooled block-drafting stats and the per-prompt τ over (prompt, greedy continuation)
    pairs, from one batched target pass (the states depend on neither the drafter nor k). Returns one
    ``{k: (pooled, per_prompt)}`` per drafter, in order."""
    samples = []
    for p, c in zip(prompts, continuations):
        if c:
            ids = torch.tensor(p + c, dtype=torch.long)
            mask = torch.zeros(len(ids), dtype=torch.bool)
            mask[len(p) :] = True
            samples.append(Sample(ids, mask))
    layers = drafters[0].cfg.aux_layer_ids
    compute_features(target, samples, layers, 8192, device, device, label="target states")
    res = [{k: (AcceptanceStats(k), []) for k in ks} for _ in drafters]
    for s in samples:
        for d, out in zip(drafters, res):
            for k, (pooled, per_prompt) in out.items():
                st = simulate_block_tau(d, target, [s], k, device)
                pooled.merge(st)
                per_prompt.append(st.tau)
        s.aux = s.last = s.argmax = None
    return res


def dflash_taus(
    drafter, target, prompts: list[list[int]], continuations: list[list[int]], ks, device
) -> dict:
    """:func:`block_taus` of one drafter: ``{k: (pooled stats, per-prompt τ)}``."""
    return block_taus([drafter], target, prompts, continuations, ks, device)[0]


def check_dflash_target(folder: Path, drafter, target, model: str) -> None:
    """Refuse a DFlash drafter made for another target than ``target`` (named ``model``): another hidden
    size or vocabulary, or target layers past its depth.

    Raises:
        ConfigError: naming both and the drafter's target layers."""
    d = drafter.cfg
    if (
        d.hidden_size != target.hidden_size
        or d.vocab_size != target.vocab_size
        or max(d.aux_layer_ids) >= target.num_layers
    ):
        raise ConfigError(
            f"{folder} was made for another target (hidden {d.hidden_size}, vocabulary {d.vocab_size}, layers "
            f"{d.target_layer_ids}) than {model} ({target.hidden_size}, {target.vocab_size}, "
            f"{target.num_layers} layers)"
        )


def run_evaluate_dflash(
    cfg: Config, run: RunDir, target, folder: Path, given: bool, k: int, only_sets, section: str
) -> dict:
    """:func:`eagle3kit.eval.evaluate.run_evaluate` for a DFlash folder (simulate mode; ``k`` ≤ block − 1).

    Raises:
        ConfigError: ``k`` past the block, a drafter of another target (hidden size, vocabulary, layers).
        StaleInput: the run's own drafter no longer matches its checkpoint or inputs."""
    ec = cfg.evaluate
    device = pick_device(ec.device)
    if not given:
        fp = (
            target.source.get("weights_fingerprint")
            if target is not None
            else weights_fingerprint(cfg.target)
        )
        check_inputs(run, "evaluate", ["drafter/model.safetensors", "heldout.jsonl"], target=fp)
    drafter = read_dflash(folder).to(device).eval()
    d = drafter.cfg
    if k > d.block_size - 1:
        raise ConfigError(
            f"k {k} > {d.block_size - 1}: a block of {d.block_size} drafts at most block_size − 1 tokens"
        )
    target = target if target is not None else load_target(cfg.target, device=device)
    check_dflash_target(folder, drafter, target, cfg.target.model)
    drafter = drafter.to(target.dtype)
    backend = check_backend(pick_backend(cfg.generate.backend), cfg.generate.backend, target)
    train_rows = trained_prompt_rows(run)
    report: dict = {"mode": "simulate", "k": k, "drafter_kind": "dflash", "max_new_tokens": ec.max_new_tokens,
                    "sets": {}, "drafter": str(folder)}  # fmt: skip
    pooled, pooled_base = AcceptanceStats(k), AcceptanceStats(k)
    n_prompts = 0
    # the baseline, as the EAGLE section has it: a drafter of the same shape, freshly initialised (seeded)
    baseline = None
    if ec.untrained_baseline:
        torch.manual_seed(12345)
        baseline = type(drafter)(d).to(device=device, dtype=target.dtype).eval()
    for name, rows in chosen_sets(cfg, run, only_sets).items():
        prompts = [render_prompt_ids(target.tokenizer, r["messages"]) for r in rows]
        entry: dict = {"num_prompts": len(rows), **check_overlap(train_rows, rows)}
        conts = greedy_continuations(
            target, prompts, ec.max_new_tokens, backend, cfg.generate.batch_size, cfg.generate.engine_args
        )
        got = block_taus([drafter, baseline] if baseline else [drafter], target, prompts, conts, (k,), device)
        stats = got[0][k][0]
        entry.update(stats.as_dict())
        hit = sum(1 for c in conts if len(c) >= ec.max_new_tokens)
        entry["hit_max_new_tokens_share"] = round(hit / max(len(conts), 1), 4)
        if baseline is not None:
            base = got[1][k][0]
            entry["untrained_tau"] = round(base.tau, 4)
            pooled_base.merge(base)
        entry["continuations"] = str(write_continuations(run, section, name, rows, prompts, conts, backend))
        report["sets"][name] = entry
        pooled.merge(stats)
        n_prompts += len(rows)
        console.print(
            f"evaluate {name}: τ(K={k}, DFlash block) = {stats.tau:.3f} over {len(rows)} prompts"
            + (f"; untrained {entry['untrained_tau']:.3f}" if baseline is not None else "")
        )
    report.update(pooled.as_dict())
    report["num_prompts"] = n_prompts
    if baseline is not None:
        report["untrained_tau"] = round(pooled_base.tau, 4)
    run.record_stage(section, {"drafter": str(folder), "mode": "simulate", "k": k}, report)
    return report
