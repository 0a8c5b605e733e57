"""Colocated online training for benchmarks/serving_gpu.py (``--online``): the first drafter trained again on
the same data, its states sent by a vLLM capture server on the same GPU as the trainer, as docs/online.md
describes it for a user: ``eagle3kit capture-server -c CONFIG --engine-model FOLDER --vllm-args
'--gpu-memory-utilization S'`` prints the server's command, which runs in the background, and ``eagle3kit run``
trains with ``train.online_from`` set to that server (the data stages copied from the offline run, so both
train on the same samples in the same order), then exports and evaluates.

Beside the offline run of the same drafter (the target in the trainer's process, its states computed once and
cached on the GPU): training tokens/s (wall: the train stage; steady: optimizer steps after the first three),
the time spent waiting for states, τ at K 3 on the recipe's evaluate sets, final loss, and model FLOP
utilisation:

    MFU = (6 · P_drafter · S + 2 · P_target · f) × tokens/s ÷ R

P: matmul parameters (2-D weights, embeddings excluded, a tied lm_head counted once); S: TTT steps (the
drafter's forward and backward at every step); f: how often the target runs over a trained token — 1 online
(the server prefills every sample again each epoch), 1 / epochs offline (states computed once, cached);
attention FLOPs left out (the same in both rows); R: the bf16 matmul rate measured on the card in the same
run (benchmarks/train_throughput.py ``matmul_rate``). Kept in ``<work>/online/`` (``online.json`` marks it
done; a rerun reads it back).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

KEEP_OUT = ("checkpoints", "drafter*", "evaluate", "tensorboard", "train_log.jsonl", "online-*")


def matmul_params(folder: Path) -> int:
    """Matmul parameters of a model folder's safetensors: every 2-D tensor but embeddings, plus the lm_head
    when the config ties it to the embedding (counted once: it runs once a token).

    Raises:
        FileNotFoundError: no ``*.safetensors`` in ``folder``."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors to count parameters in")
    n, has_head = 0, False
    for f in files:
        with safe_open(str(f), "pt") as fh:
            for key in fh.keys():
                shape = fh.get_slice(key).get_shape()
                if len(shape) == 2 and "embed" not in key:
                    n += shape[0] * shape[1]
                    has_head |= "lm_head" in key
    cfg = json.loads((Path(folder) / "config.json").read_text())
    if not has_head and cfg.get("tie_word_embeddings"):
        n += int(cfg["vocab_size"]) * int(cfg["hidden_size"])
    return n


def start_capture_server(args, cfg_path: Path, port: int, folder: Path, work: Path):
    """The capture server as a user starts it: ``capture-server`` prints the command into ``capture.sh``,
    and ``sh capture.sh`` runs as a :class:`~eagle3kit.core.engines.VLLMServer` (its own process group,
    log ``capture-server.log``); returns the server once it answers ``/version`` (``kill()`` stops it).

    Raises:
        SystemExit: capture-server refused the config, or the server exited or was not up in 900 s."""
    from eagle3kit.core.engines import VLLMServer

    class CaptureServer(VLLMServer):
        def spawn(self) -> None:  # capture-server's printed command, not VLLMServer's own
            log = open(self.log_path, "a")
            self.proc = subprocess.Popen(["sh", str(work / "capture.sh")], stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip
            log.close()

    vargs = "" if args.smoke else f"--gpu-memory-utilization {args.gpu_share} --max-model-len 2048"
    cmd = [sys.executable, "-m", "eagle3kit", "capture-server", "-c", str(cfg_path), "--port", str(port)]
    cmd += ["--engine-model", str(folder), "--vllm-args", vargs]
    got = subprocess.run(cmd, capture_output=True, text=True)
    (work / "capture-server.txt").write_text(got.stderr + got.stdout)
    if got.returncode:
        raise SystemExit(f"capture-server exited {got.returncode}: see {work / 'capture-server.txt'}")
    (work / "capture.sh").write_text(got.stdout)
    server = CaptureServer(folder, port, work / "capture-server.log")
    try:
        return server.start(900)
    except RuntimeError as e:
        server.kill()
        raise SystemExit(f"the capture server: {e}") from None


def summary(report: dict) -> dict:
    """A run's training speed, loss and evaluate τ from its report.json."""
    tr, ev = report.get("train") or {}, (report.get("evaluate") or {}).get("sets") or {}
    return {
        "train_stage_s": (tr.get("seconds") or {}).get("stage"),
        "tokens_per_s_wall": tr.get("tokens_per_s_wall"),
        "tokens_per_s_steady": tr.get("tokens_per_s_steady"),
        "final_loss": tr.get("final_loss"),
        "best_val_tau": tr.get("best_val_tau"),
        "epochs": tr.get("epochs"),
        "ttt_steps": tr.get("ttt_steps"),
        "tau_k3": {s: (v or {}).get("tau") for s, v in ev.items()},
        "online": tr.get("online"),
    }


def mfu(rows: dict, p_drafter: int, p_target: int, rate: float | None) -> dict:
    """MFU of each row at its steady and wall tokens/s (module docstring's formula); None without a rate."""
    out = {"p_drafter": p_drafter, "p_target": p_target, "matmul_rate_flops": rate}
    for name, r in rows.items():
        s, e = r["ttt_steps"] or 1, r["epochs"] or 1
        per_token = 6 * p_drafter * s + 2 * p_target * (1.0 if name == "online" else 1.0 / e)
        out[name] = {
            "flops_per_token": per_token,
            **{
                k: (
                    round(per_token * r[f"tokens_per_s_{k}"] / rate, 5)
                    if rate and r[f"tokens_per_s_{k}"]
                    else None
                )
                for k in ("steady", "wall")
            },  # fmt: skip
        }
    return out


def colocated(args, first_run: Path, target_folder: Path, cli) -> dict:
    """The online row (module docstring) for the first drafter's offline run ``first_run``; ``target_folder``:
    the safetensors folder vLLM serves; ``cli(args_list, log)`` runs ``eagle3kit``. Returns the record, also
    written to ``<work>/online/online.json``.

    Raises:
        SystemExit: the capture server did not start, or the online run failed (its log named)."""
    import yaml

    from eagle3kit.core.engines import free_port

    work = Path(args.work) / "online"
    done = work / "online.json"
    if done.exists():
        return json.loads(done.read_text())
    run = work / "run"
    if not (run / "tokens.safetensors").exists():
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(first_run, run, ignore=shutil.ignore_patterns(*KEEP_OUT))
    cfg = yaml.safe_load((first_run.parent / "config.yaml").read_text())
    port = free_port()
    cfg["run_dir"] = str(run.resolve())
    cfg["train"]["online_from"] = [f"http://127.0.0.1:{port}"]
    cfg_path = work / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    t0 = time.time()
    server = start_capture_server(args, cfg_path, port, target_folder, work)
    up = time.time() - t0
    try:
        code = cli(["run", "-c", str(cfg_path)], work / "run.log")
    finally:
        server.kill()
    if code:
        raise SystemExit(
            f"the online run exited {code}: see {work / 'run.log'} and {work / 'capture-server.log'}"
        )
    rows = {
        "offline": summary(json.loads((first_run / "report.json").read_text())),
        "online": summary(json.loads((run / "report.json").read_text())),
    }
    rate = None
    import torch

    if torch.cuda.is_available():
        from train_throughput import matmul_rate

        rate = matmul_rate(torch.device("cuda"))
    rec = {
        "drafter": cfg["drafter"].get("variant"),
        "capture_server": {
            "gpu_share": None if args.smoke else args.gpu_share,
            "start_s": round(up, 1),
            "command": (work / "capture.sh").read_text().strip(),
        },  # fmt: skip
        "rows": rows,
        "mfu": mfu(rows, matmul_params(first_run / "drafter"), matmul_params(target_folder), rate),
        "seconds": round(time.time() - t0, 1),
    }
    from eagle3kit.core.rundir import write_text

    write_text(done, json.dumps(rec, indent=1) + "\n")  # atomic: `wait … online/online.json` reads it whole
    return rec
