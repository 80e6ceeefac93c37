"""Holding the CPUs' wake-up latency down while a GPU step waits: a measurement aid for virtual machines.

A Vulkan step ends in a wait for the device (~560 us on the lent H200's Vulkan, 2-3 us on its CUDA, whose
sync spins: docs/lab/runs.md, run 26), and on a VM the waiting thread's vCPU may halt until the device's
interrupt wakes it.  Linux's PM QoS file /dev/cpu_dma_latency asks the idle loop to stay within a wake-up
latency; 0 keeps it polling instead of halting, for as long as the file stays open.  Measured on lavapipe
on this 2-core VM (haltpoll cpuidle driver; run 27): a kernel plus the engine's flag download 727-788 us
free, 320-340 us held, and an idle sync 69-279 -> 14-15 us (free, it fell to ~11-14 us on its own after a
few rounds).  Not yet measured on the H200 (tune_gpu.py wake): until it
is, this stays a script, not the package's API.  The cost is power: polling vCPUs stay busy.

    with hold_wake_latency(0):
        ...  # the measurement
"""

from __future__ import annotations

import contextlib
import os
import struct
from pathlib import Path

PM_QOS_FILE = "/dev/cpu_dma_latency"
CPUIDLE_DIR = "/sys/devices/system/cpu/cpuidle"
MAX_LATENCY_US = 2_000_000_000  # the kernel's own "no constraint" value (PM_QOS_CPU_LATENCY_DEFAULT_VALUE)


class WakeLatencyError(RuntimeError):
    """The wake-up latency could not be held (no PM QoS file, or no permission to write it)."""


@contextlib.contextmanager
def hold_wake_latency(max_us: int = 0, path: str = PM_QOS_FILE):
    """Hold the CPUs' wake-up latency at ``max_us`` microseconds (0: the idle loop polls) inside the block.

    The request lasts while the file stays open and ends when the block exits, however it exits.  Raises
    WakeLatencyError naming the file and the reason where it cannot be held (the file needs root)."""
    if isinstance(max_us, bool) or not isinstance(max_us, int) or not 0 <= max_us <= MAX_LATENCY_US:
        raise WakeLatencyError(f"hold_wake_latency max_us: expected an integer in [0, {MAX_LATENCY_US}] "
                               f"microseconds, got {max_us!r}")
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError as exc:
        raise WakeLatencyError(f"hold_wake_latency: cannot open {path} for writing ({exc.strerror}); the PM QoS "
                               f"file needs root and a Linux kernel that has it") from None
    try:
        os.write(fd, struct.pack("i", max_us))  # the native-endian s32 the kernel reads
        yield max_us
    finally:
        os.close(fd)


def current_wake_latency_us(path: str = PM_QOS_FILE) -> int | None:
    """The wake-up latency the kernel now holds the CPUs to (every open request's minimum), or None where
    the file cannot be read."""
    try:
        raw = Path(path).read_bytes()
    except OSError:
        return None
    return struct.unpack("i", raw[:4])[0] if len(raw) >= 4 else None


def cpuidle_description(root: str = CPUIDLE_DIR) -> dict:
    """The idle driver and governor (what a benchmark's machine description records beside its figures)."""
    out = {}
    for name in ("current_driver", "current_governor_ro"):
        try:
            out[name] = Path(root, name).read_text().strip()
        except OSError:
            pass
    latency = current_wake_latency_us()
    if latency is not None:
        out["wake_latency_us"] = latency
    return out
