"""What the benchmarks share: τ of drafters on the two held-out evaluation sets (K = 3, simulate
mode, greedy chain) — MT-bench first turns and the last 80 GSM8K train questions — with the
target's greedy continuations computed once per run directory and cached there."""
from __future__ import annotations

import json
from pathlib import Path


def heldout_tau(run, target, shared: str, drafters: dict[str, Path], device, eval_tokens: int = 256,
                eval_prompts: int | None = None, done: dict | None = None, on_result=None) -> tuple[dict, dict]:
    """τ(K=3) of each exported drafter folder in ``drafters`` on both sets.

    Args:
        run: the run directory (holds the continuation cache ``heldout_continuations.json``).
        shared: the shared data folder (``data/prompts/mt_bench.jsonl``, ``data/chats/gsm8k_train.jsonl``).
        done: results already measured (``{name: {set: τ}}``), skipped.
        on_result: called with (name, result) after each drafter (to save progress).
    Returns:
        ({name: {"mt_bench": τ, "gsm8k_heldout": τ}}, {set: number of prompts}).
    """
    from eagle3kit.config import PromptSource
    from eagle3kit.evaluate import greedy_continuations, simulate
    from eagle3kit.export import load_exported
    from eagle3kit.generate import render_prompt_ids
    from eagle3kit.prompts import read_source

    sets = {"mt_bench": PromptSource(path=f"{shared}/data/prompts/mt_bench.jsonl", name="mt_bench"),
            "gsm8k_heldout": PromptSource(path=f"{shared}/data/chats/gsm8k_train.jsonl", start=-80, name="gsm8k_heldout")}
    cache = Path(getattr(run, "path", run)) / "heldout_continuations.json"
    conts = json.loads(cache.read_text()) if cache.exists() else {}
    prompts = {}
    for name, src in sets.items():
        rows, _ = read_source(src)
        rows = rows[:eval_prompts] if eval_prompts else rows
        prompts[name] = [render_prompt_ids(target.tokenizer, r["messages"][:1]) for r in rows]   # first turns
        if name not in conts:
            conts[name] = greedy_continuations(target, prompts[name], eval_tokens, "transformers", 160)
            cache.write_text(json.dumps(conts))
    out = dict(done or {})
    for name, folder in drafters.items():
        if name in out:
            continue
        d = load_exported(folder, device=device).eval().to(target.dtype)
        out[name] = {s: round(simulate(d, target, prompts[s], conts[s], 3, device)[0].tau, 4) for s in sets}
        if on_result:
            on_result(name, out[name])
    return out, {s: len(p) for s, p in prompts.items()}
