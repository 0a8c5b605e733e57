"""Magpie prompt synthesis (Xu et al. 2024): the target writes user turns itself.

The chat template is rendered up to the start of a user message's text (:func:`magpie_prefix`);
whatever the target samples from there up to its end of turn is a new user prompt. Locally through
:func:`eagle3kit.data.backends.transformers_generate` (:func:`synthesize`), or through an
OpenAI-compatible completions endpoint (:func:`synthesize_via_server`, resumable from
``magpie_attempts.jsonl``). Both keep candidates by the same rule (:class:`MagpieCollector`).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter

import httpx
import torch

from eagle3kit.core.config import Config, ConfigError
from eagle3kit.core.rundir import DataError, JsonlAppender, RunDir, read_jsonl, repair_torn_tail
from eagle3kit.core.ui import console, progress
from eagle3kit.data.backends import transformers_generate
from eagle3kit.data.server_backend import MalformedReply, _client, _usage, check_server, redact
from eagle3kit.data.sources import normalize_text, prompt_id
from eagle3kit.model.target_files import load_tokenizer


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
            break  # nothing usable so far: more of the same sampling will not help
        b = min(batch_size, 4 * n - attempts)
        attempts += b
        outs = transformers_generate(
            target,
            [prefix_ids] * b,
            max_new_tokens,
            temperature=1.0,
            top_p=0.95,
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

    pc = cfg.prompts
    prefix, stop_ids = pc.magpie_prefix, []
    try:
        tok = load_tokenizer(cfg.target)
        prefix = prefix or magpie_prefix(tok)
        stop_ids = [int(tok.eos_token_id)] if tok.eos_token_id is not None else []
    except Exception as e:  # a server-only target may have no local tokenizer
        if prefix is None:
            raise ConfigError(
                f"Magpie through a server needs the target's chat template to build the prefix, but its "
                f"tokenizer did not load ({type(e).__name__}: {str(e)[:120]}); set prompts.magpie_prefix to "
                "the template rendered up to the start of a user message's text"
            ) from None
    rows, counts = synthesize_via_server(cfg, prefix, stop_ids, run / "magpie_attempts.jsonl")
    return rows, counts


def _magpie_settings(cfg: Config, prefix: str) -> dict:

    pc = cfg.prompts
    return {
        "server_model": cfg.generate.model,
        "prefix_sha256": hashlib.sha256(prefix.encode()).hexdigest()[:16],
        "max_tokens": pc.synthesize_max_tokens,
        "temperature": 1.0,
        "top_p": 0.95,
        "seed": pc.seed,
    }


async def _magpie_attempts(
    cfg: Config,
    prefix: str,
    stop_ids: list[int],
    indices: list[int],
    settings: dict,
    sink: JsonlAppender,
    log: dict,
    counts: Counter,
) -> None:
    import openai

    sem = asyncio.Semaphore(cfg.generate.concurrency)
    client = _client(cfg)
    extra: dict = {"add_special_tokens": False}  # the prefix already holds the template's special tokens
    if stop_ids:
        extra["stop_token_ids"] = stop_ids

    async def one(i: int) -> None:
        async with sem:
            try:
                resp = await client.completions.create(
                    model=cfg.generate.model,
                    prompt=prefix,
                    max_tokens=settings["max_tokens"],
                    temperature=1.0,
                    top_p=0.95,
                    seed=settings["seed"] * 1_000_003 + i,
                    extra_body=extra,
                )
                choice = resp.choices[0]
                if not isinstance(choice.text, str):
                    raise MalformedReply(f"choices[0].text is {type(choice.text).__name__}, not a string")
                row = {
                    "attempt": i,
                    "text": choice.text,
                    "finish_reason": choice.finish_reason,
                    "completion_tokens": _usage(resp).get("completion_tokens") if resp.usage else None,
                    "settings": settings,
                }
            except (
                openai.APIError,
                httpx.HTTPError,
                MalformedReply,
                AttributeError,
                IndexError,
                TypeError,
            ) as e:
                counts["magpie_failed"] += 1
                if counts["magpie_failed"] <= 5:
                    console.print(
                        f"[yellow]prompts: Magpie attempt {i} failed: {type(e).__name__} {redact(str(e), cfg)[:160]}"
                    )
                return
        sink.append(row)
        log[i] = row

    try:
        await asyncio.gather(*(one(i) for i in indices))
    finally:
        await client.close()


def _attempts_made(log_path, settings: dict) -> dict[int, dict]:
    """The attempts already in ``log_path`` by attempt number (a torn last line repaired first).

    Raises:
        ConfigError: an attempt made with other settings."""
    repair_torn_tail(log_path)
    log: dict[int, dict] = {}
    if log_path.exists():
        for ln, r in read_jsonl(log_path):
            if r.get("settings") != settings:
                raise ConfigError(
                    f"{log_path}:{ln} was made with other Magpie settings ({r.get('settings')}; now {settings}); "
                    "move the file away or use a new run_dir"
                )
            log[r["attempt"]] = r
    return log


def synthesize_via_server(
    cfg: Config, prefix: str, stop_ids: list[int], log_path
) -> tuple[list[dict], Counter]:
    """Magpie through an OpenAI-compatible completions endpoint: the raw templated ``prefix`` (the
    chat template up to a user message's text) is sent as the prompt, and the model's
    continuation up to its end of turn is a new user prompt (Xu et al. 2024, "Magpie").

    Sampling: temperature 1.0, top-p 0.95, ``seed·1000003 + attempt`` per request;
    ``add_special_tokens: false`` and ``stop_token_ids`` (vLLM/SGLang extensions; other servers
    ignore them). Every attempt is appended to ``log_path`` (JSONL), so a rerun sends only the
    attempts not yet made; candidates are kept in attempt order by
    :class:`eagle3kit.data.magpie.MagpieCollector` (finished turn, ≥ 3 words, no near-duplicate), at
    most 4·n attempts, in waves sized to what is still missing.

    Returns (prompt rows, counters: magpie_attempts, magpie_failed, magpie_kept).

    Raises:
        ConfigError: no ``generate.base_url``/``model``; ``log_path`` holds attempts made with
            other settings (another prefix, model, seed or token limit).
    """

    gc, n = cfg.generate, cfg.prompts.synthesize
    if not gc.base_url or not gc.model:
        raise ConfigError("Magpie through a server needs generate.base_url and generate.model")
    settings = _magpie_settings(cfg, prefix)
    log = _attempts_made(log_path, settings)
    counts: Counter = Counter(magpie_failed=0)

    def collect() -> MagpieCollector:
        keep = MagpieCollector(n)
        for i in sorted(log):
            if isinstance(log[i].get("text"), str):
                keep.offer(log[i]["text"], log[i].get("finish_reason") == "stop")
        return keep

    check_server(cfg)

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
                raise ConfigError(
                    f"the server at {gc.base_url} answered none of {len(wave)} Magpie requests (see the "
                    "errors above); check generate.base_url and generate.model. Attempts made so far are kept."
                )
            keep = collect()
            bar.update(
                task,
                completed=min(len(keep.rows), n),
                tokens=sum(r.get("completion_tokens") or 0 for r in log.values()),
                note=f"{len(log)} sampled, failed {counts['magpie_failed']}",
            )
    counts["magpie_attempts"] = len(log)
    counts["magpie_kept"] = len(keep.rows)
    if not keep.full and len(log) >= cap:
        cut = sum(r.get("finish_reason") != "stop" for r in log.values())
        console.print(
            f"[yellow]prompts: all {cap} Magpie attempts (4·n) in {log_path} are used: {len(keep.rows)} kept, "
            f"{cut} did not end their turn (cut at prompts.synthesize_max_tokens or no stop token), the rest were "
            f"too short or repeats. Move {log_path.name} away to sample afresh, or raise synthesize_max_tokens."
        )
    return keep.rows, counts
