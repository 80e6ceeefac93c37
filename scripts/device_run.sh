#!/usr/bin/env bash
# One call on the lent H200 (the device tool): set up Taichi from the carried wheel and the Vulkan
# loader from the carried .debs, then run what $1 asks:
#   bench  CUDA + Vulkan benchmarks (layers: device time; steps: wall time), and the workgroup-cap A/B
#   quick  CUDA layers and steps, Vulkan steps (after a kernel change)
#   tests  the parametrised suite on CUDA and Vulkan
#   steps  the 52-layer step on CUDA and Vulkan
#   final  the suite on both backends, CUDA layers, steps on both backends
#   kernel after a producer change: CUDA layers at two workgroup targets, and ncu on one deep layer
# Results and logs land in $OUT.  Carry: .whl (taichi 1.7.4 cp312, dill, colorama) and .gl (libvulkan1...).
set -uo pipefail
what=${1:-bench}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
bench() {  # name, extra env..., args...
  local name=$1; shift
  env "$@" > "$OUT/$name.log" 2>&1; echo "== $name rc=$?"; grep -E '^\{' "$OUT/$name.log" | python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    print("  %-28s %7d nwg=%-5s ours %8.3f ms  torch %7.4f ms  %6.0f GB/s  floor %.4f ms" % (r["what"][:28], r["depth"],
          r.get("workgroups", "-"), r["ours_ms"], r.get("torch_ms", 0), r["ours_gb_s"], r.get("byte_floor_ms", 0)))'
}
if [ "$what" = bench ]; then
  for arch in cuda vulkan; do
    prof=$([ $arch = cuda ] && echo 1 || echo 0)
    bench $arch-layers MUSER_TI_KERNEL_PROFILER=$prof timeout 200 python3 scripts/bench.py --arch $arch --mode layers \
      --layer-depths 2048,8192,32768,131072 --routes interleaved,splitk --repeats 15 --json "$OUT/$arch-layers.json"
    bench $arch-steps timeout 150 python3 scripts/bench.py --arch $arch --mode steps --step-depths 2048,32768,131072 \
      --repeats 15 --json "$OUT/$arch-steps.json"
  done
  for target in 1 2112; do  # the chapter's cap (nwg = 32 per KV head) and 4x the default target
    bench cap-$target MUSER_GPU_TARGET_WORKGROUPS=$target MUSER_TI_KERNEL_PROFILER=1 timeout 100 python3 scripts/bench.py \
      --arch cuda --mode layers --layer-depths 32768,131072 --routes interleaved --repeats 15 --json "$OUT/cap-$target.json"
  done
fi
if [ "$what" = quick ]; then  # CUDA layers and steps, Vulkan steps: the figures a kernel change moves
  bench cuda-layers MUSER_TI_KERNEL_PROFILER=1 timeout 150 python3 scripts/bench.py --arch cuda --mode layers \
    --layer-depths 2048,32768,131072 --routes interleaved,splitk --repeats 15 --json "$OUT/cuda-layers.json"
  bench cuda-steps timeout 120 python3 scripts/bench.py --arch cuda --mode steps --step-depths 2048,32768,131072 \
    --repeats 15 --json "$OUT/cuda-steps.json"
  bench vulkan-steps timeout 120 python3 scripts/bench.py --arch vulkan --mode steps --step-depths 2048,32768,131072 \
    --repeats 15 --json "$OUT/vulkan-steps.json"
fi
ncu_layer() {  # name, PYTHONPATH: ncu on one interleaved layer at 131,072 keys (one producer launch)
  local ncu; ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  PYTHONPATH=$2 timeout 150 "$ncu" --clock-control none -k regex:producer --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section InstructionStats python3 scripts/bench.py --arch cuda --mode layers --layer-depths 131072 \
    --routes interleaved --repeats 2 > "$OUT/ncu-$1.txt" 2>&1; echo "== ncu $1 rc=$?"
  grep -E "^ *(Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Instructions |Local Memory Spilling Requests |Block Limit (Registers|Shared))" "$OUT/ncu-$1.txt"
}
if [ "$what" = kernel ]; then  # after a producer change: workgroup targets on CUDA layers, and ncu
  for target in 264 528; do
    bench layers-wg$target MUSER_GPU_TARGET_WORKGROUPS=$target MUSER_TI_KERNEL_PROFILER=1 timeout 150 python3 \
      scripts/bench.py --arch cuda --mode layers --layer-depths 2048,32768,131072 --routes interleaved,splitk \
      --repeats 15 --json "$OUT/layers-wg$target.json"
  done
  ncu_layer producer /tmp/site:$PWD
fi
if [ "$what" = final ]; then  # the suite on both backends, then the steps on both (rows for docs/PERF.md)
  timeout 250 python3 -m pytest -q -p no:cacheprovider --arch cuda --arch vulkan tests/ 2>&1 | tail -4
  bench cuda-layers MUSER_TI_KERNEL_PROFILER=1 timeout 80 python3 scripts/bench.py --arch cuda --mode layers \
    --layer-depths 2048,8192,32768,131072 --routes interleaved,splitk --repeats 15 --json "$OUT/cuda-layers.json"
  bench cuda-steps timeout 90 python3 scripts/bench.py --arch cuda --mode steps --step-depths 2048,32768,131072 \
    --repeats 15 --json "$OUT/cuda-steps.json"
  bench vulkan-steps timeout 120 python3 scripts/bench.py --arch vulkan --mode steps --step-depths 2048,32768,131072 \
    --repeats 15 --json "$OUT/vulkan-steps.json"
fi
if [ "$what" = steps ]; then  # the 52-layer step on both backends (after a split-geometry change)
  bench cuda-steps timeout 90 python3 scripts/bench.py --arch cuda --mode steps --step-depths 2048,32768,131072 \
    --repeats 15 --json "$OUT/cuda-steps.json"
  bench vulkan-steps timeout 120 python3 scripts/bench.py --arch vulkan --mode steps --step-depths 2048,32768,131072 \
    --repeats 15 --json "$OUT/vulkan-steps.json"
fi
if [ "$what" = tests ]; then
  timeout 560 python3 -m pytest -q -p no:cacheprovider --arch cuda --arch vulkan tests/ 2>&1 | tee "$OUT/tests.log" | tail -25
fi
