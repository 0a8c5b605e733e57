#!/usr/bin/env bash
# benchmarks/serving_gpu.py on a GPU machine whose commands are limited in time (10 minutes a command,
# /tmp kept while the machine stays up), after tools/stage_vllm_gpu.sh staged vLLM there (CONTRIBUTING.md).
# Run from the repository root there.
#
#   bash benchmarks/serving_gpu_device.sh start SHARED [SERVING_GPU OPTIONS]   (carrying SHARED's folder)
#       copies the repository and SHARED to /tmp, starts serving_gpu.py with --work /tmp/sg and those
#       options in its own process session (it outlives the command), then waits like `wait 480`;
#       wheels in .whl (carried too) are installed into /tmp/site first (for --drafters …,specforge:
#       benchmarks/peers/specforge_adapter.py GPU_WHEELS)
#   bash benchmarks/serving_gpu_device.sh shape DATA [SERVING_GPU_SHAPE OPTIONS]   (carrying DATA's folder)
#       the same for serving_gpu_shape.py (the 8B-shaped target; DATA: recipe_shape.py pack's
#       recipe_shape_pack.txt, prompts/ and shapes/llama8b-full), --work /tmp/sgs
#   bash benchmarks/serving_gpu_device.sh scaling SHARED [SCALING_KINDS OPTIONS]   (carrying SHARED's folder)
#       the same for scaling_kinds.py (SHARED also holding data/prompts/humaneval.jsonl.gz), --work /tmp/sk;
#       a pool kept before, .gpudata/pool/pool.jsonl.gz with its pool_provenance.json (carried), is read
#       instead of generated; `wait` also brings the pool back as $OUT/pool.jsonl.gz (up to 16 MiB)
#   bash benchmarks/serving_gpu_device.sh wait [SECONDS] [UNTIL]
#       waits up to SECONDS (default 480) or until the run ends (or, with UNTIL, a file under serving_gpu.py's
#       work folder /tmp/sg such as online/online.json, until it is written), then copies what it has made so far
#       into $OUT/sg.tgz (the results JSON and plot, every record, the logs) and prints the log's tail
#   bash benchmarks/serving_gpu_device.sh readback     what `start` does first: puts carried parts together
#   bash benchmarks/serving_gpu_device.sh keep NAME
#       drafter NAME's trained run (its data stages, the served drafter folder, its report; no checkpoints
#       or other export layouts) into $OUT/run-NAME.tgz.part-NN, 15 MiB each (a file comes back only up to
#       16 MiB; one drafter a call); put them in .gpudata/runs here: a later `start` carrying .gpudata/runs
#       reads that drafter back instead of training it again (on a fresh machine too)
set -uo pipefail
W=${SG_WORK:-/tmp/sg} # SG_WORK: only for the script's own tests
REPO=/tmp/sg-repo
usage() { sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; }
cmd=${1:-}
case "$cmd" in "" | -h | --help) usage; exit 0 ;; esac
shift
snapshot() { # one archive: a command brings back only a few files
  mkdir -p "${OUT:-/tmp}"
  (cd /tmp && tar -czf "${OUT:-/tmp}/sg.tgz" --ignore-failed-read sg-out sg.log \
    $(ls sg/*.json sg/*.log sg/*/trained.json sg/*/config.yaml sg/*/run/report.json sg/*-fault-*/*.json \
      sg/*-fault-*/*.log sg/*-k*/served.txt sg/specforge/run/specforge.log sg/online/*.json sg/online/*.log \
      sg/online/*.txt sg/online/capture.sh 2>/dev/null) \
    $(ls -d sg/*-k*/diagnose sg/*-k*/bench sg/*-k*/*.log sg/*-fault-*/diagnose 2>/dev/null) \
    $(ls sgs/*.json sgs/*.log sgs/rs/*.json sgs/rs/*.log 2>/dev/null) $(ls -d sgs/diagnose sgs/bench 2>/dev/null) \
    $(ls sk/state.json sk/pool_provenance.json sk/n*/*/row.json sk/n*/manifest.json 2>/dev/null))
  if [ -f /tmp/sk/pool.jsonl.gz ] && [ "$(stat -c %s /tmp/sk/pool.jsonl.gz)" -le 16777216 ]; then
    cp /tmp/sk/pool.jsonl.gz /tmp/sk/pool_provenance.json "${OUT:-/tmp}/"
  fi
  grep -aE "^[a-z0-9.]+-(k[0-9]+|fault-[a-z0-9_]+): |^diagnose: |Traceback|Error|wrote " /tmp/sg.log | tail -20
  tail -c 2000 /tmp/sg.log | tr '\r' '\n' | grep -v '^\s*$' | tail -5
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>/dev/null || true
}
running() { [ -f $W.pid ] && kill -0 "$(cat $W.pid)" 2>/dev/null; }
wait_for() { # wait_for SECONDS [UNTIL]
  local end=$(($(date +%s) + ${1:-480})) until=${2:-}
  while running && [ "$(date +%s)" -lt "$end" ]; do
    [ -n "$until" ] && [ -s "$W/$until" ] && [ ! -d "$W/$until" ] && break
    sleep 1
  done
  if [ -n "$until" ] && [ -s "$W/$until" ] && [ ! -d "$W/$until" ]; then
    echo "== $until is there ($(date -u +%H:%M:%S)); the run $(running && echo goes on || echo has ended)"
  else
    running && echo "== still running ($(date -u +%H:%M:%S))" || echo "== finished ($(date -u +%H:%M:%S))"
  fi
  snapshot
}
read_back() { # the trained runs `keep` brought back (carried in .gpudata/runs), unless this machine has them
  local first name tmp
  for first in .gpudata/runs/run-*.tgz.part-00; do
    [ -f "$first" ] || continue
    name=$(basename "$first" .tgz.part-00) && name=${name#run-}
    [ -f "$W/$name/trained.json" ] && continue
    tmp="$W.readback" && rm -rf "$tmp" && mkdir -p "$tmp" "$W" # unpacked aside: a broken archive leaves nothing
    if ! cat .gpudata/runs/run-"$name".tgz.part-* | tar -xz -C "$tmp" ||
      [ ! -f "$tmp/$(basename "$W")/$name/trained.json" ]; then
      rm -rf "$tmp"
      echo "$name: the parts in .gpudata/runs do not make one whole archive (one missing, or left from another" \
        "keep); bring that keep's parts back again" >&2
      return 1
    fi
    rm -rf "${W:?}/$name" && mv "$tmp/$(basename "$W")/$name" "$W/$name" && rm -rf "$tmp" || return 1
    echo "== $name: read back from .gpudata/runs"
  done
}
launch() { # launch COMMAND FOLDER COPY SCRIPT [ARGS]: FOLDER copied to COPY, SCRIPT started in its own session
  local name=$1 folder=$2 copy=$3 script=$4
  shift 4
  running && { echo "$name: a run is going on (pid $(cat $W.pid)); use wait" >&2; exit 2; }
  rm -rf $REPO "$copy" && mkdir -p $REPO /tmp/sg-out &&
    cp -r src benchmarks examples tools tests pyproject.toml $REPO/ && cp -r "$folder" "$copy" || exit 1
  read_back || exit 1
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  fi
  cd $REPO && eval "$(bash tools/stage_vllm_gpu.sh env)"
  setsid nohup python3 "$script" "$@" >/tmp/sg.log 2>&1 </dev/null &
  echo $! >$W.pid
  echo "== started $script $* (pid $!)"
  wait_for 480
}
case "$cmd" in
start)
  shared=${1:?start needs the shared folder (data/prompts, data/chats), e.g. .gpudata/shared}
  shift
  [ -d "$shared/data" ] || { echo "start: $shared has no data/ folder" >&2; exit 2; }
  launch start "$shared" /tmp/sg-shared benchmarks/serving_gpu.py --work $W --shared /tmp/sg-shared \
    --out /tmp/sg-out/serving_gpu.json "$@"
  ;;
shape)
  data=${1:?shape needs the data folder recipe_shape.py pack wrote (prompts/, shapes/llama8b-full)}
  shift
  [ -f "$data/recipe_shape_pack.txt" ] || { echo "shape: $data is not a folder recipe_shape.py pack wrote" >&2; exit 2; }
  launch shape "$data" /tmp/sgs-data benchmarks/serving_gpu_shape.py --data /tmp/sgs-data --work /tmp/sgs \
    --out /tmp/sg-out/serving_gpu_8b_shape.json "$@"
  ;;
readback)
  read_back
  ;;
keep)
  name=${1:-}
  [ -n "$name" ] || { echo "keep: name the drafter, e.g. keep eagle3.1 ($(ls $W 2>/dev/null | tr '\n' ' '))" >&2; exit 2; }
  [[ "$name" =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] || { echo "keep: '$name' is not a drafter's name (letters, digits, . _ -)" >&2; exit 2; }
  [ -f "$W/$name/trained.json" ] || { echo "keep: no trained drafter $name under $W" >&2; exit 2; }
  mkdir -p "${OUT:-/tmp}" && rm -f "${OUT:-/tmp}/run-$name.tgz.part-"*
  tar -cz -C "$(dirname "$W")" --exclude=checkpoints --exclude='checkpoints.*' --exclude=tensorboard \
    --exclude='online-buffer' --exclude='online-consumed' --exclude='drafter-*' "$(basename "$W")/$name" |
    split -b 15m -d -a 2 - "${OUT:-/tmp}/run-$name.tgz.part-" || exit 1
  n=$(ls "${OUT:-/tmp}/run-$name.tgz.part-"* | wc -l)
  if [ "$n" -gt 4 ]; then # a call brings back at most 64 MiB, and carries at most 64 MiB with the repository
    rm -f "${OUT:-/tmp}/run-$name.tgz.part-"*
    echo "keep: $name's run is $n parts of 15 MiB, more than one command brings back (64 MiB): not kept" >&2
    exit 1
  fi
  echo "run-$name.tgz: $n part(s), $(du -cm "${OUT:-/tmp}/run-$name.tgz.part-"* | tail -1 | cut -f1) MB"
  ;;
scaling)
  shared=${1:?scaling needs the shared folder (data/prompts, data/chats), e.g. .gpudata/shared}
  shift
  [ -f "$shared/data/prompts/humaneval.jsonl.gz" ] ||
    { echo "scaling: $shared has no data/prompts/humaneval.jsonl.gz" >&2; exit 2; }
  pool=()
  [ -f .gpudata/pool/pool.jsonl.gz ] && pool=(--pool "$PWD/.gpudata/pool/pool.jsonl.gz")
  launch scaling "$shared" /tmp/sg-shared benchmarks/scaling_kinds.py --work /tmp/sk --shared /tmp/sg-shared \
    --results /tmp/sg-out/scaling_kinds "${pool[@]}" "$@"
  ;;
wait)
  [[ "${1:-480}" =~ ^[0-9]+$ ]] || { echo "wait: SECONDS must be a whole number of seconds, got '$1'" >&2; exit 2; }
  if [ -n "${2:-}" ] && { [[ "$2" == /* ]] || [[ "$2" == *..* ]]; }; then
    echo "wait: UNTIL is a path under the work folder $W, such as online/online.json, got '$2'" >&2
    exit 2
  fi
  wait_for "${1:-480}" "${2:-}"
  ;;
*)
  echo "serving_gpu_device.sh: unknown command $cmd (start, shape, scaling, wait, keep or readback)" >&2
  exit 2
  ;;
esac
