"""Prompt files: every row of a prompt source read into chat messages, strictly, and duplicates dropped.

Formats read (``format: auto`` detects them per row): MT-bench ``turns`` (first turn), ShareGPT
``conversations`` (``from``/``value``), OpenAI ``messages`` (``role``/``content``), OpenAssistant
trees (``prompt.text``), a plain JSON string, or an object with a text ``field``. A conversation
is cut after its first user turn (and any system turn before it); the cut is counted. A row that
cannot be read is skipped and listed with its file and line (:func:`report_bad_rows`), or stops
the stage with ``prompts.on_bad_row: error``. A prompt's id (:func:`prompt_id`) is the sha256 of
its messages (16 hex), so a rerun finds the same ids.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from itertools import islice

from eagle3kit.core.config import PromptSource
from eagle3kit.core.rundir import DataError, read_jsonl, sha256_file, write_jsonl
from eagle3kit.core.ui import console
from eagle3kit.data.hub_datasets import category_key, open_dataset, resolve_dataset

_TEXT_FIELDS = ("prompt", "question", "instruction", "text", "input")


_SHAREGPT_ROLES = {  # the speakers public ShareGPT dumps and their cleaning scripts write
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}


def prompt_id(messages: list[dict]) -> str:
    """Stable id of a prompt: first 16 hex of SHA-256 over the canonical JSON of its messages."""
    canon = json.dumps(
        [{"role": m["role"], "content": m["content"]} for m in messages], ensure_ascii=False, sort_keys=True
    )
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


def normalize_text(text: str) -> str:
    """Lowercase, collapse whitespace, drop punctuation: the key for near-duplicate checks."""
    return re.sub(r"\s+", " ", re.sub(r"[^\w\s]", "", text.lower())).strip()


def _text(value, where: str, what: str) -> str:
    if not isinstance(value, str):
        raise DataError(
            f"{where}: {what} must be a string, got {type(value).__name__} {str(value)[:40]!r}; fix or drop that row"
        )
    return value


def _first_user_prefix(messages, where: str) -> list[dict]:
    if not isinstance(messages, list):
        raise DataError(
            f"{where}: 'messages' must be a list of {{role, content}} objects, got {type(messages).__name__}"
        )
    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: each message needs 'role' and 'content', got {str(m)[:80]!r}")
        if m["role"] == "system":
            out.append(
                {"role": "system", "content": _text(m["content"], where, "a system message's content")}
            )
        elif m["role"] == "user":
            out.append({"role": "user", "content": _text(m["content"], where, "a user message's content")})
            return out
        else:
            break
    raise DataError(f"{where}: no user turn before the first assistant turn; such a row cannot be a prompt")


def parse_row(row, fmt: str, field: str | None, where: str) -> tuple[list[dict], str | None]:
    """One JSONL value → (messages up to the first user turn, category).

    Raises:
        DataError: the row matches no known format (names the file:line and the keys seen).
    """
    if fmt in ("auto", "plain") and isinstance(row, str):
        return [{"role": "user", "content": row}], None
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object or string, got {type(row).__name__}")
    cat = row.get("category")
    if fmt in ("auto", "mt_bench") and "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise DataError(f"{where}: 'turns' must be a non-empty list of strings; fix or drop that row")
        return [{"role": "user", "content": turns[0]}], cat
    if fmt in ("auto", "openai") and "messages" in row:
        return _first_user_prefix(row["messages"], where), cat
    if fmt in ("auto", "sharegpt") and "conversations" in row:
        conv = row["conversations"]
        if not isinstance(conv, list):
            raise DataError(f"{where}: 'conversations' must be a list")
        msgs = []
        for m in conv:
            # ShareGPT's from/value, or role/content as SpecForge's data preparation writes conversations
            speaker, text = ("from", "value") if isinstance(m, dict) and "from" in m else ("role", "content")
            if not isinstance(m, dict) or speaker not in m or text not in m:
                raise DataError(
                    f"{where}: ShareGPT turns need 'from' and 'value' (or 'role' and 'content'), got {str(m)[:80]!r}"
                )
            role = _SHAREGPT_ROLES.get(m[speaker])
            if role is None:
                raise DataError(
                    f"{where}: unknown ShareGPT speaker {m[speaker]!r} (known: {sorted(_SHAREGPT_ROLES)})"
                )
            msgs.append({"role": role, "content": _text(m[text], where, f"a ShareGPT {text!r}")})
        return _first_user_prefix(msgs, where), cat
    if fmt in ("auto", "oasst") and isinstance(row.get("prompt"), dict) and "text" in row["prompt"]:
        return [{"role": "user", "content": _text(row["prompt"]["text"], where, "prompt.text")}], cat
    if fmt in ("auto", "plain"):
        keys = [field] if field else [k for k in _TEXT_FIELDS if k in row]
        if keys and keys[0] in row:
            value = row[keys[0]]
            if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
                value = value[0]  # a list of turns (MT-bench on the hub: prompt = [turn 1, turn 2])
            return [{"role": "user", "content": _text(value, where, f"field {keys[0]!r}")}], cat
    raise DataError(
        f"{where}: row matches no prompt format (keys: {sorted(row)[:8]}); expected 'turns', 'messages', "
        f"'conversations', an OpenAssistant 'prompt' tree, or a text field ({', '.join(_TEXT_FIELDS)}); "
        "set format/field on this source"
    )


def _open_rows(src: PromptSource, bad_rows: list | None, dropped: Counter):
    """``(rows, categories present, prompt field)`` of a source: a file's ``(line, value)`` pairs
    (lines that are not JSON go to ``bad_rows``), or a dataset's lazily read rows, sliced by
    ``start``/``stop``."""
    if src.dataset is not None:
        rows, field = open_dataset(src)
        return rows, lambda: rows.categories, field
    lines: list | None = [] if bad_rows is not None else None

    def report_bad() -> None:  # the lines read so far that were not JSON, each once
        for n, reason in lines or []:
            bad_rows.append({"path": src.path, "line": n, "reason": reason})
            dropped["malformed"] += 1
        if lines:
            lines.clear()

    filtered = src.categories is not None or src.exclude_categories is not None
    if not filtered and (src.start or 0) >= 0 and (src.stop is None or src.stop >= 0):
        # read lazily: a source with a limit (or a stop) reads only the lines it needs

        def lazy():
            for item in islice(read_jsonl(src.path, bad_lines=lines), src.start, src.stop):
                report_bad()
                yield item
            report_bad()

        return lazy(), lambda: set(), src.field
    file_rows = [(n, r) for n, r in read_jsonl(src.path, bad_lines=lines)]
    report_bad()
    present = {category_key(r.get("category")) for _, r in file_rows if isinstance(r, dict)}
    return file_rows[slice(src.start, src.stop)], lambda: present, src.field


def _check_categories(src: PromptSource, present) -> None:
    """Refuse a ``categories``/``exclude_categories`` entry that no row of the source has
    (``present``: a callable giving the source's categories, computed only when a filter is set)."""
    wanted = set(src.categories or ()) | set(src.exclude_categories or ())
    if not wanted:
        return
    present = present()
    unknown = sorted(c for c in wanted if c not in present)
    if unknown:
        have = (
            ", ".join(sorted(str(c) for c in present if c is not None))
            or "none (its rows carry no 'category')"
        )
        raise DataError(
            f"{src.origin}: the source {src.label!r} names categories no row of it has: "
            f"{', '.join(map(repr, unknown))}; its categories are {have}. Fix the spelling "
            "(a category that matches nothing would silently give 0 prompts)"
        )


def read_source(
    src: PromptSource, bad_rows: list | None = None, lineage: dict | None = None
) -> tuple[list[dict], Counter]:
    """Read one prompt source (a JSONL file, or a ``datasets`` dataset through
    :mod:`eagle3kit.data.hub_datasets`) into rows; returns (rows, counts of what was dropped and why).

    Without ``bad_rows`` the first malformed row raises. With a list, each malformed row (bad
    JSON, not UTF-8, no known format, a wrongly typed field, an empty prompt) is skipped and
    ``{"path", "line", "reason"}`` appended to it, so one bad line never stops a run. A dataset's
    rows are numbered from 1 in its split, as a file's lines are. ``lineage``, when given, is filled
    with what the rows were read from: ``{"path", "sha256"}`` of a file, or ``{"dataset", "subset",
    "split", "rows_sha256"}`` of a dataset (the hash of every row read, in order).

    Raises:
        DataError: a malformed row (only without ``bad_rows``), an unreadable file, or a dataset
            ``datasets`` cannot load.
    """
    dropped: Counter = Counter()
    first_bad = len(bad_rows) if bad_rows is not None else 0
    rows, present, field = _open_rows(src, bad_rows, dropped)
    _check_categories(src, present)
    out = []
    for n, raw in rows:
        where = f"{src.origin}:{n}"
        try:
            msgs, cat = parse_row(raw, src.format, field, where)
        except DataError as e:
            if bad_rows is None:
                raise
            bad_rows.append({"path": src.origin, "line": n, "reason": str(e)[len(where) + 2 :]})
            dropped["malformed"] += 1
            continue
        if src.categories is not None and category_key(cat) not in src.categories:
            dropped["category_filtered"] += 1
            continue
        if src.exclude_categories is not None and category_key(cat) in src.exclude_categories:
            dropped["category_filtered"] += 1
            continue
        if not any(m["content"].strip() for m in msgs if m["role"] == "user"):
            dropped["empty_prompt"] += 1
            if bad_rows is not None:
                bad_rows.append(
                    {"path": src.origin, "line": n, "reason": "empty prompt (the user text is blank)"}
                )
            continue
        try:
            pid = prompt_id(msgs)
        except UnicodeEncodeError:
            if bad_rows is None:
                raise DataError(
                    f"{where}: the text holds a lone surrogate (invalid Unicode); fix or drop that row"
                ) from None
            bad_rows.append(
                {"path": src.origin, "line": n, "reason": "the text holds a lone surrogate (invalid Unicode)"}
            )
            dropped["malformed"] += 1
            continue
        row = {"id": pid, "messages": msgs, "source": src.label, "category": cat}
        if _turns_after(raw, msgs):  # counted with the drops: its turns after the first user turn are
            dropped["history_cut"] += 1
            row["history_cut"] = True
        out.append(row)
        if src.limit is not None and len(out) >= src.limit:
            break
    if bad_rows is not None:
        bad_rows[first_bad:] = sorted(bad_rows[first_bad:], key=lambda b: b["line"])
    if lineage is not None:
        if src.dataset is not None:
            name, subset, split, _ = resolve_dataset(src)
            lineage.update(dataset=name, subset=subset, split=split, rows_sha256=rows.sha256)
        else:
            lineage.update(path=src.path, sha256=sha256_file(src.path))
    return out, dropped


def source_fingerprint(src: PromptSource) -> str:
    """What a source's rows are now, to tell a changed source from an unchanged one: a file's sha256,
    or a dataset's ``datasets`` fingerprint (of its files and the operations that made it; a dataset
    saved again with other rows gets another). Raises DataError as :func:`read_source` does."""
    if src.dataset is None:
        return sha256_file(src.path)
    rows, _ = open_dataset(src)
    return str(getattr(rows.ds, "_fingerprint", None) or rows.ds.info)


def _turns_after(raw, msgs: list[dict]) -> int:
    """How many replies, tool calls and tool results of a source row (OpenAI ``messages``, ShareGPT
    ``conversations``) follow the prompt kept from it, its first user turn: the history a prompt
    row loses. MT-bench's later ``turns`` are user turns only and not counted."""
    if not isinstance(raw, dict):
        return 0
    for key in ("messages", "conversations"):
        if isinstance(raw.get(key), list):
            rest = raw[key][len(msgs) :]
            return sum(
                1
                for m in rest
                if isinstance(m, dict) and m.get("from", m.get("role")) not in ("user", "human")
            )
    return 0


def dedupe(rows: list[dict]) -> tuple[list[dict], int, int]:
    """Drop rows whose id repeats an earlier row's; returns (kept rows, number dropped, how many of
    those differed from the row kept only in the history cut after their first user turn)."""
    seen: set[str] = set()
    kept = []
    cut = 0
    for r in rows:
        if r["id"] not in seen:
            seen.add(r["id"])
            kept.append(r)
        else:
            cut += bool(r.get("history_cut"))
    for r in kept:
        r.pop("history_cut", None)
    return kept, len(rows) - len(kept), cut


def report_bad_rows(bad: list[dict], path, show: int = 5) -> None:
    """Print the first ``show`` skipped rows (file:line and reason) and write all of them to
    ``path`` (JSONL, rewritten each run, empty when none) so none goes unnoticed."""

    write_jsonl(path, bad)
    if not bad:
        return
    console.print(f"[yellow]prompts: skipped {len(bad)} malformed or empty row(s); all listed in {path}")
    for b in bad[:show]:
        console.print(f"[yellow]  {b['path']}:{b['line']}: {b['reason'][:160]}")
    if len(bad) > show:
        console.print(f"[yellow]  … and {len(bad) - show} more")
