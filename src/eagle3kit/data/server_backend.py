"""Generation through an OpenAI-compatible server (vLLM, SGLang, llama.cpp …): ``generate.backend: openai``.

Requests go through the ``openai`` SDK's ``AsyncOpenAI`` (its own retries with exponential
backoff on connection errors, 408/409/429 and 5xx; a per-request timeout), at most
``generate.concurrency`` in flight. Each finished row is appended at once (atomic line writes),
so a killed client or server loses no finished row; a rerun sends only the rows still missing.
A row that fails after the retries (or gets a 4xx) is counted and left for the next run; the
others go on.

Reasoning is parsed by :mod:`eagle3kit.data.reasoning` from whichever field the server uses; each row
records ``reasoning_source`` and ``flags``. With ``generate.expect_reasoning`` the stage stops
as soon as the first rows arrive without reasoning instead of generating thousands of useless rows.
The API key is read from the environment variable named by ``generate.api_key_env`` and never logged.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections import Counter

import httpx

from eagle3kit.core.config import Config, ConfigError
from eagle3kit.core.rundir import JsonlAppender
from eagle3kit.core.ui import console
from eagle3kit.data.reasoning import REASONING_KEYS, parse_reply, parse_stream

EXPECT_REASONING_PROBE = 8


FATAL_STATUS = (401, 403, 404)  # the key, the permission or the model is wrong: every row would fail alike


class MalformedReply(ValueError):
    """A 200 reply that is not a usable chat completion (names the field)."""


def redact(text: str, cfg: Config) -> str:
    """``text`` with the API key's value (from ``generate.api_key_env``) replaced by ``***``:
    error messages may echo the Authorization header back."""
    key = os.environ.get(cfg.generate.api_key_env) or ""
    return text.replace(key, "***") if len(key) >= 4 else text


def check_server(cfg: Config) -> list[str]:
    """Before sending any row: the base URL is an API root, the server answers, accepts the key
    and serves ``generate.model`` (``GET {base_url}/models``). Returns the served model ids
    (empty when the server has no model list).

    Raises:
        ConfigError: a malformed URL, an unreachable server, a refused key, a ``/models`` 404 (the
            URL is not the API root) or a model the server does not serve — each with its fix.
    """

    gc = cfg.generate
    url = (gc.base_url or "").rstrip("/")
    if not re.match(r"https?://[^/]+", url):
        raise ConfigError(
            f"generate.base_url {gc.base_url!r} is not an http(s) URL; give the API root, e.g. http://localhost:8000/v1"
        )
    if url.endswith(("/chat/completions", "/completions")):
        raise ConfigError(
            f"generate.base_url {gc.base_url!r} names an endpoint; give the API root, e.g. {url.rsplit('/', 2)[0]}"
        )
    key = os.environ.get(gc.api_key_env) or "EMPTY"
    try:
        r = httpx.get(
            url + "/models", headers={"Authorization": f"Bearer {key}"}, timeout=min(gc.timeout_s, 15.0)
        )
    except httpx.HTTPError as e:
        raise ConfigError(
            f"cannot reach the server at {url} ({type(e).__name__}: {redact(str(e), cfg)[:120]}); is it "
            "running, and is generate.base_url right?"
        ) from None
    if r.status_code in (401, 403):
        raise ConfigError(
            f"the server at {url} refused the API key (HTTP {r.status_code}); put the right key in the "
            f"environment variable {gc.api_key_env} (generate.api_key_env)"
        )
    if r.status_code == 404:
        raise ConfigError(
            f"{url}/models does not exist (HTTP 404): generate.base_url must be the API root, which for "
            "vLLM and SGLang ends in /v1"
        )
    try:
        served = [str(m["id"]) for m in r.json()["data"]] if r.status_code == 200 else []
    except Exception:
        served = []
    if served and gc.model not in served:
        raise ConfigError(
            f"the server at {url} serves {served}, not generate.model {gc.model!r}; set generate.model "
            "to one of them"
        )
    return served


def server_version(base_url: str, timeout: float = 5.0) -> str | None:
    """The server's version from ``GET /version`` (vLLM, SGLang), or None when it has none."""

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
    extra: dict = {"return_token_ids": True}  # vLLM returns prompt/completion ids; other servers ignore it
    if gc.template_flags:
        extra["chat_template_kwargs"] = dict(gc.template_flags)
    req = {
        "model": gc.model,
        "messages": row["messages"],
        "max_tokens": gc.max_new_tokens,
        "temperature": gc.temperature,
        "top_p": gc.top_p,
        "extra_body": extra,
    }
    if gc.temperature > 0:
        req["seed"] = gc.seed
    return req


async def _streamed(client, req: dict, special_tokens) -> tuple:
    """Send a streamed request; returns (reply, completion ids or None, prompt ids or None, usage, model)."""
    stream = await client.chat.completions.create(**req, stream=True, stream_options={"include_usage": True})
    chunks, prompt_ids, usage, model = [], None, None, None
    ids: list[int] | None = None  # None when the server sent no token ids at all
    async for chunk in stream:
        chunks.append(chunk)
        model = chunk.model or model
        extra = getattr(chunk, "model_extra", None) or {}
        prompt_ids = extra.get("prompt_token_ids") or prompt_ids
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for ch in chunk.choices or []:
            piece = (getattr(ch, "model_extra", None) or {}).get("token_ids")
            if piece is not None:
                if not isinstance(piece, list) or not all(isinstance(t, int) for t in piece):
                    raise MalformedReply(
                        f"a streamed chunk's token_ids is {str(piece)[:40]!r}, not a list of ints"
                    )
                ids = (ids or []) + piece
    reply = parse_stream(chunks, special_tokens=special_tokens)
    return reply, ids, prompt_ids, usage, model


def _check_message(message) -> None:

    content = getattr(message, "content", None)
    if content is not None and not isinstance(content, str):
        raise MalformedReply(f"message.content is a {type(content).__name__}, not a string")
    extra = getattr(message, "model_extra", None) or {}
    for k in REASONING_KEYS:
        v = getattr(message, k, None) if k in type(message).model_fields else extra.get(k)
        if v is not None and not isinstance(v, str):
            raise MalformedReply(f"message.{k} is a {type(v).__name__}, not a string")
    calls = getattr(message, "tool_calls", None)
    if calls is not None and not isinstance(calls, list):
        raise MalformedReply(f"message.tool_calls is a {type(calls).__name__}, not a list")


def _ids(value, what: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise MalformedReply(f"{what} is {str(value)[:40]!r}, not a list of token ids")
    return value


def _usage(resp) -> dict | None:
    usage = getattr(resp, "usage", None)
    if usage is None:
        return None
    u = usage.model_dump() if hasattr(usage, "model_dump") else dict(usage)
    n = u.get("completion_tokens")
    if n is not None and (not isinstance(n, int) or n < 0):
        raise MalformedReply(f"usage.completion_tokens is {n!r}, not a count")
    return u


def _row_from_response(row: dict, resp, req: dict, special_tokens, settings: dict) -> dict:
    """The stored row for one reply.

    Raises:
        MalformedReply: the reply is not a chat completion with one choice whose message has a
            string content, string reasoning, a tool-call list, and token ids that are ids.
    """
    from openai.types.chat import ChatCompletion

    if isinstance(resp, tuple):  # streamed
        reply, completion_ids, prompt_ids, usage, model = resp
        completion_ids = _ids(completion_ids, "token_ids")
    else:
        if not isinstance(resp, ChatCompletion):
            raise MalformedReply(
                f"the reply is a {type(resp).__name__} ({str(resp)[:60]!r}), not a chat completion"
            )
        if not isinstance(resp.choices, list) or not resp.choices:
            raise MalformedReply(f"the reply has no choices ({resp.choices!r})")
        choice = resp.choices[0]
        if choice.message is None:
            raise MalformedReply("choices[0].message is null")
        _check_message(choice.message)
        reply = parse_reply(choice.message, choice.finish_reason, special_tokens=special_tokens)
        completion_ids = _ids(
            (getattr(choice, "model_extra", None) or {}).get("token_ids"), "choices[0].token_ids"
        )
        prompt_ids = _ids(
            (getattr(resp, "model_extra", None) or {}).get("prompt_token_ids"), "prompt_token_ids"
        )
        usage = _usage(resp)
        model = resp.model
    if reply.finish_reason is None:
        reply.flags.append("no_finish_reason")  # the reply may be incomplete: never a training turn as it is
    return {
        "id": row["id"],
        "messages": row["messages"],
        "source": row.get("source"),
        "category": row.get("category"),
        "content": reply.content,
        "reasoning": reply.reasoning,
        "reasoning_source": reply.reasoning_source,
        "flags": reply.flags,
        "finish_reason": reply.finish_reason,
        "truncated": reply.truncated,
        "tool_calls": reply.tool_calls,
        "prompt_ids": prompt_ids,
        "completion_ids": completion_ids,
        "token_ids_returned": completion_ids is not None,
        "usage": usage,
        "template_flags": dict((req["extra_body"] or {}).get("chat_template_kwargs", {})),
        "request": {k: v for k, v in req.items() if k not in ("messages", "extra_body")},
        "server_model": model,
        "backend": "openai",
        "streamed": isinstance(resp, tuple),
        **{k: settings[k] for k in ("target", "target_weights", "served_model", "sampling")},
    }


_COUNTERS = (
    "generated",
    "failed",
    "with_reasoning",
    "without_reasoning",
    "truncated",
    "empty_content",
    "token_ids_returned",
    "flagged",
    "no_finish_reason",
    "completion_tokens",
)


def _count(counts: Counter, out: dict, done_tokens: int) -> None:
    """Count one finished row (``out``, a conversations.jsonl row)."""
    counts["generated"] += 1
    counts["with_reasoning"] += out["reasoning"] is not None
    counts["without_reasoning"] += out["reasoning"] is None
    counts["truncated"] += out["finish_reason"] == "length"
    counts["empty_content"] += not out["content"].strip()
    counts["token_ids_returned"] += out["token_ids_returned"]
    counts["completion_tokens"] += done_tokens
    counts["flagged"] += bool(out["flags"])
    counts["no_finish_reason"] += out["finish_reason"] is None


def _verdict(cfg: Config, counts: Counter, fatal: list[str], stopped: bool) -> None:
    """Raise when the run cannot have given what was asked (rows already written are kept).

    Raises:
        ConfigError: the server refused a request for good (``fatal``), every request failed, or
            ``expect_reasoning`` stopped the run (``stopped``)."""
    gc = cfg.generate
    if fatal:
        raise ConfigError(
            f"the server refused a request with {fatal[0]}; every row would fail alike, so generation "
            "stopped. Check generate.model, generate.base_url and the key in "
            f"{gc.api_key_env}. Rows already written are kept."
        )
    if counts["failed"] and not counts["generated"]:
        raise ConfigError(
            f"all {counts['failed']} requests failed ({', '.join(k for k in counts if k.startswith('failed_'))}); "
            "nothing was written. See the errors above; rerun once the server answers."
        )
    if stopped:
        raise ConfigError(
            f"generate.expect_reasoning is true but the first {counts['generated']} replies carry no reasoning "
            "(no `reasoning`/`reasoning_content` field, no <think> block): start the server with its reasoning "
            "parser (vLLM/SGLang: --reasoning-parser NAME), check generate.template_flags (enable_thinking), "
            "or set expect_reasoning: false. The rows already written are kept."
        )


async def _run(
    cfg: Config, todo: list[dict], sink: JsonlAppender, settings: dict, special_tokens, bar, task
) -> Counter:
    """Send ``todo`` with at most ``generate.concurrency`` in flight; append each finished row to
    ``sink`` at once; returns the counts (:data:`_COUNTERS`, ``failed_<status>``). A 401/403/404
    stops every request (each would fail alike); so does ``expect_reasoning`` when the first
    replies carry none."""
    import openai

    gc = cfg.generate
    counts: Counter = Counter(dict.fromkeys(_COUNTERS, 0))
    sem = asyncio.Semaphore(gc.concurrency)
    client = _client(cfg)
    stop = asyncio.Event()

    fatal: list[str] = []

    def failed(row: dict, label: str, message: str) -> None:
        counts["failed"] += 1
        counts[f"failed_{label}"] += 1
        if counts["failed"] <= 5:
            console.print(f"[yellow]generate: row {row['id']} failed: {redact(message, cfg)[:200]}")
        bar.update(task, advance=1, note=f"failed {counts['failed']}")

    async def one(row: dict) -> None:
        if stop.is_set():
            return
        async with sem:
            if stop.is_set():
                return
            req = _request(cfg, row)
            try:
                resp = await (
                    _streamed(client, req, special_tokens)
                    if gc.stream
                    else client.chat.completions.create(**req)
                )
                out = _row_from_response(row, resp, req, special_tokens, settings)
                done_tokens = int((out["usage"] or {}).get("completion_tokens") or 0)
            except openai.APIResponseValidationError as e:
                failed(row, "malformed_reply", f"malformed reply: {e}")
                return
            except (openai.APIError, httpx.HTTPError) as e:  # after the SDK's retries
                status = getattr(e, "status_code", None)
                retried = status is None or status in (408, 409, 429) or status >= 500
                failed(
                    row,
                    str(status or type(e).__name__),
                    f"{type(e).__name__} {status or ''} ({'after retries' if retried else 'not retried'}): {e}",
                )
                if status in FATAL_STATUS and not stop.is_set():
                    fatal.append(f"HTTP {status}: {redact(str(e), cfg)[:200]}")
                    stop.set()
                return
            except MalformedReply as e:
                failed(row, "malformed_reply", f"malformed reply: {e}")
                return
            except Exception as e:  # what the SDK raises on a nonsense body (broken JSON, wrong types)
                failed(row, "malformed_reply", f"malformed reply ({type(e).__name__}: {e})")
                return
        sink.append(out)
        _count(counts, out, done_tokens)
        bar.update(task, advance=1, tokens=counts["completion_tokens"], note=f"failed {counts['failed']}")
        if (
            gc.expect_reasoning
            and counts["generated"] >= min(EXPECT_REASONING_PROBE, len(todo))
            and counts["with_reasoning"] == 0
        ):
            stop.set()

    try:
        await asyncio.gather(*(one(r) for r in todo))
    finally:
        await client.close()
    _verdict(cfg, counts, fatal, stop.is_set())
    return counts


def generate_via_server(
    cfg: Config, todo: list[dict], sink: JsonlAppender, settings: dict, special_tokens=(), bar=None, task=None
) -> Counter:
    """Send every row of ``todo`` to the server; append each finished row to ``sink``.

    Returns counters: generated, failed (+ by status or ``malformed_reply``), with/without
    reasoning, truncated, empty_content, token_ids_returned, flagged, no_finish_reason,
    completion_tokens. A row that fails (after the SDK's retries for connection errors, 408, 409,
    429 and 5xx; at once for other 4xx and malformed replies) is left for the next run.

    Raises:
        ConfigError: no ``base_url``/``model`` or a failed :func:`check_server`; a 401/403/404 on
            a request (stops the run: every row would fail alike); every request failed;
            ``expect_reasoning`` and the first replies have no reasoning.
    """
    gc = cfg.generate
    if not gc.base_url or not gc.model:
        raise ConfigError(
            "generate.backend openai needs generate.base_url (e.g. http://localhost:8000/v1) and generate.model"
        )
    check_server(cfg)
    return asyncio.run(_run(cfg, todo, sink, settings, special_tokens, bar, task))
