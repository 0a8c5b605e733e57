"""``eagle3kit run``: the stages (docs/architecture.md) chained over one run directory.

Stages whose inputs are unchanged since their last run are skipped (prompts, tokenize, vocab:
keyed by the hash of their inputs and config section); ``generate`` and ``train`` resume by
themselves; ``export`` and ``evaluate`` always run. The target is loaded once and shared.
Under ``torchrun`` every process trains and rank 0 alone runs the other stages (:func:`run_all`).
"""

from __future__ import annotations

import contextlib
import resource
import time
from pathlib import Path

import torch

from eagle3kit import __version__
from eagle3kit.core.config import Config, dump_config
from eagle3kit.core.kinds import kind_for_config
from eagle3kit.core.rundir import (
    DataError,
    RunDir,
    sha256_file,
    sha256_json,
    sha256_tensors,
    write_json,
    write_text,
)
from eagle3kit.core.ui import Timer, console, print_table
from eagle3kit.data.backends import release_vllm_engine
from eagle3kit.data.generate import run_generate
from eagle3kit.data.prompts import run_prompts
from eagle3kit.data.sources import read_source, source_fingerprint
from eagle3kit.data.tokenize import run_tokenize
from eagle3kit.data.vocab import run_vocab
from eagle3kit.eval.evaluate import run_evaluate
from eagle3kit.model.contract import ExportError
from eagle3kit.model.target import (
    chat_template_hash,
    load_target,
    pick_device,
    resolve_aux_layer_ids,
    tokenizer_hash,
)
from eagle3kit.model.target_head import load_target_head
from eagle3kit.serve.export import run_export
from eagle3kit.train.distributed import Launch, end_world
from eagle3kit.train.stage import run_train


def stage_key(*parts) -> str:
    return sha256_json([p.model_dump(mode="json") if hasattr(p, "model_dump") else p for p in parts])


def _fresh(run: RunDir, stage: str, key: str, output: str) -> bool:
    inputs = run.stage_inputs(stage) or {}
    return inputs.get("stage_key") == key and (run / output).exists()


def _mark(run: RunDir, stage: str, key: str) -> None:
    m = run.manifest
    m["stages"][stage]["inputs"]["stage_key"] = key

    write_json(run / "manifest.json", m)


def write_run_header(cfg: Config, run: RunDir, target) -> None:
    """Config copy and the target's provenance in the manifest (docs/architecture.md)."""

    write_text(run / "config.yaml", dump_config(cfg))
    aux = resolve_aux_layer_ids(cfg.target, target.num_layers, cfg.drafter)
    run.update_manifest(
        eagle3kit_version=__version__,
        target={
            **target.source,
            "num_layers": target.num_layers,
            "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size,
            "dtype": cfg.target.dtype,
        },
        template_flags={},
        aux_layer_ids={"convention": "hf_output_hidden_states_index", "ids": list(aux)},
    )


def summary_rows(report: dict) -> list[tuple[str, object]]:
    """The numbers ``run`` prints at the end (from ``report.json``)."""
    ev, tr, vo = report.get("evaluate", {}), report.get("train", {}), report.get("vocab", {})
    rows: list[tuple[str, object]] = []
    for stage in ("prompts", "generate", "tokenize"):
        s = report.get(stage, {})
        dropped = {k: v for k, v in s.items() if k.startswith("dropped_") and v}
        rows.append(
            (
                f"{stage}: rows in / kept",
                f"{s.get('rows_in', '-')} / {s.get('rows_kept', '-')}"
                + (f"  dropped {dropped}" if dropped else ""),
            )
        )
    g = report.get("generate", {})
    if "truncated_share" in g:
        rows.append(("generate: share cut at max_new_tokens", g["truncated_share"]))
    rows.append(("vocab: coverage of supervised tokens", vo.get("coverage", "-")))
    rows.append(("train: final loss", tr.get("final_loss", "-")))
    rows.append(("train: step-0 accuracy", tr.get("step0_accuracy", "-")))
    rows.append(
        ("train: best validation τ (epoch)", f"{tr.get('best_val_tau', '-')} ({tr.get('best_epoch', '-')})")
    )
    if "tokens_per_s_wall" in tr:
        rows.append(
            (
                "train: tokens/s steady / wall",
                f"{tr.get('tokens_per_s_steady', '-')} / {tr['tokens_per_s_wall']}",
            )
        )
    rows.append(
        (
            "export: drafter folder (SGLang; vLLM with --speculative-config)",
            report.get("export", {}).get("path", "-"),
        )
    )
    alone = report.get("export-speculators", {}).get("path")
    if alone:
        rows.append(("export: vllm serve this folder alone", alone))
    return rows + evaluate_rows(ev)


def evaluate_rows(ev: dict) -> list[tuple[str, object]]:
    """The evaluate section of the summary (also printed by ``eagle3kit evaluate``)."""
    rows: list[tuple[str, object]] = [
        (f"evaluate: τ ({ev.get('mode', '-')}, K={ev.get('k', '-')})", ev.get("tau", "-"))
    ]
    for name, s in ev.get("sets", {}).items():
        rows.append(
            (
                f"  {name}: τ ({ev.get('mode', '-')}) / untrained τ / prompts",
                f"{s.get('tau')} / {s.get('untrained_tau', '-')} / {s.get('num_prompts')}",
            )
        )
        if "simulate_tau_same_prompts" in s:
            rows.append((f"  {name}: simulate τ on the same outputs", s["simulate_tau_same_prompts"]))
        if "speedup" in s:
            d = s.get("draft", {})
            how = "greedy" if not d.get("temperature") else f"T {d['temperature']}, top-p {d.get('top_p')}"
            rows.append(
                (
                    f"  {name}: {d.get('mode')} {d.get('steps')}/{d.get('topk')}/{d.get('num_draft_tokens')}, {how}: "
                    "tok/s spec / target-only / speedup",
                    f"{s['tokens_per_s']} / {s['baseline_tokens_per_s']} / {s['speedup']}",
                )
            )
            for c, v in (s.get("per_category") or {}).items():
                rows.append((f"    {c}: τ / speedup", f"{v['tau']} / {v['speedup']}"))
    rows.append(("evaluate: per-position acceptance (cumulative)", ev.get("per_position_acceptance", "-")))
    if "greedy_identical" in ev:
        rows.append(
            (
                "evaluate: greedy_identical",
                "n/a (sampled)" if ev["greedy_identical"] is None else ev["greedy_identical"],
            )
        )
    return rows


def export_for_vllm_alone(cfg: Config, run: RunDir, target) -> None:
    """``<run>/drafter-speculators``: the drafter in vLLM's speculators layout, naming its target, which
    ``vllm serve <run>/drafter-speculators`` serves with no other argument; a drafter that layout
    cannot hold (P-EAGLE with ``fc_norm``) is said, not refused (``<run>/drafter`` serves it)."""
    try:
        run_export(cfg, run, set_aside_existing=True, fmt="speculators", target=target)
    except ExportError as e:
        run.drop_stage("export-speculators")  # a folder moved aside and none written: the report names none
        console.print(
            f"[yellow]export: no speculators folder ({e}); serve <run>/drafter with --speculative-config"
        )


class StageClock:
    """Per stage of ``run``: wall seconds, the peak memory torch allocated on each GPU in use during it,
    and the host's peak resident memory so far (``report.json`` ``run.stages``; bytes)."""

    def __init__(self) -> None:
        self.stages: dict[str, dict] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        gpus = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else range(0)
        for i in gpus:
            torch.cuda.reset_peak_memory_stats(i)
        t = time.perf_counter()
        try:
            yield
        finally:
            rec = {
                "seconds": round(time.perf_counter() - t, 1),
                "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            }
            if torch.cuda.is_initialized():
                peaks = {
                    f"cuda:{i}": torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())
                }
                rec["gpu_peak_bytes"] = {d: b for d, b in peaks.items() if b}
            self.stages[name] = rec


def run_all(cfg: Config) -> dict:
    """Run every stage; returns ``report.json``'s content and prints the summary table. The in-process
    vLLM engine that generate and evaluate use is shut down before training on a GPU and after evaluate
    everywhere, so the process holds none of its memory when this returns.

    Under ``torchrun`` (:class:`~eagle3kit.train.distributed.Launch`) rank 0 runs the data stages
    while the other ranks wait, every rank trains, then rank 0 alone exports and evaluates (the
    others return an empty dict)."""

    run = RunDir(cfg.run_dir)
    timer, clock = Timer(), StageClock()
    launch = Launch.from_env()
    launch.agree("config-run", dump_config(cfg))  # ranks given other configs stop before any stage
    # train settings this machine or drafter kind cannot run (tf32 or flex off CUDA) fail now, not after generate
    kind = kind_for_config(cfg)
    kind.check_training(cfg, launch.size)
    kind.speed(cfg.train, pick_device(cfg.train.device), cfg.vocab.draft_vocab_size)
    target = None
    if launch.rank == 0:
        try:
            target = prepare_data(cfg, run, clock)
        except BaseException as e:
            launch.announce("data", f"{type(e).__name__}: {e}")
            raise
        # vLLM's in-process engine holds a process group of its own, and on a GPU most of its memory:
        # gone before training's (evaluate starts another when it needs one)
        if launch.size > 1 or torch.cuda.is_available():
            release_vllm_engine()
        launch.announce("data")
    else:
        if launch.local_rank == 0:
            console.print(f"node {launch.node}: waiting for rank 0's prompts → generate → tokenize → vocab")
        launch.wait_for_rank0("data")
    with clock("train"):
        run_train(cfg, run, target)
    if launch.size > 1:
        end_world()
        if launch.rank != 0:
            return {}
    with clock("export"):
        run_export(cfg, run, set_aside_existing=True)
        export_for_vllm_alone(cfg, run, target)
    if target.source.get("loaded") == "head":
        console.print(
            "[yellow]evaluate: skipped: the trainer was fed by the capture servers and holds only the target's "
            "embedding, norm and lm_head; measure the drafter where it is served (`eagle3kit bench`, `diagnose`)"
        )
    else:
        with clock("evaluate"):
            run_evaluate(cfg, run, target)
    # evaluate's engine (its continuations) is not kept past the run: on a GPU it holds nearly all the free
    # memory, which a caller of run_all in the same process (a second run, a server) would not get back
    release_vllm_engine()
    run.update_report(
        "run", {"seconds": round(timer.seconds, 1), "processes": launch.size, "stages": clock.stages}
    )
    report = run.report
    print_table(f"eagle3kit run: {Path(cfg.run_dir)} ({timer.seconds / 60:.1f} min)", summary_rows(report))
    return report


def prepare_data(cfg: Config, run: RunDir, clock: StageClock | None = None):
    """The stages before training (prompts, generate, tokenize, vocab), each skipped when its inputs
    are unchanged (generate resumes by itself); returns the loaded target, shared by the stages (only
    its embedding, final norm and lm_head when capture servers feed the trainer, ``train.online_from``,
    and a server generates, ``generate.backend: openai``). ``clock`` times each stage."""
    clock = clock or StageClock()
    console.rule(f"eagle3kit run → {run.path}")
    for (
        src
    ) in cfg.evaluate.sets:  # an evaluation set that cannot be read stops the run now, not after training
        if not read_source(src)[0]:
            raise DataError(
                f"evaluate.sets: {src.label} ({src.origin}) gives no prompt; check it and its filters"
            )
    head_only = (
        bool(cfg.train.online_from) and cfg.generate.backend == "openai"
    )  # no stage runs the target here
    with clock("load target"):
        target = (load_target_head if head_only else load_target)(cfg.target)
    write_run_header(cfg, run, target)

    sources = [source_fingerprint(s) for s in cfg.prompts.sources]  # a source that changed runs prompts again
    tok = target.tokenizer
    writer = (
        [target.source.get("weights_fingerprint"), chat_template_hash(tok)] if cfg.prompts.synthesize else []
    )
    key = stage_key(cfg.prompts, bool(cfg.evaluate.sets), cfg.target.model, sources, writer)
    if _fresh(run, "prompts", key, "prompts.jsonl"):
        console.print("prompts: up to date")
    else:
        with clock("prompts"):
            run_prompts(cfg, run, target)
        _mark(run, "prompts", key)
    with clock("generate"):
        run_generate(cfg, run, target)
    # the rendering too: another tokenizer or chat template makes other tokens from the same rows
    key = stage_key(
        cfg.tokenize, sha256_file(run / "conversations.jsonl"), tokenizer_hash(tok), chat_template_hash(tok)
    )
    if _fresh(run, "tokenize", key, "tokens.safetensors"):
        console.print("tokenize: up to date")
    else:
        with clock("tokenize"):
            run_tokenize(cfg, run, target.tokenizer, target.end_of_turn_ids())
        _mark(run, "tokenize", key)
    key = stage_key(cfg.vocab, sha256_tensors(run / "tokens.safetensors"), tokenizer_hash(tok))
    if _fresh(run, "vocab", key, "vocab.safetensors"):
        console.print("vocab: up to date")
    else:
        with clock("vocab"):
            run_vocab(cfg, run, target.tokenizer)
        _mark(run, "vocab", key)
    return target
