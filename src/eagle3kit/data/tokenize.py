"""Stage ``tokenize``: conversations → token shard (``input_ids``, ``loss_mask``).

Samples are built by :mod:`eagle3kit.data.turn_samples` (from :mod:`eagle3kit.data.templates`'s
renders): prompt ids = the target's chat template over the conversation so far with
``add_generation_prompt=True`` and the row's recorded template flags; completion ids = the ids the
target emitted (``completion_ids``) when the row has them, else the emission rebuilt from the text
(think markers as the tokenizer's special ids). Multi-turn rows give one sample per assistant turn
(``tokenize.multi_turn: per_turn``) or one sequence with every assistant turn supervised
(``one_sequence``). Loss mask = 1 on the tokens the model emitted (``tokenize.supervise`` can leave out
reasoning, think markers or end-of-turn); the one-position shift (docs/conventions.md, alignment) is
applied in training, not here.

Dropped and counted: empty completions, prompts that reach ``max_length`` (the assistant
turn would start past it), rows the template cannot render consistently, flagged server rows
(reasoning fields that disagree, a cut reasoning block, a special token inside reasoning), and —
with ``tokenize.drop_truncated`` — rows cut at the generation limit. Kept truncated rows end
without an end-of-turn token. Sequences longer than ``max_length`` are cut.

Self-check (not circular): up to ``tokenize.self_check_rows`` rows are compared with the
tokenizer's own full-conversation render (:func:`eagle3kit.data.turn_samples.self_check`), their returned
prompt ids with the render, and their returned completion ids with the text rebuild; the counts go
to the report and ``--strict`` turns a mismatch into an error.

Shard (``tokens.safetensors``): ``input_ids`` int32 [total], ``loss_mask`` uint8 [total],
``offsets`` int64 [samples + 1] (sample i is ``[offsets[i], offsets[i+1])``).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from pathlib import Path

import torch

from eagle3kit.core.config import Config
from eagle3kit.core.lineage import check_inputs
from eagle3kit.core.rundir import (
    DataError,
    RunDir,
    load_safetensors,
    read_jsonl,
    require_free,
    sha256_file,
    sha256_tensors,
    write_safetensors,
)
from eagle3kit.core.ui import console, show_samples
from eagle3kit.data.reasoning import THINK_CLOSE, THINK_OPEN, UNTRAINABLE_FLAGS, split_inline_think
from eagle3kit.data.templates import MaskRule, ThinkSpec, think_spec
from eagle3kit.data.turn_samples import Sample, build_samples, self_check
from eagle3kit.model.target import chat_template_hash, tokenizer_hash
from eagle3kit.model.target_files import load_tokenizer, model_vocab_size


def check_row(row, where: str) -> None:
    """A conversation row's structure, before any template sees it.

    Raises:
        DataError: naming ``where`` (file:line) and the field: ``messages`` not a list of
            ``{role: str, content: str | null}`` objects, ``content``/``reasoning`` not strings,
            ``template_flags`` not an object, ``tools``/``tool_calls`` not lists, ids not ints.
    """

    def bad(what: str) -> DataError:
        return DataError(f"{where}: {what}; fix or delete that line")

    if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
        raise bad("not a conversation row (needs 'messages', a list)")
    for m in row["messages"]:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"each message needs a string 'role', got {str(m)[:60]!r}")
        if m.get("content") is not None and not isinstance(m["content"], str):
            raise bad(
                f"a {m['role']} message's content is a {type(m['content']).__name__}; only text content can be "
                "trained on"
            )
    for key in ("content", "reasoning"):
        if row.get(key) is not None and not isinstance(row[key], str):
            raise bad(f"'{key}' is a {type(row[key]).__name__}, not a string")
    if not isinstance(row.get("template_flags") or {}, dict):
        raise bad("'template_flags' must be an object of template keyword arguments")
    for key in ("tools", "tool_calls"):
        if row.get(key) is not None and not isinstance(row[key], list):
            raise bad(f"'{key}' must be a list")
    for key in ("completion_ids", "prompt_ids"):
        ids = row.get(key)
        if ids is not None and (not isinstance(ids, list) or not all(type(t) is int for t in ids)):
            raise bad(f"'{key}' must be a list of integer token ids")


def samples_for_row(
    tokenizer,
    row: dict,
    spec: ThinkSpec,
    eot_ids: list[int],
    max_length: int,
    mode: str = "per_turn",
    rule: MaskRule | None = None,
    errors: list | None = None,
) -> tuple[list[Sample], str | None]:
    """One conversation row → (samples cut to ``max_length``, drop reason or None). With
    ``errors`` (a list), the template's own message for a ``template_error`` is appended to it.

    Drop reasons: ``empty_completion``, ``prompt_reaches_max_length`` (the turn would
    start past the limit), ``no_assistant_turn`` (a finished conversation with nothing to
    supervise), ``reasoning_without_think_tokens`` (a text-only reasoning row for a
    tokenizer without think special tokens), ``template_error`` (the template cannot render the
    turn consistently).
    """
    content = row.get("content")
    if "content" in row and (content is None or not str(content).strip()) and not row.get("tool_calls"):
        return [], "empty_completion"
    if row.get("reasoning") and row.get("completion_ids") is None and spec.close_id is None:
        return [], "reasoning_without_think_tokens"  # the tokenizer has no <think>/</think> to rebuild with
    if "content" not in row and not any(
        isinstance(m, dict) and m.get("role") == "assistant" for m in row["messages"]
    ):
        return [], "no_assistant_turn"
    try:
        samples = build_samples(tokenizer, row, spec, eot_ids, mode, rule)
    except (
        Exception
    ) as e:  # TemplateError, or the template itself refusing this chat (raise_exception, undefined)
        if errors is not None:
            errors.append(f"{type(e).__name__}: {str(e)[:160]}")
        return [], "template_error"
    eot = set(eot_ids)
    kept = []
    for s in samples:
        ids, mask = s.ids[:max_length], s.mask[:max_length]
        if not any(m and t not in eot for t, m in zip(ids, mask)):
            continue  # nothing but end-of-turn tokens supervised within the limit
        s.ids, s.mask, s.cut = ids, mask, len(ids) < len(s.ids)
        kept.append(s)
    if not kept:
        return [], "prompt_reaches_max_length" if samples and all(
            s.prompt_len >= max_length - 1 for s in samples
        ) else "empty_completion"
    return kept, None


def split_brought_think(row: dict, spec: ThinkSpec) -> tuple[dict, int]:
    """A conversation brought as text (no ``completion_ids``) whose reply holds its reasoning
    inline — ``<think>…</think>answer``, or a bare ``…</think>answer`` because the chat template's
    generation prompt opened the block (Qwen3, DeepSeek-R1) — split into ``reasoning`` and
    ``content`` as generate splits a server's reply (:func:`eagle3kit.data.reasoning.split_inline_think`),
    in the row's ``content`` and in each assistant message without a reasoning field. Rows for a
    tokenizer without think tokens are left as they are. Returns (row, replies split)."""

    if spec.close_id is None or row.get("completion_ids") is not None:
        return row, 0
    n = 0

    def split(content, has_reasoning):
        nonlocal n
        if has_reasoning or not isinstance(content, str) or THINK_CLOSE not in content:
            return None, content
        reasoning, rest, _, _ = split_inline_think(
            content, prompt_opens_think=not content.lstrip().startswith(THINK_OPEN)
        )
        n += 1
        return reasoning, rest

    row = dict(row)
    if "content" in row:
        r, c = split(row["content"], row.get("reasoning") is not None)
        if r is not None:
            row["reasoning"], row["content"] = r, c
    msgs = []
    for m in row.get("messages") or []:
        if isinstance(m, dict) and m.get("role") == "assistant":
            r, c = split(
                m.get("content"), m.get("reasoning") is not None or m.get("reasoning_content") is not None
            )
            if r is not None:
                m = {**m, "reasoning": r, "content": c}
        msgs.append(m)
    if "messages" in row:
        row["messages"] = msgs
    return row, n


#: Kimi's tool-call id: ``functions.<name>:<index>``, the index counting calls over the conversation
KIMI_CALL_ID = re.compile(r"^functions\.[^:\s]+:\d+$")


def renders_kimi_tool_ids(tokenizer) -> bool:
    """The chat template writes each tool call's ``id`` into the text (Kimi-K2's
    ``<|tool_call_begin|>{{ id }}`` and ``## Return of {{ tool_call_id }}``): ids in another style
    than the model's own would be trained verbatim."""
    tmpl = tokenizer.chat_template or ""
    return "<|tool_call_begin|>" in tmpl and "Return of" in tmpl


def kimi_tool_call_ids(row: dict) -> tuple[dict, int]:
    """Rewrite tool-call ids that are not Kimi's own (OpenAI's ``call_ab12``) as
    ``functions.<name>:<index>``, consistently in the call and in the tool result that answers it
    (``tool_call_id``), in ``messages`` and in the row's own ``tool_calls``. Returns (row, ids
    rewritten). Ids already in Kimi's form are kept; a tool result naming an id no call has is left."""
    index, mapping = 0, {}

    def calls(tcs):
        nonlocal index
        out = []
        for tc in tcs or []:
            if isinstance(tc, dict) and isinstance(tc.get("id"), str) and not KIMI_CALL_ID.match(tc["id"]):
                name = ((tc.get("function") or {}).get("name") or "tool").replace(":", "_")
                mapping[tc["id"]] = f"functions.{name}:{index}"
                tc = {**tc, "id": mapping[tc["id"]]}
            index += 1
            out.append(tc)
        return out

    row = dict(row)
    msgs = []
    for m in row.get("messages") or []:
        if isinstance(m, dict) and m.get("tool_calls"):
            m = {**m, "tool_calls": calls(m["tool_calls"])}
        elif isinstance(m, dict) and m.get("role") == "tool" and m.get("tool_call_id") in mapping:
            m = {**m, "tool_call_id": mapping[m["tool_call_id"]]}
        msgs.append(m)
    if "messages" in row:
        row["messages"] = msgs
    if row.get("tool_calls"):
        row["tool_calls"] = calls(row["tool_calls"])
    return row, len(mapping)


def untrainable_reason(row: dict) -> str | None:
    """Why a server-generated row must not become a training turn, or None."""

    flags = set(row.get("flags") or [])
    for flag in UNTRAINABLE_FLAGS:
        if flag in flags:
            return flag
    if row.get("reasoning") is not None and row.get("finish_reason") == "length":
        return "truncated_reasoning"
    return None


def save_shard(
    path: str | Path, samples: list[tuple[list[int], list[int]]], meta: dict | None = None
) -> None:
    """Write samples (input_ids, loss_mask) to a safetensors token shard."""
    lengths = [len(s[0]) for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    if samples:
        offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    ids = torch.tensor([t for s in samples for t in s[0]], dtype=torch.int32)
    mask = torch.tensor([t for s in samples for t in s[1]], dtype=torch.uint8)

    write_safetensors(
        path,
        {"input_ids": ids, "loss_mask": mask, "offsets": offsets},
        {k: str(v) for k, v in (meta or {}).items()},
    )


def load_shard(path: str | Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Read a token shard → list of (input_ids int64 [T], loss_mask bool [T])."""

    d = load_safetensors(path, "rerun `eagle3kit tokenize`")
    for k in ("input_ids", "loss_mask", "offsets"):
        if k not in d:
            raise DataError(f"{path}: not a token shard (missing {k}); rerun `eagle3kit tokenize`")
    off = d["offsets"].tolist()
    ids, mask = d["input_ids"].long(), d["loss_mask"].bool()
    return [(ids[off[i] : off[i + 1]], mask[off[i] : off[i + 1]]) for i in range(len(off) - 1)]


def run_tokenize(
    cfg: Config,
    run: RunDir,
    tokenizer=None,
    eot_ids: list[int] | None = None,
    strict: bool | None = None,
    show: int = 0,
) -> dict:
    """Tokenize ``conversations.jsonl`` into ``tokens.safetensors``; returns stage counts.

    Args:
        eot_ids: end-of-turn ids (default: the tokenizer's EOS).
        strict: a self-check mismatch raises (default ``tokenize.strict``).
        show: print this many samples with their supervised tokens highlighted.

    Raises:
        DataError: a row that is not a conversation, ids outside the vocabulary, or (strict) a
            self-check mismatch, naming the line.
    """
    tc = cfg.tokenize
    strict = tc.strict if strict is None else strict
    src = run.require("conversations.jsonl", "generate")
    consumed = check_inputs(run, "tokenize", ["conversations.jsonl"])
    # a token is 9 bytes of the shard (int64 id + mask byte) and at least about 3 of conversations.jsonl
    require_free(run.path, src.stat().st_size * 3, "tokenize's tokens.safetensors")
    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg.target)
    eot_ids = list(eot_ids) if eot_ids is not None else [int(tok.eos_token_id)]
    spec = think_spec(tok, None if tc.think_layout == "auto" else tc.think_layout)
    rule = MaskRule(**tc.supervise.model_dump())
    counts: Counter = Counter()
    rows, samples = _build_rows(cfg, run, src, tok, spec, eot_ids, rule, counts)
    counts["rows_kept"] += 0  # present (0) even when every row was dropped
    counts["samples"] = len(samples)
    if not samples:
        why = ", ".join(f"{k[8:]} {v}" for k, v in counts.items() if k.startswith("dropped_")) or "no rows"
        hint = (
            " — the rows' ids are not in this run's prompts.jsonl (tokenize trains only on the current prompts); "
            "delete or regenerate prompts.jsonl"
            if counts["dropped_not_in_prompts"]
            else ""
        )
        raise DataError(
            f"tokenize: 0 training samples from {counts['rows_in']} rows of {src} (dropped: {why}){hint}; "
            "the previous tokens.safetensors is left as it was"
        )
    counts["truncated_kept_share"] = round(counts["truncated_kept"] / max(counts["rows_kept"], 1), 4)
    checked = _self_check_rows(tok, rows, spec, eot_ids, tc.self_check_rows, rule, counts, src)
    if checked:
        what = (
            f"{len(checked)} self-check mismatch(es) in {src.name} ({counts['selfcheck_mismatch']} against the "
            f"template's render, {counts['selfcheck_returned_prompt_mismatch']} returned prompt ids) at line(s) "
            f"{', '.join(checked[:10])}{' …' if len(checked) > 10 else ''}"
        )
        if strict:
            raise DataError(
                f"tokenize --strict: {what}; nothing was written. Compare those rows' ids with their text "
                "(`eagle3kit tokenize --show N`), fix the template flags or the rows"
            )
        console.print(f"[yellow]tokenize: {what}; their samples are kept as built (`--strict` refuses them)")
    if show:
        show_samples(tok, samples[:show])
    out = run / "tokens.safetensors"
    rendered_by = {"tokenizer_sha256": tokenizer_hash(tok), "chat_template_sha256": chat_template_hash(tok)}
    save_shard(out, [(s.ids, s.mask) for s in samples], rendered_by)
    res = {k: v for k, v in counts.items()}
    inputs = {
        "conversations.jsonl": sha256_file(src),
        "tokenizer": tokenizer_hash(tok),
        "chat_template": rendered_by["chat_template_sha256"],
        "max_length": tc.max_length,
        "multi_turn": tc.multi_turn,
        "supervise": tc.supervise.model_dump(),
        "think_layout": spec.layout,
    }
    run.record_stage("tokenize", inputs, res, {"tokens.safetensors": sha256_tensors(out)}, consumed=consumed)
    run.update_manifest(
        **rendered_by
    )  # what the tokens were built from (never rewritten by a later run's header)
    return res


def _build_rows(
    cfg: Config, run: RunDir, src, tok, spec: ThinkSpec, eot_ids: list[int], rule: MaskRule, counts: Counter
) -> tuple[list, list[Sample]]:
    """Every row of ``src`` checked, repaired (inline reasoning split off, Kimi tool-call ids) and
    built into samples; a row that cannot be trained on is counted as ``dropped_<why>``. Returns
    ``(kept rows as (line, row, samples), all samples)``; fills ``counts``.

    Raises:
        DataError: a row that is not a conversation, or ids outside the target's vocabulary."""
    tc = cfg.tokenize
    prompts_path = run / "prompts.jsonl"
    current = {r["id"] for _, r in read_jsonl(prompts_path)} if prompts_path.exists() else None
    V = model_vocab_size(cfg.target, tok)
    kimi_ids = renders_kimi_tool_ids(tok)
    rows, samples = [], []
    template_lines: list[int] = []
    template_errors: list[str] = []
    for n, row in read_jsonl(src):
        counts["rows_in"] += 1
        check_row(row, f"{src}:{n}")
        if current is not None and row.get("id") not in current:
            counts["dropped_not_in_prompts"] += 1  # generated for an earlier prompt set: never trained on
            continue
        row, split = split_brought_think(row, spec)
        counts["reasoning_split_from_text"] += split
        if kimi_ids and row.get("completion_ids") is None:
            row, rewritten = kimi_tool_call_ids(row)
            counts["tool_call_ids_rewritten"] += rewritten
        unfit = untrainable_reason(row)
        if unfit:
            counts[f"dropped_{unfit}"] += 1
            continue
        bad = [t for t in row.get("completion_ids") or [] if not 0 <= t < V]
        if bad:
            raise DataError(
                f"{src}:{n}: completion_ids holds {bad[:3]} outside the target's [0, {V}); "
                "the row comes from another tokenizer or is corrupt"
            )
        if tc.drop_truncated and row.get("finish_reason") == "length":
            counts["dropped_truncated"] += 1
            continue
        got, reason = samples_for_row(
            tok, row, spec, eot_ids, tc.max_length, tc.multi_turn, rule, template_errors
        )
        if reason:
            counts[f"dropped_{reason}"] += 1
            if reason == "template_error":
                template_lines.append(n)
            continue
        rows.append((n, row, got))
        counts["rows_kept"] += 1
        counts["truncated_kept"] += row.get("finish_reason") == "length"
        for s in got:
            full_len = s.prompt_len + sum(len(p.ids) for p in s.pieces)
            counts["cut_at_max_length"] += full_len > len(s.ids)
            counts["tokens"] += len(s.ids)
            counts["supervised_tokens"] += sum(s.mask)
            samples.append(s)
    _say_repairs(src, counts, template_lines, template_errors)
    return rows, samples


def _say_repairs(src, counts: Counter, template_lines: list[int], template_errors: list[str]) -> None:
    """Print the rows the template could not render and the rows whose ids or reasoning were rewritten."""
    if template_lines:
        console.print(
            f"[yellow]tokenize: the chat template could not render {len(template_lines)} row(s) of {src.name} "
            f"(line(s) {', '.join(map(str, template_lines[:10]))}); first: {template_errors[0]}"
        )
    if counts["tool_call_ids_rewritten"]:
        console.print(
            f"tokenize: rewrote {counts['tool_call_ids_rewritten']} tool-call id(s) of {src.name} in the "
            "target's own form functions.<name>:<index> (calls and their results alike; the template writes "
            "ids into the text, and Kimi models emit only that form)"
        )
    if counts["reasoning_split_from_text"]:
        console.print(
            f"tokenize: split the inline reasoning (…</think>) off {counts['reasoning_split_from_text']} "
            f"reply(ies) of {src.name}, as generate splits a server's reply"
        )


def _self_check_rows(
    tok, rows: list, spec: ThinkSpec, eot_ids: list[int], limit: int, rule: MaskRule, counts: Counter, src
) -> list[str]:
    """Self-check a seeded sample of ``limit`` kept rows (all when fewer); fills ``counts`` and
    returns the line of each mismatch (``"12"``, or ``"12 (returned prompt ids)"``)."""
    pick = rows if len(rows) <= limit else random.Random(0).sample(rows, limit)
    bad: list[str] = []
    counts.update(
        {
            "selfcheck_rows": 0,
            "selfcheck_mismatch": 0,
            "selfcheck_retokenized": 0,
            "selfcheck_whitespace_only": 0,
            "selfcheck_returned_prompt_mismatch": 0,
            "selfcheck_rebuild_differs_from_returned": 0,
        }
    )
    for n, row, got in pick:
        counts["selfcheck_rows"] += 1
        where = str(n)
        verdicts = [self_check(tok, row, s, spec, eot_ids) for s in got]
        if "mismatch" in verdicts:
            counts["selfcheck_mismatch"] += 1
            bad.append(where)
        elif "retokenized" in verdicts:
            counts["selfcheck_retokenized"] += 1
        elif "whitespace" in verdicts:
            counts["selfcheck_whitespace_only"] += 1
        last = got[-1]
        if last.returned_ids and row.get("prompt_ids") is not None:
            if list(row["prompt_ids"]) != last.ids[: last.prompt_len]:
                counts["selfcheck_returned_prompt_mismatch"] += 1
                bad.append(where + " (returned prompt ids)")
            text_row = {k: v for k, v in row.items() if k != "completion_ids"}
            (rebuilt,) = [
                s
                for s in build_samples(tok, text_row, spec, eot_ids, "per_turn", rule)
                if s.turn == last.turn
            ]
            if rebuilt.ids[rebuilt.prompt_len :] != [int(t) for t in row["completion_ids"]]:
                counts["selfcheck_rebuild_differs_from_returned"] += 1
    return bad
