"""Online training from the serving engine: vLLM capture servers produce the aux states and the
teacher state of the training samples, the trainer consumes them as they arrive.

The producer is a vLLM server of the target started with its ``extract_hidden_states``
speculative method and eagle3kit's capture connector (:func:`producer_args`; the same connector
and reader as ``extract --backend vllm``, :mod:`eagle3kit.train.vllm_capture`). For each sample
the trainer asks for one token (``/v1/completions``, the sample's token ids as the prompt,
``max_tokens`` 1) with ``kv_transfer_params.hidden_states_path`` naming a file in its buffer
folder; the server writes the sample's states there (``hidden_states`` [T, n_ids, Ht],
``token_ids`` [T]) under an exclusive ``flock`` on ``<file>.lock``. The connector writes a
finished request's file at the engine's next step, so a reader that waits longer than a moment
sends a one-token flush request.

Order and resume: a sample's file is named by the SHA-256 of its token ids
(:func:`sample_key`), never by a request's position; a file is used only when its ``token_ids``
equal the sample's. A trainer killed mid-epoch reruns from its last checkpoint: the files it had
fetched and not consumed are reused, the ones no step will read again are deleted.

The buffer is bounded: a request is sent only when the bytes of the files in the buffer folder
plus the requests in flight (each counted at its size, T · the transport's bytes a token) stay
within ``buffer_bytes``; a file is deleted once its sample is consumed. The files are the ones
vLLM's connector writes to a folder the server and trainer share (one machine), read through
hs-connectors (``file`` or ``fp8``: :mod:`eagle3kit.train.transport`); between machines its
Mooncake backend is the plan (docs/online.md), not wired in.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from eagle3kit.core.config import ConfigError
from eagle3kit.core.rundir import DataError
from eagle3kit.core.ui import console
from eagle3kit.train.transport import (
    HEADER_BYTES,
    DamagedCaptureError,
    connector_config,
    read_captured,
    states_reader,
)


def sample_key(ids: torch.Tensor) -> str:
    """The SHA-256 (hex, 32 characters) of a sample's int64 token ids: its states' file name."""
    return hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:32]


def producer_args(layer_ids: list[int], store: str | Path, transport: str = "file", own: bool = True) -> dict:
    """The vLLM settings of a capture producer: ``speculative_config`` (``extract_hidden_states``
    of ``layer_ids``, the aux ids then N) and ``kv_transfer_config`` (the connector for
    ``transport``, ``file`` or ``fp8``, writing where each request's ``hidden_states_path`` says,
    ``store`` otherwise: eagle3kit's, or with ``own`` false vLLM's / hs-connectors' own,
    :func:`~eagle3kit.train.transport.connector_config`)."""
    return {
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        },
        "kv_transfer_config": connector_config(transport, store, custom_paths=True, own=own),
    }


def producer_cli_args(
    layer_ids: list[int], store: str | Path, transport: str = "file", own: bool = True
) -> list[str]:
    """:func:`producer_args` as ``vllm serve`` options (prefix caching off: every request's
    states computed, none served from another request's blocks)."""
    a = producer_args(layer_ids, store, transport, own)
    return [
        "--speculative-config",
        json.dumps(a["speculative_config"]),
        "--kv-transfer-config",
        json.dumps(a["kv_transfer_config"]),
        "--no-enable-prefix-caching",
    ]


def capture_server_command(
    model: str,
    layer_ids: list[int],
    store: str | Path,
    dtype: str,
    transport: str = "file",
    port: int = 8000,
    cpu_build: bool = False,
    own: bool = True,
    extra: list[str] | None = None,
    python: str = "python",
    vllm: str = "vllm",
) -> list[str]:
    """The command that starts a capture server for ``train --online-from``: ``vllm serve MODEL``
    (on vLLM's CPU build, whose ``vllm`` script does not start, ``python -m
    vllm.entrypoints.openai.api_server --model MODEL`` with float32's eager settings), served as
    ``target``, in ``dtype`` (the trainer's; it reserves its buffer at that width), with
    :func:`producer_cli_args` for ``layer_ids`` (the aux ids, then N) and ``extra`` options
    (``--tensor-parallel-size 8``, …); ``python`` / ``vllm``: the interpreter or vLLM command it names.
    Returns the argv list."""
    if cpu_build:
        head = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--dtype",
            "float32",
        ]
        head += ["--enforce-eager", "--kv-cache-memory-bytes", str(2 << 30)]
    else:
        head = [vllm, "serve", str(model), "--dtype", dtype]
    return [
        *head,
        "--served-model-name",
        "target",
        "--port",
        str(port),
        *producer_cli_args(layer_ids, store, transport, own),
        *(extra or []),
    ]


def _unlocked(path: str) -> bool:
    """Whether ``path``'s writer has finished: no ``.lock`` beside it, or one we can share-lock."""
    lock = path + ".lock"
    if not os.path.exists(lock):
        return os.path.exists(path)
    try:
        with open(lock) as lf:
            fcntl.flock(lf, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(lf, fcntl.LOCK_UN)
    except BlockingIOError:
        return False
    except FileNotFoundError:
        pass
    return os.path.exists(path)


def _remove(path: Path) -> None:
    """Delete a capture file and the ``.lock`` its writer leaves beside it."""
    path.unlink(missing_ok=True)
    Path(str(path) + ".lock").unlink(missing_ok=True)


def folder_bytes(folder: Path) -> int:
    """Bytes of the files in ``folder`` (a file removed while counting counts 0)."""
    total = 0
    for e in os.scandir(folder):
        try:
            if e.is_file(follow_symlinks=False):
                total += e.stat().st_size
        except FileNotFoundError:
            pass
    return total


class EngineFeeder:
    """Captured states for a trainer's samples, fetched ahead in the order it will read them.

    Args:
        urls: base URLs of the capture servers (``http://host:port``); requests go round-robin.
        model: the served model name.
        buffer: this trainer process's buffer folder (created; files of samples it will not read
            are deleted).
        buffer_bytes: most bytes the buffer's files and the requests in flight may take.
        n_ids: states a token (aux ids + 1).
        bytes_per_token: one token's bytes in a capture file of ``transport`` (a request's
            reservation per token; :func:`eagle3kit.train.transport.bytes_per_token`).
        inflight: most requests in flight at once.
        timeout_s: how long a sample may take (request, write and retries) before the server is
            declared down.
        transport: ``file`` or ``fp8``, what the servers write (checked on every file).
        layer_ids: the layer ids the servers must capture (aux ids, then N; checked where the
            file records them).
    Raises (from :meth:`get`):
        DataError: a server stopped answering (naming it and the fix), or returned a file of other
            tokens or of another transport; ConfigError: a sample larger than the whole buffer;
            ValueError: a read of a sample no schedule holds (or one read more than scheduled).
    """

    def __init__(
        self,
        urls: list[str],
        model: str,
        buffer: str | Path,
        buffer_bytes: int,
        n_ids: int,
        bytes_per_token: int,
        inflight: int = 4,
        timeout_s: float = 120.0,
        transport: str = "file",
        layer_ids: list[int] | None = None,
    ):
        self.urls, self.model = [u.rstrip("/") for u in urls], model
        self.buffer = Path(buffer)
        self.transport, self.reader, self.layer_ids = transport, states_reader(buffer), layer_ids
        self.buffer.mkdir(parents=True, exist_ok=True)
        (self.buffer / ".flush").mkdir(exist_ok=True)
        self.limit, self.n_ids, self.bpt = int(buffer_bytes), n_ids, bytes_per_token
        self.timeout = timeout_s
        self.client = httpx.Client(timeout=timeout_s)
        self.pool = ThreadPoolExecutor(max(1, inflight), thread_name_prefix="eagle3kit-feeder")
        self.inflight = max(1, inflight)
        self.cv = threading.Condition()
        self.reserved = 0  # bytes of requests in flight
        self.futures: dict[str, Future] = {}
        self.pending: dict[str, int] = {}  # key → reads still to come of its future (a key twice in order)
        self.sizes: dict[str, int] = {}
        self.order: list[tuple[str, torch.Tensor]] = []
        self.next = 0  # index into order of the next request to send
        self.wait_s = 0.0
        self.read_s = 0.0
        self.peak_bytes = 0
        self.requests = 0
        self.reused = 0
        self.damaged = 0  # files that could not be read and were requested again
        self.stale = 0  # files an earlier run left that do not fit this one (requested again)
        self.reused_keys: set[str] = set()
        self.engine_next: dict[str, int] = {}  # key → the engine's greedy token after the sample
        self.error: BaseException | None = None
        self._rr = 0
        self._stop = False
        self._thread: threading.Thread | None = None

    # ---- scheduling -------------------------------------------------------------------------
    def schedule(self, order: list[tuple[str, torch.Tensor]], prune: bool = True) -> None:
        """The samples (key, token ids) in the order :meth:`get` will ask for them (this epoch's rest,
        from the resume point); with ``prune``, files of samples not in it are deleted (without:
        kept for a later schedule, as the validation samples' fetch before a resumed epoch does)."""
        big = max(order, key=lambda o: o[1].numel(), default=None)
        if big is not None and self._size(big[1]) > self.limit:
            raise ConfigError(
                f"a sample of {big[1].numel()} tokens needs {self._size(big[1]):,} bytes of states, more than "
                f"train.online_buffer_bytes ({self.limit:,}); raise it to at least {self._size(big[1]):,}"
            )
        with self.cv:
            self.order, self.next = list(order), 0
            keep = {k for k, _ in order}
            for k in list(self.futures):  # reads of the earlier order are abandoned: this one counts anew
                self.pending[k] = 0
                if k not in keep:
                    del self.futures[k], self.pending[k]
            for f in self.buffer.glob("*.safetensors") if prune else ():
                if f.stem not in keep and f.stem not in self.sizes:  # (a file still being written stays)
                    _remove(f)
            self.cv.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="eagle3kit-feeder")
            self._thread.start()

    def _note_peak(self) -> None:
        """The most bytes the buffer folder held when looked at (a request is sent only while the
        files plus every request in flight, counted whole, stay within the bound)."""
        self.peak_bytes = max(self.peak_bytes, folder_bytes(self.buffer))

    def _size(self, ids: torch.Tensor) -> int:
        return ids.numel() * self.bpt + HEADER_BYTES

    def _ready(self) -> bool:
        """Whether the next sample of the order can be placed now (under :attr:`cv`): one whose
        future exists (the same tokens again) or whose file is on disk needs no room; a request needs
        a free slot and room for its whole size beside the files and the requests in flight. Blocked
        with no request in flight and no file awaiting its read, nothing would ever free room: the
        files left (an earlier run's or a later epoch's, not yet any read's) are deleted and fetched
        again when their turn comes."""
        key, ids = self.order[self.next]
        if key in self.futures:
            return True
        if key in self.sizes:  # an earlier order's request for these tokens, still in flight: its file
            return False
        if _unlocked(str(self.buffer / f"{key}.safetensors")):
            return True
        if len(self.sizes) >= self.inflight:
            return False
        if folder_bytes(self.buffer) + self.reserved + self._size(ids) <= self.limit:
            return True
        if not self.sizes and not any(self.pending.get(k, 0) > 0 for k in self.futures):
            for k in list(self.futures):  # files no scheduled read waits for yet: made room for
                del self.futures[k], self.pending[k]
            for f in self.buffer.glob("*.safetensors"):
                _remove(f)
        return False

    def _run(self) -> None:
        """Send requests in order while the buffer has room (the bound: files + in flight); an
        error here (the buffer folder gone, say) is handed to the reads instead of leaving them waiting."""
        try:
            self._send()
        except BaseException as e:  # noqa: BLE001 (raised by get())
            with self.cv:
                self.error = DataError(f"the feeder of {self.buffer} stopped: {type(e).__name__}: {e}")
                self.cv.notify_all()

    def _send(self) -> None:
        while True:
            with self.cv:
                while not self._stop and (self.next >= len(self.order) or not self._ready()):
                    self.cv.wait(0.05)
                if self._stop:
                    return
                key, ids = self.order[self.next]
                self.next += 1
                if key in self.futures:  # the same tokens twice in this order: one file, read twice
                    self.pending[key] += 1
                    continue
                size = self._size(ids)  # at most the limit (schedule refuses a larger sample)
                path = self.buffer / f"{key}.safetensors"
                if _unlocked(str(path)):  # its writer done (the connector leaves the .lock file behind)
                    fut: Future = Future()  # fetched by an earlier run (or twice in an epoch): reused
                    fut.set_result(path)
                    self.reused += 1
                    self.reused_keys.add(key)
                else:
                    self.reserved += size
                    self.sizes[key] = size
                    fut = self.pool.submit(self._fetch, key, ids, path)
                self.futures[key], self.pending[key] = fut, 1
                self._note_peak()

    def _post(self, ids: list[int], path: Path) -> dict:
        url = self.urls[self._rr % len(self.urls)]
        self._rr += 1
        r = self.client.post(
            f"{url}/v1/completions",
            json={
                "model": self.model,
                "prompt": ids,
                "max_tokens": 1,
                "temperature": 0.0,
                "kv_transfer_params": {"hidden_states_path": str(path)},
                "return_token_ids": True,  # the engine's own next token: checked against the trainer's head
            },
        )
        if r.status_code in (404, 405, 501):  # no completions endpoint: not vLLM at all, retrying cannot help
            raise ConfigError(
                f"{url} is not a vLLM capture server (HTTP {r.status_code} for /v1/completions); start the "
                "target with the command `eagle3kit capture-server -c CONFIG` prints, or fix train.online_from"
            )
        if r.status_code != 200:
            raise DataError(f"the capture server at {url} answered HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def _fetch(self, key: str, ids: torch.Tensor, path: Path) -> Path:
        """One sample: the request, then the file once its writer is done (flushing if needed)."""
        deadline = time.monotonic() + self.timeout
        last_err: BaseException | None = None
        while time.monotonic() < deadline:
            try:
                got = self._post(ids.tolist(), path)
                want = str(path)
                nxt = ((got.get("choices") or [{}])[0].get("token_ids") or [None])[0]
                if nxt is not None:
                    self.engine_next[key] = int(nxt)
                if (got.get("kv_transfer_params") or {}).get("hidden_states_path") != want:
                    raise ConfigError(  # a server without the capture settings: retrying cannot help
                        f"the server at {self.urls[(self._rr - 1) % len(self.urls)]} writes no states (no "
                        "hidden_states_path in its answer): it is not a capture server. Start the target with "
                        "the command `eagle3kit capture-server -c CONFIG` prints, or fix train.online_from"
                    )
                t_flush = time.monotonic() + 0.5
                while not _unlocked(want):
                    if time.monotonic() > t_flush:  # the engine writes at its next step: give it one
                        self._post(ids[:1].tolist(), self.buffer / ".flush" / f"{key}.safetensors")
                        t_flush = time.monotonic() + 0.5
                    if time.monotonic() > deadline:
                        raise DataError(f"the capture server never finished writing {want}")
                    time.sleep(0.01)
                for f in (self.buffer / ".flush").iterdir():
                    f.unlink(missing_ok=True)
                self.requests += 1
                with self.cv:
                    self.reserved -= self.sizes.pop(key, 0)
                    self._note_peak()
                    self.cv.notify_all()
                return path
            except (httpx.TransportError, DataError) as e:  # down, restarting, or a bad answer: retry
                last_err = e
                time.sleep(0.5)
        with self.cv:
            self.reserved -= self.sizes.pop(key, 0)
            self.cv.notify_all()
        raise DataError(
            f"the capture server(s) {', '.join(self.urls)} gave no states for a sample of {ids.numel()} tokens "
            f"in {self.timeout:.0f} s ({type(last_err).__name__}: {str(last_err)[:600]}); start the server "
            "again (or fix the error above) and rerun train: it resumes from its last checkpoint"
        )

    # ---- consuming ----------------------------------------------------------------------------
    def get(self, key: str, ids: torch.Tensor) -> torch.Tensor:
        """The states [T, n_ids, Ht] of the sample ``key`` (token ids ``ids``), waiting for them if
        needed (counted in :attr:`wait_s`, seconds); reading the file into a tensor is counted in
        :attr:`read_s` (seconds); its file is deleted once read."""
        t0 = time.perf_counter()
        with self.cv:
            while key not in self.futures and self.error is None:
                if not any(k == key for k, _ in self.order[self.next :]):
                    raise ValueError(
                        f"states of sample {key} were asked for but no read of it is scheduled (or all "
                        "its scheduled reads were made): schedule() the order get() follows"
                    )
                self.cv.wait(0.05)
            if self.error is not None:
                raise self.error
            fut = self.futures[key]  # kept until read: the same tokens later in the order join it
        path = fut.result()  # (the read counts as pending until done: no room is made by deleting it)
        self.wait_s += time.perf_counter() - t0
        self._note_peak()
        try:
            states = self._read(path, ids)
        except DataError as e:  # cut short by a server killed mid-write, or left by another run: ask again
            if not isinstance(e, DamagedCaptureError) and key not in self.reused_keys:
                raise  # what this run's servers wrote just now: the error is theirs (the message says)
            console.print(f"[yellow]train: {str(e).split('; delete it')[0]}; requesting its states again[/]")
            if isinstance(e, DamagedCaptureError):
                self.damaged += 1
            else:
                self.stale += 1
            self.reused_keys.discard(key)
            _remove(path)
            t1 = time.perf_counter()
            fetched = self._fetch(key, ids, path)
            self.wait_s += time.perf_counter() - t1  # waiting for the new file, not reading it
            states = self._read(fetched, ids)
        with self.cv:
            self.pending[key] -= 1
            if self.pending[key] <= 0:  # this file's last scheduled read
                del self.futures[key], self.pending[key]
                if not any(k == key for k, _ in self.order[self.next :]):  # and none to schedule
                    _remove(path)
            self.cv.notify_all()
        return states

    def _read(self, path: Path, ids: torch.Tensor) -> torch.Tensor:
        """:func:`read_captured` of one file, its seconds added to :attr:`read_s` (a read that raises too)."""
        t0 = time.perf_counter()
        try:
            return read_captured(self.reader, path, ids, self.n_ids, self.transport, self.layer_ids)
        finally:
            self.read_s += time.perf_counter() - t0

    def close(self) -> dict:
        """Stop fetching; returns the statistics (seconds waited for states, seconds reading them, peak
        bytes, requests, reused files, damaged files requested again)."""
        with self.cv:
            self._stop = True
            self.cv.notify_all()
        if self._thread is not None:
            self._thread.join(5)
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.client.close()
        return self.stats()

    def stats(self) -> dict:
        return {
            "wait_s": round(self.wait_s, 3),
            "read_s": round(self.read_s, 3),
            "peak_buffer_bytes": self.peak_bytes,
            "requests": self.requests,
            "reused_files": self.reused,
            "damaged_files": self.damaged,
            "stale_files": self.stale,
        }


def server_version(url: str) -> dict:
    """What the capture server says it is (``/version``, ``/v1/models``): the features' source."""
    try:
        with httpx.Client(timeout=10) as c:
            version = c.get(f"{url.rstrip('/')}/version").json().get("version")
            models = [m["id"] for m in c.get(f"{url.rstrip('/')}/v1/models").json().get("data", [])]
    except (httpx.HTTPError, ValueError) as e:
        raise DataError(
            f"train.online_from: no vLLM server answers at {url} ({type(e).__name__}); start the capture "
            "server first (docs/online.md) or fix the URL"
        ) from None
    return {"engine": "vllm", "version": version, "url": url, "models": models}


def dumps_source(src: list[dict]) -> str:
    return json.dumps(src, sort_keys=True)
