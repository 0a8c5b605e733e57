"""Training sequences exactly as the target emits them: chat templates, think markers, loss masks.

A sample for one assistant turn is ``prompt ids + completion ids``:

* **prompt ids**: the target's chat template over the conversation so far with
  ``add_generation_prompt=True`` and the template flags recorded at generation. History
  turns are rendered the way the template renders them (Kimi keeps only a pending tool exchange's
  reasoning, DeepSeek drops earlier reasoning); their reasoning is passed under the key the
  template reads (:func:`eagle3kit.data.reasoning.template_reasoning_key`).
* **completion ids**: the ids the server (or the local engine) returned when present; otherwise
  the model's emission rebuilt (:func:`rebuild_completion`): the think-open marker (unless the
  generation prompt already opened the block) + reasoning + think-close marker + content +
  tool calls + end-of-turn. Markers are the tokenizer's own special-token ids; the model's text
  (reasoning, content) is tokenized with ``split_special_tokens=True``, so text that merely looks
  like a marker never becomes one.

How the rebuild finds what the template adds around a turn: it renders the history with the
generation prompt (``gen``) and the history plus the turn without reasoning (``full``); past
their common prefix, ``full`` holds the turn as the template renders it (an empty think block the
template inserts, the content, tool calls, the end-of-turn token and a trailer such as ChatML's
newline), and ``gen`` may hold an opened ``<think>`` that the history form lacks (DeepSeek-R1).

The samples of a row and their check against the template's own render are built in
:mod:`eagle3kit.data.turn_samples` from what this module renders.

**Loss mask** (:class:`MaskRule`, ``tokenize.supervise``): by default every completion token —
think markers, reasoning, content, tool calls, end-of-turn — and nothing the template inserted:
role headers and default system prompts (they are in the prompt), an empty think block the model
did not write (Kimi's ``<think></think>`` on a reply without reasoning), and the trailer after
the end-of-turn token (not part of the sample at all).

Whitespace around reasoning (``think_layout``) differs by family: DeepSeek-R1 and Qwen3 write
``<think>\\n…\\n</think>\\n\\n``, Kimi-K2 and DeepSeek-V3.1 ``<think>…</think>``. It is detected
from the template (a ``<think>\\n`` anywhere in it means the newline layout) unless configured.
"""

from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass, field

from eagle3kit.core.rundir import DataError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


NEWLINE_LAYOUT = {"after_open": "\n", "before_close": "\n", "after_close": "\n\n"}


COMPACT_LAYOUT = {"after_open": "", "before_close": "", "after_close": ""}


class TemplateError(DataError):
    """The chat template renders a conversation in a way no sample can be built from (names the turn)."""


@dataclass
class MaskRule:
    """Which completion tokens are supervised (``tokenize.supervise``); template-inserted tokens never are."""

    reasoning: bool = True
    think_markers: bool = True
    end_of_turn: bool = True


@dataclass
class ThinkSpec:
    """The target's think markers as the tokenizer's special tokens, and the family's whitespace.

    ``open_id``/``close_id`` are None when the tokenizer has no such special token (a model that
    does not reason); a reasoning row cannot be rebuilt for it."""

    open_id: int | None
    close_id: int | None
    layout: dict = field(default_factory=lambda: dict(COMPACT_LAYOUT))


def special_token_id(tokenizer, text: str) -> int | None:
    """The id of ``text`` when it is one of the tokenizer's added/special tokens, else None
    (a string the vocabulary merely spells is not a marker)."""
    added = tokenizer.get_added_vocab()
    return int(added[text]) if text in added else None


def think_spec(tokenizer, layout: dict | str | None = None) -> ThinkSpec:
    """Think markers from the tokenizer's own special-token table; ``layout`` is ``newline``,
    ``compact``, a dict of the three strings, or None (detected from the chat template)."""
    if isinstance(layout, str):
        layout = {"newline": NEWLINE_LAYOUT, "compact": COMPACT_LAYOUT}[layout]
    if layout is None:
        tmpl = tokenizer.chat_template or ""
        layout = NEWLINE_LAYOUT if ("<think>\\n" in tmpl or "<think>\n" in tmpl) else COMPACT_LAYOUT
    return ThinkSpec(
        special_token_id(tokenizer, THINK_OPEN), special_token_id(tokenizer, THINK_CLOSE), dict(layout)
    )


def render(tokenizer, messages: list[dict], flags: dict | None, generation_prompt: bool, tools=None) -> str:
    """The chat template's text for ``messages`` (``flags`` → template kwargs such as ``thinking``)."""
    kw = dict(flags or {})
    if tools:
        kw["tools"] = tools
    if not messages:  # transformers refuses an empty conversation; the template itself may not
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template(tokenizer.chat_template).render(
            messages=[], add_generation_prompt=generation_prompt, **tokenizer.special_tokens_map, **kw
        )
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kw
        )
    except Exception:
        if not any(m.get("content") is None for m in messages):
            raise
        # a template that cannot render a tool-call turn's null content (SmolLM2's concatenates it): use ""
        messages = [{**m, "content": "" if m.get("content") is None else m["content"]} for m in messages]
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kw
        )


def encode_template(tokenizer, text: str) -> list[int]:
    """Ids of template text: special-token strings become their ids (as ``apply_chat_template``)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


# each tokenizer object's plain backend, dropped with the tokenizer (keyed by id() a later tokenizer
# at the same address got the earlier one's backend, and with it other ids)
_PLAIN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _plain_backend(tokenizer):
    """A copy of a fast tokenizer's backend in which every added token — special or not — is
    encoded as the text it spells (DeepSeek-R1-Distill's ``<think>`` is an added token with
    ``special: false``, which ``split_special_tokens`` alone would still turn into the marker)."""

    from tokenizers import Tokenizer

    plain = _PLAIN.get(tokenizer)
    if plain is None:
        data = json.loads(tokenizer.backend_tokenizer.to_str())
        for a in data.get("added_tokens", []):
            a["special"] = True
        plain = Tokenizer.from_str(json.dumps(data))
        plain.encode_special_tokens = True
        _PLAIN[tokenizer] = plain
    return plain


def encode_model_text(tokenizer, text: str) -> list[int]:
    """Ids of text the model wrote: a marker or any other added-token string inside it stays
    plain text (never the marker's id)."""
    if not text:
        return []
    if getattr(tokenizer, "is_fast", False) and any(t in text for t in tokenizer.get_added_vocab()):
        return list(_plain_backend(tokenizer).encode(text, add_special_tokens=False).ids)
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def wants_argument_objects(chat_template: str | None) -> bool:
    """True when the template serializes tool-call arguments itself (``arguments | tojson``, as
    Llama 3.1's does) and so needs them as an object, not the OpenAI JSON string (which it would
    encode twice). Templates that test ``is string`` (Kimi) or concatenate (DeepSeek) take strings."""
    t = chat_template or ""
    return bool(re.search(r"arguments\s*\|\s*tojson", t)) and not re.search(
        r"arguments'?\]?\s+is\s+string", t
    )


def _tool_arguments(calls: list[dict], as_objects: bool) -> list[dict]:
    """Tool calls with their arguments as JSON objects (``as_objects``) or as JSON strings; an
    argument string that is not JSON stays a string."""

    out = []
    for c in calls:
        fn = dict(c.get("function") or {})
        args = fn.get("arguments")
        if as_objects and isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args)
            except json.JSONDecodeError:
                pass
        elif not as_objects and not isinstance(args, str):
            fn["arguments"] = json.dumps(args, ensure_ascii=False)
        out.append({**c, "function": fn})
    return out


def history_message(msg: dict, reads: str, argument_objects: bool = False) -> dict:
    """An assistant message as history for the template: reasoning under the key it reads, tool-call
    arguments as objects when the template wants them (:func:`wants_argument_objects`)."""
    if msg.get("role") != "assistant":
        return msg
    reasoning = msg.get("reasoning_content", msg.get("reasoning"))
    out = {k: v for k, v in msg.items() if k not in ("reasoning", "reasoning_content")}
    if out.get("tool_calls") and not out.get("content"):
        out["content"] = (
            None  # the OpenAI form of a tool-call-only turn (R1's template renders "" as a 2nd turn)
        )
    if out.get("tool_calls"):
        out["tool_calls"] = _tool_arguments(out["tool_calls"], argument_objects)
    if reasoning:
        for k in ("reasoning", "reasoning_content") if reads == "both" else (reads,):
            out[k] = reasoning
    return out


def common_prefix(a: str, b: str) -> int:
    """Length of the common prefix of two rendered texts, never ending inside a ``<…>`` marker."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    if a.rfind("<", 0, i) > a.rfind(">", 0, i):
        i = a.rfind("<", 0, i)
    return i


# an empty think block or a lone closer a template renders around a turn; _SPAN without the trailing whitespace
_TEMPLATE_THINK_SPAN_PATTERN = (
    r"\s*(" + re.escape(THINK_OPEN) + r"\s*" + re.escape(THINK_CLOSE) + "|" + re.escape(THINK_CLOSE) + ")"
)


_TEMPLATE_THINK = re.compile(_TEMPLATE_THINK_SPAN_PATTERN + r"\s*")


TEMPLATE_THINK_SPAN = re.compile(_TEMPLATE_THINK_SPAN_PATTERN)


_MARKERS_ONLY = re.compile(r"\s|" + re.escape(THINK_OPEN) + "|" + re.escape(THINK_CLOSE))


def _turn_form(tokenizer, history: list[dict], plain: dict, flags, tools) -> tuple[str, str]:
    """(what the generation prompt adds past the common prefix, the turn as the template renders it).

    Renders ``history`` with the generation prompt and ``history + [plain]`` without; past their
    common prefix the first may hold only think markers and whitespace. Some templates render
    history differently once another assistant turn follows (Kimi moves a pending tool exchange's
    reasoning out); then the shortest history suffix that renders consistently is used.

    Raises:
        TemplateError: no history suffix gives a consistent render.
    """
    gen = ""
    for k in range(len(history) + 1):
        gen = render(tokenizer, history[k:], flags, True, tools)
        full = render(tokenizer, history[k:] + [plain], flags, False, tools)
        cut = common_prefix(gen, full)
        if not _MARKERS_ONLY.sub("", gen[cut:]):
            return gen[cut:], full[cut:]
    raise TemplateError(
        f"the template's generation prompt ends in {gen[-80:]!r}, which its render of the finished "
        "turn does not contain; cannot tell what the model emitted"
    )


@dataclass
class Piece:
    """One stretch of a completion: ``ids`` and whether they are supervised; ``kind`` names it
    (``think_marker``, ``reasoning``, ``content``, ``template``, ``end_of_turn``) for ``--show``."""

    ids: list[int]
    supervised: bool
    kind: str


def rebuild_completion(
    tokenizer,
    history: list[dict],
    msg: dict,
    flags: dict | None,
    spec: ThinkSpec,
    eot_ids: list[int],
    rule: MaskRule | None = None,
    truncated: bool = False,
    tools=None,
) -> tuple[str, list[Piece]]:
    """The generation prompt text and the model's emission for assistant message ``msg`` after
    ``history``, as :class:`Piece` s (see the module docstring for the rule).

    Args:
        msg: ``{"role": "assistant", "content", "reasoning"|"reasoning_content"?, "tool_calls"?}``.
        eot_ids: end-of-turn token ids; the rendered turn is cut after the first one.
        truncated: the reply was cut at the token limit: no end-of-turn token is appended.

    Raises:
        TemplateError: the generation prompt and the history render disagree beyond think markers
            and whitespace; or the reply has reasoning and the tokenizer has no think tokens.
    """
    rule = rule or MaskRule()
    gen = render(tokenizer, history, flags, True, tools)
    plain = {k: v for k, v in msg.items() if k not in ("reasoning", "reasoning_content")}
    plain["content"] = plain.get("content") or ("" if not plain.get("tool_calls") else None)
    gen_tail, tail = _turn_form(tokenizer, history, plain, flags, tools)
    opened = gen_tail.rstrip().endswith(THINK_OPEN) or (not gen_tail and gen.rstrip().endswith(THINK_OPEN))
    eot_strs = [tokenizer.convert_ids_to_tokens(i) for i in eot_ids]
    template_think, body = _split_turn(tail, plain["content"], spec, eot_strs)
    body_without_content = None
    if plain["content"] and plain["content"] not in body:
        # the template rewrites or ignores the content (Llama's tool-call turns, R1's cut after a
        # typed "</think>"): the model's text, then what the template renders without it
        _, tail0 = _turn_form(
            tokenizer, history, {**plain, "content": None if plain.get("tool_calls") else ""}, flags, tools
        )
        body_without_content = _split_turn(tail0, "", spec, eot_strs)[1]
    reasoning = msg.get("reasoning_content", msg.get("reasoning"))
    if reasoning and gen.rstrip().endswith(THINK_CLOSE):
        raise TemplateError(
            "the reply has reasoning but the generation prompt already closed the think block (the "
            "recorded template flags turn thinking off); the row's flags and its reply disagree"
        )
    lay = spec.layout
    pieces: list[Piece] = []
    if reasoning:
        if spec.open_id is None or spec.close_id is None:
            raise TemplateError(
                "the reply has reasoning but the tokenizer has no <think>/</think> special tokens"
            )
        if not opened:
            pieces.append(Piece([spec.open_id], rule.think_markers, "think_marker"))
            text = lay["after_open"] + reasoning + lay["before_close"]
        else:
            text = reasoning + lay["before_close"]
        pieces.append(Piece(encode_model_text(tokenizer, text), rule.reasoning, "reasoning"))
        pieces.append(Piece([spec.close_id], rule.think_markers, "think_marker"))
        body = lay["after_close"] + body.lstrip()
    elif opened:  # the prompt opened a block the model closed at once
        if spec.close_id is None:
            raise TemplateError(
                "the generation prompt opens <think> but the tokenizer has no </think> special token"
            )
        pieces.append(Piece([spec.close_id], rule.think_markers, "think_marker"))
        body = lay["after_close"] + body.lstrip()
    elif template_think.strip():
        # an empty block (or a lone closer) the template inserts around a reply without reasoning
        pieces.append(Piece(encode_template(tokenizer, template_think), False, "template"))
    pieces.extend(
        _body_pieces(tokenizer, body, plain["content"], eot_strs, rule, truncated, body_without_content)
    )
    return gen, [p for p in pieces if p.ids]


def _split_turn(tail: str, content: str | None, spec: ThinkSpec, eot_strs: list[str]) -> tuple[str, str]:
    """(the think block the template put before the turn, the turn up to and including its
    end-of-turn). A leading block counts as the template's only when the tokenizer has think
    markers and the model's content does not itself start with that text."""
    m = _TEMPLATE_THINK.match(tail)
    think = m.group(0) if m and spec.close_id is not None else ""
    if think and content and tail.lstrip().startswith(content.lstrip()[: max(1, len(think.strip()))]):
        think = ""
    body = tail[len(think) :]
    ends = [(body.find(x), x) for x in eot_strs if x and body.find(x) >= 0]
    if ends:
        at, x = min(ends)
        if content and x in content:  # the content itself spells the end-of-turn string: cut after it
            at2 = body.find(x, body.find(content) + len(content)) if content in body else -1
            at = at2 if at2 >= 0 else at
        body = body[: at + len(x)]
    return think, body


def _body_pieces(
    tokenizer,
    body: str,
    content: str | None,
    eot_strs: list[str],
    rule: MaskRule,
    truncated: bool,
    body_without_content: str | None = None,
) -> list[Piece]:
    """Content (model text), then whatever the template renders after it (tool-call sections,
    their special tokens real), then the end-of-turn token."""
    eot = next((s for s in eot_strs if s and body.endswith(s)), None)
    if eot:
        body = body[: -len(eot)]
    at = body.find(content) if content else -1
    if at >= 0:
        before, after = body[:at], body[at + len(content) :]
        pieces = [Piece(encode_model_text(tokenizer, before + content), True, "content")]
    # the template rewrote the content: keep the model's text, then the rest as rendered without it
    elif content:
        lead = body[: len(body) - len(body.lstrip())]
        pieces, after = [Piece(encode_model_text(tokenizer, lead + content), True, "content")], ""
        if body_without_content:
            rest = body_without_content
            e = next((x for x in eot_strs if x and rest.endswith(x)), None)
            after = (rest[: -len(e)] if e else rest).strip()
    else:
        after = body
        pieces = []
    if after:
        pieces.append(
            Piece(encode_template(tokenizer, after), True, "tool_calls" if after.strip() else "content")
        )
    if eot and not truncated:
        pieces.append(Piece(encode_template(tokenizer, eot), rule.end_of_turn, "end_of_turn"))
    return pieces


def classify_returned(
    ids: list[int], spec: ThinkSpec, eot_ids: list[int], opened: bool, rule: MaskRule
) -> list[Piece]:
    """The server's returned completion ids as :class:`Piece` s: think markers, reasoning (inside
    the block, which the prompt may have opened), end-of-turn, content — so the mask rule applies
    to returned ids as to rebuilt ones."""
    pieces: list[Piece] = []
    inside = opened
    eot = set(eot_ids)
    for t in ids:
        if t == spec.open_id:
            kind, sup, inside = "think_marker", rule.think_markers, True
        elif t == spec.close_id:
            kind, sup, inside = "think_marker", rule.think_markers, False
        elif inside:
            kind, sup = "reasoning", rule.reasoning
        elif t in eot:
            kind, sup = "end_of_turn", rule.end_of_turn
        else:
            kind, sup = "content", True
        if pieces and pieces[-1].kind == kind and pieces[-1].supervised == sup and kind != "think_marker":
            pieces[-1].ids.append(t)
        else:
            pieces.append(Piece([t], sup, kind))
    return pieces
