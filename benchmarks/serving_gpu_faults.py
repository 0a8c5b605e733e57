"""The planted integration faults served on a GPU (``serving_gpu.py --faults``): does ``eagle3kit diagnose``
name each fault when the server is vLLM on a GPU in bf16, as it does against vLLM's CPU build?

For each drafter named in ``--faults`` (trained by serving_gpu.py's first stage), copies of its exported
folder with one fault written in — for an EAGLE drafter the aux ids one layer later, d2t removed, fc
removed, norm_before_residual flipped (:func:`eagle3kit.diagnose.faults.plant_in_folder`); for a DFlash
drafter every target layer id one later and the mask token set to 0
(:func:`eagle3kit.drafters.dflash.faults.plant_dflash_in_folder`) — each served alone at K 3 and diagnosed by the
CLI given the drafter as trained, on the bench prompts sent one at a time. Then ``eagle3kit bench --compare``
of the first two drafters' bench records at the smallest K. Records kept in ``<work>/<drafter>-fault-<name>/``
and read back on a rerun; the results JSON is written after every fault."""

from __future__ import annotations

import json
import time
from pathlib import Path

EAGLE_FAULTS = ("aux_ids_plus_1", "d2t_missing", "fc_missing", "norm_before_residual")
DFLASH_FAULTS = ("target_layer_ids_plus_1", "mask_token:0")
FAULT_K = 3


def faults_of(drafter: Path) -> tuple[str, ...]:
    """The faults planted for the exported folder ``drafter``: DFlash's for a DFlash folder (either layout;
    the plants write vLLM's ``dflash_config``), else EAGLE's."""
    from eagle3kit.drafters.dflash.folder import is_dflash_folder

    return DFLASH_FAULTS if is_dflash_folder(drafter) else EAGLE_FAULTS


def plant(drafter: Path, out: Path, fault: str) -> Path:
    """``out`` holding ``drafter`` with ``fault`` written in. A copy is planted beside ``out`` and renamed into
    it, so ``out`` is either whole or absent; a whole one is kept on a rerun, a leftover partial copy replaced."""
    import shutil

    from eagle3kit.diagnose.faults import plant_in_folder
    from eagle3kit.drafters.dflash.faults import plant_dflash_in_folder

    if out.is_dir() and (out / "config.json").exists():
        return out
    part = out.with_name(out.name + ".partial")
    shutil.rmtree(part, ignore_errors=True)
    planter = plant_dflash_in_folder if fault in DFLASH_FAULTS else plant_in_folder
    planter(drafter, part, fault)
    shutil.rmtree(out, ignore_errors=True)  # a killed run's partial copy
    part.rename(out)
    return out


def summary(served: str, fault: str, code: int | None, rep: dict, seconds: float | None) -> dict:
    """One row: what ``diagnose`` said of the server with ``fault`` planted; ``named``: the fault diagnose
    named first, or its verdict when it named none (``agree``, ``unexplained``)."""
    named = rep.get("verdict")
    if named == "fault":  # the finding starts with the fault's name, a colon and its fix (mask_token:0: ...)
        names = [x["name"] for x in rep.get("hypotheses", []) if rep["finding"].startswith(x["name"] + ":")]
        named = max(names, key=len) if names else rep["finding"].split(":")[0]
    h = next((x for x in rep.get("hypotheses", []) if x["name"] == named), None)
    return {
        "drafter": served,
        "fault": fault,
        "exit_code": code,
        "verdict": rep.get("verdict"),
        "named": named,
        "correct": named == fault,
        "tau_engine": (rep.get("engine") or {}).get("tau"),
        "tau_as_trained": (rep.get("reference") or {}).get("tau"),
        "tau_named_fault": h["tau"] if h else None,
        "k": rep.get("k"),
        "prompts": (rep.get("prompts") or {}).get("count"),
        "seconds": seconds,
    }


def diagnose_faults(
    args, runs: dict, prompts: Path, serve, diagnose, methods: dict, on_row=None
) -> list[dict]:
    """Every planted fault of every drafter in ``args.fault_list`` served alone on the GPU and diagnosed
    (see the module); ``on_row(rows so far)`` after each. Diagnose's exit 1 (a fault named) is expected.
    ``serve(args, target, log, speculative_config)``: an unstarted server; ``diagnose(args, url, drafter,
    prompts, folder)``: the CLI's diagnose into ``folder/diagnose``, its exit code; ``methods``: drafter name →
    vLLM's speculative method."""
    import shutil

    from common import read_json_object

    from eagle3kit.core.config import TargetConfig
    from eagle3kit.core.rundir import write_text
    from eagle3kit.model.target import load_target
    from eagle3kit.model.target_export import export_fp32_folder

    work, rows, target = Path(args.work), [], None
    for name in args.fault_list:
        drafter = runs[name] / "drafter"
        for fault in faults_of(drafter):
            d = work / f"{name}-fault-{fault.replace(':', '_')}"
            rep_path, meta = d / "diagnose" / "diagnose.json", d / "exit.json"
            if not (rep_path.exists() and meta.exists()):
                d.mkdir(parents=True, exist_ok=True)
                # a report left by a killed run is not this one
                shutil.rmtree(d / "diagnose", ignore_errors=True)
                folder = plant(drafter, d / "folder", fault)
                if target is None:
                    target = export_fp32_folder(load_target(TargetConfig(), device="cpu"))
                spec = {"method": methods[name], "model": str(folder), "num_speculative_tokens": FAULT_K}
                srv, t0 = serve(args, target, d / "server.log", spec), time.time()
                try:
                    srv.start(900)
                    code = diagnose(args, srv.url, drafter, prompts, d)
                finally:
                    srv.kill()
                if code not in (0, 1) or not rep_path.exists():  # 0: agree, 1: a fault named
                    raise SystemExit(f"diagnose against {d.name} exited {code}: see {d / 'diagnose.log'}")
                write_text(
                    meta, json.dumps({"exit_code": code, "seconds": round(time.time() - t0, 1)}) + "\n"
                )
            m = read_json_object(meta, f"delete {d} to diagnose that fault again")
            rows.append(summary(name, fault, m["exit_code"], json.loads(rep_path.read_text()), m["seconds"]))
            r = rows[-1]
            print(
                f"{d.name}: {r['verdict']} ({r['named']}), τ engine {r['tau_engine']}, exit {r['exit_code']}",
                flush=True,
            )
            if on_row is not None:
                on_row(rows)
    return rows


def compare_benches(args, cli) -> dict | None:
    """``eagle3kit bench --compare A B`` of the first two drafters' bench records at the smallest K (None
    when fewer than two exist): its exit code and printed table, kept in ``<work>/compare.log``;
    ``cli(args_list, log)`` runs ``eagle3kit`` and returns its exit code."""
    work, k = Path(args.work), min(args.k_list)
    recs = [work / f"{n}-k{k}" / "bench" / "bench.json" for n in args.drafter_list]
    recs = [r for r in recs if r.exists()][:2]
    if len(recs) < 2:
        return None
    log = work / "compare.log"
    code = cli(["bench", "--compare", str(recs[0]), str(recs[1])], log)
    return {
        "a": recs[0].parent.parent.name,
        "b": recs[1].parent.parent.name,
        "exit_code": code,
        "output": log.read_text(),
    }


def print_faults(rows: list[dict]) -> None:
    """The faults' table."""
    print(
        "| drafter | planted | verdict (named) | correct | τ vLLM | τ as trained | τ named fault | exit | s |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        cells = [r["drafter"], r["fault"], f"{r['verdict']} ({r['named']})", r["correct"], r["tau_engine"]]
        cells += [r["tau_as_trained"], r["tau_named_fault"], r["exit_code"], r["seconds"]]
        print("| " + " | ".join(map(str, cells)) + " |")
