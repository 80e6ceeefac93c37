#!/usr/bin/env bash
# One call on the lent H200 (the device tool): set up Taichi from the carried wheel and the Vulkan
# loader from the carried .debs, then run what $1 asks:
#   bench  CUDA + Vulkan benchmarks (layers: GPU busy time from CUPTI on CUDA, graph replays on Vulkan; steps:
#          wall time), and the workgroup-cap A/B (BENCH_ARCHS, BENCH_MODES, BENCH_CAPS: "" skips the A/B;
#          BENCH_STEP_TIMEOUT: a cold CUDA step build took over 150 s in run 27)
#   quick  CUDA layers and steps, Vulkan steps (after a kernel change)
#   tests  the parametrised suite on CUDA and Vulkan (TEST_WORKERS, TEST_SHARD, TEST_ARGS, TEST_TIMEOUT; TEST_IDS: a
#          file of node ids, run in TEST_WORKERS processes, such as a cut call's unreached tests; TEST_CONTINUE=1:
#          the tests no earlier call reached, by this warm machine's logs and the kept ones TEST_CONTINUE_FROM names)
#   steps  the 52-layer step on CUDA and Vulkan
#   final  the suite on both backends, CUDA layers, steps on both backends
#   figures  quick, then Vulkan tile variants by wall time (TUNE_VARIANTS)
#   kernel after a producer change: CUDA layers at two workgroup targets, and ncu on one deep layer
#   tune   tile variants of the GPU producer in one process, with ptxas -v on each (scripts/tune_gpu.py; TUNE_TIMEOUT)
#   vktune tile variants of the GPU producer on Vulkan (NVIDIA's driver) in one process, by wall time and by
#          graph replays (TUNE_VARIANTS, TUNE_DEPTHS, TUNE_TIMEOUT, TUNE_GRAPH; TUNE_CUDA: the same on CUDA)
#   vkab   after a change to Vulkan's per-token host path: what reading the flags back costs (tune_gpu.py
#          readback) on both backends, then Vulkan steps (VKAB_DEPTHS) on $AB_OLD and this tree, VKAB_ROUNDS
#          rounds in alternation
#   vkwait what a Vulkan wait costs under the guest's idle states held off (/dev/cpu_dma_latency = 0) and under the
#          driver's yield settings (__GL_YIELD): readback per way, one process each; tune_gpu.py wake; then Vulkan
#          steps (VKWAIT_WAYS, VKWAIT_ROUNDS, VKWAIT_STEP_WAY, VKWAIT_DEPTHS, VKWAIT_TIMEOUT; PACK_OUT=1: it writes
#          more than 8 files)
#   ncu    ncu's counters on one NoPE layer at 131,072 keys
#   stalls ncu's stall reasons for that layer's producer (or STALLS_KERNEL), and its SASS lines by stall samples
#   hoststep  where a 52-layer step's wall time goes on CUDA and Vulkan; Vulkan tile variants by wall time
#   trace  a CUDA step's timeline through torch.profiler (kernels, gaps, driver calls) and its Python time
#   cudaab CUDA steps on the tree in $AB_OLD and on this one
#   launch what one Taichi dispatch costs the host on CUDA and Vulkan (scripts/tune_gpu.py launch)
#   stepbits  where the one-dispatch step's bits and the graph route's part: partials or output, per class and
#          layer (scripts/step_bits.py; STEPBITS_ARCHS, STEPBITS_ARGS, STEPBITS_TIMEOUT)
#   paths  the one-dispatch step against the graph route, one process per backend (tune_gpu.py paths; PATHS_WHICH,
#          PATHS_ARCHS, PATHS_DEPTHS, PATHS_TIMEOUT)
#   hostab steps and one deep layer on this tree and on the tree in $AB_OLD (an older commit), the
#          trace on this one, then Vulkan steps on both
#   warpab the warp-tiled producer (default) against the block tile (MUSER_GPU_TILE=WT=0): accuracy and
#          registers (tune), CUDA layers (CUPTI) in alternation, ncu on one deep layer of each
#   check  the suite on CUDA, stopping at the first failure (CHECK_TESTS, CHECK_TIMEOUT; MUSER_GPU_TILE=WU=1
#          there unless CHECK_TILE says otherwise: the warp tile's unrolled CUDA build compiles ~50 s a producer)
#   layers CUDA layers (CUPTI) at LAYER_DEPTHS on LAYER_ROUTES
#   deep   CUDA layers (CUPTI) and CUDA steps at the issue's depths, with short timeouts
#   pyhost after a host-side change: CUDA steps at 2,048 and 131,072 keys on this tree, at 2,048 on $AB_OLD,
#          at 2,048 on this tree again, then the host's parts (tune_gpu.py stephost)
#   hostalt CUDA steps at 2,048 keys on this tree and $AB_OLD in alternating rounds (HOSTALT_ROUNDS), then
#          the host's parts (tune_gpu.py stephost)
#   tileab tile variants (tune), then CUDA layers (CUPTI) per MUSER_GPU_TILE in TILEAB_TILES, alternating rounds
#   kernelhost after a change to the step kernel's arguments: steps on the default build, then this tree
#          against $AB_OLD at 2,048 keys in alternating rounds, both with a fast-compiling tile (KH_TILE)
#   spread CUDA steps on the default build in SPREAD_ROUNDS processes (the first at 2,048 and 131,072 keys, with
#          time to compile; the rest at 2,048 keys), so a figure is seen across processes and hosts' speeds
#   storeab  stall profiles (ncu) of the default tile and of STOREAB_TILE, tile variants (tune) between them
#   treeab CUDA layers (CUPTI) on each tree in AB_TREES (":"-separated, "." this one), AB_ROUNDS rounds in alternation
#   kernelab  after a kernel change: CUDA layers (CUPTI) on $AB_OLD and this tree, twice in alternation,
#          ncu on one deep layer on both, and the PTX's plane loads on this tree (AB_NCU=0: the layers only)
# Results and logs land in $OUT.  Carry: .whl (taichi 1.7.4 cp312, dill, colorama; pytest-xdist and execnet for
# `tests` in parallel) and .gl (libvulkan1...).
set -uo pipefail
what=${1:-bench}
pack_out=${PACK_OUT:-}; export PACK_OUT=  # only the outermost call packs (modes call this script again)
if [ ! -d /tmp/site/taichi ]; then  # once per machine: later calls in the same command reuse it
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
bench() {  # name, extra env..., args...
  local name=$1; shift
  env "$@" > "$OUT/$name.log" 2>&1; echo "== $name rc=$?"; grep -E '^\{' "$OUT/$name.log" | python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    print("  %-28s %7d nwg=%-5s ours %8.3f ms  torch %7.4f ms  %6.0f GB/s  floor %.4f ms%s" % (r["what"][:28], r["depth"],
          r.get("workgroups", "-"), r["ours_ms"], r.get("torch_ms", 0), r["ours_gb_s"], r.get("byte_floor_ms", 0),
          "  device I/O %.3f ms" % r["device_io_ms"] if "device_io_ms" in r else "") +
          ("  tasks (us) " + " ".join("%s %.1f" % (k, v * 1e3) for k, v in r["tasks_ms"].items()) if "tasks_ms" in r else "") +
          ("  kernels (us) " + " ".join("%s %.1f" % (k[:28], v) for k, v in r["kernel_us"].items()) if "kernel_us" in r else ""))'
}
if [ "$what" = bench ]; then  # all of it takes ~900 s of limits: split it over calls with BENCH_ARCHS/MODES/CAPS
  for arch in ${BENCH_ARCHS-cuda vulkan}; do  # BENCH_ARCHS="": none (":-" would read it as unset)
    case " ${BENCH_MODES:-layers steps} " in *" layers "*)
    bench $arch-layers timeout 200 python3 scripts/bench.py --arch $arch --mode layers \
      --layer-depths 2048,8192,32768,131072 --routes interleaved,splitk --repeats 15 --json "$OUT/$arch-layers.json";; esac
    case " ${BENCH_MODES:-layers steps} " in *" steps "*)
    bench $arch-steps timeout ${BENCH_STEP_TIMEOUT:-360} python3 scripts/bench.py --arch $arch --mode steps --step-depths 2048,32768,131072 \
      --repeats 15 --json "$OUT/$arch-steps.json";; esac
  done
  # one NoPE layer has 2 pairs (KV heads): 64 is the chapter's cap (nwg = 32 a pair), 264 the default (132),
  # 2112 GPU_MAX_WORKGROUPS (1,024).  Up to run 26 this list began at 1: the chapter's cap only while the first
  # kernel floored nwg at 32 a pair; since the tiled producer (e808ab1, runs 5-6) it gives nwg = 1
  for target in ${BENCH_CAPS-64 264 2112}; do
    bench cap-$target MUSER_GPU_TARGET_WORKGROUPS=$target timeout 100 python3 scripts/bench.py \
      --arch cuda --mode layers --layer-depths 32768,131072 --routes interleaved --repeats 15 --json "$OUT/cap-$target.json"
  done
fi
if [ "$what" = quick ]; then  # CUDA layers and steps, Vulkan steps: the figures a kernel change moves
  bench cuda-layers timeout 150 python3 scripts/bench.py --arch cuda --mode layers \
    --layer-depths 2048,8192,32768,131072 --routes interleaved,splitk --repeats 15 --json "$OUT/cuda-layers.json"
  # 120 s each cut both on a cold machine in run 31 (a cold CUDA step build alone takes over 150 s, run 27)
  bench cuda-steps timeout 220 python3 scripts/bench.py --arch cuda --mode steps --step-depths 2048,32768,131072 \
    --repeats 15 --json "$OUT/cuda-steps.json"
  bench vulkan-steps timeout 200 python3 scripts/bench.py --arch vulkan --mode steps --step-depths 2048,32768,131072 \
    --repeats 15 --json "$OUT/vulkan-steps.json"
fi
ncu_layer() {  # name, tree (default: this one): ncu on one interleaved layer at 131,072 keys (one producer launch).
  # Run from the tree: bench.py puts its own tree first on sys.path, so PYTHONPATH alone does not pick one
  local ncu; ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  (cd "${2:-.}" && PYTHONPATH=/tmp/site:$PWD timeout 150 "$ncu" --clock-control none -k regex:producer --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section InstructionStats python3 scripts/bench.py --arch cuda --mode layers --layer-depths 131072 \
    --routes interleaved --repeats 2 > "$OUT/ncu-$1.txt" 2>&1); echo "== ncu $1 rc=$? (1: bench.py's CUPTI clashes with ncu after the profiled launch)"
  grep -E "^ *(Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Instructions |Local Memory Spilling Requests |Block Limit (Registers|Shared))" "$OUT/ncu-$1.txt"
}
if [ "$what" = kernel ]; then  # after a producer change: workgroup targets on CUDA layers, and ncu
  for target in 264 528; do
    bench layers-wg$target MUSER_GPU_TARGET_WORKGROUPS=$target timeout 150 python3 \
      scripts/bench.py --arch cuda --mode layers --layer-depths 2048,32768,131072 --routes interleaved,splitk \
      --repeats 15 --json "$OUT/layers-wg$target.json"
  done
  ncu_layer producer
fi
if [ "$what" = final ]; then  # the suite on both backends, then the steps on both (rows for docs/PERF.md)
  timeout 250 python3 -m pytest -q -p no:cacheprovider --arch cuda --arch vulkan tests/ 2>&1 | tail -4
  bench cuda-layers timeout 80 python3 scripts/bench.py --arch cuda --mode layers \
    --layer-depths 2048,8192,32768,131072 --routes interleaved,splitk --repeats 15 --json "$OUT/cuda-layers.json"
  bench cuda-steps timeout 90 python3 scripts/bench.py --arch cuda --mode steps --step-depths 2048,32768,131072 \
    --repeats 15 --json "$OUT/cuda-steps.json"
  bench vulkan-steps timeout 120 python3 scripts/bench.py --arch vulkan --mode steps --step-depths 2048,32768,131072 \
    --repeats 15 --json "$OUT/vulkan-steps.json"
fi
if [ "$what" = figures ]; then  # quick's rows, then the Vulkan tile check by wall time (TUNE_VARIANTS)
  bash "$0" quick
  timeout 120 python3 scripts/tune_gpu.py tiles --arch vulkan --depths 2048,131072 --variants "${TUNE_VARIANTS:-;T=256,PF=0}" \
    --json "$OUT/tune-vulkan.json" > "$OUT/tune-vulkan.log" 2>&1
  echo "== tune vulkan rc=$?"; grep -E '^\{' "$OUT/tune-vulkan.log" | cut -c1-300
fi
if [ "$what" = steps ]; then  # the 52-layer step on both backends (after a split-geometry change)
  bench cuda-steps timeout 90 python3 scripts/bench.py --arch cuda --mode steps --step-depths 2048,32768,131072 \
    --repeats 15 --json "$OUT/cuda-steps.json"
  bench vulkan-steps timeout 150 python3 scripts/bench.py --arch vulkan --mode steps --step-depths 2048,32768,131072 \
    --repeats 15 --json "$OUT/vulkan-steps.json"
fi
tree_bench() {  # tree, tag, name, extra env..., args...: bench on that tree as <tag>-<name> (@JSON@: its JSON path)
  local tree=$1 tag=$2 name=$3; shift 3
  (cd "$tree" && export PYTHONPATH=/tmp/site:$PWD && bench "$tag-$name" "${@//@JSON@/$OUT/$tag-$name.json}")
}
ab_bench() {  # name, extra env..., args...: bench on the tree in $AB_OLD as old-<name>, then on this one as new-<name>
  local name=$1; shift
  tree_bench "$AB_OLD" old "$name" "$@"
  tree_bench . new "$name" "$@"
}
AB_STEPS="timeout 150 python3 scripts/bench.py --arch cuda --mode steps --step-depths 2048,131072 --repeats 15 --json @JSON@"
if [ "$what" = cudaab ]; then  # CUDA steps on the tree in $AB_OLD, then on this one, in one call
  ab_bench cuda-steps $AB_STEPS
fi
if [ "$what" = tests ]; then  # TEST_WORKERS=15: that many processes (pytest-xdist and execnet carried in .whl;
  # compiles dominate: run 15's 15 processes reached 1,095 of 1,099 tests in 530 s with the CUDA unroll)
  workers=$([ -n "${TEST_WORKERS:-}" ] && python3 -c "import xdist" 2>/dev/null && echo "-n $TEST_WORKERS")
  # -v -rfE: each result line lands in the log as it happens, so a run cut by its limit still names its failures
  # TEST_SHARD=1/2, then 2/2 in a second call: the suite in two halves of whole files (tests/conftest.py --shard)
  # The limit interrupts (SIGINT), then kills 45 s later: an interrupted pytest still prints its summary and the
  # durations, and each process exits, which is when Taichi writes its offline cache (a killed one writes none,
  # run 28), so a later call on the warm machine loads the kernels this one compiled instead of compiling them
  # again (~50 s an x8-unrolled CUDA producer, run 14; pyhost below relies on the same)
  stop="timeout -s INT -k 45 ${TEST_TIMEOUT:-560}"
  durations="--durations=0 --durations-min=${TEST_DURATIONS_MIN:-5}"
  # Each call's log stays on the machine while it is warm, so the next call can go on where this one was cut
  # without a round trip here (the machine goes back after 30 s idle, and a fresh one costs ~100 s to start)
  suite_logs=/tmp/muser_suite_logs; mkdir -p "$suite_logs"
  if [ -n "${TEST_CONTINUE:-}" ]; then  # ids from scripts/suite_results.py over the logs, collected here, so they
    # are this pytest's ids; TEST_CONTINUE_FROM: kept logs of the same kernels, e.g. docs/perf/h200/run30/*.log.gz.
    # They join the machine's logs as they are (suite_results.py reads .gz), so a chained call that names none still
    # counts them (a first try at run 31 did not, and ran 1,186 tests again that run 30 had reached).  One glob, so
    # kept-* sorts before this machine's run-* and a later log wins
    shopt -s nullglob
    for f in ${TEST_CONTINUE_FROM:-}; do cp "$f" "$suite_logs/kept-$(echo "$f" | tr '/' '_')" || exit 1; done
    earlier=("$suite_logs"/*); shopt -u nullglob
    if [ ${#earlier[@]} = 0 ]; then
      echo "TEST_CONTINUE: no earlier tests log (a fresh machine, and TEST_CONTINUE_FROM names none)"; exit 1
    fi
    python3 scripts/suite_results.py "${earlier[@]}" --out "$OUT/before" > "$OUT/before.txt" 2>&1; cat "$OUT/before.txt"
    [ -f "$OUT/before/unreached.txt" ] || exit 1
    [ -s "$OUT/before/unreached.txt" ] || { echo "== TEST_CONTINUE: every collected test has a result"; exit 0; }
    TEST_IDS=$OUT/before/unreached.txt
  fi
  if [ -n "${TEST_IDS:-}" ]; then  # a file of node ids (a cut call's unreached tests): TEST_WORKERS processes, each
    # pytest alone on its share (conftest --only-ids).  Not xdist: on the H200's image (pytest 9.1.1, xdist 3.8.0 and
    # its other plugins) xdist ran node-id arguments as 0 items and --only-ids into an INTERNALERROR (run 28);
    # both worked here with the same xdist
    # l/: runs of sorted ids, so a test's cases that share kernels compile them once in one process.  Round robin
    # (r/) spread them and every process compiled them all: run 31 reached 50 of 111 ids in ~500 s that way, a
    # call on l/ the session before 86 of the same 111 (cold H100s both)
    rm -f /tmp/ids_part*; split -n l/${TEST_WORKERS:-8} -d "$TEST_IDS" /tmp/ids_part
    for part in /tmp/ids_part*; do
      $stop python3 -m pytest -v -rfE $durations -p no:cacheprovider -p no:xdist --arch cuda --arch vulkan \
        --only-ids "$part" tests/ > "$part.log" 2>&1 &
    done
    wait; cat /tmp/ids_part*.log > "$OUT/tests.log"; echo "== tests (TEST_IDS, one process a part) done"
  else
    $stop python3 -m pytest -v -rfE $durations -p no:cacheprovider $workers --arch cuda --arch vulkan \
      ${TEST_SHARD:+--shard $TEST_SHARD} ${TEST_ARGS:-tests/} > "$OUT/tests.log" 2>&1; echo "== tests rc=$?"
  fi
  cp "$OUT/tests.log" "$suite_logs/run-$(date +%s).log"  # sorts after kept-*
  grep -cE " PASSED" "$OUT/tests.log" | sed 's/$/ passed so far/'; grep -E "FAILED|ERROR" "$OUT/tests.log" | head -40; tail -4 "$OUT/tests.log"
fi
ptx_report() {  # registers and spills of every producer module Taichi printed (MUSER_TI_PRINT_ASM=1)
  local ptxas; ptxas=$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)
  for f in taichi_kernel_nvptx_*.ptx; do
    grep -aq "\.entry producer" "$f" || continue
    echo "$f $(grep -m1 -o '\.maxntid [0-9, ]*' "$f") $(grep -m1 -o '\.minnctapersm [0-9]*' "$f")"
    tr -d '\000' < "$f" > /tmp/clean.ptx  # Taichi's printed PTX ends in a NUL, which ptxas reads as a bad EOF
    "$ptxas" -arch=sm_90 -v /tmp/clean.ptx -o /dev/null 2>&1 | grep -E "registers|spill" | sed 's/^/    /'
    cp "$f" "$OUT/"
  done
}
if [ "$what" = tune ]; then  # tile variants of the GPU producer in one process (scripts/tune_gpu.py), with ptxas -v
  variants=${TUNE_VARIANTS:-";PF=0;T=256;T=256,PF=0;HB=8;DC=32"}
  MUSER_TI_PRINT_ASM=1 MUSER_TI_KERNEL_PROFILER=1 timeout ${TUNE_TIMEOUT:-400} python3 scripts/tune_gpu.py tiles --arch cuda \
    --depths ${TUNE_DEPTHS:-2048,32768,131072} --variants "$variants" --json "$OUT/tune-cuda.json" > "$OUT/tune-cuda.log" 2>&1
  echo "== tune cuda rc=$?"; grep -E '^\{' "$OUT/tune-cuda.log" | python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    print("  %-22s %7d dev %8.1f us wall %8.1f us err %.1e same-bits %s compile %ss %s" % (r["variant"], r["depth"],
          r.get("device_us", 0), r.get("wall_us", 0), r.get("rel_err", -1), r.get("bits_as_default"), r.get("first_launch_s"), r.get("error", "")))'
  ptx_report
fi
tile_rows() {  # tune_gpu.py tiles rows: wall and graph-replay times
  grep -E '^\{' "$1" | python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    print("  %-24s %7d wall %8.1f graph %8.1f us err %.1e same-bits %s compile %ss nwg %s %s" % (r["variant"],
          r["depth"], r.get("wall_us", 0), r.get("graph_us", 0), r.get("rel_err", -1), r.get("bits_as_default"),
          r.get("first_launch_s"), r.get("workgroups"), r.get("error", "")))'
}
if [ "$what" = vktune ]; then  # the warp tile's knobs on SPIR-V, each variant's layer timed two ways
  timeout ${TUNE_TIMEOUT:-400} python3 scripts/tune_gpu.py tiles --arch vulkan --depths ${TUNE_DEPTHS:-32768,131072} \
    --variants "${TUNE_VARIANTS:-}" --graph ${TUNE_GRAPH:-8} --json "$OUT/tune-vulkan.json" > "$OUT/tune-vulkan.log" 2>&1
  echo "== tune vulkan rc=$?"; tile_rows "$OUT/tune-vulkan.log"
  if [ -n "${TUNE_CUDA:-}" ]; then  # the same timing on CUDA, where CUPTI's figures check it (TUNE_CUDA: variants)
    timeout ${TUNE_CUDA_TIMEOUT:-200} python3 scripts/tune_gpu.py tiles --arch cuda --depths ${TUNE_DEPTHS:-32768,131072} \
      --variants "$TUNE_CUDA" --graph ${TUNE_GRAPH:-8} --json "$OUT/tune-cuda.json" > "$OUT/tune-cuda.log" 2>&1
    echo "== tune cuda rc=$?"; tile_rows "$OUT/tune-cuda.log"
  fi
fi
if [ "$what" = hoststep ]; then  # where a step's wall time goes, CUDA and Vulkan; Vulkan tile variants by wall time
  for arch in cuda vulkan; do
    timeout 150 python3 scripts/tune_gpu.py step --arch $arch --depth 2048 --json "$OUT/step-$arch.json" > "$OUT/step-$arch.log" 2>&1
    echo "== step $arch rc=$?"; grep -E '^\{' "$OUT/step-$arch.log"
  done
  timeout 200 python3 scripts/tune_gpu.py tiles --arch vulkan --depths 2048,131072 --variants "${TUNE_VARIANTS:-}" \
    --json "$OUT/tune-vulkan.json" > "$OUT/tune-vulkan.log" 2>&1
  echo "== tune vulkan rc=$?"; grep -E '^\{' "$OUT/tune-vulkan.log" | cut -c1-400
fi
if [ "$what" = ncu ]; then  # ncu's counters on one deep NoPE layer's producer
  ncu_layer producer
fi
SHARED_METRICS=l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum
SHARED_METRICS+=,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum
if [ "$what" = stalls ]; then  # why warps wait: ncu's stall reasons, the shared pipe's wavefronts, and the SASS lines
  # they sample most (MUSER_GPU_TILE picks the tile; STALLS_KERNEL=reduce profiles the layer's reducer instead)
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  timeout 200 "$ncu" --clock-control none -k regex:${STALLS_KERNEL:-producer} --launch-skip 3 --launch-count 1 --import-source no \
    --section WarpStateStats --section SourceCounters --section LaunchStats --metrics "$SHARED_METRICS" \
    -f -o "$OUT/stalls" python3 scripts/bench.py \
    --arch cuda --mode layers --layer-depths 131072 --routes interleaved --repeats 2 > "$OUT/stalls.log" 2>&1
  echo "== ncu stalls rc=$?"
  "$ncu" -i "$OUT/stalls.ncu-rep" --page raw --csv > "$OUT/stalls-raw.csv" 2>&1
  "$ncu" -i "$OUT/stalls.ncu-rep" --page source --print-source sass --csv > "$OUT/stalls-sass.csv" 2>&1
  rm -f "$OUT/stalls.ncu-rep"
  python3 scripts/stall_report.py "$OUT/stalls-raw.csv" "$OUT/stalls-sass.csv" | tee "$OUT/stalls.txt"
fi
if [ "$what" = trace ]; then  # a step's timeline (torch.profiler / CUPTI) and its Python time, CUDA
  timeout 200 python3 scripts/tune_gpu.py trace --arch cuda --depths ${TRACE_DEPTHS:-2048,131072} --repeats 10 --layers \
    --trace-dir "$OUT/traces" --json "$OUT/trace-cuda.json" > "$OUT/trace-cuda.log" 2>&1
  echo "== trace cuda rc=$?"; grep -E '^\{' "$OUT/trace-cuda.log" | python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    print("%s %d: wall %.0f us, GPU busy %.0f / span %.0f us, first kernel +%.0f us, %d kernels" % (r["way"], r["depth"],
          r["wall_us"], r["gpu_busy_us"], r["gpu_span_us"], r["first_kernel_after_us"], r["kernel_count"]))
    print("   kernels:", ", ".join("%s %.1f" % (k[:40], v) for k, v in r["kernel_us"].items()))
    print("   calls:", ", ".join("%s x%d %.0f" % (k, v["count"], v["us"]) for k, v in r["host_calls"].items()))
    print("   python:", ", ".join("%s %.0f/%.0f" % (x["fn"], x["own_us"], x["cum_us"]) for x in r["python_top"][:8]))'
  gzip -9 "$OUT"/traces/*.json
fi
if [ "$what" = launch ]; then
  for arch in cuda vulkan; do
    timeout 100 python3 scripts/tune_gpu.py launch --arch $arch --json "$OUT/launch-$arch.json" > "$OUT/launch-$arch.log" 2>&1
    echo "== launch $arch rc=$?"; grep -E '^\{' "$OUT/launch-$arch.log" | cut -c1-260
  done
fi
if [ "$what" = paths ]; then  # PATHS_WHICH=one,direct on PATHS_ARCHS=vulkan: run 26's lead, graph or not
  for arch in ${PATHS_ARCHS:-cuda vulkan}; do
    timeout ${PATHS_TIMEOUT:-200} python3 scripts/tune_gpu.py paths --arch $arch --depths ${PATHS_DEPTHS:-2048,131072} \
      --paths ${PATHS_WHICH:-one,graph} --rounds 3 --repeats 10 --json "$OUT/paths-$arch.json" > "$OUT/paths-$arch.log" 2>&1
    echo "== paths $arch rc=$?"; grep -E '^\{' "$OUT/paths-$arch.log" | python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    print("  %-7s %6d %-12s %-11s %8.0f us  graph.run %6.0f us  rounds %s  launches %s" % (r["arch"], r["depth"],
          r["path"], r["way"], r["median_us"], r["graph_run_us"], " ".join("%.0f" % x for x in r["round_medians_us"]),
          r["launches"]))'
  done
fi
if [ "$what" = hostab ]; then  # AB_OLD=build/ab_old: `git archive <commit> muser_ti scripts configs pyproject.toml`
  ab_bench cuda-steps $AB_STEPS
  ab_bench cuda-layers timeout 60 python3 scripts/bench.py --arch cuda --mode layers --layer-depths 2048,131072 \
    --routes interleaved --repeats 15 --json @JSON@
  bash "$0" trace
  ab_bench vulkan-steps timeout 150 python3 scripts/bench.py --arch vulkan --mode steps --step-depths 2048,131072 \
    --repeats 15 --json @JSON@
fi
if [ "$what" = vkab ]; then  # AB_OLD=build/ab_old, as hostab
  for arch in vulkan cuda; do
    timeout 90 python3 scripts/tune_gpu.py readback --arch $arch --rounds 3 --json "$OUT/readback-$arch.json" \
      > "$OUT/readback-$arch.log" 2>&1; echo "== readback $arch rc=$?"
    grep -E '^\{' "$OUT/readback-$arch.log" | cut -c1-160
  done
  for round in $(seq 1 ${VKAB_ROUNDS:-2}); do  # the first process compiles the step (Taichi's cache serves the rest)
    ab_bench vulkan-steps-$round timeout ${VKAB_TIMEOUT:-200} python3 scripts/bench.py --arch vulkan --mode steps \
      --step-depths ${VKAB_DEPTHS:-2048} --repeats 15 --json @JSON@
  done
fi
if [ "$what" = vkwait ]; then  # what a Vulkan wait's ~560 us is (run 26: 2-3 us on CUDA, whose sync spins): the
  # guest's idle states (a vCPU that halts while the host thread waits may wake late: latency0 holds
  # /dev/cpu_dma_latency at 0 so the idle loop polls) or the driver's way of waiting (__GL_YIELD, documented for
  # NVIDIA's OpenGL; whether its Vulkan driver reads it is what this finds out).  Readback per way in alternating
  # rounds (VKWAIT_ROUNDS), then Vulkan steps (VKWAIT_DEPTHS) plain and under VKWAIT_STEP_WAY
  { cat /sys/devices/system/cpu/cpuidle/current_driver /sys/devices/system/cpu/cpuidle/current_governor_ro
    grep -H . /sys/devices/system/cpu/cpu0/cpuidle/state*/name /sys/devices/system/cpu/cpu0/cpuidle/state*/latency
  } > "$OUT/cpuidle.txt" 2>&1; cat "$OUT/cpuidle.txt"
  way_env() {  # way -> the environment it runs under (plain and latency0: none)
    case $1 in
      plain|latency0) ;;
      yield-nothing) echo __GL_YIELD=NOTHING;;
      yield-usleep) echo __GL_YIELD=USLEEP;;
      *) echo "vkwait: unknown way $1 (plain, latency0, yield-nothing, yield-usleep)" >&2; return 2;;
    esac
  }
  holder=
  hold() {  # latency0: PM QoS holds the request while the file stays open, so a process keeps it open
    [ "$1" = latency0 ] || return 0
    python3 -c 'import sys, time; sys.path.insert(0, "scripts"); from wake_latency import hold_wake_latency
with hold_wake_latency(0): time.sleep(3600)' & holder=$!
    sleep 0.5
  }
  release() { [ -z "$holder" ] || kill "$holder"; holder=; }
  for round in $(seq 1 ${VKWAIT_ROUNDS:-2}); do
    for way in ${VKWAIT_WAYS:-plain latency0 yield-nothing yield-usleep}; do
      e=$(way_env $way) || continue
      hold $way
      env $e timeout 90 python3 scripts/tune_gpu.py readback --arch vulkan --rounds 1 \
        --json "$OUT/readback-$way-$round.json" > "$OUT/readback-$way-$round.log" 2>&1
      echo "== readback $way round $round rc=$?"; release
      grep -E '^\{' "$OUT/readback-$way-$round.log" | cut -c1-150
    done
  done
  # one process, one engine: free, held, free again (tune_gpu.py wake); it compiles the step (~90 s), which
  # Taichi's cache then serves to the bench processes
  timeout ${VKWAIT_TIMEOUT:-200} python3 scripts/tune_gpu.py wake --arch vulkan --depths ${VKWAIT_DEPTHS:-2048} \
    --rounds 2 --json "$OUT/wake-vulkan.json" > "$OUT/wake-vulkan.log" 2>&1; echo "== wake vulkan rc=$?"
  grep -E '^\{' "$OUT/wake-vulkan.log" | python3 -c '
import json, sys
for r in map(json.loads, sys.stdin):
    print("  %-16s %-28s %9.1f us  rounds %s" % (r["phase"], r["way"], r["median_us"], " ".join("%.0f" % t for t in r["round_medians_us"])))'
  for way in plain ${VKWAIT_STEP_WAY:-latency0}; do
    e=$(way_env $way) || continue
    hold $way
    bench vulkan-steps-$way $e timeout ${VKWAIT_TIMEOUT:-200} python3 scripts/bench.py --arch vulkan \
      --mode steps --step-depths ${VKWAIT_DEPTHS:-2048} --repeats 15 --json "$OUT/vulkan-steps-$way.json"
    release
  done
fi
if [ "$what" = kernelab ]; then  # AB_OLD=build/ab_old, as hostab
  for round in 1 2; do
    ab_bench cuda-layers-$round timeout 120 python3 scripts/bench.py --arch cuda --mode layers \
      --layer-depths ${AB_DEPTHS:-2048,32768,131072} --routes ${AB_ROUTES:-interleaved,splitk} --repeats 15 --json @JSON@
  done
  if [ "${AB_NCU:-1}" != 0 ]; then  # AB_NCU=0: the layers only (the reducer's time is in their CUPTI kernel_us)
    ncu_layer old "$AB_OLD"
    ncu_layer new
    (cd /tmp && MUSER_TI_PRINT_ASM=1 PYTHONPATH=/tmp/site:$OLDPWD timeout 120 python3 $OLDPWD/scripts/bench.py --arch cuda \
      --mode layers --layer-depths 2048 --routes interleaved --repeats 2 > /dev/null 2>&1
     for f in taichi_kernel_nvptx_*.ptx; do grep -q "\.entry producer" "$f" || continue
       echo "$f: $(grep -cE 'ld(\.global)?\.(b16|u16)' "$f") 16-bit loads, $(grep -cE 'ld(\.global)?\.(b32|u32)' "$f") 32-bit loads"
     done)
  fi
fi
if [ "$what" = treeab ]; then  # AB_TREES (":"-separated; "." is this tree): CUDA layers (CUPTI) on each tree, one process
  # per tree and round, AB_ROUNDS rounds in alternation, so a tree's figure is seen across processes
  IFS=':' read -r -a trees <<< "${AB_TREES:-$AB_OLD:.}"
  for round in $(seq 1 ${AB_ROUNDS:-2}); do
    for tree in "${trees[@]}"; do
      tree_bench "$tree" "$([ "$tree" = . ] && echo head || basename "$tree")" layers-$round timeout ${AB_TIMEOUT:-150} \
        python3 scripts/bench.py --arch cuda --mode layers --layer-depths ${AB_DEPTHS:-2048,32768,131072} \
        --routes ${AB_ROUTES:-interleaved} --repeats 15 --json @JSON@
    done
  done
fi
if [ "$what" = warpab ]; then  # one process per tile and round, alternating, so host drift shows as a round spread
  TUNE_VARIANTS=";WT=0" TUNE_DEPTHS=${WARPAB_TUNE_DEPTHS:-2048,131072} bash "$0" tune
  for round in $(seq 1 ${WARPAB_ROUNDS:-1}); do
    for wt in 1 0; do
      bench layers-wt$wt-$round MUSER_GPU_TILE=WT=$wt timeout 150 python3 scripts/bench.py --arch cuda --mode layers \
        --layer-depths ${AB_DEPTHS:-2048,32768,131072} --routes interleaved,splitk --repeats 15 --json "$OUT/layers-wt$wt-$round.json"
    done
  done
  ncu_layer warp
  MUSER_GPU_TILE=WT=0 ncu_layer block
fi
if [ "$what" = tileab ]; then  # tile variants (TUNE_VARIANTS) in one process, then CUDA layers (CUPTI, torch in the same
  # process) for each MUSER_GPU_TILE in TILEAB_TILES (";"-separated, empty: the default) in alternating rounds
  TUNE_DEPTHS=${TUNE_DEPTHS:-32768,131072} bash "$0" tune
  IFS=';' read -r -a tiles <<< "${TILEAB_TILES:-;HS=2}"
  for round in $(seq 1 ${TILEAB_ROUNDS:-1}); do
    for i in "${!tiles[@]}"; do
      bench layers-tile$i-$round MUSER_GPU_TILE="${tiles[$i]}" timeout ${TILEAB_TIMEOUT:-150} python3 scripts/bench.py \
        --arch cuda --mode layers --layer-depths ${AB_DEPTHS:-2048,32768,131072} --routes ${AB_ROUTES:-interleaved} \
        --repeats 15 --json "$OUT/layers-tile$i-$round.json"
    done
  done
fi
if [ "$what" = ptx ]; then  # the producer's PTX and ptxas's resource report (MUSER_TI_PRINT_ASM=1), one small layer
  (cd /tmp && MUSER_TI_PRINT_ASM=1 PYTHONPATH=/tmp/site:$OLDPWD timeout 120 python3 $OLDPWD/scripts/bench.py --arch cuda \
    --mode layers --layer-depths 2048 --routes interleaved --repeats 2 > /dev/null 2>&1
   OUT=$OUT ptx_report)
fi
if [ "$what" = check ]; then
  MUSER_GPU_TILE=${CHECK_TILE-WU=1} timeout ${CHECK_TIMEOUT:-200} python3 -m pytest -x -q -p no:cacheprovider --arch cuda \
    ${CHECK_TESTS:-tests/} 2>&1 | tee "$OUT/check.log" | grep -v "^\s*$" | tail -40
fi
if [ "$what" = layers ]; then  # CUDA layers alone (CUPTI, torch in the same process)
  bench cuda-layers timeout ${LAYERS_TIMEOUT:-150} python3 scripts/bench.py --arch cuda --mode layers \
    --layer-depths ${LAYER_DEPTHS:-2048,32768,131072} --routes ${LAYER_ROUTES:-interleaved} --repeats 15 \
    --json "$OUT/cuda-layers.json"
fi
if [ "$what" = deep ]; then
  LAYERS_TIMEOUT=${DEEP_LAYERS_TIMEOUT:-150} LAYER_DEPTHS=${DEEP_LAYER_DEPTHS:-2048,32768,131072} \
    LAYER_ROUTES=${DEEP_ROUTES:-interleaved,splitk} bash "$0" layers
  bench cuda-steps timeout ${DEEP_STEPS_TIMEOUT:-170} python3 scripts/bench.py --arch cuda --mode steps \
    --step-depths ${DEEP_STEP_DEPTHS:-2048,131072} --repeats 15 --json "$OUT/cuda-steps.json"
fi
if [ "$what" = pyhost ]; then  # after a host-side (Python) change, AB_OLD as hostab.  A bare machine compiles the
  # one-dispatch step (two unrolled producers) for over 150 s, and Taichi writes its offline cache only when a
  # process exits: the first process compiles with room to spare, the later ones load what it wrote
  bench new-cuda-steps-1 timeout 330 python3 scripts/bench.py --arch cuda --mode steps --step-depths 2048,131072 \
    --repeats 15 --json "$OUT/new-cuda-steps-1.json"
  (cd "$AB_OLD" && export PYTHONPATH=/tmp/site:$PWD && bench old-cuda-steps-2 timeout 90 python3 scripts/bench.py \
    --arch cuda --mode steps --step-depths 2048 --repeats 15 --json "$OUT/old-cuda-steps-2.json")
  bench new-cuda-steps-3 timeout 90 python3 scripts/bench.py --arch cuda --mode steps --step-depths 2048 \
    --repeats 15 --json "$OUT/new-cuda-steps-3.json"
  timeout 60 python3 scripts/tune_gpu.py stephost --arch cuda --depth 2048 --repeats 10 --json "$OUT/stephost-cuda.json" \
    > "$OUT/stephost-cuda.log" 2>&1; echo "== stephost rc=$?"; grep -E '^\{' "$OUT/stephost-cuda.log"
fi
if [ "$what" = hostalt ]; then  # AB_OLD as hostab: CUDA steps at 2,048 keys on this tree and on $AB_OLD in
  # HOSTALT_ROUNDS alternating rounds, one process each (the host's speed moves between processes: run 16
  # saw torch's 52 calls at 1.11-1.75 ms), then the host's parts on this tree (tune_gpu.py stephost)
  for round in $(seq 1 ${HOSTALT_ROUNDS:-2}); do
    ab_bench cuda-steps-$round timeout 70 python3 scripts/bench.py --arch cuda --mode steps --step-depths 2048 \
      --repeats 15 --json @JSON@
  done
  timeout 60 python3 scripts/tune_gpu.py stephost --arch cuda --depth 2048 --repeats 10 --json "$OUT/stephost-cuda.json" \
    > "$OUT/stephost-cuda.log" 2>&1; echo "== stephost rc=$?"; grep -E '^\{' "$OUT/stephost-cuda.log"
fi
if [ "$what" = kernelhost ]; then  # after a change to the step kernel's arguments, AB_OLD as hostab: CUDA steps on this
  # tree's default build (its first compile takes the long timeout), then this tree against $AB_OLD at 2,048 keys
  # in HOSTALT_ROUNDS alternating rounds with MUSER_GPU_TILE=${KH_TILE-WU=1}: both trees then compile in seconds,
  # and the host's share, which the change moves, is the same either way
  bench new-cuda-steps-default timeout ${KH_FIRST_TIMEOUT:-300} python3 scripts/bench.py --arch cuda --mode steps \
    --step-depths ${KH_DEPTHS:-2048,131072} --repeats 15 --json "$OUT/new-cuda-steps-default.json"
  for round in $(seq 1 ${HOSTALT_ROUNDS:-2}); do
    ab_bench cuda-steps-tile-$round MUSER_GPU_TILE=${KH_TILE-WU=1} timeout 90 python3 scripts/bench.py --arch cuda \
      --mode steps --step-depths 2048 --repeats 15 --json @JSON@
  done
fi
if [ "$what" = stepbits ]; then  # where the one-dispatch step and the graph route part, bit for bit (scripts/step_bits.py;
  # STEPBITS_ARCHS, STEPBITS_ARGS, STEPBITS_TIMEOUT): run 29's Vulkan failure of the bits test
  for arch in ${STEPBITS_ARCHS:-vulkan cuda}; do
    timeout ${STEPBITS_TIMEOUT:-300} python3 scripts/step_bits.py --arch $arch ${STEPBITS_ARGS:-} > "$OUT/stepbits-$arch.log" 2>&1
    echo "== stepbits $arch rc=$?"; grep -E '^\{' "$OUT/stepbits-$arch.log" | cut -c1-400
  done
fi
if [ "$what" = spread ]; then  # the step across processes: the host's speed moves between them (torch's 52 calls
  # took 1.05-1.75 ms in runs 16-17), so one process's median is not the figure
  bench spread-cuda-steps-1 timeout ${SPREAD_FIRST_TIMEOUT:-330} python3 scripts/bench.py --arch cuda --mode steps \
    --step-depths 2048,131072 --repeats 15 --json "$OUT/spread-cuda-steps-1.json"
  for round in $(seq 2 ${SPREAD_ROUNDS:-4}); do
    bench spread-cuda-steps-$round timeout 80 python3 scripts/bench.py --arch cuda --mode steps --step-depths 2048 \
      --repeats 15 --json "$OUT/spread-cuda-steps-$round.json"
  done
fi
if [ "$what" = storeab ]; then  # the default tile's stall profile, tile variants in one process (tune, STOREAB_VARIANTS),
  # then the stall profile of STOREAB_TILE: after a change to how the producer uses shared memory
  for tile in "" "${STOREAB_TILE:-SS=1,WS=1}"; do
    d=$OUT/stalls-$(echo "${tile:-default}" | tr '=,' '__'); mkdir -p "$d"
    MUSER_GPU_TILE=$tile OUT=$d bash "$0" stalls
    [ -n "$tile" ] || TUNE_VARIANTS=${STOREAB_VARIANTS:-";SS=1;SS=1,WS=1"} TUNE_DEPTHS=${TUNE_DEPTHS:-32768,131072} bash "$0" tune
  done
fi
if [ -n "$pack_out" ]; then  # the device returns at most 8 files: pack the rest into one
  (cd "$OUT" && tar czf /tmp/out.tgz --exclude=out.tgz . && find . -mindepth 1 -delete && mv /tmp/out.tgz .)
fi
