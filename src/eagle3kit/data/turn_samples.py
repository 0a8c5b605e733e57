"""Training samples of one conversation row, with their loss masks, and their check against the
template's own render of the whole conversation.

``per_turn`` gives one sample per assistant turn (``prompt(history) + emission``, the emission rebuilt
by :func:`eagle3kit.data.templates.rebuild_completion` or taken from the engine's returned ids);
``one_sequence`` one sample ending with the last turn, in which the earlier assistant turns are
supervised as the template renders history. :func:`self_check` compares a sample with the tokenizer's
own ``apply_chat_template`` over the conversation (an independent path).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from eagle3kit.data.reasoning import template_reasoning_key
from eagle3kit.data.templates import (
    TEMPLATE_THINK_SPAN,
    THINK_OPEN,
    MaskRule,
    Piece,
    ThinkSpec,
    classify_returned,
    common_prefix,
    encode_template,
    history_message,
    rebuild_completion,
    render,
    wants_argument_objects,
)


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
    the assistant turn it ends with, where the completion starts, and its pieces (for ``--show``);
    ``cut``: its ids were cut at ``tokenize.max_length`` (the pieces are not)."""

    ids: list[int]
    mask: list[int]
    turn: int
    prompt_len: int
    pieces: list[Piece]
    returned_ids: bool
    cut: bool = False


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
        start = common_prefix(render(tokenizer, conv_h[:j], flags, True, tools), prompt)
        stop = common_prefix(render(tokenizer, conv_h[: j + 1], flags, False, tools), prompt)
        mt = TEMPLATE_THINK_SPAN.match(prompt, start) if has_think else None
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
    for a reply cut at the token limit, an end-of-turn token; past a sample cut at
    ``tokenize.max_length`` (``sample.cut``), with anything.

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
        if sample.cut:  # the render's tokens past max_length were never in the sample
            return True
        if cut and rest and rest[0] in eot:
            rest = rest[1:]
        return all(is_space(t) for t in rest)

    if fits(a, b, rest_ids):
        return "ok"
    ta, tb = tokenizer.decode(a), tokenizer.decode(b)
    if cut or sample.cut:  # a cut reply may end inside a character, which the server's text drops
        ta = ta.rstrip("\ufffd").rstrip()
    if sample.cut and tb.startswith(ta):
        return "retokenized"
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
        or sample.cut
        or (cut and any(nb[len(na) :] == squeeze.sub("", tokenizer.convert_ids_to_tokens(t)) for t in eot))
    ):
        return "whitespace"  # the template trims or adds whitespace at the turn's edges (Llama's `| trim`)
    return "mismatch"
