"""The run directory: JSONL files with atomic appends, content hashes, ``manifest.json`` and
``report.json`` (docs/architecture.md).

Layout of a run directory::

    config.yaml          the resolved config of the last stage that ran
    manifest.json        provenance: target, tokenizer/template hashes, aux ids, vocab hash, per-stage inputs and counts
    report.json          the numbers: per-stage rows in/kept/dropped, vocab coverage, train loss, evaluate τ
    prompts.jsonl        training prompts          heldout.jsonl   held-out evaluation prompts
    conversations.jsonl  generated replies (append-only, resumable)
    tokens.safetensors   token shard               vocab.safetensors  d2t/t2d
    checkpoints/         training state            drafter/           exported drafter
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gzip
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Iterator

import safetensors.torch
import torch
from safetensors import safe_open

from eagle3kit import __version__


class DataError(ValueError):
    """Bad input data; the message names the file, the line and the fix."""


@contextlib.contextmanager
def folder_lock(folder: str | Path, stage: str, alternative: str) -> Iterator[None]:
    """Hold ``folder/.<stage>.lock`` (``flock``) for the duration; the lock dies with its
    process, so nothing is left to clean up after a kill.

    Raises:
        DataError: another process holds it (names its pid, and ``alternative``), or the folder
        cannot be written.
    """

    folder = Path(folder)
    try:
        fd = os.open(folder / f".{stage}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except (
        OSError
    ) as e:  # a read-only folder (EROFS, EACCES, EPERM): the stage could write nothing there either
        raise write_failed(folder / f".{stage}.lock", e) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        raise DataError(
            f"another `eagle3kit {stage}` (pid {other or '?'}) is writing to {folder}; wait for it to "
            f"finish, or {alternative}"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """SHA-256 of a file's bytes (hex). Raises FileNotFoundError naming the path."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


#: what to do about an unreadable file of a run directory, by name (what its one-line error says):
#: stage outputs are written again by their stage; report.json holds only the stages' summaries (the
#: next stage writes a new one); manifest.json holds the lineage every stage checks its inputs against
REWRITE = {
    "tokens.safetensors": "rerun `eagle3kit tokenize`",
    "vocab.safetensors": "rerun `eagle3kit vocab`",
    "best.safetensors": "rerun `eagle3kit train` (move checkpoints/ away first to train anew)",
    "last.safetensors": "move checkpoints/ away and rerun `eagle3kit train`, which then starts anew",
    "model.safetensors": "export the drafter again (`eagle3kit export`)",
    "report.json": "restore it, or delete report.json alone (it holds only the stages' summaries; "
    "the next stage writes a new one)",
    "manifest.json": "restore it, or start a new run_dir (without it no stage can tell what its inputs were "
    "built from)",
}


def open_safetensors(path: str | Path, fix: str | None = None):
    """``safetensors.safe_open(path, "pt")`` (use it in a ``with``), with a DataError naming the
    file and the fix (``fix``, else the :data:`REWRITE` rule for its name) when the file is
    truncated or not safetensors at all — an interrupted copy, a full disk — instead of
    safetensors' own "incomplete metadata" traceback.

    Raises: FileNotFoundError: no such file; DataError: unreadable."""

    path = Path(path)
    if path.is_dir():
        raise DataError(
            f"{path} is a directory, not a safetensors file; {fix or REWRITE.get(path.name, 'write it again')}"
        )
    try:
        return safe_open(str(path), "pt")
    except FileNotFoundError:
        raise
    except Exception as e:  # SafetensorError, OSError
        raise DataError(
            f"{path} is unreadable: truncated, or not a readable safetensors file ({type(e).__name__}: "
            f"{e}); {fix or REWRITE.get(path.name, 'write it again')}"
        ) from None


def sha256_tensors(path: str | Path) -> str:
    """SHA-256 of a safetensors file's *content*: tensor names, dtypes, shapes, bytes and
    metadata in sorted order. (The file bytes are not stable: safetensors writes its metadata
    map in arbitrary order.)

    Raises: DataError: the file is unreadable (:func:`open_safetensors`)."""
    with open_safetensors(path) as f:
        return sha256_state({name: f.get_tensor(name) for name in f.keys()}, f.metadata() or {})


def sha256_state(tensors: dict, metadata: dict | None = None) -> str:
    """SHA-256 of named tensors (names, dtypes, shapes, bytes, sorted by name) and ``metadata``."""

    h = hashlib.sha256()
    h.update(json.dumps(sorted((metadata or {}).items())).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def load_safetensors(path: str | Path, fix: str) -> dict:
    """``safetensors.torch.load_file`` with a DataError naming the file and ``fix`` when the file
    is not a safetensors file (a text file, a pickle, a folder): see :func:`open_safetensors`."""
    with open_safetensors(path, fix) as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def write_failed(path: str | Path, e: BaseException) -> "DataError":
    """The one-line error for a failed write of ``path``: what the system said (disk full,
    read-only, permission denied) and the fix."""

    code = getattr(e, "errno", None)
    text = str(e)
    if code is None and "os error" in text:  # safetensors' SafetensorError: "… (os error 28) …"
        try:
            code = int(text.split("os error", 1)[1].split(")", 1)[0])
        except ValueError:
            code = None
    why = os.strerror(code) if code else text.splitlines()[0][:200]
    fix = {
        errno.ENOSPC: "free space on that disk, or give a run_dir on another",
        errno.EDQUOT: "free space within your quota, or give a run_dir elsewhere",
        errno.EROFS: "the file system is read-only: give a run_dir on a writable one",
        errno.EACCES: "make the folder writable for you, or give another run_dir",
        errno.EPERM: "make the folder writable for you, or give another run_dir",
    }.get(code, "fix the folder or give another run_dir")
    return DataError(
        f"could not write {path}: {why}; {fix} (nothing was left half-written: the earlier file, if any, is as it was)"
    )


def as_umask_allows(*paths: str | Path) -> None:
    """Give files the mode a new file of this process gets (0666 less the umask, 0644 by default):
    ``safetensors`` writes its files 0600, which an engine serving them under another user cannot read."""
    mask = os.umask(0)
    os.umask(mask)
    for p in paths:
        os.chmod(p, 0o666 & ~mask)


def write_safetensors(path: str | Path, tensors: dict, metadata: dict | None = None) -> None:
    """``safetensors.torch.save_file`` through a temporary name in the same folder, then a rename:
    a failed or killed write leaves the earlier file as it was and no partial file.

    Raises:
        DataError: the write failed (disk full, read-only folder, no permission), naming the file
            and the fix (see :func:`write_failed`).
    """

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        safetensors.torch.save_file(tensors, str(tmp), metadata=metadata)  # looked up per call: tests fail it
        as_umask_allows(tmp)
        os.replace(tmp, path)
    except Exception as e:  # OSError, SafetensorError (an I/O error inside the Rust writer)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise write_failed(path, e) from None


def require_free(folder: str | Path, need: int, what: str) -> None:
    """Refuse before any work when ``folder``'s disk has fewer than ``need`` bytes free.

    Raises:
        DataError: naming the folder, both numbers (bytes) and the fix.
    """

    folder = Path(folder)
    probe = folder if folder.exists() else folder.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        raise DataError(
            f"{what} needs about {need:,} bytes in {folder} but its disk has {free:,} free; free space, or "
            "give a run_dir on another disk (nothing was started)"
        )


def sha256_json(obj: Any) -> str:
    return sha256_bytes(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode())


def read_jsonl(path: str | Path, bad_lines: list | None = None) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_number, value)`` for each non-empty line (1-based line numbers).

    With ``bad_lines`` (a list), a line that is not UTF-8 or not valid JSON is skipped and
    ``(line_number, reason)`` appended to it instead of raising.

    Raises:
        FileNotFoundError: the file does not exist.
        DataError: a line is not valid JSON (names file and line; only without ``bad_lines``),
            the path is a directory, or a ``.gz`` file is not gzip. A last line without a
            trailing newline that does not parse is reported as a torn append.
    """

    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path} is a directory; give the path of a JSONL file")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:  # type: ignore[operator]
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    msg = f"not UTF-8 text ({e.reason} at byte {e.start}); re-encode the file as UTF-8"
                    if bad_lines is None:
                        raise DataError(f"{path}:{n}: {msg}") from None
                    bad_lines.append((n, msg))
                    continue
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as e:
                    torn = (
                        ""
                        if line.endswith("\n")
                        else " (the last line has no newline: an interrupted append?)"
                    )
                    msg = f"not valid JSON ({e.msg}){torn}; fix or delete that line"
                    if bad_lines is None:
                        raise DataError(f"{path}:{n}: {msg}") from None
                    bad_lines.append((n, msg))
                    continue
                yield n, value
    except (gzip.BadGzipFile, EOFError) as e:
        raise DataError(
            f"{path}: named .gz but not a valid gzip file ({e}); rename or recompress it"
        ) from None


def repair_torn_tail(path: str | Path) -> int:
    """Cut a partial last line (no trailing newline) left by a killed writer.

    Returns the number of bytes removed (0 when the file ends cleanly or does not exist).
    """
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return 0
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return 0
        keep = data.rfind(b"\n") + 1
        f.truncate(keep)
        return len(data) - keep


class JsonlAppender:
    """Append rows to a JSONL file, one ``os.write`` per row on an ``O_APPEND`` descriptor, then
    ``fsync``: a killed process leaves at most one torn last line, which
    :func:`repair_torn_tail` removes on the next open."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        repair_torn_tail(self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, row: dict) -> None:
        os.write(self._fd, (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "JsonlAppender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _atomic_text(path: Path, write) -> None:
    """``write(file)`` into ``<path>.tmp``, then rename it to ``path``; a failed write removes the
    temporary file and is one line naming ``path`` (:func:`write_failed`)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            write(f)
        os.replace(tmp, path)
    except OSError as e:
        if tmp.parent.is_dir():
            tmp.unlink(missing_ok=True)
        raise write_failed(path, e) from None


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> int:
    """Write rows to ``path`` atomically (temp file + rename). Returns the row count.

    Raises:
        DataError: the write failed (disk full, read-only …): one line naming ``path``; the earlier
            file, if any, is as it was."""
    n = 0

    def write(f):
        nonlocal n
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1

    _atomic_text(Path(path), write)
    return n


def read_json(path: str | Path) -> Any:
    """Read a JSON file; DataError naming the file when it is not UTF-8 JSON."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not readable JSON ({e}); restore it or remove it") from None


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` atomically (temp file + rename); a failed write is one line naming ``path``.

    Raises:
        DataError: the write failed (see :func:`write_jsonl`)."""
    _atomic_text(Path(path), lambda f: f.write(text))


def write_json(path: str | Path, obj: Any) -> None:
    """Write JSON atomically (temp file + rename).

    Raises:
        DataError: the write failed: one line naming ``path`` (see :func:`write_jsonl`)."""
    write_text(path, json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=False) + "\n")


def set_aside(path: str | Path) -> Path:
    """Rename ``path`` to ``<name>.prev-N`` (the first free N) and return the new path: earlier
    results are moved, never deleted or overwritten."""
    path = Path(path)
    n = 1
    while path.with_name(f"{path.name}.prev-{n}").exists():
        n += 1
    dest = path.with_name(f"{path.name}.prev-{n}")
    path.rename(dest)
    return dest


def _set_lineage(
    manifest: dict, name: str, stage: str, sha: str | None, consumed: dict, target: str | None
) -> None:
    """``manifest["lineage"][name]``: written by ``stage``, content hash ``sha`` (None: unfinished),
    from the run-dir files ``consumed`` ({name: hash}) and the target fingerprint ``target``."""
    manifest.setdefault("lineage", {})[name] = {
        "stage": stage,
        "sha256": sha,
        "from": dict(consumed),
        "target": target,
    }


class RunDir:
    """A run directory with its ``manifest.json`` (provenance) and ``report.json`` (numbers).

    Raises:
        DataError: the path (or a parent) is a file.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise DataError(f"run directory {self.path} is a file; choose another run_dir")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except (NotADirectoryError, FileExistsError):
            raise DataError(
                f"cannot create run directory {self.path}: a parent is a file; choose another run_dir"
            ) from None

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def _load(self, name: str) -> dict:
        p = self.path / name
        if not p.exists():
            return {}
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise DataError(
                f"{p}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); {REWRITE[name]}"
            ) from None
        shapes = {"stages": dict, "lineage": dict}
        bad = not isinstance(data, dict) or next(
            (k for k, t in shapes.items() if not isinstance(data.get(k, t()), t)), None
        )
        if bad or (
            name == "manifest.json"
            and any(
                not isinstance(r, dict) or not {"stage", "sha256"} <= set(r)
                for r in data.get("lineage", {}).values()
            )
        ):
            raise DataError(
                f"{p}: not an eagle3kit {name} (a JSON object whose stages and lineage are objects, each "
                f"lineage record with its stage and sha256); {REWRITE[name]}"
            )
        return data

    @property
    def manifest(self) -> dict:
        return self._load("manifest.json")

    @property
    def report(self) -> dict:
        return self._load("report.json")

    def update_manifest(self, **fields: Any) -> dict:
        m = self.manifest
        m.setdefault("eagle3kit_version", __version__)
        m.update(fields)
        write_json(self.path / "manifest.json", m)
        return m

    def record_stage(
        self,
        stage: str,
        inputs: dict,
        counts: dict,
        outputs: dict | None = None,
        consumed: dict | None = None,
        target: str | None = None,
    ) -> None:
        """Record a finished stage: its inputs in the manifest, its counts in the report, and — with
        ``consumed`` ({run-dir file: content hash} of what it read) — the lineage of each of its
        ``outputs`` ({run-dir file: content hash}), made from the target weights fingerprint
        ``target`` (see :mod:`eagle3kit.core.lineage`)."""
        m = self.manifest
        m.setdefault("eagle3kit_version", __version__)
        m.setdefault("stages", {})[stage] = {"inputs": inputs, "outputs": outputs or {}, "counts": counts}
        if consumed is not None:
            for name, sha in (outputs or {}).items():
                _set_lineage(m, name, stage, sha, consumed, target)
        write_json(self.path / "manifest.json", m)
        r = self.report
        r[stage] = dict(counts)
        write_json(self.path / "report.json", r)

    def mark_pending(self, name: str, stage: str, consumed: dict, target: str | None = None) -> None:
        """Record before ``stage`` starts writing ``name`` that it is being written: its lineage
        record has no hash until :meth:`record_stage` completes it, so a stage killed in between
        leaves a file every later stage refuses as unfinished (:func:`eagle3kit.core.lineage.check_inputs`)."""
        m = self.manifest
        m.setdefault("eagle3kit_version", __version__)
        _set_lineage(m, name, stage, None, consumed, target)
        write_json(self.path / "manifest.json", m)

    def drop_stage(self, stage: str) -> None:
        """Forget ``stage``'s record (manifest and report): its output is gone (moved aside and not
        written again)."""
        m = self.manifest
        if m.get("stages", {}).pop(stage, None) is not None:
            write_json(self.path / "manifest.json", m)
        r = self.report
        if r.pop(stage, None) is not None:
            write_json(self.path / "report.json", r)

    def stage_inputs(self, stage: str) -> dict | None:
        return self.manifest.get("stages", {}).get(stage, {}).get("inputs")

    def update_report(self, section: str, values: dict) -> dict:
        r = self.report
        r.setdefault(section, {}).update(values)
        write_json(self.path / "report.json", r)
        return r

    def lock(self, stage: str):
        """Hold ``.<stage>.lock`` while a stage appends to this run, so two processes never write
        the same files (two ``generate`` runs would otherwise each send and append the same rows).
        See :func:`folder_lock`."""
        return folder_lock(self.path, stage, "use another run_dir")

    def require(self, name: str, stage_hint: str) -> Path:
        """Path of a previous stage's output, or a FileNotFoundError naming the stage to run."""
        p = self.path / name
        if not p.exists():
            raise FileNotFoundError(
                f"{p} is missing: run `eagle3kit {stage_hint} --run-dir {self.path}` first"
            )
        return p
