"""Lineage: every stage output in a run directory knows exactly what it was built from.

One rule for all stages. When a stage writes a file into the run directory it records
(:meth:`RunDir.record_stage <eagle3kit.core.rundir.RunDir.record_stage>` with ``consumed``), in
``manifest.json`` under ``lineage``, the file's content hash, the stage that wrote it, the content
hashes of the run-directory files it consumed and the fingerprint of the target weights it used
(never the target's path)::

    "lineage": {"tokens.safetensors": {"stage": "tokenize", "sha256": "…",
                                       "from": {"conversations.jsonl": "…"}, "target": null}, …}

Before a stage does any work it calls :func:`check_inputs` on the files it will read. Each file is
checked against the chain above it, to the top:

* the file is what its stage wrote (a file edited, replaced or left half-written by a killed stage
  after its record names that stage to rerun);
* every file it was built from is still the one it was built from (``vocab.safetensors`` built from
  other tokens than today's ``tokens.safetensors`` names ``vocab``);
* it was made from the target weights the stage now uses, where both are known (weights replaced
  in place at the same path name ``generate``).

A file without a record (brought by the user, or written by an eagle3kit without lineage) is
taken as it is. Hashes are those of :mod:`eagle3kit.core.rundir`: a safetensors file's content
(:func:`~eagle3kit.core.rundir.sha256_tensors`), any other file's bytes
(:func:`~eagle3kit.core.rundir.sha256_file`).
"""

from __future__ import annotations

from pathlib import Path

from eagle3kit.core.rundir import DataError, RunDir, sha256_file, sha256_tensors

#: outputs their stage only appends to (a rerun keeps what is there)
APPEND_ONLY = {"conversations.jsonl"}


#: the command that rebuilds each stage's outputs
RERUN = {
    "prompts": "prompts",
    "generate": "generate",
    "tokenize": "tokenize",
    "vocab": "vocab",
    "train": "train",
    "export": "export",
}


class StaleInput(DataError):
    """A stage's input no longer matches what it was built from; the message names the file, what
    changed and the stage to rerun."""


def content_hash(path: str | Path) -> str:
    """The hash lineage records for ``path``: tensor content for ``.safetensors``, bytes otherwise.

    Raises:
        FileNotFoundError: the file does not exist.
    """
    path = Path(path)
    return sha256_tensors(path) if path.suffix == ".safetensors" else sha256_file(path)


def check_inputs(run: RunDir, stage: str, names: list[str], target: str | None = None) -> dict[str, str]:
    """Verify the run-directory files ``names`` that ``stage`` is about to read against their
    lineage (see the module), to the top of the chain; ``target`` is the fingerprint of the weights
    ``stage`` uses (None: not checked). Files that do not exist are skipped (the stage names them
    itself).

    Returns:
        {name: content hash} of the files checked, for the stage to record as what it consumed.

    Raises:
        StaleInput: naming the stale file, what it no longer matches and the stage to rerun.
    """
    lineage = run.manifest.get("lineage", {})
    hashes: dict[str, str] = {}
    done: set[str] = set()

    def current(name: str) -> str:
        if name not in hashes:
            hashes[name] = content_hash(run / name)
        return hashes[name]

    def visit(name: str) -> None:
        """Check ``name``'s chain, the earliest stage first (that is the one to rerun first)."""
        if name in done or not (run / name).exists():
            return
        done.add(name)
        rec = lineage.get(name)
        if rec is None:
            current(name)
            return
        for up in rec.get("from", {}):
            visit(up)
        redo = f"`eagle3kit {RERUN.get(rec['stage'], rec['stage'])} --run-dir {run.path}`"
        then = "" if stage == rec["stage"] else f", then `eagle3kit {stage}`"
        if rec["sha256"] is None:
            raise StaleInput(
                f"{run / name} is unfinished: `eagle3kit {rec['stage']}` was stopped while writing it; "
                f"rerun {redo} to finish it{then}"
            )
        if current(name) != rec["sha256"]:
            # generate only appends: a rerun would keep the changed rows, so the file must go first
            how, fix = (
                (
                    "edited, replaced, or cut short",
                    f"restore it, or move it away and rerun {redo} to generate every row anew",
                )
                if name in APPEND_ONLY
                else ("edited, replaced, or left by an interrupted run", f"rerun {redo}")
            )
            raise StaleInput(
                f"{run / name} changed after `eagle3kit {rec['stage']}` wrote it ({how}); {fix}{then}, or "
                "start a new run_dir with the file you want"
            )
        for up, sha in rec.get("from", {}).items():
            if (run / up).exists() and current(up) != sha:
                raise StaleInput(
                    f"{run / name} was built by `eagle3kit {rec['stage']}` from another {up} than the one in "
                    f"{run.path} now; rerun {redo}{then}"
                )
        if target and rec.get("target") and rec["target"] != target:
            raise StaleInput(
                f"{run / name} was made by `eagle3kit {rec['stage']}` with other target weights (fingerprint "
                f"{rec['target'][:12]}…) than the target has now ({target[:12]}…): its weights or config.json were "
                "replaced. "
                "Start a new run_dir for these weights (data from two models must not be mixed)"
            )

    for name in names:
        visit(name)
    return {name: hashes[name] for name in names if name in hashes}
