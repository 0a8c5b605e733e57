"""Reasoning capture from OpenAI-compatible chat replies (reasoning fields, cut blocks, tool calls, special tokens).

Servers return a model's thinking in different places:

* ``message.reasoning`` (vLLM ≥ 0.10 with a reasoning parser, OpenRouter),
* ``message.reasoning_content`` (DeepSeek API, SGLang, older vLLM) — the OpenAI SDK exposes it
  only through ``model_extra`` because it is not part of its schema,
* streamed ``delta.reasoning`` / ``delta.reasoning_content`` pieces,
* inline ``<think>…</think>`` at the start of ``content`` (no reasoning parser on the server),
* only the closing ``</think>`` in ``content``, because the chat template's generation prompt
  already opened the block (DeepSeek-R1-Distill).

:func:`parse_reply` turns any of these into one :class:`Reply` that records where the reasoning
came from and flags what it could not resolve (two fields that disagree, an unclosed block, a
special-token string inside the reasoning) instead of guessing.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

THINK_OPEN = "<think>"


THINK_CLOSE = "</think>"


REASONING_KEYS = ("reasoning", "reasoning_content")


# flags that keep a reply out of training as it is (disagreeing fields, a cut block, a special token,
# a reply without finish_reason that may be incomplete)
UNTRAINABLE_FLAGS = (
    "reasoning_fields_disagree",
    "unclosed_think",
    "special_token_in_reasoning",
    "no_finish_reason",
)


@dataclass
class Reply:
    """One parsed assistant reply.

    ``reasoning_source``: ``message.reasoning``, ``message.reasoning_content``,
    ``model_extra.reasoning_content``, ``stream.reasoning``, ``stream.reasoning_content``,
    ``inline_think``, ``prompt_opened_think`` or None. ``flags``: problems found (a row with
    ``reasoning_fields_disagree``, ``unclosed_think`` or ``special_token_in_reasoning`` must not
    become a training turn unchanged). ``truncated``: the reply was cut (``finish_reason`` length
    or an unclosed think block). ``tool_calls``: the OpenAI ``tool_calls`` list
    (``[{"id", "type": "function", "function": {"name", "arguments": str}}]``) or None."""

    content: str
    reasoning: str | None = None
    reasoning_source: str | None = None
    finish_reason: str | None = None
    truncated: bool = False
    flags: list[str] = field(default_factory=list)
    tool_calls: list[dict] | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def trainable(self) -> bool:
        """False when the row must not become a training turn as it is."""
        if not self.content.strip() and not self.tool_calls:
            return False
        if self.truncated and self.reasoning is not None:
            return False  # a cut-off reasoning block
        return not (set(UNTRAINABLE_FLAGS) & set(self.flags))


def _get(obj: Any, key: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(key)
    val = getattr(obj, key, None)
    if val is None:
        extra = getattr(obj, "model_extra", None) or {}
        val = extra.get(key)
    return val


def _field_reasoning(message: Any) -> tuple[str | None, str | None, list[str]]:
    """(reasoning, source, flags) from the dedicated fields of a message or SDK object."""
    found: dict[str, str] = {}
    for key in REASONING_KEYS:
        if isinstance(message, dict):
            val, src = message.get(key), f"message.{key}"
        else:
            extra = getattr(message, "model_extra", None) or {}
            if key in extra:  # not in the SDK's schema: pydantic keeps it as an extra field
                val, src = extra[key], f"model_extra.{key}"
            else:
                val, src = getattr(message, key, None), f"message.{key}"
        if isinstance(val, str) and val != "":
            found[src] = val
    if not found:
        return None, None, []
    values = set(found.values())
    flags = ["reasoning_fields_disagree"] if len(values) > 1 else []
    src = next(iter(found))
    return found[src], src, flags


def split_inline_think(
    content: str, prompt_opens_think: bool
) -> tuple[str | None, str, str | None, list[str]]:
    """Split ``<think>…</think>`` (or a bare ``…</think>`` after a prompt that opened the block)
    off the start of ``content``. Returns (reasoning, content, source, flags)."""
    text = content or ""
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN):
        body = stripped[len(THINK_OPEN) :]
        if THINK_CLOSE not in body:
            return body.strip(), "", "inline_think", ["unclosed_think"]
        reasoning, _, rest = body.partition(THINK_CLOSE)
        return reasoning.strip(), rest.strip(), "inline_think", []
    if THINK_CLOSE in text and (prompt_opens_think or THINK_OPEN not in text):
        reasoning, _, rest = text.partition(THINK_CLOSE)
        flags = [] if prompt_opens_think else ["close_marker_without_open"]
        return reasoning.strip(), rest.strip(), "prompt_opened_think", flags
    if prompt_opens_think and text:
        # the prompt opened a think block that the reply never closed: all of it is reasoning
        return text.strip(), "", "prompt_opened_think", ["unclosed_think"]
    return None, text, None, []


def parse_reply(
    message: Any,
    finish_reason: str | None = None,
    prompt_opens_think: bool = False,
    special_tokens: Iterable[str] = (),
) -> Reply:
    """Parse a non-streamed ``choices[0].message`` (a dict or an OpenAI SDK object).

    Args:
        finish_reason: the choice's ``finish_reason``.
        prompt_opens_think: the rendered prompt ends inside an open ``<think>`` block.
        special_tokens: the tokenizer's special-token strings; one inside the reasoning flags the
            row: tokenizing it would put a special-token id inside the reasoning span.
    """
    content = _get(message, "content") or ""
    reasoning, source, flags = _field_reasoning(message)
    if reasoning is None:
        reasoning, content, source, more = split_inline_think(content, prompt_opens_think)
        flags += more
    elif THINK_CLOSE in content:
        # a field held the reasoning but the content still carries a stray closing marker
        _, _, content = content.partition(THINK_CLOSE)
        content = content.strip()
        flags.append("stray_close_marker_removed")
    if reasoning is not None:
        bad = [t for t in special_tokens if t and t in reasoning and t not in (THINK_OPEN, THINK_CLOSE)]
        if bad:
            flags.append("special_token_in_reasoning")
    truncated = finish_reason == "length" or "unclosed_think" in flags
    return Reply(
        content=content,
        reasoning=reasoning,
        reasoning_source=source,
        finish_reason=finish_reason,
        truncated=truncated,
        flags=flags,
        tool_calls=_tool_calls(message),
    )


def _tool_calls(message: Any) -> list[dict] | None:
    calls = _get(message, "tool_calls")
    if not calls:
        return None
    out = []
    for c in calls:
        c = c.model_dump(exclude_none=True) if hasattr(c, "model_dump") else dict(c)
        fn = dict(c.get("function") or {})
        out.append(
            {
                "id": c.get("id"),
                "type": c.get("type") or "function",
                "function": {"name": fn.get("name"), "arguments": fn.get("arguments") or ""},
            }
        )
    return out


def accumulate_stream(chunks: Iterable[Any]) -> tuple[dict, str | None]:
    """Merge streamed ``choices[0].delta`` pieces into one message dict.

    Returns (message, finish_reason); the message carries ``content`` and whichever reasoning
    keys the stream used, so :func:`parse_reply` treats both modes alike (source names are
    rewritten to ``stream.*`` by :func:`parse_stream`)."""
    parts: dict[str, list[str]] = {"content": [], "reasoning": [], "reasoning_content": []}
    calls: dict[int, dict] = {}  # streamed tool calls, merged by index: id/name once, arguments in pieces
    finish = None
    for chunk in chunks:
        choices = _get(chunk, "choices") or []
        if not choices:
            continue
        ch = choices[0]
        delta = _get(ch, "delta") or {}
        for key in parts:
            piece = _get(delta, key)
            if isinstance(piece, str):
                parts[key].append(piece)
        for tc in _get(delta, "tool_calls") or []:
            index = _get(tc, "index")
            if index is None:  # a server that omits the index: a new id starts a new call
                index = max(calls, default=0)
                if _get(tc, "id") and calls.get(index, {}).get("id") not in (None, _get(tc, "id")):
                    index += 1
            slot = calls.setdefault(
                index, {"id": None, "type": "function", "function": {"name": None, "arguments": ""}}
            )
            slot["id"] = _get(tc, "id") or slot["id"]
            fn = _get(tc, "function")
            slot["function"]["name"] = _get(fn, "name") or slot["function"]["name"]
            slot["function"]["arguments"] += _get(fn, "arguments") or ""
        finish = _get(ch, "finish_reason") or finish
    msg: dict = {k: "".join(v) for k, v in parts.items() if v}
    msg.setdefault("content", "")
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg, finish


def parse_stream(
    chunks: Iterable[Any], prompt_opens_think: bool = False, special_tokens: Iterable[str] = ()
) -> Reply:
    """:func:`parse_reply` over a stream of chunks (dicts or SDK objects)."""
    msg, finish = accumulate_stream(chunks)
    reply = parse_reply(msg, finish, prompt_opens_think, special_tokens)
    if reply.reasoning_source and reply.reasoning_source.startswith("message."):
        reply.reasoning_source = "stream." + reply.reasoning_source.split(".", 1)[1]
    return reply


def assistant_history_message(
    content: str, reasoning: str | None, server_reads: str = "both", tool_calls: list[dict] | None = None
) -> dict:
    """An earlier assistant turn for the next request, with its reasoning under the key the target
    server reads (``reasoning``, ``reasoning_content`` or ``both``), and its tool calls."""
    msg: dict = {"role": "assistant", "content": content}
    if reasoning:
        keys = REASONING_KEYS if server_reads == "both" else (server_reads,)
        for k in keys:
            msg[k] = reasoning
    if tool_calls:
        msg["tool_calls"] = [dict(c) for c in tool_calls]
    return msg


def template_reasoning_key(chat_template: str | None) -> str:
    """Which message key a chat template reads an earlier turn's reasoning from: ``reasoning_content``
    (Kimi-K2, DeepSeek, Qwen3 templates), ``reasoning`` (templates written for vLLM's field), or
    ``both`` when the template names neither (sending both costs nothing: templates ignore unknown keys)."""

    t = chat_template or ""
    if "reasoning_content" in t:
        return "reasoning_content"
    if re.search(r"""[.'"\[]reasoning\b(?!_)""", t):
        return "reasoning"
    return "both"


def next_turn_messages(
    messages: list[dict], reply: Reply, tool_results: list[dict] | None = None, server_reads: str = "both"
) -> list[dict]:
    """The messages of the next request after ``reply``: the history, the reply as an assistant
    turn (reasoning under ``server_reads``, tool calls kept), then one ``tool`` message per
    ``tool_results`` item (``{"tool_call_id", "content"}``) — the multi-step tool exchange.

    Raises:
        ValueError: a tool result answers no tool call of the reply (names the id).
    """
    ids = {c["id"] for c in reply.tool_calls or []}
    out = list(messages) + [
        assistant_history_message(reply.content, reply.reasoning, server_reads, reply.tool_calls)
    ]
    for res in tool_results or []:
        if res["tool_call_id"] not in ids:
            raise ValueError(
                f"tool result for {res['tool_call_id']!r} answers no tool call of the reply (calls: {sorted(ids)})"
            )
        out.append({"role": "tool", "tool_call_id": res["tool_call_id"], "content": res["content"]})
    return out
