"""SpecForge 0.2.0's EAGLE-3 drafter for benchmarks/serving_gpu.py (``--drafters …,specforge``): its offline
trainer on the recipe run's training split, tokens, draft vocabulary and target states — benchmarks/variants.py's
``specforge`` row (benchmarks/peers/specforge_run.py), its own settings but those that must match (TTT 7, 12
epochs, the learning rate, about 8,192 tokens an optimizer step) — then:

* ``<run>/specforge-export/``: SpecForge's own export (``specforge.export.to_hf``), the folder its users hand
  to vLLM, and the one vLLM serves in the row;
* ``<run>/drafter/``: eagle3kit's import of that export (``eagle3kit import``), the same weights, which
  ``diagnose`` and the simulated τ read.

Needs ``specforge==0.2.0`` and its needs importable (``SPECFORGE_PATH``, else the folder on ``PYTHONPATH``
holding ``specforge/``; benchmarks/peers/specforge_adapter.py ``GPU_WHEELS`` lists what the GPU image lacks)
and a GPU: SpecForge's fused loss is a triton kernel.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

SERVED = "specforge-export"  # under the run folder: what vLLM serves


def specforge_path() -> str:
    """The folder holding the ``specforge`` package: ``SPECFORGE_PATH``, else the first ``sys.path`` entry
    that holds it.

    Raises:
        SystemExit: none found, naming what to install."""
    if os.environ.get("SPECFORGE_PATH"):
        return os.environ["SPECFORGE_PATH"]
    for p in sys.path:
        if p and (Path(p) / "specforge" / "__init__.py").is_file():
            return p
    raise SystemExit(
        "--drafters names specforge, but no specforge package is importable: pip install --no-deps "
        "specforge==0.2.0 (and benchmarks/peers/specforge_adapter.py GPU_WHEELS) into a folder on PYTHONPATH, "
        "or set SPECFORGE_PATH"
    )


def train_specforge(args, run: Path, done: Path) -> Path:
    """SpecForge's drafter trained in ``run`` (a copy of the first drafter's data stages, its config.yaml
    written): ``run/specforge-export`` and ``run/drafter`` as the module docstring says; ``done`` (the row's
    ``trained.json``) written last with the training's seconds and tokens/s and τ at K 3 simulated on the
    recipe's evaluate sets (80 MT-bench first turns and the last 80 GSM8K-train questions, the target's 256
    greedy tokens; benchmarks/common.py ``heldout_tau``). Returns ``run``.

    Raises:
        SystemExit: no specforge package (:func:`specforge_path`), or SpecForge's trainer failed (its log
            named)."""
    from common import heldout_tau, open_run
    from peers.specforge_run import train_specforge as train_peer

    os.environ["SPECFORGE_PATH"] = specforge_path()
    t0 = time.time()
    shim = SimpleNamespace(work=str(run.parent), shared=args.shared, eval={}, parallel=1)
    got = train_peer(shim, "specforge:0", run, heldout_tau, lambda _path: open_run(str(run)), (3,))
    (run / "export").rename(run / SERVED)
    sets = {s: (got["tau"] or {}).get(s, {}).get("k3") for s in ("mt_bench", "gsm8k_heldout")}
    keep = ("train_seconds", "tokens_per_s_wall", "tokens_per_s_steady", "train_samples", "import_layout")
    done.write_text(
        json.dumps(
            {
                "seconds": round(time.time() - t0, 1),
                "evaluate": sets,
                "evaluate_note": "simulated τ at K 3 on the recipe's evaluate sets (benchmarks/common.py heldout_tau)",
                "specforge": {k: got.get(k) for k in keep},
            }
        )
        + "\n"
    )
    return run


def served_folder(run: Path) -> Path:
    """The folder vLLM serves for a drafter's run: SpecForge's own export for its row, else eagle3kit's."""
    return run / SERVED if (run / SERVED / "config.json").is_file() else run / "drafter"


def served_note(d: Path) -> str | None:
    """What ``d/served.txt`` says was served (None for records made before it was written)."""
    f = d / "served.txt"
    return f.read_text().strip() if f.exists() else None


def start_drafter_server(server, args, target: Path, d: Path, spec_cfg: dict, run: Path):
    """The drafter's server (``server(args, target, log, spec_cfg)`` makes one), started (up to 900 s);
    ``d/served.txt`` says which folder it serves. A folder other than eagle3kit's (SpecForge's own export)
    that vLLM refuses is replaced by eagle3kit's import of it, and ``served.txt`` says so, naming the
    refused start's log.

    Raises:
        RuntimeError: eagle3kit's folder did not start either (its log named)."""
    d.mkdir(parents=True, exist_ok=True)
    log = d.parent / f"{d.name}.log"
    spec = server(args, target, log, spec_cfg)
    try:
        spec.start(900)
        (d / "served.txt").write_text(f"{spec_cfg['model']}\n")
        return spec
    except RuntimeError:
        spec.kill()
        if Path(spec_cfg["model"]) == run / "drafter":
            raise
    refused = log.rename(log.with_name(f"{d.name}-refused.log"))
    spec_cfg = {**spec_cfg, "model": str(run / "drafter")}
    spec = server(args, target, log, spec_cfg)
    try:
        spec.start(900)
    except RuntimeError:
        spec.kill()
        raise
    (d / "served.txt").write_text(f"{spec_cfg['model']} (vLLM refused {run / SERVED}: {refused})\n")
    return spec
