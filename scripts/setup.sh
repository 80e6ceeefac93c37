#!/usr/bin/env bash
# Set up muser-ti in ./.venv (idempotent).  With --test: the test extras too, and, where this runs as
# root with apt, Mesa's software Vulkan driver (lavapipe) and the Vulkan loader for the Vulkan tests.
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

if [ "$want_test" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  if ! dpkg -s mesa-vulkan-drivers libvulkan1 >/dev/null 2>&1; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q mesa-vulkan-drivers libvulkan1
  fi
elif [ "$want_test" = 1 ]; then
  echo "note: not root with apt; install mesa-vulkan-drivers and libvulkan1 yourself or the Vulkan tests skip" >&2
fi

# The llama rung's ggml (ggml-python builds it from source) is built for the x86-64 AVX2 baseline, not for the
# building machine (GGML_NATIVE): on an AVX-512 Xeon the native build's flash attention over large K and V
# (tests/test_ggml_flash_attn.py::test_large_magnitudes) was 3.4-5.2e-2 of max|V| off the float64 reference,
# against 4.3-4.7e-4 for the AVX2 build on the same machine (the test's bound is 3e-3): the rung the routes
# are checked against would depend on the CI machine's processor.
export CMAKE_ARGS="${CMAKE_ARGS:-} -DGGML_NATIVE=OFF"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if [ "$want_test" = 1 ]; then
  .venv/bin/python -m pip install -q -e ".[test]"
else
  .venv/bin/python -m pip install -q -e .
fi
# a ggml built natively before (pip's wheel cache keeps one) is rebuilt for the baseline
if .venv/bin/python -c "import ggml, sys; sys.exit(not ggml.ggml_cpu_has_avx512())" 2>/dev/null; then
  ggml_version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('ggml-python'))")
  .venv/bin/python -m pip install -q --no-cache-dir --force-reinstall --no-deps "ggml-python==$ggml_version"
fi
