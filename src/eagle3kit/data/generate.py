"""Stage ``generate``: the target writes the assistant turn of every prompt.

Backends: ``transformers`` (always available; batched, left-padded ``generate``) and ``vllm``
(vLLM's offline ``LLM`` class, when vLLM is installed; served from a float32 safetensors copy of
the target). ``auto`` picks vLLM when importable. Greedy by default.

Output: ``conversations.jsonl``, append-only; a rerun skips prompt ids already present, so a
killed run resumes without redoing or duplicating rows. A row::

    {"id", "messages", "source", "category",
     "prompt_ids": [...],            # the rendered prompt the target saw
     "completion_ids": [...],        # exactly the tokens the target emitted (end-of-turn included when emitted)
     "content": str, "reasoning": null, "finish_reason": "stop" | "length",
     "usage": {"prompt_tokens", "completion_tokens"}, "template_flags": {}, "backend", "sampling"}
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from eagle3kit.core.config import Config, ConfigError
from eagle3kit.core.engines import uses_mla, vllm_cpu_build, vllm_install_hint, vllm_model_class
from eagle3kit.core.lineage import StaleInput, check_inputs
from eagle3kit.core.rundir import DataError, JsonlAppender, RunDir, read_jsonl, repair_torn_tail, sha256_file
from eagle3kit.core.ui import Timer, console, progress
from eagle3kit.data.backends import (
    render_prompt_ids,
    target_context,
    transformers_generate,
    vllm_available,
    vllm_generate,
    vllm_version,
)
from eagle3kit.data.server_backend import generate_via_server, server_version
from eagle3kit.model.target import Target, chat_template_hash, load_target
from eagle3kit.model.target_files import load_tokenizer, target_architectures, weights_fingerprint


def _special_tokens(cfg: Config) -> list[str]:
    """The target tokenizer's special-token strings (a reply holding one is flagged), when the tokenizer is at hand."""

    try:
        tok = load_tokenizer(cfg.target)
    except Exception as e:  # a server-only target may have no local tokenizer
        console.print(
            f"[yellow]generate: no local tokenizer for {cfg.target.model} ({type(e).__name__}); "
            "special-token strings inside reasoning are not checked"
        )
        return []
    return [str(t) for t in tok.all_special_tokens] + [
        str(t) for t in getattr(tok, "added_tokens_decoder", {}).values()
    ]


def pick_backend(name: str) -> str:
    """The generation backend ``generate.backend`` names; ``auto``: vLLM in this process when the
    installed build fits the machine (the CUDA build where torch sees a GPU, the CPU build where it
    sees none), else transformers.

    Raises:
        ConfigError: ``vllm`` asked for and not installed (the message names the extra to install).
    """
    if name == "auto":
        fits = vllm_available() and vllm_cpu_build() != torch.cuda.is_available()
        return "vllm" if fits else "transformers"
    if name == "vllm" and not vllm_available():
        raise ConfigError(
            f"generate.backend is vllm but vLLM is not installed: {vllm_install_hint()} (generate.backend: openai, "
            "base_url: …); or set generate.backend: transformers"
        )
    return name


def generate_completions(
    target: Target,
    prompts: list[list[int]],
    max_new_tokens: int,
    backend: str,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    engine_args: dict | None = None,
) -> list[list[int]]:
    """Completions of ``prompts`` (token id lists) by ``backend`` (``vllm`` or ``transformers``),
    each up to its first end-of-turn token; ``engine_args`` are more ``vllm.LLM`` arguments."""
    if backend == "vllm":
        return vllm_generate(target, prompts, max_new_tokens, temperature, top_p, seed, engine_args)
    return transformers_generate(
        target, prompts, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed
    )


VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128)


def check_backend(backend: str, asked: str, target: Target) -> str:
    """vLLM's CPU build supports only some head sizes: ``auto`` falls back to transformers, an
    explicit ``vllm`` is refused with the reason."""
    if backend != "vllm":
        return backend

    tc = target.config
    head = int(getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads)
    on_disk = Path(target.source.get("path") or "") / "config.json"
    config = (
        json.loads(on_disk.read_text()) if not target.source.get("gguf_file") and on_disk.is_file() else {}
    )
    archs = config.get("architectures") or target_architectures(target.model.config)
    if not uses_mla(config) and head not in VLLM_CPU_HEAD_SIZES:
        why = f"vLLM's CPU build cannot run head size {head} (it runs {', '.join(map(str, VLLM_CPU_HEAD_SIZES))})"
    elif vllm_model_class(archs) is None:
        why = f"the installed vLLM has no model class for {archs}"
    else:
        return backend
    if asked == "auto":
        console.print(f"[yellow]generate: {why}; using transformers")
        return "transformers"
    raise ConfigError(f"generate.backend is vllm but {why}; use backend transformers")


def generation_settings(cfg: Config, target: Target | None = None) -> dict:
    """What a conversation row depends on: the target and its weights fingerprint
    (:func:`~eagle3kit.model.target.weights_fingerprint`; None through a server, whose weights eagle3kit
    cannot see), the served model name (server backend), the hash of the chat template the prompts are
    rendered with (None through a server, which renders them), the template flags and the sampling
    settings. Rows made with other settings — other weights at the same path too — are never
    mixed into a run (see :func:`existing_rows`)."""

    gc = cfg.generate
    server = gc.backend == "openai"
    weights = (
        None
        if server
        else (
            target.source.get("weights_fingerprint")
            if target is not None
            else weights_fingerprint(cfg.target)
        )
    )  # a loaded target has it already
    template = None  # through a server, the server renders with its own template
    if not server:
        template = chat_template_hash(target.tokenizer if target is not None else load_tokenizer(cfg.target))
    return {
        "target": cfg.target.model,
        "target_weights": weights,
        "served_model": gc.model if gc.backend == "openai" else None,
        "chat_template": template,
        "template_flags": dict(gc.template_flags),
        "sampling": {
            "temperature": gc.temperature,
            "top_p": gc.top_p,
            "max_new_tokens": gc.max_new_tokens,
            "seed": gc.seed if gc.temperature > 0 else None,
        },
    }


SETTING_KEYS = ("target", "target_weights", "served_model", "chat_template", "template_flags", "sampling")


def existing_rows(path, settings: dict) -> set[str]:
    """Ids of rows already in ``conversations.jsonl``.

    Raises:
        DataError: a row is not an object with ``id`` and ``messages`` (names the line), or rows were
            generated with another target or other sampling settings (names what changed): mixing
            them would silently train on two different distributions.
    """

    if not path.exists():
        return set()
    ids, other, first = set(), Counter(), {}
    for n, r in read_jsonl(path):
        if (
            not isinstance(r, dict)
            or not isinstance(r.get("id"), str)
            or not isinstance(r.get("messages"), list)
        ):
            raise DataError(
                f"{path}:{n}: not a conversation row (needs 'id' and 'messages'); fix or delete that line"
            )
        same_weights = (
            r.get("target_weights") is not None and r.get("target_weights") == settings["target_weights"]
        )
        for key in SETTING_KEYS:
            if key == "target" and same_weights:
                continue  # the same weights, moved or named otherwise: the same target
            if key in r and r[key] != settings[key]:
                other[key] += 1
                first.setdefault(key, (n, r[key]))
        ids.add(r["id"])
    if other:
        was = "; ".join(
            f"{k}: {first[k][1]!r} (line {first[k][0]}, {other[k]} rows) but now {settings[k]!r}"
            for k in sorted(other)
        )
        if "target_weights" in other and "target" not in other:
            was += (
                f" — the weights or config.json at {settings['target']} were replaced since those rows were "
                "generated"
            )
        raise ConfigError(
            f"{path} holds rows generated with other settings — {was}. Move the file away or use a new "
            "run_dir (mixing them would train on both), or go back to the settings it was made with"
        )
    return ids


def read_prompt_rows(path) -> list[dict]:
    """The rows of ``prompts.jsonl``, each checked: an object with a string ``id`` and ``messages``,
    a list of ``{role, content: str}``.

    Raises:
        DataError: a row that is not (names the line; the file is written by the prompts stage).
    """

    rows = []
    for n, r in read_jsonl(path):
        ok = (
            isinstance(r, dict)
            and isinstance(r.get("id"), str)
            and isinstance(r.get("messages"), list)
            and r["messages"]
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in r["messages"]
            )
        )
        if not ok:
            raise DataError(
                f"{path}:{n}: not a prompt row ({{'id': str, 'messages': [{{'role', 'content': str}}, ...]}}); "
                "prompts.jsonl is written by `eagle3kit prompts`: rerun it rather than editing the file"
            )
        rows.append(r)
    return rows


def run_generate(cfg: Config, run: RunDir, target: Target | None = None) -> dict:
    """Generate a reply for every prompt in ``prompts.jsonl`` not yet in ``conversations.jsonl``.

    Returns stage counts: rows_in, already_done, generated, truncated (no end-of-turn within
    ``max_new_tokens``), empty_content, completion_tokens, seconds (the generation loop, s),
    startup_seconds (loading the target or tokenizer, probing the server), tokens_per_s
    (completion tokens / seconds).
    """
    with run.lock("generate"):
        return _run_generate(cfg, run, target)


def _run_generate(cfg: Config, run: RunDir, target: Target | None) -> dict:
    """The stage's steps: the inputs and the output file checked, the missing rows generated
    through the server or locally, the totals over the whole file recorded."""
    gc = cfg.generate
    rows = read_prompt_rows(run.require("prompts.jsonl", "prompts"))
    out_path = run / "conversations.jsonl"
    consumed = _check_output(run, out_path)
    settings = generation_settings(cfg, target)
    done = existing_rows(out_path, settings)
    todo = [r for r in rows if r["id"] not in done]
    if todo:  # until recorded below, conversations.jsonl is unfinished to every later stage
        run.mark_pending("conversations.jsonl", "generate", consumed, settings["target_weights"])
    counts = Counter(rows_in=len(rows), already_done=len(rows) - len(todo))
    backend = pick_backend(gc.backend)
    engine = None
    stage_timer = timer = Timer()
    if todo and backend == "openai":
        engine = {
            "name": "openai-compatible",
            "base_url": gc.base_url,
            "model": gc.model,
            "version": server_version(gc.base_url) if gc.base_url else None,
        }
        special = _special_tokens(cfg)
        timer = Timer()  # tokens/s counts the request loop, not the start-up (tokenizer, /version probe)
        with JsonlAppender(out_path) as sink, progress() as bar:
            task = bar.add_task("generate (server)", total=len(todo), tokens=0, note="")
            counts.update(generate_via_server(cfg, todo, sink, settings, special, bar, task))
    elif todo:
        if target is None:
            target = load_target(cfg.target)
        backend = check_backend(backend, gc.backend, target)
        if gc.engine_args and backend != "vllm":
            console.print(
                f"[yellow]generate: generate.engine_args are vLLM's, and {backend} generates: not used"
            )
        timer = Timer()
        _generate_locally(cfg, target, backend, todo, out_path, settings, counts)
    if todo:
        counts["startup_seconds"] = round(stage_timer.seconds - timer.seconds, 2)
        counts["seconds"] = round(timer.seconds, 3)
        counts["tokens_per_s"] = round(counts["completion_tokens"] / max(timer.seconds, 1e-9), 1)
    # totals over the whole file (a resumed run reports the file, not just this call)
    total, backends = Counter(), set()
    for _, r in read_jsonl(out_path) if out_path.exists() else []:
        total["rows"] += 1
        total["truncated"] += r.get("finish_reason") == "length"
        backends.add(r.get("backend") or "?")
    counts["rows_kept"] = total["rows"]
    counts["truncated_share"] = round(total["truncated"] / max(total["rows"], 1), 4)
    if not todo and backends:  # nothing generated now: the backend the file's rows were made with
        backend = ", ".join(sorted(backends))
    inputs = {
        "prompts.jsonl": consumed["prompts.jsonl"],
        "backend": backend,
        "target": cfg.target.model,
        "target_weights": settings["target_weights"],
        "max_new_tokens": gc.max_new_tokens,
        "temperature": gc.temperature,
    }
    if backend == "vllm":
        inputs["engine"] = {"name": "vllm", "version": vllm_version()}
    if engine:
        inputs["engine"] = engine
        run.update_manifest(generation_server=engine)
    out = {k: (round(v, 4) if isinstance(v, float) else int(v)) for k, v in counts.items()}
    outputs = {"conversations.jsonl": sha256_file(out_path)}
    run.record_stage("generate", inputs, out, outputs, consumed=consumed, target=settings["target_weights"])
    return out


def _check_output(run: RunDir, out_path: Path) -> dict:
    """Repair a torn last line of ``conversations.jsonl``, check the prompts' lineage and refuse a
    finished file that was changed since; returns the consumed hashes.

    Raises:
        StaleInput: prompts.jsonl changed since, or conversations.jsonl was edited or replaced."""
    torn = repair_torn_tail(out_path)
    if torn:
        console.print(
            f"[yellow]conversations.jsonl: removed a torn last line ({torn} bytes) left by an interrupted run"
        )
    consumed = check_inputs(run, "generate", ["prompts.jsonl"])
    rec = run.manifest.get("lineage", {}).get("conversations.jsonl") or {}
    if rec.get("sha256") and out_path.exists() and sha256_file(out_path) != rec["sha256"]:
        raise StaleInput(
            f"{out_path} changed after `eagle3kit generate` finished it (edited or replaced): generate only "
            "appends the missing rows and would keep the changed ones. Restore the file, or move it away "
            "to generate every row anew"
        )
    return consumed


def _generate_locally(
    cfg: Config,
    target: Target,
    backend: str,
    todo: list[dict],
    out_path: Path,
    settings: dict,
    counts: Counter,
) -> None:
    """The target answers ``todo`` in chunks (``transformers`` or offline vLLM), shortest first;
    each row is appended as it is done. A prompt with no room for the reply in the target's
    context is not sent (counted as ``prompt_too_long`` and named)."""
    gc = cfg.generate
    tok = target.tokenizer
    eot = set(target.end_of_turn_ids())
    chunk = gc.batch_size if backend == "transformers" else max(gc.batch_size, 64)
    todo.sort(key=lambda r: len(str(r["messages"])))
    context = target_context(target)
    too_long: list[tuple[str, int]] = []
    with JsonlAppender(out_path) as sink, progress() as bar:
        task = bar.add_task(f"generate ({backend})", total=len(todo), tokens=0, note="")
        for start in range(0, len(todo), chunk):
            batch = todo[start : start + chunk]
            done_here = len(batch)  # rows this chunk settles: generated, or too long to send
            pids = [render_prompt_ids(tok, r["messages"], gc.template_flags) for r in batch]
            if context:  # a prompt with no room for the reply in the target's context is not sent
                fits = [len(p) + gc.max_new_tokens <= context for p in pids]
                too_long += [(r["id"], len(p)) for r, p, ok in zip(batch, pids, fits) if not ok]
                batch = [r for r, ok in zip(batch, fits) if ok]
                pids = [p for p, ok in zip(pids, fits) if ok]
                if not batch:
                    bar.update(task, advance=done_here)
                    continue
            outs = generate_completions(
                target,
                pids,
                gc.max_new_tokens,
                backend,
                gc.temperature,
                gc.top_p,
                gc.seed + start,
                gc.engine_args,
            )
            for r, p, c in zip(batch, pids, outs):
                sink.append(_row(r, p, c, tok, eot, backend, settings, counts))
            bar.update(task, advance=done_here, tokens=counts["completion_tokens"])
    if too_long:
        counts["prompt_too_long"] = len(too_long)
        longest = max(n for _, n in too_long)
        console.print(
            f"[yellow]generate: {len(too_long)} prompt(s) leave no room for generate.max_new_tokens "
            f"{gc.max_new_tokens} in the target's context of {context} tokens (longest "
            f"{longest} tokens; ids {', '.join(str(i) for i, _ in too_long[:3])}"
            f"{' …' if len(too_long) > 3 else ''}): not generated. "
            + (
                "Drop these prompts from the prompt source: the longest alone fills the context"
                if longest >= context
                else "Lower generate.max_new_tokens, or drop these prompts from the prompt source"
            )
        )


def _row(
    r: dict, p: list[int], c: list[int], tok, eot: set[int], backend: str, settings: dict, counts: Counter
) -> dict:
    """One ``conversations.jsonl`` row for prompt row ``r``: prompt ids ``p``, completion ids ``c``
    exactly as emitted (end of turn included when emitted); counts it."""
    finish = "stop" if c and c[-1] in eot else "length"
    content = tok.decode(c[:-1] if finish == "stop" else c, skip_special_tokens=True)
    counts["generated"] += 1
    counts["truncated"] += finish == "length"
    counts["empty_content"] += not content.strip()
    counts["completion_tokens"] += len(c)
    return {
        "id": r["id"],
        "messages": r["messages"],
        "source": r.get("source"),
        "category": r.get("category"),
        "prompt_ids": p,
        "completion_ids": c,
        "content": content,
        "reasoning": None,
        "finish_reason": finish,
        "usage": {"prompt_tokens": len(p), "completion_tokens": len(c)},
        "backend": backend,
        **settings,
    }
