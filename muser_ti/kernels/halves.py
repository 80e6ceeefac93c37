"""How the f16 KV planes are stored: packed, two halves to a u32 word.

A plane row of head_dim halves is head_dim / 2 words; word w holds dimension 2w in its low 16 bits and
2w + 1 in its high 16 bits.  On a little-endian machine those are exactly the bytes of the f16 row, so
a host view is a reinterpretation (``to_halves``), and ggml reads the same memory as f16.

Why packed: Taichi loads an f16 ndarray one element at a time (``ld.b16`` on CUDA, a ``ushort`` per
element on SPIR-V) and cannot reinterpret an ndarray's dtype, so the only way to load a plane wider
than 2 bytes per lane is to store it in a wider type.  u32 is the widest type every backend has
(SPIR-V's u64 needs Int64, which Taichi's Metal backend enables only on Apple3+); the halves are
converted in registers with exact f16 -> f32 conversions, so every value is the one an f16 plane held.
"""

import ctypes

import numpy as np
import taichi as ti

HALVES_PER_WORD = 2
LOW_HALF = 0xFFFF

packed_plane = ti.types.ndarray(dtype=ti.u32, ndim=4)  # [..., head_dim / 2] words of two halves


F16_MIN_NORMAL_BITS = 0x38800000  # 2**-14 as f32 bits: below it an f16 is subnormal
F16_OVERFLOW_BITS = 0x477FF000  # 65520 as f32 bits: from here f16 rounds to inf
F32_REBIAS = 0x38000000  # (127 - 15) << 23: the f32 exponent bias less the f16 one, in place


@ti.func
def half_bits(x):
    """The f16 bits of f32 ``x`` rounded to nearest even, f16 subnormals kept, as a u32: numpy's and
    F16C's rounding.

    In integer arithmetic, not ti.cast(x, ti.f16): a SPIR-V float conversion follows the driver's
    default float controls, which may flush f16 subnormals to zero, so the cast's bits would depend on
    the device (NVIDIA's Vulkan driver differed from numpy here).  This runs once per stored word, off
    the decode loop.  Non-finite input (which the engine refuses) gives a quiet NaN."""
    b = ti.bit_cast(ti.cast(x, ti.f32), ti.u32)
    sign = (b >> 16) & ti.u32(0x8000)
    a = b & ti.u32(0x7FFFFFFF)
    # Normal range: rebias the exponent in place, round the 13 dropped bits to nearest even (a carry
    # out of the significand moves to the next binade, and past 65504 to inf, as it should).
    normal = (a - ti.u32(F32_REBIAS) + ti.u32(0xFFF) + ((a >> 13) & ti.u32(1))) >> 13
    # Subnormal range: the significand m (implicit bit set) counts 2**(e - 150); an f16 subnormal
    # counts 2**-24, so h = m >> (126 - e), rounded to nearest even.  Shifts past 24 give 0 (m < 2**24);
    # 31 keeps the shift defined.
    e = ti.cast(a >> 23, ti.i32)
    m = (a & ti.u32(0x7FFFFF)) | ti.u32(0x800000)
    s = ti.cast(ti.min(ti.max(126 - e, 1), 31), ti.u32)
    kept = m >> s
    rest = m & ((ti.u32(1) << s) - ti.u32(1))
    tie = ti.u32(1) << (s - ti.u32(1))
    up = ti.select((rest > tie) | ((rest == tie) & ((kept & ti.u32(1)) == ti.u32(1))), ti.u32(1), ti.u32(0))
    h = ti.select(a < ti.u32(F16_MIN_NORMAL_BITS), kept + up, normal)
    h = ti.select(a >= ti.u32(F16_OVERFLOW_BITS), ti.u32(0x7C00), h)
    h = ti.select(a > ti.u32(0x7F800000), ti.u32(0x7E00), h)
    return sign | h


@ti.func
def pack(lo, hi):
    """One word from two f32 values: ``lo`` is dimension 2w, ``hi`` 2w + 1 (both rounded to f16)."""
    return half_bits(lo) | (half_bits(hi) << 16)


@ti.func
def low(word):
    """The f32 value of a word's low half (dimension 2w), exact."""
    return ti.cast(ti.bit_cast(ti.cast(word & LOW_HALF, ti.u16), ti.f16), ti.f32)


@ti.func
def high(word):
    """The f32 value of a word's high half (dimension 2w + 1), exact."""
    return ti.cast(ti.bit_cast(ti.cast(word >> 16, ti.u16), ti.f16), ti.f32)


def packed_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The words' shape of a plane whose halves have ``shape`` (its last dimension, head_dim, is even:
    config.HEAD_DIMS)."""
    *lead, d = shape
    if d % HALVES_PER_WORD:
        raise ValueError(f"a packed plane row holds pairs of halves: head_dim {d} must be even")
    return (*lead, d // HALVES_PER_WORD)


def alloc(shape: tuple[int, ...]):
    """A zeroed packed plane for halves of ``shape``."""
    return ti.ndarray(ti.u32, packed_shape(shape))


def halves_shape(arr) -> tuple[int, ...]:
    """The shape in halves of a packed plane (an ndarray of words)."""
    *lead, words = arr.shape
    return (*lead, words * HALVES_PER_WORD)


def to_halves(arr) -> np.ndarray:
    """A host copy of a packed plane as float16, shape [..., head_dim]."""
    return arr.to_numpy().view(np.float16)


def from_halves(arr, halves: np.ndarray) -> None:
    """Write float16 ``halves`` (shape [..., head_dim]) into a packed plane."""
    words = np.ascontiguousarray(halves, dtype=np.float16).view(np.uint32)
    if words.shape != tuple(arr.shape):
        raise ValueError(f"halves of shape {halves.shape} do not fill a packed plane of {tuple(arr.shape)} words")
    arr.from_numpy(words)


def host_view(arr) -> np.ndarray:
    """A zero-copy float16 view, shape [..., head_dim], of a packed plane in host memory (the CPU backend,
    where Taichi's arrays are the process's own memory): what ggml's kernel reads in place.  Valid while
    ``arr`` lives; on a GPU backend Taichi gives no host address and this raises."""
    if ti.lang.impl.current_cfg().arch not in (ti.x64, ti.arm64):
        raise ValueError(f"host_view needs the CPU backend; Taichi runs on {ti.lang.impl.current_cfg().arch}")
    addr = ti.lang.impl.get_runtime().prog.get_ndarray_data_ptr_as_int(arr.arr)
    shape = halves_shape(arr)
    buf = (ctypes.c_uint16 * int(np.prod(shape))).from_address(int(addr))
    return np.frombuffer(buf, dtype=np.float16).reshape(shape)


__all__ = ["HALVES_PER_WORD", "alloc", "from_halves", "halves_shape", "high", "host_view", "low", "pack",
           "packed_plane", "packed_shape", "to_halves"]
