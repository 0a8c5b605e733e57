"""Serving on a GPU: SmolLM2-135M-Instruct served by vLLM in bf16, alone and with each drafter kind eagle3kit
trains (train's default EAGLE-3.1, EAGLE-3, DFlash) and SpecForge 0.2.0's EAGLE-3 drafter, all trained on the
example recipe's data (examples/smollm2-shared-data.yaml, its prompt files read from ``--shared``), at 3, 5 and
7 draft tokens.

Stages (each resumable: a finished run, diagnosis or bench record is read back, not made again):

1. ``eagle3kit run`` of the recipe for the first drafter (prompts, SmolLM2's replies, tokens, vocabulary,
   training, export, evaluate); then the others trained on a copy of its data stages (the same tokens):
   eagle3kit's by ``eagle3kit run``, SpecForge's by its own trainer (benchmarks/serving_gpu_peer.py; its own
   export is what vLLM serves). With ``--online``, right after the first: the first drafter trained again
   from a capture server on the same GPU, beside its offline run (benchmarks/serving_gpu_online.py).
2. The plain server (no speculation), started first and kept; then, one at a time (two vLLM servers
   started together on one GPU each count the other's memory as their own), a server per drafter and K.
3. Against each drafter's server: ``eagle3kit diagnose`` on the bench prompts, each sent alone — τ from
   vLLM's counters beside τ simulated by eagle3kit on the same prompts and vLLM's own outputs, and the
   verdict; then ``eagle3kit bench`` against the plain server at every ``--concurrency``: output
   tokens/s, speedup, TTFT, TPOT and vLLM's τ.
4. With ``--faults DRAFTERS``, before the rows: copies of those drafters with a planted integration fault,
   each served alone and diagnosed (benchmarks/serving_gpu_faults.py); at the end, ``bench --compare`` of the
   first two drafters' records at the smallest K.
5. The cost model, from concurrency 1: the plain server's time per output token T (one target
   step), the drafter's server's time per verify step S = TPOT × τ, and the overhead of drafting and
   verifying O = S − T; speedup = τ / (1 + O / T), so a target whose step takes T' instead gets about
   τ / (1 + O / T') with the same drafter and τ (O grows with the drafter's size, not the target's,
   while a verify step of K + 1 tokens costs about one decode step: memory-bound at batch 1).

Prompts: the first ``--prompts`` of MT-bench and of the held-out GSM8K questions (the recipe's evaluate
sets), ``--max-tokens`` each, greedy.

    python benchmarks/serving_gpu.py --work /tmp/sg --shared ../shared [--drafters eagle3.1,eagle3,dflash]
        [--ks 3,5,7] [--concurrency 1,4,16,64] [--prompts 40] [--max-tokens 256] [--faults eagle3.1,dflash]
        [--online] [--smoke]

``--smoke`` rehearses every stage on vLLM's CPU build (float32, a few prompts and tokens, one epoch):
it checks the plumbing, not the numbers. Writes ``benchmarks/results/serving_gpu.json`` (``--out``) and a
plot beside it, and prints one table. On a GPU machine without network: vLLM from tools/stage_vllm_gpu.py
(CONTRIBUTING.md), and of ``--shared`` only data/prompts/{mt_bench,spec_bench}.jsonl and
data/chats/{oasst_en_100_tree,gsm8k_train}.jsonl are read (5.7 MB: carry them in a folder of that layout).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "serving_gpu.json"
EXAMPLE = ROOT / "examples" / "smollm2-shared-data.yaml"
DRAFTERS = {  # name: (drafter section, train settings over the recipe's, vLLM's method)
    "eagle3.1": ({"variant": "eagle3.1"}, {}, "eagle3"),
    "eagle3": ({"variant": "eagle3"}, {}, "eagle3"),
    # 5 layers, blocks of 8 (K up to 7); 4,096 tokens a step: 8,192 needs about 75 GiB (an 80 GB H100 ran out)
    "dflash": ({"variant": "dflash"}, {"lr": 6e-4, "tokens_per_step": 4096}, "dflash"),
    # SpecForge 0.2.0's trainer on the same data (serving_gpu_peer.py); its own export is what vLLM serves
    "specforge": ({"variant": "eagle3"}, {}, "eagle3"),
}
SMOKE = {"limit": 12, "max_new_tokens": 16, "epochs": 1, "tokens_per_step": 256}
SETS = ("mt_bench", "gsm8k_heldout")


def parse_list(text: str, name: str, allowed=None, low: int = 1) -> list:
    """``--NAME a,b,c``: the entries, each one of ``allowed`` (names) or an integer ≥ ``low``, none twice.

    Raises:
        SystemExit: naming the option, the bad entry and what is wanted."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or "" in parts:
        raise SystemExit(f"--{name} {text!r}: an empty entry; give a comma-separated list")
    out = []
    for p in parts:
        if allowed is not None:
            if p not in allowed:
                raise SystemExit(f"--{name} {text!r}: {p!r} is not one of {', '.join(allowed)}")
            v = p
        else:
            if not (p.isascii() and p.isdigit()) or int(p) < low:
                raise SystemExit(f"--{name} {text!r}: {p!r} is not an integer of at least {low}")
            v = int(p)
        if v in out:
            raise SystemExit(f"--{name} {text!r}: {p} is given twice")
        out.append(v)
    return out


def check_args(args) -> None:
    """Refuse bad options before anything runs; ``<work>/settings.json`` keeps the first run's sizes so
    that a resumed run cannot mix records made with other ones."""
    args.drafter_list = parse_list(args.drafters, "drafters", list(DRAFTERS))
    if args.drafter_list[0] == "specforge":
        raise SystemExit(
            f"--drafters {args.drafters!r}: specforge trains on the first drafter's data; name an eagle3kit "
            "drafter first (eagle3.1, eagle3 or dflash)"
        )
    args.k_list = parse_list(args.ks, "ks", low=1)
    if max(args.k_list) > 7:
        raise SystemExit(f"--ks {args.ks}: the drafters train 7 TTT steps (DFlash blocks of 8): K up to 7")
    args.levels = parse_list(args.concurrency, "concurrency", low=1)
    args.fault_list = parse_list(args.faults, "faults", list(DRAFTERS)) if args.faults.strip() else []
    if set(args.fault_list) - set(args.drafter_list):
        missing = ", ".join(sorted(set(args.fault_list) - set(args.drafter_list)))
        raise SystemExit(
            f"--faults {args.faults!r}: {missing} not in --drafters {args.drafters!r}: add it there"
        )
    if args.prompts < 1 or args.max_tokens < 1:
        raise SystemExit(f"--prompts {args.prompts} --max-tokens {args.max_tokens}: give at least 1 of each")
    shared = Path(args.shared)
    for rel in ("data/prompts/mt_bench.jsonl", "data/chats/gsm8k_train.jsonl"):
        if not (shared / rel).is_file():
            raise SystemExit(f"--shared {shared}: {rel} is missing; pass the shared folder holding data/")
    work = Path(args.work)
    if work.exists() and not work.is_dir():
        raise SystemExit(f"--work {work}: exists and is not a folder; pass a new folder or an earlier run's")
    # what every record in --work was made with; --ks and further --drafters only add records
    settings = {
        "first_drafter": args.drafter_list[0],
        "concurrency": sorted(args.levels),
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "smoke": args.smoke,
    }
    path = work / "settings.json"
    if path.exists():
        from common import read_json_object

        before = read_json_object(path, "delete it or use another --work")
        diff = [
            f"{k}: {settings[k]} here, {before.get(k)} there"
            for k in settings
            if before.get(k) != settings[k]
        ]
        if diff:
            raise SystemExit(
                f"--work {work} holds records made with other settings ({'; '.join(diff)}): give the same "
                "values, or another --work (other K or drafters may be added to a --work)"
            )
    else:
        work.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings) + "\n")


def run_config(args, name: str) -> Path:
    """``<work>/<name>/config.yaml``: the recipe with its prompt files read from ``--shared``, this drafter's
    section and train settings (``--smoke``: a few prompts and tokens, one epoch)."""
    import yaml

    cfg = yaml.safe_load(EXAMPLE.read_text())
    cfg["run_dir"] = str((Path(args.work) / name / "run").resolve())
    for src in cfg["prompts"]["sources"] + cfg["evaluate"]["sets"]:
        src["path"] = str((Path(args.shared) / src["path"].split("shared/", 1)[1]).resolve())
        if args.smoke:
            src["limit"] = SMOKE["limit"]
    section, train, _ = DRAFTERS[name]
    cfg["drafter"] = dict(section)
    cfg["train"].update(train)
    if args.smoke:
        cfg["generate"]["max_new_tokens"] = cfg["evaluate"]["max_new_tokens"] = SMOKE["max_new_tokens"]
        cfg["train"].update(epochs=SMOKE["epochs"], tokens_per_step=SMOKE["tokens_per_step"])
    out = Path(args.work) / name / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


def train(args, name: str) -> Path:
    """The drafter's run folder, trained once (``trained.json`` written last marks it done); every drafter
    but the first copies the first run's data stages, so all train on the same tokens."""
    from eagle3kit.core.config import load_config
    from eagle3kit.pipeline import run_all

    d = Path(args.work) / name
    run, done = d / "run", d / "trained.json"
    if done.exists() and (run / "drafter").is_dir():
        return run
    first = args.drafter_list[0]
    if name != first:
        keep = shutil.ignore_patterns("checkpoints", "drafter*", "evaluate", "tensorboard", "train_log.jsonl")
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(train(args, first), run, ignore=keep)
    if name == "specforge":
        from serving_gpu_peer import train_specforge

        shutil.copy(run_config(args, name), run / "config.yaml")  # what open_run reads
        return train_specforge(args, run, done)
    t0 = time.time()
    report = run_all(load_config(run_config(args, name)))
    sets = (report.get("evaluate") or {}).get("sets") or {}
    done.write_text(
        json.dumps(
            {"seconds": round(time.time() - t0, 1), "evaluate": {s: sets.get(s, {}).get("tau") for s in SETS}}
        )
        + "\n"
    )
    return run


def target_folder() -> Path:
    """The target's safetensors folder vLLM reads (SmolLM2 exported in float32 once, then reused)."""
    from eagle3kit.core.config import TargetConfig
    from eagle3kit.model.target import load_target
    from eagle3kit.model.target_export import export_fp32_folder

    return export_fp32_folder(load_target(TargetConfig(), device="cpu"))


def bench_prompts(args) -> Path:
    """``<work>/prompts.jsonl``: the first ``--prompts`` of each evaluate set (MT-bench, held-out GSM8K)."""
    from eagle3kit.core.config import PromptSource
    from eagle3kit.data.sources import read_source

    shared = Path(args.shared)
    rows = read_source(PromptSource(path=str(shared / "data/prompts/mt_bench.jsonl"), limit=args.prompts))[0]
    rows += read_source(
        PromptSource(path=str(shared / "data/chats/gsm8k_train.jsonl"), start=-80, limit=args.prompts)
    )[0]
    out = Path(args.work) / "prompts.jsonl"
    out.write_text("".join(json.dumps({"messages": r["messages"][:1]}) + "\n" for r in rows))
    return out


def server(args, target: Path, log: Path, spec: dict | None, name: str = "smollm2"):
    """A vLLM server for ``target`` served as ``name``: the CPU build's flags with ``--smoke``, else bf16 on
    the GPU with vLLM's defaults (CUDA graphs) in ``--gpu-share`` of its memory."""
    from eagle3kit.core.engines import VLLMServer, free_port

    class GPUServer(VLLMServer):
        def engine_args(self) -> list[str]:
            return [
                "--dtype",
                "bfloat16",
                "--max-model-len",
                "2048",
                "--gpu-memory-utilization",
                str(args.gpu_share),
            ]

    cls = VLLMServer if args.smoke else GPUServer
    return cls(target, free_port(), log, served_name=name, speculative=spec)


def cli(args_list: list[str], log: Path) -> int:
    """``python -m eagle3kit ARGS`` with its output in ``log``; returns the exit code."""
    with log.open("w") as fh:
        return subprocess.run(
            [sys.executable, "-m", "eagle3kit", *args_list], stdout=fh, stderr=subprocess.STDOUT
        ).returncode


def diagnose(args, url: str, drafter: Path, prompts: Path, d: Path) -> int:
    """``eagle3kit diagnose`` against the server at ``url`` given ``drafter`` as trained, on the first
    2 × ``--prompts`` of ``prompts`` each sent alone, in the served numerics (bf16 on a GPU): its report in
    ``d/diagnose/``, its output in ``d/diagnose.log``; returns its exit code (0 agree, 1 a fault named)."""
    return cli(["diagnose", "--base-url", url, "--drafter", str(drafter), "--prompts", str(prompts),
                "--num-prompts", str(2 * args.prompts), "--max-tokens", str(args.max_tokens), "--out",
                str(d / "diagnose"), "--overwrite", *([] if args.smoke else ["--dtype", "bfloat16"])],
               d / "diagnose.log")  # fmt: skip


def measure(args, key: str, drafter: Path, spec, plain, prompts: Path) -> dict:
    """diagnose (each prompt alone) and bench (every level) against one drafter's server; each record
    kept in ``<work>/<key>/`` and read back on a rerun."""
    d = Path(args.work) / key
    d.mkdir(parents=True, exist_ok=True)
    if not (d / "diagnose" / "diagnose.json").exists():
        diagnose(args, spec.url, drafter, prompts, d)  # exit 1 when a fault is named: its report is kept
    if not (d / "bench" / "bench.json").exists():
        code = cli(["bench", "--base-url", spec.url, "--baseline-url", plain.url + "/v1", "--prompts", str(prompts),
                    "--concurrency", ",".join(map(str, args.levels)), "--max-tokens", str(args.max_tokens),
                    "--drafter", str(drafter), "--hardware", args.hardware, "--out", str(d / "bench"),
                    "--overwrite"], d / "bench.log")  # fmt: skip
        if code:
            raise SystemExit(f"bench against {key} exited {code}: see {d / 'bench.log'}")
    diag = (
        json.loads((d / "diagnose" / "diagnose.json").read_text())
        if (d / "diagnose" / "diagnose.json").exists()
        else {}
    )
    return {"diagnose": diag, "bench": json.loads((d / "bench" / "bench.json").read_text())}


def row(name: str, k: int, got: dict, evaluate: dict) -> dict:
    """One drafter and K: τ served and simulated on the same outputs, the verdict, and per level the
    speed with and without the drafter; ``cost``: the model of the module's docstring at concurrency 1."""
    diag, rec = got["diagnose"], got["bench"]
    spec, base = rec["servers"]["speculative"]["results"], rec["servers"]["baseline"]["results"]
    levels = {}
    for s, b in zip(spec, base, strict=True):
        levels[str(s["concurrency"])] = {
            "output_tokens_per_s": s["output_tokens_per_s"],
            "plain_output_tokens_per_s": b["output_tokens_per_s"],
            "speedup": s.get("speedup"),
            "tau_vllm": (s.get("acceptance") or {}).get("tau"),
            "ttft_ms_p50": s["ttft_ms"]["p50"],
            "tpot_ms_p50": s["tpot_ms"]["p50"],
            "plain_tpot_ms_p50": b["tpot_ms"]["p50"],
        }
    out = {
        "drafter": name,
        "k": k,
        "tau_served": (diag.get("engine") or {}).get("tau"),
        "tau_simulated": (diag.get("reference") or {}).get("tau"),
        "verdict": diag.get("verdict"),
        "tau_evaluate_recipe_sets": evaluate,
        "levels": levels,
    }
    c1 = levels.get("1")
    if c1 and c1["tau_vllm"]:
        t, s = c1["plain_tpot_ms_p50"], c1["tpot_ms_p50"] * c1["tau_vllm"]
        out["cost"] = {
            "target_step_ms": t,
            "verify_step_ms": round(s, 3),
            "overhead_ms": round(s - t, 3),
            "formula": "speedup = tau / (1 + overhead / target_step): carry tau and overhead to another target",
        }
    return out


def serve_all(args, runs: dict, prompts: Path, on_row=None) -> list[dict]:
    """The plain server kept up; each drafter's server at each K started alone, measured, killed;
    ``on_row(rows so far)`` after each row (the results written as they come, in case the machine goes)."""
    from serving_gpu_peer import served_folder, served_note, start_drafter_server

    work = Path(args.work)
    keys = [f"{name}-k{k}" for name in args.drafter_list for k in args.k_list]
    if all((work / key / p).exists() for key in keys for p in ("diagnose/diagnose.json", "bench/bench.json")):
        plain = target = None  # every record made: read back, no server started
    else:
        target = target_folder()
        plain = server(args, target, work / "plain.log", None)
        plain.start(900)
    rows = []
    try:
        for name in args.drafter_list:
            evaluate = json.loads((work / name / "trained.json").read_text())["evaluate"]
            for k in args.k_list:
                key = f"{name}-k{k}"
                spec_cfg = {
                    "method": DRAFTERS[name][2],
                    "model": str(served_folder(runs[name])),  # serving_gpu_peer.py
                    "num_speculative_tokens": k,
                }
                done = all((work / key / p).exists() for p in ("diagnose/diagnose.json", "bench/bench.json"))
                spec = None
                try:
                    if not done:
                        spec = start_drafter_server(server, args, target, work / key, spec_cfg, runs[name])
                    rows.append(
                        row(
                            name,
                            k,
                            measure(args, key, runs[name] / "drafter", spec, plain, prompts),
                            evaluate,
                        )
                    )
                    r = rows[-1]
                    r["served_folder"] = served_note(work / key)
                    print(
                        f"{key}: τ served {r['tau_served']}, simulated {r['tau_simulated']}, {r['verdict']}",
                        flush=True,
                    )
                    if on_row is not None:
                        on_row(rows)
                finally:
                    if spec is not None:
                        spec.kill()
    finally:
        if plain is not None:
            plain.kill()
    return rows


def machine(args) -> dict:
    """The card and the versions the numbers come from."""
    import torch
    import vllm

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    hardware = "CPU, vLLM's CPU build (--smoke)" if args.smoke else args.hardware
    return {"gpu": gpu, "hardware": hardware, "vllm": vllm.__version__, "torch": torch.__version__,
            "smoke": args.smoke}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True, help="working folder (runs, servers' logs, records)")
    ap.add_argument("--shared", required=True, help="the shared folder holding data/prompts and data/chats")
    ap.add_argument(
        "--drafters", default=",".join(DRAFTERS), help="comma-separated, the first trains the data"
    )
    ap.add_argument("--ks", default="3,5,7", help="draft tokens a verify step, comma-separated")
    ap.add_argument("--concurrency", default="1,4,16,64", help="bench levels, comma-separated")
    ap.add_argument("--prompts", type=int, default=40, help="first N of MT-bench and of held-out GSM8K each")
    ap.add_argument("--max-tokens", type=int, default=256, help="output tokens per request, greedy")
    ap.add_argument("--gpu-share", type=float, default=0.3, help="vLLM's --gpu-memory-utilization per server")
    ap.add_argument(
        "--hardware", default="1x GPU", help="the card, as the records name it, e.g. '1x H100 80GB'"
    )
    ap.add_argument(
        "--faults",
        default="",
        help="drafters whose planted faults are served and diagnosed (serving_gpu_faults.py)",
    )
    ap.add_argument(
        "--online",
        action="store_true",
        help="also train the first drafter online from a capture server on the same GPU (serving_gpu_online.py)",
    )
    ap.add_argument("--smoke", action="store_true", help="rehearse on vLLM's CPU build: tiny sizes, float32")
    ap.add_argument("--out", default=str(OUT), help="the results JSON (the plot beside it)")
    args = ap.parse_args()
    if not 0.05 <= args.gpu_share <= 0.45:
        raise SystemExit(f"--gpu-share {args.gpu_share}: give 0.05 to 0.45 (two servers share the GPU)")
    check_args(args)
    from common import expected_time
    from serving_gpu_report import plot, print_online, print_table

    expected_time(
        "serving_gpu",
        "about 2 minutes on the 2-core CPU (--smoke, one drafter, K 3)"
        if args.smoke
        else "on one H100 80GB, --drafters eagle3.1,dflash --ks 3,7 --prompts 10 took about 16 minutes (training "
        "7, serving 9); --faults eagle3.1,dflash adds 103-143 s a planted fault (six: about 12 minutes); the "
        "defaults' nine rows at 40 prompts, about 40 minutes (an estimate)",
    )
    t0 = time.time()
    import torch

    runs, online = {}, None
    for name in args.drafter_list:
        runs[name] = train(args, name)
        torch.cuda.empty_cache()  # training's cached blocks would crowd the servers and diagnose's target out
        if args.online and name == args.drafter_list[0]:  # before the others: the row no peer has
            from serving_gpu_online import colocated

            try:  # a failed online row is recorded, not fatal: the served rows still follow
                online = colocated(args, runs[name], target_folder(), cli)
            except SystemExit as e:
                online = {"failed": str(e)}
                print(f"online row failed: {e}", flush=True)
            torch.cuda.empty_cache()
    from eagle3kit.core.rundir import write_text

    out = Path(args.out)
    first = Path(args.work) / "first_seconds.json"  # the first run's time; a resume's is its own
    card = machine(args)

    faults: list[dict] = []
    compared = None

    def write(rows: list[dict], final: bool) -> None:
        result = {
            "benchmark": "benchmarks/serving_gpu.py",
            "command": " ".join(["python", "benchmarks/serving_gpu.py", *sys.argv[1:]]),
            "machine": card,
            "prompts": f"first {args.prompts} of MT-bench and of held-out GSM8K each, {args.max_tokens} tokens, greedy",
            "seconds": round(time.time() - t0),
            "complete": final,
            "rows": rows,
            **({"faults": faults} if args.fault_list else {}),
            "compare": compared,
            **({"online": online} if args.online else {}),
        }
        if final and not first.exists():
            first.write_text(json.dumps(result["seconds"]) + "\n")
        result["first_run_seconds"] = json.loads(first.read_text()) if first.exists() else None
        write_text(out, json.dumps(result, indent=1) + "\n")  # atomic: a lost machine leaves the last row's

    prompts = bench_prompts(args)
    if args.fault_list:  # first: the faults are the shorter stage
        from serving_gpu_faults import diagnose_faults

        def got_fault(got: list[dict]) -> None:
            faults[:] = got
            write([], False)

        methods = {name: DRAFTERS[name][2] for name in DRAFTERS}
        faults[:] = diagnose_faults(args, runs, prompts, server, diagnose, methods, on_row=got_fault)
    rows = serve_all(args, runs, prompts, on_row=lambda rows: write(rows, False))
    from serving_gpu_faults import compare_benches, print_faults

    compared = compare_benches(args, cli)
    if args.fault_list:
        print_faults(faults)
    if compared is None:
        print(f"bench --compare: not run (fewer than two drafters' records at K {min(args.k_list)})")
    else:
        print(
            f"bench --compare {compared['a']} {compared['b']}: exit {compared['exit_code']} (1: regressions)"
        )
        print(compared["output"].rstrip())
    if online is not None:
        print_online(online)
    write(rows, True)
    plot(rows, args.levels, out.with_suffix(".png"))
    title = f"served by vLLM ({'CPU build, smoke' if args.smoke else args.hardware}): τ and speedup over plain decoding"
    print_table(rows, args.levels, title)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
