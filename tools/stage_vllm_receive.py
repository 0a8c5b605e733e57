"""One part of a tools/stage_vllm_gpu.py staging received on the GPU machine (called by
tools/stage_vllm_gpu.sh receive): the part is named by its SHA-256 in its manifest (so a folder's name
does not matter, and a part damaged in transfer is refused at once); a part of another staging (another
archive) drops the parts, wheels and times of the earlier one; once every part is there the archive is
unpacked into ``STAGE/wheels``.

    python3 tools/stage_vllm_receive.py PART_DIR STAGE

Exit 0 with "complete" as the last line once the wheels are unpacked, 0 with "waiting" before; 2 with a
message naming the part and the fix for a folder without its files, an unreadable manifest or a part
that matches no entry of its manifest.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while b := fh.read(1 << 20):
            h.update(b)
    return h.hexdigest()


def fail(msg: str) -> None:
    print(msg, file=sys.stderr)
    raise SystemExit(2)


def receive(part_dir: Path, stage: Path) -> bool:
    """Keep the part in ``stage/parts`` as ``pN.part``; True once all are there and unpacked."""
    part, mpath = part_dir / "stage.part", part_dir / "manifest.json"
    if not (part.is_file() and mpath.is_file()):
        fail(f"{part_dir}: no stage.part and manifest.json there (was it in carry?)")
    try:
        m = json.loads(mpath.read_text())
        archive, parts = m["archive_sha256"], [p["sha256"] for p in m["parts"]]
    except (ValueError, KeyError, TypeError) as e:
        fail(f"{mpath}: not a manifest stage_vllm_gpu.py wrote ({e}); carry the part folder again")
    got = sha256(part)
    if got not in parts:
        fail(
            f"{part}: its SHA-256 matches no part of its manifest (damaged in transfer?); carry {part_dir} again"
        )
    n = parts.index(got) + 1
    held = stage / "manifest.json"
    if held.is_file() and json.loads(held.read_text()).get("archive_sha256") != archive:
        print("a part of another staging: the earlier staging's parts and wheels are dropped")
        for old in ("parts", "wheels", "t_first", "staged_seconds", "install_seconds"):
            shutil.rmtree(stage / old, ignore_errors=True) if (stage / old).is_dir() else (
                stage / old
            ).unlink(missing_ok=True)
    (stage / "parts").mkdir(parents=True, exist_ok=True)
    if not (stage / "t_first").exists():
        (stage / "t_first").write_text(f"{time.time()}\n")
    shutil.copyfile(part, stage / "parts" / f"p{n}.part")
    held.write_text(mpath.read_text())
    here = sorted(int(p.stem[1:]) for p in (stage / "parts").glob("p*.part"))
    missing = [f"p{i}" for i in range(1, len(parts) + 1) if i not in here]
    print(f"part p{n} of {len(parts)} kept; still to come: {', '.join(missing) or 'none'}")
    if missing:
        return False
    t0 = time.time()
    shutil.rmtree(stage / "wheels", ignore_errors=True)
    (stage / "wheels").mkdir()
    files = [str(stage / "parts" / f"p{i}.part") for i in range(1, len(parts) + 1)]
    cat = subprocess.Popen(["cat", *files], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-C", str(stage / "wheels"), "-xJf", "-"], stdin=cat.stdout, check=True)
    print(f"unpacked {len(m.get('wheels', []))} wheels in {time.time() - t0:.0f} s")
    return True


if __name__ == "__main__":
    if len(sys.argv) != 3:
        fail("usage: stage_vllm_receive.py PART_DIR STAGE")
    print("complete" if receive(Path(sys.argv[1]), Path(sys.argv[2])) else "waiting")
