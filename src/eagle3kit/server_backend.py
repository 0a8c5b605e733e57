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
