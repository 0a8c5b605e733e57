"""`eagle3kit run` under torchrun, as the GPU recipes launch it, on a tiny target on the CPU (gloo):
two processes on one node run each stage that is not distributed once (rank 0, generating with vLLM's
CPU build in its own process, whose process group is gone before training's) and train together;
two "nodes" (two torchrun agents over a localhost c10d rendezvous, one process each) train, one node
dies after 5 steps, and the relaunch resumes to the uninterrupted run's loss at every step. Each launch is
a real ``python -m torch.distributed.run … -m eagle3kit run -c CONFIG``."""

import json
import os
import subprocess
import sys

import pytest
from conftest import GSM8K

from eagle3kit.core.config import load_config
from eagle3kit.core.engines import free_port
from eagle3kit.core.rundir import read_jsonl
from eagle3kit.pipeline import run_all

CONFIG = """run_dir: {run}
target: {{model: {target}, dtype: float32, device: cpu}}
prompts: {{sources: [{{path: {gsm8k}, stop: 24}}], heldout_fraction: 0.25}}
generate: {{backend: {backend}, max_new_tokens: 16, batch_size: 8}}
vocab: {{draft_vocab_size: 256}}
train: {{epochs: 2, ttt_steps: 2, tokens_per_step: 64, checkpoint_every: 3, device: cpu, lr: 0.003}}
evaluate: {{k: 2, max_new_tokens: 16}}
"""
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _config(d, target, backend: str = "transformers"):
    d.mkdir(parents=True, exist_ok=True)
    (d / "c.yaml").write_text(CONFIG.format(run=d / "run", target=target, gsm8k=GSM8K, backend=backend))
    return d / "c.yaml"


@pytest.fixture(scope="module")
def vllm_target(tmp_path_factory, smollm2_tokenizer):
    """A tiny Llama with head size 64 (one vLLM's CPU build runs) and SmolLM2's tokenizer."""
    from conftest import build_tiny_llama

    d = tmp_path_factory.mktemp("tiny-vllm")
    m = build_tiny_llama(8, hidden_size=128, intermediate_size=256, num_attention_heads=2, head_dim=64)
    m.generation_config.eos_token_id = 2
    m.save_pretrained(d)
    smollm2_tokenizer.save_pretrained(d)
    return d


def _env(stop_after: int = 0) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    env.pop("EAGLE3KIT_STOP_AFTER_STEPS", None)
    if stop_after:
        env["EAGLE3KIT_STOP_AFTER_STEPS"] = str(stop_after)
    return env


def _losses(run) -> list[float]:
    return [r["loss"] for _, r in read_jsonl(run / "train_log.jsonl")]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, vllm_target):
    """`torchrun --standalone --nproc-per-node 2 -m eagle3kit run -c c.yaml` (generate.backend vllm: rank 0
    runs an in-process engine), and the same config in one process (eagle3kit.pipeline.run_all), with
    transformers generating, for the report's sections."""
    d = tmp_path_factory.mktemp("torchrun")
    cfg = _config(d / "two", vllm_target, "vllm")
    res = subprocess.run(
        [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "eagle3kit", "run", "-c", str(cfg)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    single = run_all(load_config(_config(d / "one", vllm_target)))
    return {"run": d / "two" / "run", "res": res, "single": single}


def test_torchrun_runs_each_data_stage_once_trains_on_both_processes_and_reports_as_one(two_processes):
    res, run = two_processes["res"], two_processes["run"]
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    prompts = [r["id"] for _, r in read_jsonl(run / "prompts.jsonl")]
    convs = [r["id"] for _, r in read_jsonl(run / "conversations.jsonl")]
    assert len(prompts) == 18 and sorted(convs) == sorted(prompts)  # 24 − 6 held out, each generated once
    assert len(list(read_jsonl(run / "heldout.jsonl"))) == 6
    out = res.stdout + res.stderr  # the progress lines are on stderr, the summary table on stdout
    assert out.count("eagle3kit run →") == 1 and out.count("generate (vllm)") == 1  # rank 0's stages
    assert "train: world size 2 (DDP on cpu)" in out
    assert out.count("eagle3kit run: ") == 1 and out.count("evaluate heldout: τ") == 1  # one summary
    report = json.loads((run / "report.json").read_text())
    assert report["train"]["processes"] == 2 and report["run"]["processes"] == 2
    assert set(report) == set(two_processes["single"])  # the same sections as a run in one process
    assert report["generate"]["generated"] == 18 and report["prompts"]["rows_kept"] == 18
    # the steps of an epoch: each process trains half the samples, so half the single run's steps
    assert len(_losses(run)) < len(_losses(run.parent.parent / "one" / "run"))
    assert (run / "drafter" / "model.safetensors").exists() and (run / "drafter-speculators").is_dir()


def _two_nodes(
    how: list[str], port: int, stop_after_on_node1: int = 0, how_node1: list[str] | None = None
) -> list[subprocess.CompletedProcess]:
    """Two torchrun agents (`--nnodes 2 --nproc-per-node 1`) over a c10d rendezvous on localhost,
    each running `eagle3kit run` with ``how`` (`-c CONFIG`, or `--run-dir RUN`: the run's own config;
    ``how_node1``: node 1's instead)."""
    procs = [
        subprocess.Popen(
            [
                *TORCHRUN,
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(node),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                f"eagle3kit-{port}",
                "-m",
                "eagle3kit",
                "run",
                *(how_node1 if node == 1 and how_node1 is not None else how),
            ],
            env=_env(stop_after_on_node1 if node == 1 else 0),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def test_two_nodes_train_one_dies_and_the_relaunch_resumes_to_the_uninterrupted_loss_curve(
    two_processes, tmp_path, vllm_target
):
    cfg = _config(tmp_path, vllm_target, "vllm")  # the same data as the uninterrupted run's
    died = _two_nodes(["-c", str(cfg)], free_port(), stop_after_on_node1=5)
    assert all(p.returncode != 0 for p in died), [p.stderr[-2000:] for p in died]
    assert "stopped after 5 steps" in died[1].stderr
    # rank 0 took 5 steps (checkpoint at step 3); the steps it logged after the checkpoint may be lost
    # with it when torchrun stops the surviving node, and the resume writes them again
    assert 3 <= len(_losses(tmp_path / "run")) <= 5
    again = _two_nodes(["--run-dir", str(tmp_path / "run")], free_port())  # relaunched by its run folder
    assert all(p.returncode == 0 for p in again), [p.stdout[-2000:] + p.stderr[-2000:] for p in again]
    both = again[0].stderr + again[1].stderr
    assert "resuming at epoch 1 of 2, step 3 of" in both and "vocab: up to date" in both
    assert "waiting for rank 0's prompts" in both  # the node whose process is not rank 0
    whole = _losses(two_processes["run"])
    assert _losses(tmp_path / "run") == pytest.approx(whole, rel=1e-6, abs=1e-7)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["train"]["processes"] == 2 and "evaluate" in report


def test_ranks_launched_with_other_configs_stop_before_any_stage_naming_the_keys(tmp_path, vllm_target):
    """Two nodes given configs that differ in train.lr (0.003 and 0.03): every rank stops before the first
    stage, naming the key and both values (they would have trained different replicas and exited 0, with
    config.yaml recording rank 0's alone)."""
    c0 = _config(tmp_path / "a", vllm_target)
    c1 = tmp_path / "b.yaml"
    c1.write_text(c0.read_text().replace("lr: 0.003", "lr: 0.03"))
    res = _two_nodes(["-c", str(c0)], free_port(), how_node1=["-c", str(c1)])
    said = " ".join((res[0].stdout + res[0].stderr + res[1].stdout + res[1].stderr).split())
    assert all(r.returncode != 0 for r in res), said[-2000:]
    assert "was launched with another config than rank 0 (train.lr: 0.0" in said
    assert ("0.003 on rank 0, 0.03 on rank 1" in said) or ("0.03 on rank 0, 0.003 on rank 1" in said)
    assert not (tmp_path / "a" / "run" / "prompts.jsonl").exists()
