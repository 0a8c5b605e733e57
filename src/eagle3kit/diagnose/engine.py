"""What the serving engine did on each prompt: the prompt ids it rendered, its greedy output ids
and its own acceptance counters for that prompt alone.

Prompts are sent one at a time, so each prompt's counter delta is its own (docs/architecture.md, engines):

* vLLM: ``POST /v1/chat/completions`` with ``return_token_ids`` (the response carries
  ``prompt_token_ids`` and the choice's ``token_ids``), and ``/metrics`` read before and after
  each request (``vllm:spec_decode_num_drafts``, ``…_num_draft_tokens``, ``…_num_accepted_tokens``,
  ``…_num_accepted_tokens_per_pos``);
* SGLang: ``POST /generate`` with the prompt ids rendered by the target's template (``bench``'s
  template check runs first) and ``meta_info``'s ``spec_verify_ct``, ``spec_accept_token_num`` and
  ``spec_draft_token_num`` (no per-position counts). Written from SGLang's documented fields; no
  SGLang server runs here, so this path is not engine-verified.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx

from eagle3kit.core.engines import acceptance_from_counters, counter_delta, spec_decode_counters
from eagle3kit.core.ui import progress
from eagle3kit.data.backends import render_prompt_ids


class EngineError(RuntimeError):
    """The server refused a request, dropped mid-run, or gave no token ids or counters."""


@dataclass
class EngineRun:
    """The engine's side of a diagnosis, one entry per prompt, in the order sent.

    ``prompt_ids``/``outputs``: int token ids; ``per_prompt``: counter deltas ``{drafts,
    draft_tokens, accepted, per_position: {k: accepted at position k}}`` (counts);
    ``seconds``: wall time of the requests."""

    engine: str
    prompt_ids: list[list[int]] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    per_prompt: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def totals(self) -> dict:
        """Pooled acceptance over every prompt (:func:`eagle3kit.core.engines.acceptance_from_counters`)."""
        tot: dict = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_position": {}}
        for d in self.per_prompt:
            for key in ("drafts", "draft_tokens", "accepted"):
                tot[key] += d[key]
            for k, v in (d.get("per_position") or {}).items():
                tot["per_position"][k] = tot["per_position"].get(k, 0.0) + v
        return acceptance_from_counters(tot)


def _counters(base: str, headers: dict) -> dict:
    """:func:`eagle3kit.core.engines.spec_decode_counters`, its failures as :class:`EngineError`."""
    try:
        return spec_decode_counters(base, headers=headers)
    except (httpx.HTTPError, ValueError) as e:
        raise EngineError(
            f"{base}/metrics could not be read ({type(e).__name__}: {' '.join(str(e).split())[:160]}); nothing "
            "was written: rerun diagnose once the server answers (vLLM serves its counters there)"
        ) from None


def _settled_counters(base: str, headers: dict, before: dict, wait_s: float = 2.0) -> dict:
    """vLLM's counters once they stop moving: the request's last step may be recorded a moment
    after its response (two equal reads 50 ms apart, at most ``wait_s`` seconds)."""
    last = _counters(base, headers)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < wait_s:
        time.sleep(0.05)
        now = _counters(base, headers)
        if now == last and now["drafts"] > before["drafts"]:
            return now
        last = now
    return last


def _post(base: str, path: str, body: dict, headers: dict, timeout: float) -> dict:
    try:
        r = httpx.post(base + path, json=body, headers=headers, timeout=timeout)
    except httpx.TimeoutException:
        raise EngineError(
            f"{base}{path} did not answer within {timeout:g} s (--timeout); nothing was written: rerun diagnose "
            "once the server answers, or raise --timeout"
        ) from None
    except httpx.HTTPError as e:
        raise EngineError(
            f"the server at {base} stopped answering ({type(e).__name__}: {str(e)[:160]}); nothing was "
            "written: rerun diagnose once the server answers"
        ) from None
    if r.status_code != 200:
        raise EngineError(
            f"{base}{path} answered {r.status_code}: {r.text[:300]}; nothing was written: rerun diagnose once the "
            "server answers"
        )
    try:
        return r.json()
    except ValueError:
        raise EngineError(f"{base}{path} answered something that is not JSON: {r.text[:200]!r}") from None


def measure_engine(
    base: str,
    model: str,
    rows: list[dict],
    max_tokens: int,
    engine: str,
    tokenizer=None,
    headers: dict | None = None,
    timeout: float = 600.0,
    prompt_ids: list[list[int]] | None = None,
    vocab_size: int | None = None,
) -> EngineRun:
    """Send each row's ``messages`` alone, greedy, ``max_tokens`` new tokens; see the module.

    Args:
        base: the server root (no ``/v1``); model: the served model id; engine: ``vllm`` or
            ``sglang``; tokenizer: the target's (SGLang only: it renders the prompt ids).
        prompt_ids: prompts the client rendered itself, sent as token ids (vLLM's
            ``/v1/completions``) instead of the rows' messages. vocab_size: the target's (ids
            outside [0, V) are refused). timeout: seconds per request.
    Raises:
        EngineError: a request failed or timed out, the response held no token ids, ids outside
            the vocabulary, no output, counters that went backwards, or (vLLM) counters that did
            not move (the server runs no speculative decoding)."""
    headers = headers or {}
    run = EngineRun(engine)
    t0 = time.perf_counter()
    with progress() as bar:
        task = bar.add_task(f"engine ({engine}, one prompt at a time)", total=len(rows), tokens=0, note="")
        n = 0
        for i, r in enumerate(rows):
            given = prompt_ids[i] if prompt_ids is not None else None
            if engine == "vllm":
                ids, out, delta = _vllm_one(base, model, r["messages"], max_tokens, headers, timeout, given)
            else:
                if given is None:
                    given = render_prompt_ids(tokenizer, r["messages"])
                ids, out, delta = _sglang_one(base, given, max_tokens, headers, timeout)
            check_answer(base, i, ids, out, delta, vocab_size)
            run.prompt_ids.append(ids)
            run.outputs.append(out)
            run.per_prompt.append(delta)
            n += len(out)
            bar.update(task, advance=1, tokens=n)
    run.seconds = time.perf_counter() - t0
    if not any(d["drafts"] for d in run.per_prompt):
        raise EngineError(
            f"the server at {base} reported no drafts over {len(rows)} prompts: it serves the target "
            "without speculative decoding (start it with --speculative-config naming the drafter)"
        )
    return run


def check_answer(
    base: str, i: int, ids: list[int], out: list[int], delta: dict, vocab_size: int | None
) -> None:
    """Refuse what would give a wrong diagnosis: no output, ids outside the target's vocabulary,
    counters that went backwards (the server restarted or reset them mid-run)."""
    if not out:
        raise EngineError(
            f"the server returned no output tokens for prompt {i + 1}: diagnose needs the engine's greedy "
            "output (raise --max-tokens, or check the server's stop settings)"
        )
    bad = [t for t in ids + out if t < 0 or (vocab_size and t >= vocab_size)]
    if bad:
        raise EngineError(
            f"the server returned token ids outside [0, {vocab_size}) for prompt {i + 1} (e.g. {bad[0]}): it does "
            "not serve this --target"
        )
    if min(delta[k] for k in ("drafts", "draft_tokens", "accepted")) < 0 or any(
        v < 0 for v in (delta.get("per_position") or {}).values()
    ):
        raise EngineError(
            f"the server's counters went backwards during prompt {i + 1} (it restarted or reset its metrics); "
            "nothing was written: rerun diagnose"
        )


def _vllm_one(base, model, messages, max_tokens, headers, timeout, prompt_ids=None):
    before = _counters(base, headers)
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "return_token_ids": True}
    if prompt_ids is None:  # the server renders the chat with its template
        got = _post(base, "/v1/chat/completions", {**body, "messages": messages}, headers, timeout)
    else:  # the client rendered it
        got = _post(base, "/v1/completions", {**body, "prompt": prompt_ids}, headers, timeout)
        got = {"prompt_token_ids": prompt_ids, **got}
    try:
        ids = [int(t) for t in got["prompt_token_ids"]]
        out = [int(t) for t in got["choices"][0]["token_ids"]]
    except (KeyError, IndexError, TypeError, ValueError):
        raise EngineError(
            f"{base} returned no prompt_token_ids/token_ids of integers (vLLM ≥ 0.10.2 returns them with "
            "return_token_ids); diagnose needs the engine's own ids"
        ) from None
    after = _settled_counters(base, headers, before)
    return ids, out, counter_delta(before, after)


def _sglang_one(base, ids, max_tokens, headers, timeout):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0}}
    got = _post(base, "/generate", body, headers, timeout)
    meta = got.get("meta_info") or {}
    if got.get("output_ids") is None or meta.get("spec_verify_ct") is None:
        raise EngineError(
            f"{base}/generate returned no output_ids or meta_info.spec_verify_ct: start SGLang with "
            "--speculative-algorithm EAGLE3"
        )
    try:
        out = [int(t) for t in got["output_ids"]]
        drafts = int(meta["spec_verify_ct"])
        accepted = int(meta.get("spec_accept_token_num", len(out) - drafts))
        tokens = int(meta.get("spec_draft_token_num", 0))
    except (TypeError, ValueError):
        raise EngineError(f"{base}/generate returned output_ids or meta_info that are not integers") from None
    return ids, out, {"drafts": drafts, "draft_tokens": tokens, "accepted": accepted, "per_position": {}}
