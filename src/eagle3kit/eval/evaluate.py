"""Stage ``evaluate``: what the drafter is worth, measured against the target itself (docs/measuring.md).

* ``simulate``: greedy-chain τ and per-position acceptance computed exactly from the target's own
  greedy continuation: the target generates (``evaluate.max_new_tokens``), one target forward runs
  over prompt + continuation, and the drafter unrolls K steps at every position with the
  continuation's tokens; replaying verify steps over those matches gives exactly what greedy
  chain decoding would accept.
* ``decode``: the reference speculative decoder (:mod:`eagle3kit.eval.decoder`) runs for real and every
  output is compared with target-only greedy output (``greedy_identical``); simulate's τ on the
  same continuations is reported beside it.

With ``evaluate.untrained_baseline`` an untrained drafter (same shape, seeded) is measured the same
way, so a report always shows what training added. Prompts seen in training are refused.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from eagle3kit.core.config import Config, ConfigError, SpecConfig
from eagle3kit.core.kinds import check_run_kind, kind_for_folder
from eagle3kit.core.lineage import check_inputs
from eagle3kit.core.metrics import AcceptanceStats
from eagle3kit.core.rundir import RunDir
from eagle3kit.core.ui import console, progress
from eagle3kit.data.backends import render_prompt_ids
from eagle3kit.data.generate import check_backend, pick_backend
from eagle3kit.eval.decoder import (
    DrafterState,
    first_divergence,
    greedy_generate,
    speculative_generate,
    target_generate,
)
from eagle3kit.eval.sets import (  # noqa: F401 (evaluate's own names, kept importable)
    check_overlap,
    chosen_sets,
    eval_sets,
    greedy_continuations,
    trained_prompt_rows,
    write_continuations,
)
from eagle3kit.model.drafter import Eagle3Drafter
from eagle3kit.model.fasttarget import FastTarget
from eagle3kit.model.folder import load_exported
from eagle3kit.model.target import Target, load_target, pick_device
from eagle3kit.model.target_files import weights_fingerprint
from eagle3kit.train.acceptance import simulate_samples
from eagle3kit.train.batches import Sample
from eagle3kit.train.samples import compute_features


def simulate(
    drafter: Eagle3Drafter,
    target: Target,
    prompts: list[list[int]],
    continuations: list[list[int]],
    k: int,
    device,
    label: str = "simulate",
) -> tuple[AcceptanceStats, list[float]]:
    """Simulated greedy-chain acceptance over (prompt, continuation) pairs.

    Returns pooled stats and the per-prompt τ (for the report's spread)."""
    return simulate_drafters([drafter], target, prompts, continuations, k, device, label)[0]


def simulate_drafters(
    drafters: list[Eagle3Drafter],
    target: Target,
    prompts: list[list[int]],
    continuations: list[list[int]],
    k: int,
    device,
    label: str = "simulate",
) -> list[tuple]:
    """:func:`simulate` for several drafters of the same aux layers on the same pairs, with one
    target pass: [(pooled stats, per-prompt τ)] in the order of ``drafters``."""
    aux_ids = drafters[0].config.aux_layer_ids
    if any(d.config.aux_layer_ids != aux_ids for d in drafters):
        raise ValueError("simulate_drafters: the drafters read different aux layers; simulate them apart")
    samples = []
    for p, c in zip(prompts, continuations):
        ids = torch.tensor(p + c, dtype=torch.long)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(p) :] = True
        samples.append(Sample(ids, mask))
    compute_features(target, samples, aux_ids, 8192, device, device, label=f"target features ({label})")
    out = [(AcceptanceStats(k), []) for _ in drafters]
    for s in samples:
        for d, (pooled, per_prompt) in zip(drafters, out):
            st = simulate_samples(d, target, [s], k, device)
            pooled.merge(st)
            per_prompt.append(st.tau)
        s.aux = s.last = s.argmax = None
    return out


def decode(
    drafter: Eagle3Drafter,
    target: Target,
    prompts: list[list[int]],
    max_new_tokens: int,
    spec,
    categories: list[str | None] | None = None,
    seed: int = 0,
    baseline: bool = True,
) -> dict:
    """Run the reference decoder (:mod:`eagle3kit.eval.decoder`) on every prompt, and target-only
    decoding with the same cache for the speedup; greedy outputs are also compared with
    transformers' ``generate`` (the losslessness check).

    Args: spec: a :class:`eagle3kit.core.config.SpecConfig` (or K, a greedy chain); categories: each
    prompt's category (MT-bench, Spec-Bench), for the per-category τ and speedup; baseline: also
    time target-only decoding (False: only the losslessness check, greedy; the speed keys are None).
    Returns dict with ``stats`` (pooled), ``greedy_identical`` (all prompts matched; None when
    sampling), ``mismatches``, ``outputs``, ``references``, ``tokens_per_s``,
    ``baseline_tokens_per_s``, ``speedup`` (wall-clock, this device) and ``per_category``.
    Raises: ValueError when ``baseline`` is False for a sampling ``spec`` (its reference is the
    target-only sample).
    """
    spec = SpecConfig(steps=spec) if isinstance(spec, int) else spec
    greedy = spec.temperature == 0
    if not (baseline or greedy):
        raise ValueError(
            "decode: a sampling spec needs baseline=True (target-only sampling is its reference)"
        )
    eot = target.end_of_turn_ids()
    longest = max(len(p) for p in prompts) + max_new_tokens + spec.n_tokens + 2
    ft = FastTarget(target.model, target.parts, drafter.config.aux_layer_ids, longest)
    ds = DrafterState(drafter, ft.embed, ft.max_len + spec.steps * spec.topk + 1, spec, target.vocab_size)
    pooled = AcceptanceStats(spec.steps)
    mismatches, refs, outs = [], [], []
    cats: dict = {}
    totals = _timing()
    with progress() as bar:
        task = bar.add_task(f"reference decode ({spec.mode})", total=len(prompts), tokens=0, note="")
        for i, p in enumerate(prompts):
            t0 = time.perf_counter()
            res = speculative_generate(
                target, drafter, p, max_new_tokens, spec, eot, seed=seed + i, ft=ft, ds=ds
            )
            t1 = time.perf_counter()
            base = []
            if baseline:
                base = target_generate(
                    ft, p, max_new_tokens, eot, spec.temperature, spec.top_p, seed=seed + i
                )
            t2 = time.perf_counter()
            ref = greedy_generate(target, p, max_new_tokens) if greedy else base
            refs.append(ref)
            outs.append(res.tokens)
            pooled.merge(res.stats)
            if greedy and res.tokens != ref:
                mismatches.append({"prompt_index": i, **(first_divergence(target, p, res.tokens, ref) or {})})
            c = cats.setdefault((categories or [None] * len(prompts))[i] or "-", _timing(spec.steps))
            c["stats"].merge(res.stats)
            c["n"] += 1
            for d in (c, totals):
                d["tokens"] += len(res.tokens)
                d["seconds"] += t1 - t0
                d["base_tokens"] += len(base)
                d["base_seconds"] += t2 - t1
            bar.update(task, advance=1, tokens=totals["tokens"], note=f"τ {pooled.tau:.2f}")
    return {
        "stats": pooled,
        "greedy_identical": (not mismatches) if greedy else None,
        "mismatches": mismatches,
        "outputs": outs,
        "references": refs,
        **_speed(totals, baseline),
        "per_category": {
            k: {"prompts": v["n"], "tau": round(v["stats"].tau, 4), **_speed(v, baseline)}
            for k, v in cats.items()
        },
    }


def _timing(k: int | None = None) -> dict:
    """Token and second counters of :func:`decode` (with per-category ``stats`` and ``n`` when ``k``)."""
    d = {"tokens": 0, "seconds": 0.0, "base_tokens": 0, "base_seconds": 0.0}
    return d if k is None else {"stats": AcceptanceStats(k), "n": 0, **d}


def _speed(d: dict, baseline: bool) -> dict:
    """Tokens/s with and without speculation and their ratio (None without a timed baseline)."""
    if not baseline:
        return {"tokens_per_s": None, "baseline_tokens_per_s": None, "speedup": None}
    tps, btps = d["tokens"] / max(d["seconds"], 1e-9), d["base_tokens"] / max(d["base_seconds"], 1e-9)
    return {
        "tokens_per_s": round(tps, 2),
        "baseline_tokens_per_s": round(btps, 2),
        "speedup": round(tps / btps, 4),
    }


def untrained_drafter(drafter: Eagle3Drafter, seed: int = 12345) -> Eagle3Drafter:
    """A freshly initialised drafter of the same shape and vocabulary (the baseline)."""
    torch.manual_seed(seed)
    d = Eagle3Drafter(drafter.config).to(device=drafter.fc.weight.device, dtype=drafter.fc.weight.dtype)
    d.d2t.copy_(drafter.d2t)
    d.t2d.copy_(drafter.t2d)
    return d.eval()


def run_evaluate(
    cfg: Config,
    run: RunDir,
    target: Target | None = None,
    drafter_dir: str | None = None,
    mode: str | None = None,
    k: int | None = None,
    only_sets: list[str] | None = None,
    section: str = "evaluate",
) -> dict:
    """Evaluate the exported drafter (``<run>/drafter`` or ``drafter_dir``) on every prompt set
    (or those named in ``only_sets``); the result goes to ``report.json`` under ``section``.

    Raises:
        StaleInput: the run's drafter (no ``drafter_dir``) is not the export of its checkpoint, or
            something it was built from changed since (see :mod:`eagle3kit.core.lineage`).
        ConfigError: the drafter was trained for another target.
    """
    mode, k = mode or cfg.evaluate.mode, k or cfg.evaluate.k
    folder = Path(drafter_dir) if drafter_dir else run.path / "drafter"
    kind = kind_for_folder(folder)
    if not drafter_dir and (folder / "config.json").is_file():
        check_run_kind(kind, cfg.drafter.variant, folder)
    return kind.evaluate(cfg, run, target, folder, bool(drafter_dir), mode, k, only_sets, section)


def evaluate_chain_drafter(
    cfg: Config,
    run: RunDir,
    target: Target | None,
    folder: Path,
    given: bool,
    mode: str,
    k: int,
    only_sets: list[str] | None,
    section: str,
) -> dict:
    """:func:`run_evaluate` for an EAGLE-3 family folder (its kind's
    :meth:`~eagle3kit.core.kinds.DrafterKind.evaluate`); ``given``: a folder named by the user, whose
    lineage is not the run's."""
    ec = cfg.evaluate
    device = pick_device(ec.device)
    target, drafter, folder = _checked_drafter(
        cfg, run, target, str(folder) if given else None, device, tree=mode == "decode" and ec.draft == "tree"
    )
    train_rows = trained_prompt_rows(run)
    backend = check_backend(pick_backend(cfg.generate.backend), cfg.generate.backend, target)
    baseline = untrained_drafter(drafter) if ec.untrained_baseline else None
    report: dict = {
        "mode": mode,
        "k": k,
        "max_new_tokens": ec.max_new_tokens,
        "sets": {},
        "drafter": str(folder),
    }
    all_stats, all_base = AcceptanceStats(k), AcceptanceStats(k)
    n_prompts, identical = 0, None  # None: nothing compared (sampling)
    for name, rows in chosen_sets(cfg, run, only_sets).items():
        prompts = [render_prompt_ids(target.tokenizer, r["messages"]) for r in rows]
        entry: dict = {"num_prompts": len(rows), **check_overlap(train_rows, rows)}
        if mode == "simulate":
            stats, conts, base = _simulate_set(
                cfg, run, section, name, rows, prompts, drafter, baseline, target, backend, k, device, entry
            )
        else:
            stats, conts = _decode_set(cfg, name, rows, prompts, drafter, target, k, device, entry)
            if entry["greedy_identical"] is not None:
                identical = (
                    entry["greedy_identical"]
                    if identical is None
                    else identical and entry["greedy_identical"]
                )
            base = None
            if baseline is not None:
                base = simulate(baseline, target, prompts, conts, k, device, f"{name}, untrained drafter")[0]
        entry.update(stats.as_dict())
        if base is not None:
            entry["untrained_tau"] = round(base.tau, 4)
            all_base.merge(base)
        report["sets"][name] = entry
        all_stats.merge(stats)
        n_prompts += len(rows)
        console.print(
            f"evaluate {name}: τ(K={k}, {mode}) = {stats.tau:.3f} over {len(rows)} prompts"
            + (f"; untrained {entry['untrained_tau']:.3f}" if baseline is not None else "")
        )
    report.update(all_stats.as_dict())
    report["num_prompts"] = n_prompts
    if baseline is not None:
        report["untrained_tau"] = round(all_base.tau, 4)
    if mode == "decode":
        report["greedy_identical"] = identical
    run.record_stage(section, {"drafter": str(folder), "mode": mode, "k": k}, report)
    return report


def _checked_drafter(
    cfg: Config, run: RunDir, target: Target | None, drafter_dir: str | None, device, tree: bool = False
):
    """``(target, drafter, folder)``: the drafter loaded in the target's dtype after its lineage (the
    run's own drafter), its drafting (``tree``: a P-EAGLE drafter drafts chains only) and its target
    (widths, vocabulary, weights fingerprint, layers) are checked.

    Raises:
        StaleInput, ConfigError: as :func:`run_evaluate`."""
    folder = Path(drafter_dir) if drafter_dir else run.require("drafter/model.safetensors", "export").parent
    if not drafter_dir:  # the run's own drafter: its chain (checkpoint, tokens, vocab, target weights) first
        fp = (
            target.source.get("weights_fingerprint")
            if target is not None
            else weights_fingerprint(cfg.target)
        )
        check_inputs(run, "evaluate", ["drafter/model.safetensors", "heldout.jsonl"], target=fp)
    drafter = load_exported(folder, device=device).eval()
    if drafter.config.parallel_drafting and tree:
        raise ConfigError(
            f"{folder} is a P-EAGLE (parallel-drafting) drafter, which drafts a chain: use --draft chain"
        )
    if target is None:
        target = load_target(cfg.target, device=device)
    check_drafter_target(folder, drafter, target, cfg.target.model)
    return target, drafter.to(target.dtype), folder


def check_drafter_target(folder: Path, drafter: Eagle3Drafter, target: Target, model: str) -> None:
    """Refuse a drafter that was trained for another target than ``target`` (named ``model``):
    other widths or vocabulary, other weights (the fingerprint its config records), aux layers past
    the target's depth. Warns when the recorded fingerprint has an older format.

    Raises:
        ConfigError: naming both values and the fix."""
    dc = drafter.config
    if dc.target_hidden_size != target.hidden_size or dc.vocab_size != target.vocab_size:
        raise ConfigError(
            f"{folder} was trained for another target (hidden {dc.target_hidden_size}, vocab {dc.vocab_size}) "
            f"than {model} ({target.hidden_size}, {target.vocab_size})"
        )
    trained_on = (json.loads((folder / "config.json").read_text()).get("eagle3kit") or {}).get("target") or {}
    fp, now = trained_on.get("weights_fingerprint"), target.source.get("weights_fingerprint")
    if (
        fp
        and now
        and fp != now
        and trained_on.get("fingerprint_format") != target.source.get("fingerprint_format")
    ):
        console.print(
            f"[yellow]warning:[/] {folder} records its target's weights with an older fingerprint rule; "
            f"the target's identity cannot be checked (same model name: {trained_on.get('model')})"
        )
    elif fp and now and fp != now:
        raise ConfigError(
            f"{folder} was trained on another target ({trained_on.get('model')}, weights {fp[:12]}…) than "
            f"{model} (weights {now[:12]}…); evaluate it with the target it was trained for"
        )
    if max(dc.aux_layer_ids) >= target.num_layers:
        raise ConfigError(
            f"{folder} reads aux layers {dc.aux_layer_ids}, but {model} has "
            f"{target.num_layers} layers: it was trained for another target"
        )


def _simulate_set(
    cfg, run, section, name, rows, prompts, drafter, baseline, target, backend, k, device, entry
):
    """Simulate mode on one set: the target's greedy continuations (written beside the report),
    then the trained (and untrained) drafter over them. Fills ``entry``; returns
    ``(stats, continuations, untrained stats or None)``."""
    ec = cfg.evaluate
    conts = greedy_continuations(
        target, prompts, ec.max_new_tokens, backend, cfg.generate.batch_size, cfg.generate.engine_args
    )
    both = simulate_drafters(
        [drafter] + ([baseline] if baseline is not None else []),
        target,
        prompts,
        conts,
        k,
        device,
        f"{name}, trained drafter" + (" and untrained" if baseline is not None else ""),
    )
    hit = sum(1 for c in conts if len(c) >= ec.max_new_tokens)
    entry["hit_max_new_tokens_share"] = round(hit / max(len(conts), 1), 4)
    entry["continuations"] = str(write_continuations(run, section, name, rows, prompts, conts, backend))
    return both[0][0], conts, (both[1][0] if baseline is not None else None)


_DECODE_KEYS = (
    "greedy_identical",
    "mismatches",
    "tokens_per_s",
    "baseline_tokens_per_s",
    "speedup",
    "per_category",
)


def _decode_set(cfg, name, rows, prompts, drafter, target, k, device, entry):
    """Decode mode on one set: the reference decoder (:func:`decode`) and, for a greedy chain,
    simulate on the decoded outputs beside it. Fills ``entry``; returns ``(stats, references)``."""
    ec = cfg.evaluate
    spec = ec.model_copy(update={"k": k}).spec()
    dec = decode(drafter, target, prompts, ec.max_new_tokens, spec, [r.get("category") or name for r in rows])
    entry.update({k_: dec[k_] for k_ in _DECODE_KEYS})
    entry["draft"] = {
        "mode": spec.mode,
        "steps": spec.steps,
        "topk": spec.topk,
        "num_draft_tokens": spec.n_tokens,
        "temperature": spec.temperature,
        "top_p": spec.top_p,
    }
    stats, conts = dec["stats"], dec["references"]
    if spec.mode == "chain" and spec.temperature == 0:  # simulate replays exactly greedy chain drafting
        sim, _ = simulate(drafter, target, prompts, conts, k, device, f"{name}, simulate on decoded outputs")
        entry["simulate_tau_same_prompts"] = round(sim.tau, 4)
        entry["decode_vs_simulate_rel_diff"] = round(abs(stats.tau - sim.tau) / sim.tau, 4)
    return stats, conts
