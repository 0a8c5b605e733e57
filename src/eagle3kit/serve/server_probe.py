"""Asking an OpenAI-compatible server what it is before measuring it: the engine (vLLM or SGLang) and its
version, the served model, whether it renders prompts with the target's chat template
(:func:`check_template`), SGLang's state; the API key in headers, never in messages (:func:`redact`)."""

from __future__ import annotations

import re

import httpx
from prometheus_client.parser import text_string_to_metric_families

from eagle3kit.data.backends import render_prompt_ids
from eagle3kit.serve.benchreport import BenchError


def redact(text: str, api_key: str | None) -> str:
    """``text`` with the API key and any bearer token or ``sk-…`` key replaced by ``***`` (a server
    may echo the Authorization header in an error; nothing secret is logged or written)."""

    if api_key and api_key != "EMPTY":
        text = text.replace(api_key, "***")
    return re.sub(r"sk-[A-Za-z0-9_\-]{4,}", "sk-***", re.sub(r"(?i)bearer\s+\S+", "Bearer ***", text))


def auth_headers(api_key: str | None) -> dict:
    """``Authorization: Bearer KEY`` for the server's non-OpenAI endpoints (``/v1/models``,
    ``/tokenize``, ``/metrics``), empty when there is no key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key and api_key != "EMPTY" else {}


def get_json(url: str, timeout: float = 10.0, headers: dict | None = None):

    try:
        r = httpx.get(url, timeout=timeout, headers=headers or {})
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    try:
        return r.json()
    except ValueError:
        return None


def detect_engine(base: str, headers: dict | None = None, flag: str = "--base-url") -> dict:
    """``{"name": "sglang"|"vllm"|"openai-compatible", "version", "server_info"}`` of the server at
    ``base`` (its root, without ``/v1``): SGLang answers ``/server_info`` (older releases
    ``/get_server_info``), vLLM ``/version`` and ``vllm:`` metrics.

    Raises:
        BenchError: the server does not answer ``/v1/models``.
    """
    if get_json(base + "/v1/models", headers=headers) is None:
        raise BenchError(
            f"no OpenAI-compatible server answers {base}/v1/models: start it, or fix {flag} "
            "(give the server root, e.g. http://127.0.0.1:8000; a server that wants a key needs it in "
            "--api-key-env)"
        )
    for path in ("/server_info", "/get_server_info"):
        info = get_json(base + path, headers=headers)
        if isinstance(info, dict) and ("internal_states" in info or "speculative_algorithm" in info):
            return {"name": "sglang", "version": info.get("version"), "server_info": info}
    ver = get_json(base + "/version", headers=headers)
    if isinstance(ver, dict) and "version" in ver:
        return {"name": "vllm", "version": ver["version"], "server_info": None}
    return {"name": "openai-compatible", "version": None, "server_info": None}


def served_model(base: str, headers: dict | None = None) -> str:
    """The first model id the server lists at ``/v1/models``."""
    data = get_json(base + "/v1/models", headers=headers) or {}
    if not isinstance(data, dict):
        data = {}
    ids = [m.get("id") for m in (data.get("data") or []) if isinstance(m, dict)]
    if not ids:
        raise BenchError(f"{base}/v1/models lists no model; pass --model")
    return ids[0]


def json_or_none(resp):
    try:
        got = resp.json()
    except ValueError:
        return None
    return got if isinstance(got, dict) else None


def first_difference(a: list[int], b: list[int]) -> int:
    """The first index where token-id lists ``a`` and ``b`` differ (the shorter length when one is
    a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_template(
    base: str, model: str, tokenizer, rows: list[dict], sample: int = 8, headers: dict | None = None
) -> dict:
    """The server must render prompts with the target's own chat template. Renders up to
    ``sample`` prompts with ``tokenizer``'s template and compares them with the server's
    ``POST /tokenize`` of the same messages (vLLM, SGLang) or, where it has none, with the
    ``usage.prompt_tokens`` of a one-token request.

    Raises:
        BenchError: naming the first mismatching prompt, both lengths and the first differing position.
    """

    checked, how = 0, "tokenize"
    for r in rows[:sample]:
        ours = render_prompt_ids(tokenizer, r["messages"])
        resp = httpx.post(
            base + "/tokenize",
            json={"model": model, "messages": r["messages"], "add_generation_prompt": True},
            timeout=30,
            headers=headers or {},
        )
        tok = json_or_none(resp) if resp.status_code == 200 else None
        if tok is not None and isinstance(tok.get("tokens"), list):
            theirs = [int(t) for t in tok["tokens"]]
        else:
            how = "usage.prompt_tokens"
            body = {"model": model, "messages": r["messages"], "max_tokens": 1, "temperature": 0.0}
            got = (
                json_or_none(
                    httpx.post(base + "/v1/chat/completions", json=body, timeout=120, headers=headers or {})
                )
                or {}
            )
            n = (got.get("usage") or {}).get("prompt_tokens") if isinstance(got.get("usage"), dict) else None
            if n is None:
                return {"checked": checked, "method": "none: the server gives neither /tokenize nor usage"}
            theirs = ours if n == len(ours) else [-1] * int(n)
        if theirs != ours:
            pos = first_difference(ours, theirs)
            where = (
                f", first difference at token {pos}: {theirs[pos] if pos < len(theirs) else 'end'} there, "
                f"{ours[pos] if pos < len(ours) else 'end'} with the target's template "
                f"({tokenizer.decode(ours[pos : pos + 3])!r})"
                if how == "tokenize"
                else " (only lengths can be compared)"
            )
            raise BenchError(
                f"the server renders prompts with another chat template than the target's ({how}): prompt "
                f"{r['messages'][0]['content'][:60]!r} is {len(theirs)} tokens there and {len(ours)} with the target's "
                f"template{where}. Serve the target with its own template (drop a --chat-template override), or pass "
                "the --target whose template the server uses"
            )
        checked += 1
    return {"checked": checked, "method": how, "result": "same prompt ids as the target's own template"}


SGLANG_GAUGES = {
    "sglang:spec_accept_length": "spec_accept_length",
    "sglang:spec_accept_rate": "spec_accept_rate",
}


def sglang_state(base: str, headers: dict | None = None) -> dict:
    """SGLang's own view after a level: the ``/metrics`` gauges ``sglang:spec_accept_length`` and
    ``sglang:spec_accept_rate`` (prometheus-client parser; gauges over the scheduler's recent
    window, not counters) and ``/server_info``'s ``avg_spec_accept_length``."""

    out: dict = {}
    try:
        text = httpx.get(base + "/metrics", timeout=10, headers=headers or {}).text
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                if smp.name in SGLANG_GAUGES:
                    out[SGLANG_GAUGES[smp.name]] = smp.value
    except (httpx.HTTPError, ValueError):
        out["metrics"] = "unavailable (start SGLang with --enable-metrics)"
    info = (
        get_json(base + "/server_info", headers=headers)
        or get_json(base + "/get_server_info", headers=headers)
        or {}
    )
    states = (info.get("internal_states") if isinstance(info, dict) else None) or [{}]
    out["server_info_avg_spec_accept_length"] = states[0].get("avg_spec_accept_length")
    return out
