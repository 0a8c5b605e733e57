"""Stage ``prompts``: read prompt files or synthesize prompts from the target (Magpie).

Output rows (``prompts.jsonl`` for training, ``heldout.jsonl`` for evaluation)::

    {"id": sha256 of the messages (16 hex), "messages": [{"role": "user", "content": ...}, ...],
     "source": "mt_bench", "category": "writing" | null}

Formats read (``format: auto`` detects them per row): MT-bench ``turns`` (first turn), ShareGPT
``conversations`` (``from``/``value``), OpenAI ``messages`` (``role``/``content``), OpenAssistant
trees (``prompt.text``), a plain JSON string, or an object with a text ``field``. A conversation
is cut after its first user turn (and any system turn before it): generation writes the first
assistant reply. Duplicates (same messages) are dropped and counted.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
from collections import Counter

from .config import Config, PromptSource
from .rundir import DataError, RunDir, read_jsonl, sha256_file, write_jsonl

_TEXT_FIELDS = ("prompt", "question", "instruction", "text", "input")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def prompt_id(messages: list[dict]) -> str:
    """Stable id of a prompt: first 16 hex of SHA-256 over the canonical JSON of its messages."""
    canon = json.dumps([{"role": m["role"], "content": m["content"]} for m in messages], ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


def normalize_text(text: str) -> str:
    """Lowercase, collapse whitespace, drop punctuation: the key for near-duplicate checks."""
    return re.sub(r"\s+", " ", re.sub(r"[^\w\s]", "", text.lower())).strip()


def _text(value, where: str, what: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: {what} must be a string, got {type(value).__name__} {str(value)[:40]!r}; fix or drop that row")
    return value


def _first_user_prefix(messages, where: str) -> list[dict]:
    if not isinstance(messages, list):
        raise DataError(f"{where}: 'messages' must be a list of {{role, content}} objects, got {type(messages).__name__}")
    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: each message needs 'role' and 'content', got {str(m)[:80]!r}")
        if m["role"] == "system":
            out.append({"role": "system", "content": _text(m["content"], where, "a system message's content")})
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
            if not isinstance(m, dict) or "from" not in m or "value" not in m:
                raise DataError(f"{where}: ShareGPT turns need 'from' and 'value', got {str(m)[:80]!r}")
            role = _SHAREGPT_ROLES.get(m["from"])
            if role is None:
                raise DataError(f"{where}: unknown ShareGPT speaker {m['from']!r} (known: {sorted(_SHAREGPT_ROLES)})")
            msgs.append({"role": role, "content": _text(m["value"], where, "a ShareGPT 'value'")})
        return _first_user_prefix(msgs, where), cat
    if fmt in ("auto", "oasst") and isinstance(row.get("prompt"), dict) and "text" in row["prompt"]:
        return [{"role": "user", "content": _text(row["prompt"]["text"], where, "prompt.text")}], cat
    if fmt in ("auto", "plain"):
        keys = [field] if field else [k for k in _TEXT_FIELDS if k in row]
        if keys and keys[0] in row:
            return [{"role": "user", "content": _text(row[keys[0]], where, f"field {keys[0]!r}")}], cat
    raise DataError(
        f"{where}: row matches no prompt format (keys: {sorted(row)[:8]}); expected 'turns', 'messages', "
        f"'conversations', an OpenAssistant 'prompt' tree, or a text field ({', '.join(_TEXT_FIELDS)}); "
        "set format/field on this source"
    )


def read_source(src: PromptSource, bad_rows: list | None = None) -> tuple[list[dict], Counter]:
    """Read one prompt source into rows; returns (rows, counts of what was dropped and why).

    Without ``bad_rows`` the first malformed row raises. With a list, each malformed row (bad
    JSON, not UTF-8, no known format, a wrongly typed field, an empty prompt) is skipped and
    ``{"path", "line", "reason"}`` appended to it, so one bad line never stops a run.

    Raises:
        DataError: a malformed row (only without ``bad_rows``), or an unreadable file.
    """
    dropped: Counter = Counter()
    first_bad = len(bad_rows) if bad_rows is not None else 0
    lines: list | None = [] if bad_rows is not None else None
    rows = [(n, r) for n, r in read_jsonl(src.path, bad_lines=lines)]
    for n, reason in lines or []:
        bad_rows.append({"path": src.path, "line": n, "reason": reason})
        dropped["malformed"] += 1
    wanted = set(src.categories or ()) | set(src.exclude_categories or ())
    if wanted:
        present = {r.get("category") for _, r in rows if isinstance(r, dict)}
        unknown = sorted(c for c in wanted if c not in present)
        if unknown:
            have = ", ".join(sorted(str(c) for c in present if c is not None)) or "none (its rows carry no 'category')"
            raise DataError(f"{src.path}: the source {src.label!r} names categories no row of the file has: "
                            f"{', '.join(map(repr, unknown))}; the file's categories are {have}. Fix the spelling "
                            "(a category that matches nothing would silently give 0 prompts)")
    rows = rows[slice(src.start, src.stop)]
    out = []
    for n, raw in rows:
        where = f"{src.path}:{n}"
        try:
            msgs, cat = parse_row(raw, src.format, src.field, where)
        except DataError as e:
            if bad_rows is None:
                raise
            bad_rows.append({"path": src.path, "line": n, "reason": str(e)[len(where) + 2:]})
            dropped["malformed"] += 1
            continue
        if src.categories is not None and cat not in src.categories:
            dropped["category_filtered"] += 1
            continue
        if src.exclude_categories is not None and cat in src.exclude_categories:
            dropped["category_filtered"] += 1
            continue
        if not any(m["content"].strip() for m in msgs if m["role"] == "user"):
            dropped["empty_prompt"] += 1
            if bad_rows is not None:
                bad_rows.append({"path": src.path, "line": n, "reason": "empty prompt (the user text is blank)"})
            continue
        try:
            pid = prompt_id(msgs)
        except UnicodeEncodeError:
            if bad_rows is None:
                raise DataError(f"{where}: the text holds a lone surrogate (invalid Unicode); fix or drop that row") from None
            bad_rows.append({"path": src.path, "line": n, "reason": "the text holds a lone surrogate (invalid Unicode)"})
            dropped["malformed"] += 1
            continue
        row = {"id": pid, "messages": msgs, "source": src.label, "category": cat}
        if _turns_after(raw, msgs):             # counted with the drops: its turns after the first user turn are
            dropped["history_cut"] += 1
            row["history_cut"] = True
        out.append(row)
        if src.limit is not None and len(out) >= src.limit:
            break
    if bad_rows is not None:
        bad_rows[first_bad:] = sorted(bad_rows[first_bad:], key=lambda b: b["line"])
    return out, dropped


def _turns_after(raw, msgs: list[dict]) -> int:
    """How many replies, tool calls and tool results of a source row (OpenAI ``messages``, ShareGPT
    ``conversations``) follow the prompt kept from it, its first user turn: the history a prompt
    row loses. MT-bench's later ``turns`` are user turns only and not counted."""
    if not isinstance(raw, dict):
        return 0
    for key, role in (("messages", "role"), ("conversations", "from")):
        if isinstance(raw.get(key), list):
            rest = raw[key][len(msgs):]
            return sum(1 for m in rest if isinstance(m, dict) and m.get(role) not in ("user", "human"))
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


def magpie_prefix(tokenizer) -> str:
    """The chat template rendered up to the start of a user message's text (Magpie).

    Found by rendering a one-user-turn chat with a placeholder and cutting at the placeholder,
    so it includes any default system prompt the template injects.

    Raises:
        DataError: the template does not echo the user text (cannot be used for Magpie).
    """
    marker = "\u2063MAGPIE\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    cut = text.find(marker)
    if cut < 0:
        raise DataError("the target's chat template does not render the user text; cannot synthesize prompts")
    return text[:cut]


class MagpieCollector:
    """The acceptance rule for synthesized user turns, shared by the local and the server path:
    a candidate is kept when the model ended its turn (not cut at the token limit), has at least
    3 words, and is not a near-duplicate (:func:`normalize_text`) of one already kept."""

    def __init__(self, n: int):
        self.n = n
        self.rows: list[dict] = []
        self._seen: set[str] = set()

    @property
    def full(self) -> bool:
        return len(self.rows) >= self.n

    def offer(self, text: str, ended_turn: bool) -> bool:
        """Consider one candidate; returns True when it was kept."""
        text = text.strip()
        if self.full or not ended_turn or len(text.split()) < 3:
            return False
        key = normalize_text(text)
        if key in self._seen:
            return False
        self._seen.add(key)
        msgs = [{"role": "user", "content": text}]
        self.rows.append({"id": prompt_id(msgs), "messages": msgs, "source": "magpie", "category": None})
        return True


def synthesize(target, n: int, max_new_tokens: int, seed: int, batch_size: int = 16) -> list[dict]:
    """Let the target write ``n`` distinct user turns (Magpie): sample after the user header.

    Sampling: temperature 1.0, top-p 0.95, seeded; candidates are kept by
    :class:`MagpieCollector`; at most 4·n attempts, and it gives up when the first
    max(256, 4·batch_size) attempts kept nothing. Returns prompt rows with ``source: "magpie"``.
    """
    import torch

    from .generate import transformers_generate
    from .ui import progress

    tok = target.tokenizer
    prefix_ids = tok(magpie_prefix(tok), add_special_tokens=False)["input_ids"]
    eot = set(target.end_of_turn_ids())
    keep = MagpieCollector(n)
    attempts = 0
    gen = torch.Generator().manual_seed(seed)
    bar = progress()
    bar.start()
    task = bar.add_task("synthesize prompts (Magpie)", total=n, tokens=0, note="")
    made_tokens = 0
    while not keep.full and attempts < 4 * n:
        if not keep.rows and attempts >= max(256, 4 * batch_size):
            break   # nothing usable so far: more of the same sampling will not help
        b = min(batch_size, 4 * n - attempts)
        attempts += b
        outs = transformers_generate(
            target, [prefix_ids] * b, max_new_tokens, temperature=1.0, top_p=0.95,
            seed=int(torch.randint(0, 2**31 - 1, (1,), generator=gen)),
        )
        made_tokens += sum(len(o) for o in outs)
        for ids in outs:
            ended = bool(ids) and ids[-1] in eot
            keep.offer(tok.decode(ids[:-1] if ended else ids, skip_special_tokens=True), ended)
        bar.update(task, completed=len(keep.rows), tokens=made_tokens, note=f"{attempts} sampled")
    bar.stop()
    return keep.rows


def _synthesize_via_server(cfg: Config, run: RunDir) -> tuple[list[dict], dict]:
    """Magpie through the generation server's completions endpoint (``generate.backend: openai``).

    The raw templated prefix is ``prompts.magpie_prefix`` or, when unset, rendered from the
    target's local tokenizer (which also gives the end-of-turn ids sent as ``stop_token_ids``)."""
    from .config import ConfigError
    from .server_backend import synthesize_via_server

    pc = cfg.prompts
    prefix, stop_ids = pc.magpie_prefix, []
    try:
        from .target import load_tokenizer

        tok = load_tokenizer(cfg.target)
        prefix = prefix or magpie_prefix(tok)
        stop_ids = [int(tok.eos_token_id)] if tok.eos_token_id is not None else []
    except Exception as e:   # a server-only target may have no local tokenizer
        if prefix is None:
            raise ConfigError(f"Magpie through a server needs the target's chat template to build the prefix, but its "
                              f"tokenizer did not load ({type(e).__name__}: {str(e)[:120]}); set prompts.magpie_prefix to "
                              "the template rendered up to the start of a user message's text") from None
    rows, counts = synthesize_via_server(cfg, prefix, stop_ids, run / "magpie_attempts.jsonl")
    return rows, counts


def report_bad_rows(bad: list[dict], path, show: int = 5) -> None:
    """Print the first ``show`` skipped rows (file:line and reason) and write all of them to
    ``path`` (JSONL, rewritten each run, empty when none) so none goes unnoticed."""
    from .ui import console

    write_jsonl(path, bad)
    if not bad:
        return
    console.print(f"[yellow]prompts: skipped {len(bad)} malformed or empty row(s); all listed in {path}")
    for b in bad[:show]:
        console.print(f"[yellow]  {b['path']}:{b['line']}: {b['reason'][:160]}")
    if len(bad) > show:
        console.print(f"[yellow]  … and {len(bad) - show} more")


def run_prompts(cfg: Config, run: RunDir, target=None) -> dict:
    """Build ``prompts.jsonl`` (and ``heldout.jsonl`` when evaluation uses a held-out split).

    Reads every ``prompts.sources`` file, then adds ``prompts.synthesize`` Magpie prompts written by
    the target (loaded when ``target`` is None) or through the generation server; duplicates across
    all of them are dropped. Returns the stage counts written to the report.

    Raises:
        DataError: the sources gave no prompts, or Magpie gave none.
    """
    from .ui import console

    pc = cfg.prompts
    counts: Counter = Counter()
    inputs: dict = {}
    bad: list[dict] | None = None if pc.on_bad_row == "error" else []
    rows: list[dict] = []
    for src in pc.sources:
        got, dropped = read_source(src, bad)
        counts.update({k if k == "history_cut" else f"dropped_{k}": v for k, v in dropped.items()})
        counts[f"rows_from_{src.label}"] = len(got)
        rows.extend(got)
        inputs[src.label] = {"path": src.path, "sha256": sha256_file(src.path)}
    if pc.sources and not rows:
        if bad is not None:
            report_bad_rows(bad, run / "prompts_rejected.jsonl")
        raise DataError("the prompts stage produced 0 prompts (" + ", ".join(f"{s.path}" for s in pc.sources)
                        + f"; dropped: {dict(counts) or 'none'}); check the files and their filters")
    if pc.sources and pc.synthesize == 64:
        console.print("[yellow]prompts: prompts.synthesize is 64 beside prompt files, so 64 Magpie prompts are added to "
                      "theirs. Run folders made before 2026-11-30 store `synthesize: 64` with their sources, which was "
                      "ignored then: set it to 0 in their config.yaml to keep what they had")
    if pc.synthesize and cfg.generate.backend == "openai":
        made, got = _synthesize_via_server(cfg, run)
        counts.update(got)
        inputs["magpie"] = {"server": cfg.generate.base_url, "model": cfg.generate.model, "n": pc.synthesize, "seed": pc.seed}
    elif pc.synthesize:
        if target is None:
            from .target import load_target

            target = load_target(cfg.target)
        made = synthesize(target, pc.synthesize, pc.synthesize_max_tokens, pc.seed, cfg.generate.batch_size)
        inputs["magpie"] = {"target": cfg.target.model, "n": pc.synthesize, "seed": pc.seed}
    else:
        made = []
    if pc.synthesize:
        counts["rows_from_magpie"] = len(made)
        if len(made) < pc.synthesize:
            counts["synthesize_shortfall"] = pc.synthesize - len(made)
        if not made and not rows:
            raise DataError(f"Magpie synthesis produced 0 usable prompts ({dict(counts) or 'no attempts'}): the target "
                            "never ended a user turn within prompts.synthesize_max_tokens; raise it, or give prompt files")
        if len(made) < pc.synthesize:
            console.print(f"[yellow]prompts: Magpie gave {len(made)} of the {pc.synthesize} prompts asked for (the rest did "
                          "not end their turn within prompts.synthesize_max_tokens, were too short or repeated); the "
                          "stage goes on with them")
    rows.extend(made)
    counts["rows_in"] = len(rows)
    if bad is not None:
        report_bad_rows(bad, run / "prompts_rejected.jsonl")
    rows, ndup, ncut = dedupe(rows)
    counts["dropped_duplicate"] = ndup
    if counts["history_cut"]:
        counts["dropped_duplicate_after_history_cut"] = ncut
    if ncut:
        console.print(f"[yellow]prompts: {ncut} row(s) differed from another only in the turns after their first user turn "
                      f"(replies, tool calls and results) and were dropped as its duplicates: a prompt is the system and "
                      f"first user turn only ({counts['history_cut']} row(s) had such turns cut). To train on a "
                      "conversation's own history, bring it as conversations.jsonl")
    heldout: list[dict] = []
    if pc.heldout_fraction > 0 and not cfg.evaluate.sets:
        rng = random.Random(pc.seed)
        order = list(range(len(rows)))
        rng.shuffle(order)
        n_hold = max(1, round(len(rows) * pc.heldout_fraction)) if rows else 0
        hold = set(order[:n_hold])
        heldout = [r for i, r in enumerate(rows) if i in hold]
        rows = [r for i, r in enumerate(rows) if i not in hold]
        if not rows:
            raise DataError(f"all {len(heldout)} prompts were held out for evaluation; give more prompts or lower "
                            "prompts.heldout_fraction")
    write_jsonl(run / "prompts.jsonl", rows)
    write_jsonl(run / "heldout.jsonl", heldout)
    counts["rows_kept"] = len(rows)
    counts["heldout"] = len(heldout)
    out = {k: int(v) for k, v in counts.items()}
    run.record_stage("prompts", inputs, out, {"prompts.jsonl": sha256_file(run / "prompts.jsonl"),
                                              "heldout.jsonl": sha256_file(run / "heldout.jsonl")}, consumed={})
    return out
