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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
