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

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if [ "$want_test" = 1 ]; then
  .venv/bin/python -m pip install -q -e ".[test]"
else
  .venv/bin/python -m pip install -q -e .
fi
