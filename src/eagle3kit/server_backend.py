"""Generation through an OpenAI-compatible server (vLLM, SGLang, llama.cpp …): ``generate.backend: openai``.

Requests go through the ``openai`` SDK's ``AsyncOpenAI`` (its own retries with exponential
backoff on connection errors, 408/409/429 and 5xx; a per-request timeout), at most
``generate.concurrency`` in flight. Each finished row is appended at once (atomic line writes),
so a killed client or server loses no finished row; a rerun sends only the rows still missing.
A row that fails after the retries (or gets a 4xx) is counted and left for the next run; the
others go on.

Reasoning is parsed by :mod:`eagle3kit.reasoning` from whichever field the server uses; each row
records ``reasoning_source`` and ``flags``. With ``generate.expect_reasoning`` the stage stops
as soon as the first rows arrive without reasoning instead of generating thousands of useless rows.
The API key is read from the environment variable named by ``generate.api_key_env`` and never logged.
"""
from __future__ import annotations

import asyncio
import os
from collections import Counter

from .config import Config, ConfigError
from .reasoning import parse_reply, parse_stream
from .rundir import JsonlAppender
from .ui import console

EXPECT_REASONING_PROBE = 8


def server_version(base_url: str, timeout: float = 5.0) -> str | None:
    """The server's version from ``GET /version`` (vLLM, SGLang), or None when it has none."""
    import httpx

    root = base_url.rstrip("/")
    root = root[: -len("/v1")] if root.endswith("/v1") else root
    try:
        r = httpx.get(root + "/version", timeout=timeout)
        if r.status_code == 200:
            data = r.json()
            return str(data.get("version", data)) if isinstance(data, dict) else str(data)
    except Exception:
        return None
    return None


def _client(cfg: Config):
    from openai import AsyncOpenAI

    gc = cfg.generate
    key = os.environ.get(gc.api_key_env) or "EMPTY"  # local servers accept any key
    return AsyncOpenAI(base_url=gc.base_url, api_key=key, max_retries=gc.max_retries, timeout=gc.timeout_s)


def _request(cfg: Config, row: dict) -> dict:
    gc = cfg.generate
    extra: dict = {"return_token_ids": True}   # vLLM returns prompt/completion ids; other servers ignore it
    if gc.template_flags:
        extra["chat_template_kwargs"] = dict(gc.template_flags)
    req = {"model": gc.model, "messages": row["messages"], "max_tokens": gc.max_new_tokens,
           "temperature": gc.temperature, "top_p": gc.top_p, "extra_body": extra}
    if gc.temperature > 0:
        req["seed"] = gc.seed
    return req


async def _streamed(client, req: dict, special_tokens) -> tuple:
    """Send a streamed request; returns (reply, completion ids or None, prompt ids or None, usage, model)."""
    stream = await client.chat.completions.create(**req, stream=True, stream_options={"include_usage": True})
    chunks, prompt_ids, usage, model = [], None, None, None
    ids: list[int] | None = None   # None when the server sent no token ids at all
    async for chunk in stream:
        chunks.append(chunk)
        model = chunk.model or model
        extra = getattr(chunk, "model_extra", None) or {}
        prompt_ids = extra.get("prompt_token_ids") or prompt_ids
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for ch in chunk.choices:
            piece = (getattr(ch, "model_extra", None) or {}).get("token_ids")
            if piece is not None:
                ids = (ids or []) + list(piece)
    reply = parse_stream(chunks, special_tokens=special_tokens)
    return reply, ids, prompt_ids, usage, model


def _row_from_response(row: dict, resp, req: dict, special_tokens, settings: dict) -> dict:
    if isinstance(resp, tuple):   # streamed
        reply, completion_ids, prompt_ids, usage, model = resp
    else:
        choice = resp.choices[0]
        reply = parse_reply(choice.message, choice.finish_reason, special_tokens=special_tokens)
        completion_ids = (getattr(choice, "model_extra", None) or {}).get("token_ids")
        prompt_ids = (getattr(resp, "model_extra", None) or {}).get("prompt_token_ids")
        usage = resp.usage.model_dump() if resp.usage is not None else None
        model = resp.model
    return {
        "id": row["id"], "messages": row["messages"], "source": row.get("source"), "category": row.get("category"),
        "content": reply.content, "reasoning": reply.reasoning, "reasoning_source": reply.reasoning_source,
        "flags": reply.flags, "finish_reason": reply.finish_reason, "truncated": reply.truncated,
        "tool_calls": reply.tool_calls,
        "prompt_ids": prompt_ids, "completion_ids": completion_ids,
        "token_ids_returned": completion_ids is not None, "usage": usage,
        "template_flags": dict((req["extra_body"] or {}).get("chat_template_kwargs", {})),
        "request": {k: v for k, v in req.items() if k not in ("messages", "extra_body")},
        "server_model": model, "backend": "openai", "streamed": isinstance(resp, tuple), "sampling": settings["sampling"], "target": settings["target"],
    }


async def _run(cfg: Config, todo: list[dict], sink: JsonlAppender, settings: dict, special_tokens, bar, task) -> Counter:
    import httpx
    import openai

    gc = cfg.generate
    counts: Counter = Counter({k: 0 for k in ("generated", "failed", "with_reasoning", "without_reasoning", "truncated",
                                              "empty_content", "token_ids_returned", "flagged", "completion_tokens")})
    sem = asyncio.Semaphore(gc.concurrency)
    client = _client(cfg)
    stop = asyncio.Event()

    async def one(row: dict) -> None:
        if stop.is_set():
            return
        async with sem:
            if stop.is_set():
                return
            req = _request(cfg, row)
            try:
                resp = await (_streamed(client, req, special_tokens) if gc.stream else client.chat.completions.create(**req))
            except (openai.APIError, httpx.HTTPError) as e:   # after the SDK's retries; a stream cut mid-way too
                counts["failed"] += 1
                status = getattr(e, "status_code", None)
                counts[f"failed_{status or type(e).__name__}"] += 1
                if counts["failed"] <= 5:
                    console.print(f"[yellow]generate: row {row['id']} failed after retries: {type(e).__name__} "
                                  f"{status or ''} {str(e)[:160]}")
                bar.update(task, advance=1, note=f"failed {counts['failed']}")
                return
        out = _row_from_response(row, resp, req, special_tokens, settings)
        sink.append(out)
        counts["generated"] += 1
        counts["with_reasoning"] += out["reasoning"] is not None
        counts["without_reasoning"] += out["reasoning"] is None
        counts["truncated"] += out["finish_reason"] == "length"
        counts["empty_content"] += not out["content"].strip()
        counts["token_ids_returned"] += out["token_ids_returned"]
        counts["completion_tokens"] += (out["usage"] or {}).get("completion_tokens") or 0
        counts["flagged"] += bool(out["flags"])
        bar.update(task, advance=1, tokens=counts["completion_tokens"], note=f"failed {counts['failed']}")
        if gc.expect_reasoning and counts["generated"] >= min(EXPECT_REASONING_PROBE, len(todo)) \
                and counts["with_reasoning"] == 0:
            stop.set()

    try:
        await asyncio.gather(*(one(r) for r in todo))
    finally:
        await client.close()
    if stop.is_set():
        raise ConfigError(
            f"generate.expect_reasoning is true but the first {counts['generated']} replies carry no reasoning "
            "(no `reasoning`/`reasoning_content` field, no <think> block): start the server with its reasoning "
            "parser (vLLM/SGLang: --reasoning-parser NAME), check generate.template_flags (enable_thinking), "
            "or set expect_reasoning: false. The rows already written are kept."
        )
    return counts


def generate_via_server(cfg: Config, todo: list[dict], sink: JsonlAppender, settings: dict,
                        special_tokens=(), bar=None, task=None) -> Counter:
    """Send every row of ``todo`` to the server; append each finished row to ``sink``.

    Returns counters: generated, failed (+ by status), with/without reasoning, truncated,
    empty_content, token_ids_returned, flagged, completion_tokens.

    Raises:
        ConfigError: no ``base_url``/``model``, or ``expect_reasoning`` and the first replies
            have no reasoning.
    """
    gc = cfg.generate
    if not gc.base_url or not gc.model:
        raise ConfigError("generate.backend openai needs generate.base_url (e.g. http://localhost:8000/v1) and generate.model")
    return asyncio.run(_run(cfg, todo, sink, settings, special_tokens, bar, task))


def _magpie_settings(cfg: Config, prefix: str) -> dict:
    import hashlib

    pc = cfg.prompts
    return {"server_model": cfg.generate.model, "prefix_sha256": hashlib.sha256(prefix.encode()).hexdigest()[:16],
            "max_tokens": pc.synthesize_max_tokens, "temperature": 1.0, "top_p": 0.95, "seed": pc.seed}


async def _magpie_attempts(cfg: Config, prefix: str, stop_ids: list[int], indices: list[int], settings: dict,
                           sink: JsonlAppender, log: dict, counts: Counter) -> None:
    import httpx
    import openai

    sem = asyncio.Semaphore(cfg.generate.concurrency)
    client = _client(cfg)
    extra: dict = {"add_special_tokens": False}   # the prefix already holds the template's special tokens
    if stop_ids:
        extra["stop_token_ids"] = stop_ids

    async def one(i: int) -> None:
        async with sem:
            try:
                resp = await client.completions.create(
                    model=cfg.generate.model, prompt=prefix, max_tokens=settings["max_tokens"], temperature=1.0,
                    top_p=0.95, seed=settings["seed"] * 1_000_003 + i, extra_body=extra)
            except (openai.APIError, httpx.HTTPError) as e:
                counts["magpie_failed"] += 1
                if counts["magpie_failed"] <= 5:
                    console.print(f"[yellow]prompts: Magpie attempt {i} failed after retries: {type(e).__name__} {str(e)[:160]}")
                return
        choice = resp.choices[0]
        row = {"attempt": i, "text": choice.text, "finish_reason": choice.finish_reason,
               "completion_tokens": resp.usage.completion_tokens if resp.usage else None, "settings": settings}
        sink.append(row)
        log[i] = row

    try:
        await asyncio.gather(*(one(i) for i in indices))
    finally:
        await client.close()


def synthesize_via_server(cfg: Config, prefix: str, stop_ids: list[int], log_path) -> tuple[list[dict], Counter]:
    """Magpie through an OpenAI-compatible completions endpoint: the raw templated ``prefix`` (the
    chat template up to a user message's text) is sent as the prompt, and the model's
    continuation up to its end of turn is a new user prompt (Xu et al. 2024, "Magpie").

    Sampling: temperature 1.0, top-p 0.95, ``seed·1000003 + attempt`` per request;
    ``add_special_tokens: false`` and ``stop_token_ids`` (vLLM/SGLang extensions; other servers
    ignore them). Every attempt is appended to ``log_path`` (JSONL), so a rerun sends only the
    attempts not yet made; candidates are kept in attempt order by
    :class:`eagle3kit.prompts.MagpieCollector` (finished turn, ≥ 3 words, no near-duplicate), at
    most 4·n attempts, in waves sized to what is still missing.

    Returns (prompt rows, counters: magpie_attempts, magpie_failed, magpie_kept).

    Raises:
        ConfigError: no ``generate.base_url``/``model``; ``log_path`` holds attempts made with
            other settings (another prefix, model, seed or token limit).
    """
    from .prompts import MagpieCollector
    from .rundir import read_jsonl, repair_torn_tail
    from .ui import progress

    gc, n = cfg.generate, cfg.prompts.synthesize
    if not gc.base_url or not gc.model:
        raise ConfigError("Magpie through a server needs generate.base_url and generate.model")
    settings = _magpie_settings(cfg, prefix)
    repair_torn_tail(log_path)
    log: dict[int, dict] = {}
    if log_path.exists():
        for ln, r in read_jsonl(log_path):
            if r.get("settings") != settings:
                raise ConfigError(f"{log_path}:{ln} was made with other Magpie settings ({r.get('settings')}; now {settings}); "
                                  "move the file away or use a new run_dir")
            log[r["attempt"]] = r
    counts: Counter = Counter(magpie_failed=0)

    def collect() -> MagpieCollector:
        keep = MagpieCollector(n)
        for i in sorted(log):
            keep.offer(log[i]["text"], log[i]["finish_reason"] == "stop")
        return keep

    keep, cap, nxt = collect(), 4 * n, 0
    with JsonlAppender(log_path) as sink, progress() as bar:
        task = bar.add_task("synthesize prompts (Magpie, server)", total=n, tokens=0, note="")
        while not keep.full:
            want = max(gc.concurrency, 2 * (n - len(keep.rows)))
            wave = []
            while nxt < cap and len(wave) < want:
                if nxt not in log:
                    wave.append(nxt)
                nxt += 1
            if not wave:
                break
            before = len(log)
            asyncio.run(_magpie_attempts(cfg, prefix, stop_ids, wave, settings, sink, log, counts))
            if len(log) == before:
                raise ConfigError(f"the server at {gc.base_url} answered none of {len(wave)} Magpie requests (see the "
                                  "errors above); check generate.base_url and generate.model. Attempts made so far are kept.")
            keep = collect()
            bar.update(task, completed=min(len(keep.rows), n), tokens=sum(r.get("completion_tokens") or 0 for r in log.values()),
                       note=f"{len(log)} sampled, failed {counts['magpie_failed']}")
    counts["magpie_attempts"] = len(log)
    counts["magpie_kept"] = len(keep.rows)
    return keep.rows, counts
