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
from dataclasses import dataclass, field

from eagle3kit.core.rundir import DataError
from eagle3kit.data.reasoning import template_reasoning_key

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


_PLAIN: dict[int, object] = {}


def _plain_backend(tokenizer):
    """A copy of a fast tokenizer's backend in which every added token — special or not — is
    encoded as the text it spells (DeepSeek-R1-Distill's ``<think>`` is an added token with
    ``special: false``, which ``split_special_tokens`` alone would still turn into the marker)."""

    from tokenizers import Tokenizer

    key = id(tokenizer)
    if key not in _PLAIN:
        data = json.loads(tokenizer.backend_tokenizer.to_str())
        for a in data.get("added_tokens", []):
            a["special"] = True
        plain = Tokenizer.from_str(json.dumps(data))
        plain.encode_special_tokens = True
        _PLAIN[key] = plain
    return _PLAIN[key]


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


def _common_prefix(a: str, b: str) -> int:
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


_TEMPLATE_THINK_SPAN = re.compile(_TEMPLATE_THINK_SPAN_PATTERN)


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
        cut = _common_prefix(gen, full)
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


def conversation(row: dict) -> list[dict]:
    """A conversation row's messages with its reply appended as the last assistant turn. A row
    without ``content`` is a finished conversation: its ``messages`` are taken as they are (turns
    after the last assistant turn are not supervised)."""
    msgs = [dict(m) for m in row["messages"]]
    if "content" not in row:
        return msgs
    final = {"role": "assistant", "content": row.get("content") or ""}
    if row.get("reasoning"):
        final["reasoning"] = row["reasoning"]
    if row.get("tool_calls"):
        final["tool_calls"] = row["tool_calls"]
    return msgs + [final]


@dataclass
class Sample:
    """One training sequence: ``ids``/``mask`` (equal length, mask 1 = supervised), the index of
    the assistant turn it ends with, where the completion starts, and its pieces (for ``--show``)."""

    ids: list[int]
    mask: list[int]
    turn: int
    prompt_len: int
    pieces: list[Piece]
    returned_ids: bool


def _turn_spans(
    tokenizer, conv_h: list[dict], upto: int, prompt: str, flags, eot_strs, tools, has_think: bool
) -> list[tuple[int, int]]:
    """Character spans of the earlier assistant turns inside the rendered ``prompt`` (the turns
    as the template renders history), without a template-inserted think block: a turn starts
    where the render of the history before it (with the generation prompt) leaves the prompt and
    ends at the last end-of-turn string before the render of the history through it does."""
    spans = []
    for j, m in enumerate(conv_h[:upto]):
        if m.get("role") != "assistant":
            continue
        start = _common_prefix(render(tokenizer, conv_h[:j], flags, True, tools), prompt)
        stop = _common_prefix(render(tokenizer, conv_h[: j + 1], flags, False, tools), prompt)
        mt = _TEMPLATE_THINK_SPAN.match(prompt, start) if has_think else None
        content = m.get("content") or ""
        if mt and not prompt[start:].lstrip().startswith(
            content.lstrip()[: max(1, len(mt.group(0).strip()))] if content else "\0"
        ):
            # an empty block or a lone closer the template renders for history: not the model's
            start = mt.end()
        ends = [
            prompt.rfind(x, start, stop) + len(x) for x in eot_strs if x and prompt.rfind(x, start, stop) >= 0
        ]
        spans.append((start, max(ends) if ends else stop))
    return spans


def _apply_rule(
    ids: list[int], mask: list[int], spec: ThinkSpec, eot_ids: list[int], rule: MaskRule
) -> list[int]:
    """The mask rule on earlier turns inside a one-sequence prompt: drop end-of-turn tokens, think
    markers and the reasoning between them from the supervised spans when the rule says so."""
    out, inside, eot = list(mask), False, set(eot_ids)
    for k, t in enumerate(ids):
        if t == spec.open_id or t == spec.close_id:
            inside = t == spec.open_id
            out[k] &= int(rule.think_markers)
        elif inside:
            out[k] &= int(rule.reasoning)
        elif t in eot:
            out[k] &= int(rule.end_of_turn)
    return out


def build_samples(
    tokenizer,
    row: dict,
    spec: ThinkSpec,
    eot_ids: list[int],
    mode: str = "per_turn",
    rule: MaskRule | None = None,
) -> list[Sample]:
    """Training samples of one conversation row.

    ``mode``: ``per_turn`` — one sample per assistant turn, each ``prompt(history) + emission``;
    ``one_sequence`` — one sample ending with the last turn's emission, in which the earlier
    assistant turns (as the template renders history) are supervised too. Only the last turn can
    use the row's ``completion_ids`` (the server's or engine's returned ids); other turns are rebuilt.

    Raises:
        TemplateError: see :func:`rebuild_completion`.
    """

    rule = rule or MaskRule()
    flags = row.get("template_flags") or {}
    tools = row.get("tools")
    conv = conversation(row)
    reads = template_reasoning_key(tokenizer.chat_template)
    objects = wants_argument_objects(tokenizer.chat_template)
    conv_h = [history_message(m, reads, objects) for m in conv]
    turns = [i for i, m in enumerate(conv) if m.get("role") == "assistant"]
    if mode == "one_sequence":
        turns = turns[-1:]
    out = []
    for i in turns:
        last = i == len(conv) - 1 and "content" in row
        truncated = last and row.get("finish_reason") == "length"
        returned = last and row.get("completion_ids") is not None
        if returned:  # the engine's ids are the emission: nothing to rebuild
            gen = render(tokenizer, conv_h[:i], flags, True, tools)
            pieces = classify_returned(
                [int(t) for t in row["completion_ids"]],
                spec,
                eot_ids,
                gen.rstrip().endswith(THINK_OPEN),
                rule,
            )
        else:
            gen, pieces = rebuild_completion(
                tokenizer,
                conv_h[:i],
                {**conv_h[i], "reasoning": conv[i].get("reasoning_content", conv[i].get("reasoning"))},
                flags,
                spec,
                eot_ids,
                rule,
                truncated,
                tools,
            )
        prompt_ids = encode_template(tokenizer, gen)
        prompt_mask = [0] * len(prompt_ids)
        if mode == "one_sequence":
            eot_strs = [tokenizer.convert_ids_to_tokens(t) for t in eot_ids]
            spans = _turn_spans(tokenizer, conv_h, i, gen, flags, eot_strs, tools, spec.close_id is not None)
            enc = tokenizer(gen, add_special_tokens=False, return_offsets_mapping=True)
            prompt_ids = list(enc["input_ids"])
            prompt_mask = [
                int(b > a and any(s <= a and b <= e for s, e in spans)) for a, b in enc["offset_mapping"]
            ]
            prompt_mask = _apply_rule(prompt_ids, prompt_mask, spec, eot_ids, rule)
        ids = prompt_ids + [t for p in pieces for t in p.ids]
        mask = prompt_mask + [int(p.supervised) for p in pieces for _ in p.ids]
        out.append(Sample(ids, mask, i, len(prompt_ids), pieces, returned))
    return out


def strip_think(ids: list[int], spec: ThinkSpec, is_space) -> list[int]:
    """``ids`` without think blocks: from an open marker through the close marker, a lone close
    marker, and the whitespace-only tokens around them. Used to compare a sample with a template
    render that drops or empties reasoning."""
    out: list[int] = []
    inside = False
    skip_space = False
    for t in ids:
        if t == spec.open_id:
            while out and is_space(out[-1]):
                out.pop()
            inside = True
            continue
        if t == spec.close_id:
            while out and is_space(out[-1]):
                out.pop()
            inside, skip_space = False, True
            continue
        if inside or (skip_space and is_space(t)):
            continue
        skip_space = False
        out.append(t)
    return out


def self_check(tokenizer, row: dict, sample: Sample, spec: ThinkSpec, eot_ids: list[int]) -> str:
    """Compare a sample with an independent path: the tokenizer's own ``apply_chat_template``
    over the whole conversation up to that turn (no generation prompt, reasoning under the key the
    template reads). Think blocks are stripped from both first (templates drop or empty history
    reasoning); the render may go on past the sample only with whitespace (a template trailer) or,
    for a reply cut at the token limit, an end-of-turn token.

    Returns ``ok``, ``retokenized`` (same text, other ids: the model emitted a non-canonical
    tokenization, which the sample keeps; or a reply cut inside a multi-byte character, whose
    stored text lacks the partial character), ``whitespace`` (the texts differ only in whitespace:
    a template that trims the content) or ``mismatch``.

    Rows without returned ids are checked only against the template (the sample was built from the
    same template): that catches rebuild faults (markers, end-of-turn, tool sections, history), not
    wrong template flags or a prompt the server changed — those show only in returned prompt ids.
    """

    conv = [
        history_message(
            m,
            template_reasoning_key(tokenizer.chat_template),
            wants_argument_objects(tokenizer.chat_template),
        )
        for m in conversation(row)
    ]
    full = encode_template(
        tokenizer,
        render(tokenizer, conv[: sample.turn + 1], row.get("template_flags"), False, row.get("tools")),
    )
    cache: dict[int, bool] = {}

    def is_space(t: int) -> bool:
        if t not in cache:
            cache[t] = t not in (spec.open_id, spec.close_id) and tokenizer.decode([t]).strip() == ""
        return cache[t]

    a = strip_think(sample.ids, spec, is_space)  # a think block the prompt opened starts at its marker
    b = strip_think(full, spec, is_space)
    eot = set(eot_ids)

    def fits(x: list, y: list, rest_ok) -> bool:
        return y[: len(x)] == x and rest_ok(y[len(x) :])

    cut = row.get("finish_reason") == "length" and sample.turn == len(conv) - 1

    def rest_ids(rest: list[int]) -> bool:
        if cut and rest and rest[0] in eot:
            rest = rest[1:]
        return all(is_space(t) for t in rest)

    if fits(a, b, rest_ids):
        return "ok"
    ta, tb = tokenizer.decode(a), tokenizer.decode(b)
    if cut:  # a reply cut at the limit may end inside a character, which the server's text drops
        ta = ta.rstrip("\ufffd").rstrip()
    if tb.startswith(ta):
        rest = tb[len(ta) :].lstrip() if cut else tb[len(ta) :]
        for s in (tokenizer.convert_ids_to_tokens(t) for t in eot):
            if cut and rest.startswith(s):
                rest = rest[len(s) :]
        if not rest.strip():
            return "retokenized"
    squeeze = re.compile(r"\s+")
    na, nb = squeeze.sub("", ta), squeeze.sub("", tb)
    if nb.startswith(na) and (
        nb[len(na) :] == ""
        or (cut and any(nb[len(na) :] == squeeze.sub("", tokenizer.convert_ids_to_tokens(t)) for t in eot))
    ):
        return "whitespace"  # the template trims or adds whitespace at the turn's edges (Llama's `| trim`)
    return "mismatch"
