#!/usr/bin/env bash
# The lab's runner on the lent GPU machine (an H100 or H200, through the device tool): set up Taichi from
# the carried wheels and the Vulkan loader from the carried .debs, then run one mode:
#
#   bench            CUDA and Vulkan: one layer per route (GPU busy time: CUPTI on CUDA, for torch SDPA and
#                    llama.cpp's CUDA kernel too, built here from the carried .ggml; graph replays on Vulkan) and
#                    52-layer steps (wall per token), the copy bandwidth in the same processes (BENCH_ARCHS,
#                    BENCH_MODES, BENCH_DEPTHS, BENCH_ROUTES, BENCH_REPEATS, BENCH_TIMEOUT)
#   tests            the suite on CUDA and Vulkan, time-boxed (TEST_WORKERS, TEST_TIMEOUT, TEST_SHARD, TEST_ARGS;
#                    TEST_IDS: a file of node ids; TEST_CONTINUE=1: what no earlier call on this machine reached,
#                    TEST_CONTINUE_FROM: logs of earlier calls to count too; TEST_BUILD_PEER=N: build the llama.cpp
#                    CUDA peer beside the tests on N cores, for a later bench)
#   profile          ncu on one deep NoPE layer's producer: counters and stall reasons with the SASS lines they
#                    sample most (PROFILE_KERNEL: producer or reduce), and a CUPTI trace of a step
#   ab OLD NEW       CUDA layers (CUPTI) and steps on two trees in alternating rounds (AB_ROUNDS), each a folder
#                    made here with `git archive <commit> muser_ti configs pyproject.toml | tar -x -C build/ab_old`
#                    and carried, or "." for this tree
#   tune             the GPU producer's tiles in one process against the float64 reference (scripts/lab/tune_gpu.py
#                    tiles; TUNE_VARIANTS), with ptxas's registers and spills per producer
#   spread           CUDA steps in SPREAD_ROUNDS processes: the host's speed moves between processes
#   launch           the per-layer call from compiled code (muser_ti/layer_launch.py) on CUDA: its tests (the C-API
#                    path against Taichi's Python path bit for bit, the capture refusal, test_token, transformers'
#                    Glimmer on the engine; LAUNCH_TESTS names other files), the host's cost per layer on both
#                    paths against step() (per_layer), and a whole model's decode token against transformers' own
#                    attention over its DynamicCache and StaticCache in bf16 (bench/model_token.py; LAUNCH_CONTEXTS;
#                    TEST_TIMEOUT, PER_LAYER_TIMEOUT and MODEL_TOKEN_TIMEOUT fit them into a call's 10 minutes)
#   batch            many sequences on CUDA: test_batch and transformers' left-padded batch, then the batched step
#                    against torch's SDPA over a bf16 static cache (bench/batch_decode.py; BATCH_SIZES, BATCH_DEPTHS,
#                    BATCH_LAUNCHES: the engine's launch paths, a row each)
#   parts            where each launch path's host time goes on CUDA (scripts/lab/launch_parts.py): one engine's
#                    per-layer token and a batch's step, timed and then profiled with the C calls wrapped
#                    (PARTS_DEPTHS, PARTS_CASES, PARTS_TIMEOUT); then bench/per_layer.py (PER_LAYER_TIMEOUT)
#   model            a model's calls (MODEL_PART: tests, bench, profile or all): the per-layer token's tests and
#                    transformers' Glimmer on the engine on CUDA
#                    (torch CUDA tensors, zero-copy) and Vulkan (host tensors); the host's cost per layer against
#                    step(); the engine against torch's SDPA as a model calls it (MODEL_DEPTHS, MODEL_TESTS)
#
# Carry .whl (taichi 1.7.4 cp312, dill, colorama; pytest-xdist and execnet for tests), .gl (the Vulkan
# loader's .debs) and, for the llama.cpp CUDA peer, .ggml (ggml-python 0.0.45's sdist).
# Results and logs land in $OUT; docs/lab/runs.md is the notebook they go into.
set -uo pipefail
what=${1:-bench}
if [ ! -d /tmp/site/taichi ]; then  # once per machine: later calls on the warm machine reuse it
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts/lab PYTHONUNBUFFERED=1 ENABLE_TAICHI_HEADER_PRINT=0
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"

GGML_CUDA=/tmp/ggml_cuda  # the CUDA build of the pinned ggml's libraries (MUSER_GGML_CUDA_DIR for the bench)
ggml_cuda_build() {  # llama.cpp's CUDA kernel as a peer: the pinned ggml-python's vendored ggml, built for CUDA once a
  # machine (.ggml carried: ggml-python 0.0.45's sdist; ~3 minutes on 16 cores); $1: ninja's jobs
  [ -f .ggml/ggml_python-0.0.45.tar.gz ] || { echo "== no .ggml carried: the llama.cpp CUDA peer is left out"; return 1; }
  [ -f $GGML_CUDA/libggml-cuda.so ] && return 0
  tar xzf .ggml/ggml_python-0.0.45.tar.gz -C /tmp &&
    cmake -S /tmp/ggml_python-0.0.45/vendor/ggml -B /tmp/ggml-build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON > /tmp/ggml-cuda-build.log 2>&1 &&
    ninja -C /tmp/ggml-build -j ${1:-16} ggml-base ggml-cuda >> /tmp/ggml-cuda-build.log 2>&1 &&
    mkdir -p $GGML_CUDA && find /tmp/ggml-build -name 'libggml*.so' -exec cp {} $GGML_CUDA/ \; ||
    { echo "== ggml CUDA build failed"; tail -20 /tmp/ggml-cuda-build.log; return 1; }
}
ggml_cuda() {  # the peer for the bench (built now if no earlier call on this machine built it)
  if [ -f /tmp/ggml-build.pid ]; then  # a build another mode started in the background: wait for it
    while kill -0 "$(cat /tmp/ggml-build.pid)" 2>/dev/null; do sleep 2; done; rm -f /tmp/ggml-build.pid
  fi
  ggml_cuda_build || return
  export MUSER_GGML_CUDA_DIR=$GGML_CUDA LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
  python3 -c "from muser_ti.bench import ggml_cuda_peer; print('== llama.cpp CUDA peer:', ggml_cuda_peer.status())"
}

bench() {  # name, command...: the command's JSON rows, one line each
  local name=$1; shift
  "$@" > "$OUT/$name.log" 2>&1; echo "== $name rc=$?"
  grep -E '^\{' "$OUT/$name.log" | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    peers = "  ".join("%s %.4f ms" % (k[:-3], r[k]) for k in sorted(r) if k.endswith("_ms") and k != "ours_ms")
    print("  %-34s %7d  ours %8.4f ms  %s  %6.0f GB/s" % (r["what"][:34], r["depth"], r["ours_ms"], peers, r["ours_gb_s"]))'
}

case $what in
bench)
  case " ${BENCH_ARCHS-cuda vulkan} " in *" cuda "*) ggml_cuda;; esac
  for arch in ${BENCH_ARCHS-cuda vulkan}; do
    case " ${BENCH_MODES:-layers steps} " in *" layers "*)
      bench $arch-layers timeout ${BENCH_TIMEOUT:-200} python3 scripts/bench.py --arch $arch --mode layers \
        --layer-depths ${BENCH_DEPTHS:-2048,32768,131072} --routes ${BENCH_ROUTES:-interleaved,splitk} \
        --repeats ${BENCH_REPEATS:-15} --json "$OUT/$arch-layers.json";;
    esac
    case " ${BENCH_MODES:-layers steps} " in *" steps "*)  # a cold CUDA step build takes over 150 s
      bench $arch-steps timeout ${BENCH_TIMEOUT:-360} python3 scripts/bench.py --arch $arch --mode steps \
        --step-depths ${BENCH_DEPTHS:-2048,32768,131072} --repeats ${BENCH_REPEATS:-15} --json "$OUT/$arch-steps.json";;
    esac
  done;;

tests)
  if [ -n "${TEST_BUILD_PEER:-}" ] && [ -f .ggml/ggml_python-0.0.45.tar.gz ]; then  # the peer builds beside the tests,
    # on a few cores, in a session of its own so it outlives this call while the machine is warm
    setsid bash -c "$(declare -f ggml_cuda_build); GGML_CUDA=$GGML_CUDA; ggml_cuda_build $TEST_BUILD_PEER" \
      > /tmp/ggml-build.out 2>&1 &
    echo $! > /tmp/ggml-build.pid
  fi
  # -v -rfE: each result lands in the log as it happens, so a call cut by its limit still names its failures.  The
  # limit interrupts (SIGINT) and kills 45 s later: an interrupted pytest prints its summary and each process
  # exits, which is when Taichi writes its offline cache, so the next call on the warm machine loads the kernels
  stop="timeout -s INT -k 45 ${TEST_TIMEOUT:-560}"
  common="-v -rfE --durations=0 --durations-min=5 -p no:cacheprovider -p timebox --arch cuda --arch vulkan"
  suite_logs=/tmp/muser_suite_logs; mkdir -p "$suite_logs"
  if [ -n "${TEST_CONTINUE:-}" ]; then  # the ids no earlier log names (suite_results.py), as this pytest collects them
    shopt -s nullglob
    for f in ${TEST_CONTINUE_FROM:-}; do cp "$f" "$suite_logs/kept-$(basename "$f")" || exit 1; done
    earlier=("$suite_logs"/*); shopt -u nullglob
    [ ${#earlier[@]} -gt 0 ] || { echo "TEST_CONTINUE: no earlier log on this machine or in TEST_CONTINUE_FROM"; exit 1; }
    python3 scripts/lab/suite_results.py "${earlier[@]}" --out "$OUT/before" | tee "$OUT/before.txt"
    [ -s "$OUT/before/unreached.txt" ] || { echo "== TEST_CONTINUE: every collected test has a result"; exit 0; }
    TEST_IDS=$OUT/before/unreached.txt
  fi
  if [ -n "${TEST_IDS:-}" ]; then
    # one plain pytest per part (--only-ids), not xdist, which took node ids as 0 items on the device's image; runs
    # of sorted ids (l/), so a test's cases that share kernels compile them once in one process
    rm -f /tmp/ids_part*; split -n l/${TEST_WORKERS:-8} -d "$TEST_IDS" /tmp/ids_part
    for part in /tmp/ids_part*; do
      $stop python3 -m pytest $common -p no:xdist --only-ids "$part" tests/ > "$part.log" 2>&1 &
    done
    wait; cat /tmp/ids_part*.log > "$OUT/tests.log"
  else
    workers=$([ -n "${TEST_WORKERS:-}" ] && python3 -c "import xdist" 2>/dev/null && echo "-n $TEST_WORKERS")
    $stop python3 -m pytest $common $workers ${TEST_SHARD:+--shard $TEST_SHARD} ${TEST_ARGS:-tests/} > "$OUT/tests.log" 2>&1
  fi
  echo "== tests rc=$?"; cp "$OUT/tests.log" "$suite_logs/run-$(date +%s).log"
  grep -cE " PASSED" "$OUT/tests.log" | sed 's/$/ passed/'; grep -E "FAILED|ERROR" "$OUT/tests.log" | head -40
  tail -4 "$OUT/tests.log";;

profile)
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  metrics=l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum
  timeout 200 "$ncu" --clock-control none -k regex:${PROFILE_KERNEL:-producer} --launch-skip 3 --launch-count 1 \
    --import-source no --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section SourceCounters --metrics "$metrics" -f -o "$OUT/profile" \
    python3 scripts/bench.py --arch cuda --mode layers --layer-depths 131072 --routes interleaved --repeats 2 \
    > "$OUT/profile.log" 2>&1; echo "== ncu rc=$?"
  "$ncu" -i "$OUT/profile.ncu-rep" --page details > "$OUT/profile.txt" 2>&1
  "$ncu" -i "$OUT/profile.ncu-rep" --page raw --csv > "$OUT/profile-raw.csv" 2>&1
  "$ncu" -i "$OUT/profile.ncu-rep" --page source --print-source sass --csv > "$OUT/profile-sass.csv" 2>&1
  rm -f "$OUT/profile.ncu-rep"
  grep -E "^ *(Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Instructions )" "$OUT/profile.txt"
  python3 scripts/lab/stall_report.py "$OUT/profile-raw.csv" "$OUT/profile-sass.csv" | tee "$OUT/stalls.txt"
  timeout 200 python3 scripts/lab/tune_gpu.py trace --depths 2048,131072 --json "$OUT/trace.json" > "$OUT/trace.log" 2>&1
  echo "== trace rc=$?";;

ab)
  old=${2:?ab OLD NEW: two tree folders}; new=${3:?ab OLD NEW: two tree folders}
  for round in $(seq 1 ${AB_ROUNDS:-2}); do
    for side in old new; do
      tree=${!side}
      (cd "$tree" && PYTHONPATH=/tmp/site:$PWD bench "$side-$round-layers" timeout 200 python3 -m muser_ti.cli.bench \
        --arch cuda --mode layers --layer-depths 2048,32768,131072 --routes interleaved --repeats 15)
      (cd "$tree" && PYTHONPATH=/tmp/site:$PWD bench "$side-$round-steps" timeout 300 python3 -m muser_ti.cli.bench \
        --arch cuda --mode steps --step-depths 2048,131072 --repeats 15)
    done
  done;;

tune)
  MUSER_TI_PRINT_ASM=1 timeout ${TUNE_TIMEOUT:-400} python3 scripts/lab/tune_gpu.py tiles --arch ${TUNE_ARCH:-cuda} \
    --depths ${TUNE_DEPTHS:-2048,32768,131072} --variants "${TUNE_VARIANTS:-;block}" --json "$OUT/tune.json" \
    > "$OUT/tune.log" 2>&1; echo "== tune rc=$?"; grep -E '^\{' "$OUT/tune.log" | cut -c1-300
  ptxas=$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)
  for f in taichi_kernel_nvptx_*.ptx; do  # registers and spills of every producer module Taichi printed
    [ -f "$f" ] && grep -aq "\.entry producer" "$f" || continue
    tr -d '\000' < "$f" > /tmp/clean.ptx  # Taichi's printed PTX ends in a NUL, which ptxas reads as a bad EOF
    echo "$f: $("$ptxas" -arch=sm_90 -v /tmp/clean.ptx -o /dev/null 2>&1 | grep -E "registers|spill" | tr '\n' ' ')"
  done;;

spread)  # the first process compiles (a cold CUDA step build takes over 150 s); the rest load Taichi's cache
  bench spread-1 timeout ${SPREAD_FIRST_TIMEOUT:-330} python3 scripts/bench.py --arch cuda --mode steps \
    --step-depths 2048,131072 --repeats 15 --json "$OUT/spread-1.json"
  for round in $(seq 2 ${SPREAD_ROUNDS:-4}); do
    bench spread-$round timeout 80 python3 scripts/bench.py --arch cuda --mode steps --step-depths 2048 --repeats 15 \
      --json "$OUT/spread-$round.json"
  done;;

launch)
  timeout -s INT -k 30 ${TEST_TIMEOUT:-240} python3 -m pytest -n 0 -v -rfE -p no:cacheprovider --arch cuda \
    ${LAUNCH_TESTS:-tests/test_layer_launch.py tests/test_token.py tests/test_transformers_integration.py} \
    > "$OUT/launch-tests.log" 2>&1
  echo "== launch tests rc=$?"; grep -cE " PASSED" "$OUT/launch-tests.log" | sed 's/$/ passed/'
  grep -E "FAILED|ERROR" "$OUT/launch-tests.log" | head -20; tail -3 "$OUT/launch-tests.log"
  timeout ${PER_LAYER_TIMEOUT:-150} python3 -m muser_ti.bench.per_layer --arch cuda --depth 64 --depth 2048 --tokens 20 --json \
    > "$OUT/per_layer_cuda.json" 2> "$OUT/per_layer_cuda.err"; echo "== per_layer cuda rc=$?"
  grep -E '"(depth|step_ms|token_capi_ms|token_python_ms|overhead_capi_us_per_layer|overhead_python_us_per_layer|capi_path)"' \
    "$OUT/per_layer_cuda.json" | tr -d '\n '; echo; tail -2 "$OUT/per_layer_cuda.err"
  for context in ${LAUNCH_CONTEXTS:-2040 32760}; do
    timeout ${MODEL_TOKEN_TIMEOUT:-200} python3 -m muser_ti.bench.model_token --arch cuda --context $context --tokens 20 \
      > "$OUT/model_token_$context.json" 2> "$OUT/model_token_$context.err"
    echo "== model_token $context rc=$?"; cat "$OUT/model_token_$context.json"; tail -3 "$OUT/model_token_$context.err"
  done;;

parts)  # where each launch path's host time goes (launch_parts.py), then the host cost a layer against step()
  for depth in ${PARTS_DEPTHS:-2048 32768}; do
    cases=""; for c in ${PARTS_CASES:-engine:capi engine:python batch:capi:1 batch:python:1 batch:capi:32 batch:python:32}; do
      cases="$cases --case $c"; done
    timeout ${PARTS_TIMEOUT:-240} python3 scripts/lab/launch_parts.py --arch cuda --depth $depth $cases \
      > "$OUT/parts_$depth.txt" 2>&1; echo "== parts $depth rc=$?"; grep -E "^==" "$OUT/parts_$depth.txt"
  done
  timeout ${PER_LAYER_TIMEOUT:-150} python3 -m muser_ti.bench.per_layer --arch cuda --depth 64 --depth 2048 --tokens 20 \
    > "$OUT/per_layer_cuda.txt" 2>&1; echo "== per_layer cuda rc=$?"; tail -4 "$OUT/per_layer_cuda.txt";;

batch)  # many sequences on CUDA: the batch tests (muser_ti/batch.py, transformers' left-padded batch), then the
  # batched step against torch's SDPA over a bf16 static cache (BATCH_SIZES, BATCH_DEPTHS, BATCH_TIMEOUT)
  timeout -s INT -k 30 ${TEST_TIMEOUT:-200} python3 -m pytest -n 0 -v -rfE -p no:cacheprovider --arch cuda \
    ${BATCH_TESTS:-tests/test_batch.py tests/test_transformers_integration.py} \
    -k "${BATCH_K:-test_batch or left_padded or finish_apart or each_row_alone or batch_refusals}" \
    > "$OUT/batch-tests.log" 2>&1
  echo "== batch tests rc=$?"; grep -cE " PASSED" "$OUT/batch-tests.log" | sed 's/$/ passed/'
  grep -E "FAILED|ERROR" "$OUT/batch-tests.log" | head -20; tail -3 "$OUT/batch-tests.log"
  sizes=""; for b in ${BATCH_SIZES:-1 8 32 128}; do sizes="$sizes --batch $b"; done
  depths=""; for d in ${BATCH_DEPTHS:-2048 32768}; do depths="$depths --depth $d"; done
  launches=""; for l in ${BATCH_LAUNCHES:-capi python}; do launches="$launches --launch $l"; done
  timeout ${BATCH_TIMEOUT:-300} python3 -m muser_ti.bench.batch_decode --arch cuda $sizes $depths $launches \
    --tokens 10 \
    > "$OUT/batch_decode_cuda.txt" 2> "$OUT/batch_decode_cuda.err"; echo "== batch_decode cuda rc=$?"
  cat "$OUT/batch_decode_cuda.txt"; tail -3 "$OUT/batch_decode_cuda.err";;

model)  # MODEL_PART: tests | bench | profile | all (a call holds one part within its 10 minutes)
  if [ "${MODEL_PART:-all}" = tests ] || [ "${MODEL_PART:-all}" = all ]; then
    timeout -s INT -k 45 ${TEST_TIMEOUT:-420} python3 -m pytest -v -rfE -p no:cacheprovider --arch cuda --arch vulkan \
      ${MODEL_TESTS:-tests/test_token.py} > "$OUT/model-tests.log" 2>&1
    echo "== model tests rc=$?"; grep -cE " PASSED" "$OUT/model-tests.log" | sed 's/$/ passed/'
    grep -E "FAILED|ERROR" "$OUT/model-tests.log" | head -30; tail -3 "$OUT/model-tests.log"
  fi
  [ "${MODEL_PART:-all}" = tests ] && exit 0
  if [ "${MODEL_PART:-all}" = profile ]; then  # where a per-layer token's host time goes (scripts/lab/layer_profile.py)
    for depth in ${MODEL_DEPTHS:-2048}; do
      timeout 200 python3 scripts/lab/layer_profile.py --depth $depth > "$OUT/layer_profile_$depth.log" 2>&1
      echo "== layer_profile $depth rc=$?"; head -8 "$OUT/layer_profile_$depth.log"
    done
    exit 0
  fi
  for depth in ${MODEL_DEPTHS:-2048 32768}; do
    timeout 150 python3 -m muser_ti.bench.in_model --peer torch --arch cuda --depth $depth --tokens 20 --json \
      > "$OUT/in_model_cuda_$depth.json" 2> "$OUT/in_model_cuda_$depth.err"; echo "== in_model cuda $depth rc=$?"
    grep -E '"(depth|engine_ms|peer_ms|ratio)"' "$OUT/in_model_cuda_$depth.json" | tr -d '\n '; echo
  done
  timeout 240 python3 -m muser_ti.bench.per_layer --arch cuda --depth 64 --depth 2048 --tokens 20 --json \
    > "$OUT/per_layer_cuda.json" 2> "$OUT/per_layer_cuda.err"; echo "== per_layer cuda rc=$?"
  grep -E '"(depth|step_ms|token_capi_ms|token_python_ms|overhead_capi_us_per_layer|overhead_python_us_per_layer)"' \
    "$OUT/per_layer_cuda.json" | tr -d '\n '; echo
  for run in "cuda cuda" "vulkan cpu"; do  # transformers' Glimmer on the engine: CUDA tensors in place; host tensors
    set -- $run
    timeout 200 python3 -m muser_ti.cli.model --layers ${MODEL_LAYERS:-8} --prompt-tokens ${MODEL_PROMPT:-2040} \
      --tokens ${MODEL_TOKENS:-64} --arch $1 --device $2 --json > "$OUT/model_$1.json" 2> "$OUT/model_$1.err"
    echo "== muser-model arch $1 device $2 rc=$?"; tail -3 "$OUT/model_$1.err"
    python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print({k: s[k] for k in ('tokens_per_s','token_ms','attention_ms','attention_share','routes','agreement')})" "$OUT/model_$1.json"
  done;;

*) echo "run.sh: unknown mode $what (bench, tests, profile, ab OLD NEW, tune, spread, model)"; exit 2;;
esac
