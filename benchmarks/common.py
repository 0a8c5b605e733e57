"""What the benchmarks share: opening a run directory (its config, the target, tokens and vocab),
training one variant of its drafter in a sub-folder, and τ of drafters on the two held-out
evaluation sets (K = 3, simulate mode, greedy chain) — MT-bench first turns and the last 80 GSM8K
train questions — with the target's greedy continuations computed once per run directory and
cached there."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path


def expected_time(what: str, estimate: str) -> None:
    """Print ``{what}: expected {estimate}; progress lines follow`` as one flushed stdout line, so
    that whoever starts a long benchmark knows up front how long it will be quiet.

    ``estimate`` names the time and the hardware it was measured on (``"about 8 minutes on one
    H200"``), or starts with ``"not timed"``, in any case (then printed without the word "expected")."""
    if not isinstance(estimate, str) or not estimate.strip():
        raise TypeError(
            f"expected_time({what!r}, ...): the estimate must be a non-empty str, not {estimate!r}"
        )
    lead = "" if estimate.lower().startswith("not timed") else "expected "
    print(f"{what}: {lead}{estimate}; progress lines follow", flush=True)


def gpu_processes() -> int | None:
    """How many processes hold a context on the machine's GPUs now (``nvidia-smi --query-compute-apps``),
    this one included when it has one; None without nvidia-smi or when it fails. Recorded at the start and
    end of a timed part, so a row's tokens/s says what shared the device while it was measured."""
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        got = subprocess.run(
            [exe, "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if got.returncode:
        return None
    return sum(1 for line in got.stdout.splitlines() if line.strip())


def gpu_peak_memory() -> dict | None:
    """This process's peak GPU memory on device 0 since ``torch.cuda.reset_peak_memory_stats()`` (or its
    start): what PyTorch's allocator held for tensors (``allocated_gib``) and reserved from the driver
    (``reserved_gib``, the figure that must fit the card), and the card's total (``card_gib``), in GiB
    (2**30 bytes) to 0.01; None without CUDA. The CUDA context (a few hundred MiB) is not counted."""
    import torch

    if not torch.cuda.is_available():
        return None
    gib = 2**30
    return {
        "allocated_gib": round(torch.cuda.max_memory_allocated(0) / gib, 2),
        "reserved_gib": round(torch.cuda.max_memory_reserved(0) / gib, 2),
        "card_gib": round(torch.cuda.get_device_properties(0).total_memory / gib, 2),
    }


def read_json_object(path: Path, fix: str) -> dict:
    """The JSON object in ``path``.

    Raises:
        SystemExit: the file is unreadable, not JSON or not an object; the message names ``path``, what
            is wrong and ``fix`` (what to do)."""
    try:
        got = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: not readable JSON ({e}); {fix}") from None
    if not isinstance(got, dict):
        raise SystemExit(f"{path}: holds a {type(got).__name__}, not a JSON object; {fix}")
    return got


def open_run(path: str):
    """(run, cfg, device, target) for a run directory whose conversations exist; tokenizes and
    builds the draft vocabulary first when they are missing."""
    from eagle3kit.core.config import load_config
    from eagle3kit.core.rundir import RunDir
    from eagle3kit.data.tokenize import run_tokenize
    from eagle3kit.data.vocab import run_vocab
    from eagle3kit.model.target import load_target, pick_device

    run = RunDir(path)
    cfg = load_config(run / "config.yaml", {"run_dir": str(run.path)})
    device = pick_device("auto")
    target = load_target(cfg.target, device=device)
    if not (run / "tokens.safetensors").exists():
        run_tokenize(cfg, run, tokenizer=target.tokenizer)
        run_vocab(cfg, run, tokenizer=target.tokenizer)
    return run, cfg, device, target


def train_variant(
    cfg, run, vdir: Path, target, drafter: dict | None = None, **train_settings
) -> tuple[dict, float]:
    """Train a drafter in ``vdir`` (the run's tokens and vocab copied in) with ``train_settings``
    overriding the run's ``train`` section and ``drafter`` its ``drafter`` section (the variant),
    and export its best checkpoint to ``vdir/drafter``. Returns (train report, seconds)."""
    from eagle3kit.core.rundir import RunDir
    from eagle3kit.model.folder import export_drafter
    from eagle3kit.train.checkpoints import load_drafter_checkpoint
    from eagle3kit.train.stage import run_train

    vdir.mkdir(parents=True, exist_ok=True)
    for f in ("tokens.safetensors", "vocab.safetensors"):
        if not (vdir / f).exists():
            shutil.copy(run / f, vdir / f)
    vcfg = cfg.model_copy(deep=True)
    vcfg.run_dir = str(vdir)
    for k, v in train_settings.items():
        setattr(vcfg.train, k, v)
    if drafter is not None:
        from eagle3kit.core.config_train import DrafterVariantConfig

        vcfg.drafter = DrafterVariantConfig(**drafter)
    t = time.perf_counter()
    res = run_train(vcfg, RunDir(vdir), target=target)
    seconds = time.perf_counter() - t
    best = vdir / "checkpoints" / "best.safetensors"
    if vcfg.drafter.variant == "dflash":
        import torch

        from eagle3kit.drafters.dflash.folder import write_dflash
        from eagle3kit.drafters.dflash.trainer import load_dflash_checkpoint

        write_dflash(load_dflash_checkpoint(best)[0], vdir / "drafter", "vllm", torch.float32)
    else:
        export_drafter(load_drafter_checkpoint(best), vdir / "drafter", overwrite=True)
    return res, seconds


EVAL_SETS = {
    "mt_bench": {"path": "data/prompts/mt_bench.jsonl"},
    "gsm8k_heldout": {"path": "data/chats/gsm8k_train.jsonl", "start": -80},
}


def heldout_sets(
    run,
    target,
    shared: str,
    eval_tokens: int = 256,
    eval_prompts: int | None = None,
    backend: str = "transformers",
) -> dict:
    """The two evaluation sets: ``{set: (rows, prompt ids, target greedy continuations)}``.

    Prompts are first user turns (MT-bench's first turn), rendered with the target's template;
    continuations are the target's greedy ``eval_tokens`` tokens (through the generation
    ``backend``), computed once and cached in the run directory (``heldout_continuations.json``)."""
    from eagle3kit.core.config import PromptSource
    from eagle3kit.data.backends import render_prompt_ids
    from eagle3kit.data.sources import read_source
    from eagle3kit.eval.evaluate import greedy_continuations

    cache = Path(getattr(run, "path", run)) / "heldout_continuations.json"
    conts = json.loads(cache.read_text()) if cache.exists() else {}
    if conts.get("_eval_tokens", eval_tokens) != eval_tokens:  # made for another token limit: made again
        conts = {}
    conts["_eval_tokens"] = eval_tokens
    out = {}
    for name, spec in EVAL_SETS.items():
        rows, _ = read_source(PromptSource(name=name, **{**spec, "path": f"{shared}/{spec['path']}"}))
        rows = rows[:eval_prompts] if eval_prompts else rows
        prompts = [render_prompt_ids(target.tokenizer, r["messages"][:1]) for r in rows]
        if name not in conts or len(conts[name]) != len(prompts):
            conts[name] = greedy_continuations(target, prompts, eval_tokens, backend, 160)
            cache.write_text(json.dumps(conts))
        out[name] = (rows, prompts, conts[name])
    return out


def heldout_tau(
    run,
    target,
    shared: str,
    drafters: dict[str, Path],
    device,
    eval_tokens: int = 256,
    eval_prompts: int | None = None,
    done: dict | None = None,
    on_result=None,
    ks: tuple[int, ...] = (3,),
) -> tuple[dict, dict]:
    """τ of each exported drafter folder in ``drafters`` on both sets (simulate mode, greedy chain)
    at every K in ``ks``.

    Args:
        run: the run directory (holds the continuation cache, see :func:`heldout_sets`).
        shared: the shared data folder (``data/prompts/mt_bench.jsonl``, ``data/chats/gsm8k_train.jsonl``).
        done: results already measured (``{name: {set: {"k3": τ}}}``), skipped.
        on_result: called with (name, result) after each drafter (to save progress).
    Returns:
        ({name: {"mt_bench": {"k3": τ, …}, "gsm8k_heldout": {…}}}, {set: number of prompts}).
    """
    from eagle3kit.eval.evaluate import simulate
    from eagle3kit.model.folder import load_exported

    sets = heldout_sets(run, target, shared, eval_tokens, eval_prompts)
    out = dict(done or {})
    from eagle3kit.drafters.dflash.evaluate import dflash_taus
    from eagle3kit.drafters.dflash.folder import is_dflash_folder, read_dflash

    for name, folder in drafters.items():
        if name in out:
            continue
        if is_dflash_folder(folder):  # block drafting: k tokens a forward, k ≤ block − 1
            d = read_dflash(folder).to(device).eval().to(target.dtype)
            out[name] = {
                s: {
                    f"k{k}": round(st.tau, 4)
                    for k, (st, _) in dflash_taus(d, target, p, c, ks, device).items()
                }
                for s, (_, p, c) in sets.items()
            }
        else:
            d = load_exported(folder, device=device).eval().to(target.dtype)
            out[name] = {
                s: {f"k{k}": round(simulate(d, target, p, c, k, device)[0].tau, 4) for k in ks}
                for s, (_, p, c) in sets.items()
            }
        if on_result:
            on_result(name, out[name])
    return out, {s: len(p) for s, (_, p, _) in sets.items()}
