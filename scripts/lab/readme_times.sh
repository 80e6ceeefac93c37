#!/usr/bin/env bash
# The README's cold and warm times for the user's commands, on this machine: each command twice, first with
# empty kernel caches (Taichi's, Mesa's shader cache, the engine's compiled modules), then warm on the caches
# the first run filled.  Run it on a quiet machine from the checkout (.venv set up); WHAT picks the commands
# (decode-cpu decode-vulkan model-hf model-mlx).  Prints one line per run: what, cold|warm, wall seconds.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$(mktemp -d /tmp/readme-times.XXXX)
for what in ${WHAT:-decode-cpu decode-vulkan model-hf model-mlx}; do
  case $what in
    decode-cpu)    cmd=(.venv/bin/muser-decode --config glimmer.yaml --arch cpu) ;;
    decode-vulkan) cmd=(.venv/bin/muser-decode --config glimmer.yaml --arch vulkan) ;;
    model-hf)      cmd=(.venv/bin/muser-model --layers 8 --prompt-tokens 2040 --tokens 16) ;;
    model-mlx)     cmd=(.venv/bin/muser-model --framework mlx --layers 8 --prompt-tokens 2040 --tokens 16) ;;
    *) echo "unknown: $what"; exit 2 ;;
  esac
  export TI_OFFLINE_CACHE_FILE_PATH=$root/$what/taichi MESA_SHADER_CACHE_DIR=$root/$what/mesa \
         MUSER_AOT_CACHE=$root/$what/aot
  for pass in cold warm; do
    start=$(date +%s.%N)
    "${cmd[@]}" > "$root/$what-$pass.out" 2> "$root/$what-$pass.err"; rc=$?
    printf '%s %s %.1f s rc=%s\n' "$what" "$pass" "$(echo "$(date +%s.%N) - $start" | bc)" "$rc"
  done
done
echo "outputs: $root"
