#!/usr/bin/env bash
# Set up muser-ti in ./.venv (idempotent): the package, editable, with the commands' extra ([cli]: rich, matplotlib).
# With --test: the test extras too, and, where this runs as root with apt, Mesa's software Vulkan driver (lavapipe)
# and the Vulkan loader for the Vulkan tests: system-wide, so it says what apt will install or upgrade first;
# --no-apt leaves the system alone (the Vulkan tests then skip where no Vulkan driver is installed).
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
want_apt=1
for arg in "$@"; do
  case "$arg" in
    --test) want_test=1 ;;
    --no-apt) want_apt=0 ;;
    *) echo "usage: bash scripts/setup.sh [--test] [--no-apt]" >&2; exit 2 ;;
  esac
done

vulkan_packages="mesa-vulkan-drivers libvulkan1"
if [ "$want_test" = 1 ] && [ "$want_apt" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  # shellcheck disable=SC2086
  if ! dpkg -s $vulkan_packages >/dev/null 2>&1; then
    echo "setup: installing system-wide with apt-get, for the Vulkan tests: $vulkan_packages" \
         "(Mesa's software Vulkan driver lavapipe, the Vulkan loader); --no-apt skips this" >&2
    apt-get update -q
    echo "setup: apt will install or upgrade:" >&2
    # shellcheck disable=SC2086
    apt-get install -s -q $vulkan_packages | sed -n 's/^Inst /  /p' >&2
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q $vulkan_packages
  fi
elif [ "$want_test" = 1 ]; then
  echo "note: apt not used (not root, no apt-get, or --no-apt); install $vulkan_packages yourself or the Vulkan tests skip" >&2
fi

# The llama rung's ggml (ggml-python builds it from source) is built for the x86-64 AVX2 baseline, not for the
# building machine (GGML_NATIVE), so the rung's numerics do not depend on the CI machine's processor. AVX-512 is
# not what moves them: ggml v0.15.3 computes f16 in half precision only on CPUs with AVX512-FP16 (Sapphire Rapids
# and later Xeons; cpuid flag avx512_fp16): the 3.4-5.2e-2 of max|V| a native build once gave in test_large_magnitudes
# on a Xeon (bound 3e-3) came from that. Without it (Zen 5, Ice Lake) the native AVX-512 build is 4.2-4.7e-4 off, like this
# build (scripts/lab/ggml_builds_accuracy.py). The CPU bench's peer is a native build of its own
# (muser_ti/bench/native_ggml.py, kept in ~/.cache/muser-ti/ggml-native/), never this one.
export CMAKE_ARGS="${CMAKE_ARGS:-} -DGGML_NATIVE=OFF"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if [ "$want_test" = 1 ]; then
  # the tests run the real clients too: mlx-lm's and transformers' Glimmer (the [mlx] and [hf] extras)
  .venv/bin/python -m pip install -q -e ".[test,cli,mlx,hf]"
else
  .venv/bin/python -m pip install -q -e ".[cli]"
fi
# a ggml built natively before (pip's wheel cache keeps one) is rebuilt for the baseline
if .venv/bin/python -c "import ggml, sys; sys.exit(not ggml.ggml_cpu_has_avx512())" 2>/dev/null; then
  ggml_version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('ggml-python'))")
  .venv/bin/python -m pip install -q --no-cache-dir --force-reinstall --no-deps "ggml-python==$ggml_version"
fi
