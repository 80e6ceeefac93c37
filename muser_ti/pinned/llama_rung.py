"""The pinned llama rung (§16.5.2): llama.cpp's own flash-attention kernel over the project's planes.

Off macOS the pinned library is ggml-python 0.0.45 (ggml v0.15.3), version-checked at load, and its
``ggml_flash_attn_ext`` reads the planes in place (no copy) with the plane's own row stride: 256
halves for Glimmer's token-major SWA ring (n_kv_heads * head_dim), 128 for the head-major NoPE plane.
It runs on the CPU, so it can only read planes that live in host memory: on the CPU backend it is
the rung; on a GPU backend off macOS the rung is not loaded and the ladder falls to the project's
kernels.  On macOS the rung is the Metal bridge in metal_pinned/ (``muser_ti.pinned.metal_bridge``), reading
mirror planes the engine keeps in bridge buffers (``muser_ti.pinned.mirror``; never run, no macOS here).

Two graphs (§16.8):
* teacher: the vec kernel reads the ring where it lies: an unwrapped span directly, a full wrapped
  ring as all its rows (every slot is in the window when capacity == window; with slack the rows
  outside the window get a -inf mask).  Mathematically the same attention, not llama's bits.
* serving: wrapped SWA rows are first staged into llama.cpp's own cell order, a llama-style SWA cache
  of GGML_PAD(window + n_ubatch, 256) cells with token t in cell t % cells, attended over
  n_kv = min(cells, GGML_PAD(used, 256)) cells with an f16 -inf mask outside the window and on empty
  cells: the kernel sees llama's reduction lanes, so its bits are llama.cpp's own.
"""

from __future__ import annotations

import os
import platform

import numpy as np

from ..planes import PlaneState

LLAMA_KV_PAD = 256  # llama.cpp pads the attended cell count to 256 (GGML_PAD(used, 256))


def pad(x: int, n: int) -> int:
    """GGML_PAD: round x up to a multiple of n."""
    return (x + n - 1) // n * n


def pinned_status(arch: str) -> tuple[bool, str]:
    """(loaded, description) of the pinned library for planes on ``arch``; never raises."""
    if platform.system() == "Darwin":
        if arch != "metal":
            return False, f"on macOS the pinned rung is the Metal bridge; planes on {arch} cannot use it"
        from . import metal_bridge

        ok, why = metal_bridge.status()
        if not ok:
            return False, why
        # The bridge dispatches on MTLBuffers and Taichi 1.7.4 exposes none for a Metal ndarray, so the
        # engine keeps mirror planes in bridge buffers and the vec routes read those (plane_mirror.py:
        # every plane is then held twice).  Never run: there is no macOS machine here.
        return True, f"{why}; the vec routes read bridge-owned mirror planes (every plane held twice)"
    from .ggml import pinned_status as ggml_status

    ok, why = ggml_status()
    if not ok:
        return False, why
    if arch != "cpu":
        return False, (f"{why} is installed, but its kernel runs on the CPU and cannot read planes in {arch} "
                       "memory; the ladder falls to the project's kernels")
    return True, why


def ring_view(state: PlaneState, position: int, window: int) -> tuple[int, int, np.ndarray | None]:
    """(first_row, n_rows, mask) for the vec kernel over a ring the predicates admitted (teacher graph)."""
    visible = min(position + 1, window)
    logical_start = position + 1 - visible
    if state.origin_physical == 0:
        first = state.physical(logical_start)
        assert first + visible <= state.capacity, "an unwrapped plane's window is one contiguous span"
        return first, visible, None
    assert state.len == state.capacity, "partially wrapped rings never reach the vec route"
    if visible == state.capacity:
        return 0, visible, None  # every slot is in the window: softmax does not care about the order
    # A full ring with slack: read every slot, mask the ones whose token left the window.
    slots = np.arange(state.capacity)
    logical = state.origin_logical + (slots - state.origin_physical) % state.capacity
    mask = np.where(logical >= logical_start, 0.0, -np.inf).astype(np.float16)
    return 0, state.capacity, mask


class ServingCache:
    """llama.cpp's SWA cache layout for the serving graph: cells, not a ring with origins."""

    def __init__(self, n_layers: int, window: int, n_ubatch: int, n_kv: int, head_dim: int, zeros=np.zeros):
        """``zeros(shape, dtype)`` allocates the cells: the mirror's backing on Metal, so the bridge can read them."""
        self.window = window
        self.cells = pad(window + n_ubatch, LLAMA_KV_PAD)
        self.k = zeros((n_layers, self.cells, n_kv, head_dim), np.float16)
        self.v = zeros((n_layers, self.cells, n_kv, head_dim), np.float16)
        self.pos = np.full(self.cells, -1, np.int64)  # token held by each cell, -1 = empty

    def stage(self, position: int, k_rows: np.ndarray, v_rows: np.ndarray) -> None:
        """Copy one token's f16 rows (all layers, [n_layers, n_kv, d]) into cell position % cells."""
        cell = position % self.cells
        self.k[:, cell] = k_rows
        self.v[:, cell] = v_rows
        self.pos[cell] = position

    def first_missing(self, position: int) -> int | None:
        """The oldest token the next token at ``position`` attends (besides itself) that no cell holds any more,
        or None: after a rewind deeper than the cells' room beyond the window, llama.cpp's cache has reused
        them for later tokens."""
        for t in range(max(0, position - self.window + 1), position):
            if self.pos[t % self.cells] != t:
                return t
        return None

    def forget_from(self, position: int) -> None:
        """A rollback: cells holding tokens at or after ``position`` become empty."""
        self.pos[self.pos >= position] = -1

    def view(self, position: int) -> tuple[int, np.ndarray]:
        """(n_kv, mask) llama.cpp attends for the token at ``position``."""
        used = int((self.pos >= 0).sum())
        n_kv = min(self.cells, pad(used, LLAMA_KV_PAD))
        held = self.pos[:n_kv]
        in_window = (held >= 0) & (held > position - self.window) & (held <= position)
        return n_kv, np.where(in_window, 0.0, -np.inf).astype(np.float16)


def default_threads() -> int:
    return os.cpu_count() or 1
