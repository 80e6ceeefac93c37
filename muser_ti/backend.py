"""Choosing and starting a Taichi backend.

Taichi runs one backend per process; switching re-initialises it and invalidates every array made
before.  :func:`activate` owns that: it resolves ``"auto"``, starts Taichi once per arch, and bumps a
generation counter that engines check so a stale engine fails loudly instead of reading freed memory.

``"auto"`` picks Metal, then CUDA, then a *hardware* Vulkan device, else the CPU; it never picks a
software Vulkan driver (lavapipe), which tests select explicitly with ``arch="vulkan"``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import platform
import sys
from functools import lru_cache

from .errors import BackendError

# Taichi prints a banner on import and another at every ti.init, on standard output; a library's standard
# output belongs to its caller (`muser-decode --json | jq .`).  The import's banner is off unless the caller
# asks for it (Taichi's own switch; redirecting sys.stdout around the import instead would make Taichi wrap
# every kernel call to flush a print buffer), and ti.init's line goes to standard error (activate).  This
# module is the package's first import of Taichi (muser_ti/__init__.py imports it first).
os.environ.setdefault("ENABLE_TAICHI_HEADER_PRINT", "0")
import taichi as ti  # noqa: E402

ARCHS = ("auto", "cpu", "cuda", "vulkan", "metal")
GPU_ARCHS = ("cuda", "vulkan", "metal")
# What makes each backend available: every BackendError for an arch says it (a user who asked for it can act on it)
NEEDS = {
    "cuda": "it needs an NVIDIA GPU with NVIDIA's driver (libcuda.so)",
    "vulkan": ("it needs a Vulkan loader and a driver: a GPU's own, or Mesa's software driver lavapipe "
               "(on Debian or Ubuntu: apt-get install libvulkan1 mesa-vulkan-drivers)"),
    "metal": "it needs macOS with Taichi's Metal backend (a Mac with a Metal GPU)",
    "cpu": "Taichi's CPU backend supports x86-64 and arm64",
}

_active: str | None = None
_generation = 0




# ---- Vulkan device discovery (no Taichi involved, so probing never re-initialises anything) ------
VK_DEVICE_TYPES = {0: "other", 1: "integrated-gpu", 2: "discrete-gpu", 3: "virtual-gpu", 4: "cpu"}


class _VkInstanceCreateInfo(ctypes.Structure):
    _fields_ = [
        ("sType", ctypes.c_uint32),
        ("pNext", ctypes.c_void_p),
        ("flags", ctypes.c_uint32),
        ("pApplicationInfo", ctypes.c_void_p),
        ("enabledLayerCount", ctypes.c_uint32),
        ("ppEnabledLayerNames", ctypes.c_void_p),
        ("enabledExtensionCount", ctypes.c_uint32),
        ("ppEnabledExtensionNames", ctypes.c_void_p),
    ]


@lru_cache(maxsize=1)
def vulkan_devices() -> tuple[tuple[str, str], ...]:
    """(name, type) of every Vulkan physical device the loader sees; () if there is no loader."""
    path = ctypes.util.find_library("vulkan") or "libvulkan.so.1"
    try:
        vk = ctypes.CDLL(path)
    except OSError:
        return ()
    info = _VkInstanceCreateInfo(sType=1)  # VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO
    instance = ctypes.c_void_p()
    if vk.vkCreateInstance(ctypes.byref(info), None, ctypes.byref(instance)) != 0:
        return ()
    try:
        count = ctypes.c_uint32(0)
        vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), None)
        handles = (ctypes.c_void_p * count.value)()
        vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), handles)
        found = []
        for h in handles[: count.value]:
            props = ctypes.create_string_buffer(4096)  # VkPhysicalDeviceProperties is < 1 KiB
            vk.vkGetPhysicalDeviceProperties(ctypes.c_void_p(h), props)
            dev_type = int.from_bytes(props.raw[16:20], "little")
            name = props.raw[20:276].split(b"\0", 1)[0].decode(errors="replace")
            found.append((name, VK_DEVICE_TYPES.get(dev_type, "unknown")))
        return tuple(found)
    finally:
        vk.vkDestroyInstance(instance, None)


def has_hardware_vulkan() -> bool:
    return any(kind != "cpu" for _, kind in vulkan_devices())


def has_vulkan() -> bool:
    return bool(vulkan_devices())


def _cuda_available() -> bool:
    return ctypes.util.find_library("cuda") is not None or os.path.exists("/usr/lib/x86_64-linux-gnu/libcuda.so.1")


def resolve_arch(arch: str) -> str:
    if arch not in ARCHS:
        raise BackendError(f"arch {arch!r} is not one of {', '.join(ARCHS)}")
    if arch != "auto":
        return arch
    if platform.system() == "Darwin":
        return "metal"
    if _cuda_available():
        return "cuda"
    if has_hardware_vulkan():
        return "vulkan"
    return "cpu"


def activate(arch: str = "auto") -> str:
    """Start Taichi on ``arch`` (once per process per arch) and return the concrete arch name."""
    global _active, _generation
    want = resolve_arch(arch)
    if want == _active:
        return want
    if want == "metal" and platform.system() != "Darwin":
        raise BackendError(f"arch 'metal' is unavailable: {NEEDS['metal']}; this machine runs {platform.system()}")
    if want == "vulkan" and not has_vulkan():
        raise BackendError(f"arch 'vulkan' is unavailable: no Vulkan device found; {NEEDS['vulkan']}")
    if want == "cuda" and not _cuda_available():  # before ti.init, which would warn and start the CPU instead
        raise BackendError(f"arch 'cuda' is unavailable: no CUDA driver found; {NEEDS['cuda']}")
    if _active is not None:
        # arrays and graphs of the old runtime that only a reference cycle still holds would be freed after
        # the reset, into memory it no longer owns (a segfault): collect them while it stands
        gc.collect()
        ti.reset()
    # fast_math off: the reducers' exp must be the precise one (reduce_v2's precise::exp), and the
    # error bounds in tolerances.py assume it.
    # MUSER_TI_KERNEL_PROFILER=1: per-kernel device times (scripts/bench.py's GPU layer timings).
    # MUSER_TI_PRINT_ASM=1: Taichi writes each CUDA module's PTX to the working directory (for ptxas -v).
    profiler = os.environ.get("MUSER_TI_KERNEL_PROFILER") == "1"
    print_asm = os.environ.get("MUSER_TI_PRINT_ASM") == "1"
    with contextlib.redirect_stdout(sys.stderr):
        ti.init(arch=getattr(ti, want), fast_math=False, offline_cache=not print_asm, log_level=ti.WARN,
                unrolling_limit=0, kernel_profiler=profiler, print_kernel_asm=print_asm)
    got = ti.lang.impl.current_cfg().arch.name
    if got != {"cpu": "x64"}.get(want, want) and not (want == "cpu" and got in ("x64", "arm64")):
        ti.reset()
        _active = None
        raise BackendError(f"arch {want!r} is unavailable: Taichi started {got!r} instead; {NEEDS[want]}")
    _active = want
    _generation += 1
    return want


def active() -> str | None:
    return _active


def release() -> None:
    """End Taichi's program, which writes the kernels it compiled into its offline cache; the next activate()
    starts a fresh one.  Every engine of this process is unusable after it."""
    global _active
    if _active is None:
        return
    gc.collect()  # as in activate: what only a cycle holds goes while the runtime stands
    ti.reset()
    _active = None


def generation() -> int:
    return _generation
