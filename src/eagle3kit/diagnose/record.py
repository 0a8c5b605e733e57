"""The engine record diagnose keeps (engine.json: the server's answers, token ids and counters) and reads
back for --replay: written atomically, read with every field checked, answers checked against the
target's vocabulary."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from eagle3kit.core.config import ConfigError
from eagle3kit.diagnose.engine import EngineError, EngineRun, check_answer


class DiagnoseError(ConfigError):
    """Bad input to ``diagnose`` (exit 2): the message names the thing and the fix."""


ENGINE_RECORD = "engine.json"


def write_engine_record(out: Path, report: dict, rows: list[dict], run: EngineRun) -> None:
    """``out/engine.json``: the server, the prompts as sent, the template check and every prompt's ids,
    output ids and counter deltas — what ``diagnose --replay`` reads to diagnose the same answers on
    another machine (written whole under a temporary name, then renamed)."""
    rec = {
        "server": {**report["server"], "engine": report["server"]["engine"]},
        "prompts": report["prompts"],
        "max_tokens": report["max_tokens"],
        "template": report["template"],
        "rows": rows,
        "run": asdict(run),
    }
    tmp = out / (ENGINE_RECORD + ".tmp")
    tmp.write_text(json.dumps(rec) + "\n")
    os.replace(tmp, out / ENGINE_RECORD)


def read_engine_record(path: str | Path) -> dict:
    """The record :func:`write_engine_record` wrote (``path``: the folder or the file), checked as a live
    run's answers are: one prompt, output and counter entry each, whole numbers, counters that add up
    (accepted ≤ draft tokens, accepted at a position ≤ drafts), something drafted, an engine diagnose
    knows (:func:`check_record_answers` adds the output checks that need the target's vocabulary).

    Raises:
        DiagnoseError: no folder or record there, or one that is malformed or could not come from a server."""
    p = Path(path)
    if not p.exists():
        raise DiagnoseError(
            f"--replay {path} does not exist; give the --out folder of a diagnose run against the server"
        )
    p = p / ENGINE_RECORD if p.is_dir() else p
    if not p.is_file():
        raise DiagnoseError(
            f"--replay {path}: no diagnose engine record there (no {ENGINE_RECORD}); give the --out folder of a "
            "diagnose run against the server"
        )
    try:
        rec = json.loads(p.read_text())
        run, srv = rec["run"], rec["server"]
        srv["url"], srv["model"], srv["engine"], rec["rows"], rec["max_tokens"], rec["template"]["mismatch"]
        EngineRun(**run)
        for d in run["per_prompt"]:  # JSON keys are text: the positions back to numbers, in order
            d["per_position"] = {int(k): int(v) for k, v in (d.get("per_position") or {}).items()}
            for k in ("drafts", "draft_tokens", "accepted"):
                d[k] = int(d[k])
        run["prompt_ids"] = [[int(t) for t in ids] for ids in run["prompt_ids"]]
        run["outputs"] = [[int(t) for t in out] for out in run["outputs"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise DiagnoseError(
            f"--replay {path}: the record is not one diagnose wrote ({type(e).__name__}: {e}); give the --out "
            "folder of a diagnose run against the server"
        ) from None
    problem = _record_problem(rec)
    if problem:
        raise DiagnoseError(f"--replay {path}: the record cannot be diagnosed: {problem}")
    return rec


def _record_problem(rec: dict) -> str | None:
    """What makes a record impossible for a server to have answered, or None."""
    run, n = rec["run"], len(rec["rows"])
    if rec["server"]["engine"] not in ("vllm", "sglang"):
        return f"its engine is {rec['server']['engine']!r}; diagnose reads vLLM's and SGLang's counters only"
    if not (len(run["prompt_ids"]) == len(run["outputs"]) == len(run["per_prompt"]) == n > 0):
        return (
            f"it holds {n} prompts, {len(run['prompt_ids'])} prompt ids, {len(run['outputs'])} outputs and "
            f"{len(run['per_prompt'])} counter entries: one each per prompt, at least one"
        )
    for i, d in enumerate(run["per_prompt"]):
        over = max(d["per_position"].values(), default=0) > d["drafts"]
        if (
            d["accepted"] > d["draft_tokens"]
            or over
            or min(d["drafts"], d["draft_tokens"], d["accepted"]) < 0
        ):
            return f"prompt {i + 1}'s counters do not add up ({d}): more accepted than drafted, or below zero"
    if not sum(d["drafts"] for d in run["per_prompt"]):
        return "the engine drafted nothing in the recorded run (it served without speculative decoding)"
    return None


def check_record_answers(rec: dict, vocab_size: int) -> None:
    """The live run's output checks on a record (:func:`~eagle3kit.diagnose.engine.check_answer`): no empty
    output, ids inside the target's vocabulary.

    Raises:
        DiagnoseError: naming the prompt and what is wrong."""
    run = rec["run"]
    for i, (ids, out, d) in enumerate(zip(run["prompt_ids"], run["outputs"], run["per_prompt"])):
        try:
            check_answer(rec["server"]["url"], i, ids, out, d, vocab_size)
        except EngineError as e:
            raise DiagnoseError(f"the recorded answers cannot be diagnosed with this target: {e}") from None
