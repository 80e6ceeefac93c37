"""The token scan: the device's input checks of a token (non-finite values, values outside the f16 range),
as stamped flags the host reads when it chooses, and the gate the one-dispatch step's writes ask.

The host's side of it (reading the flags, naming a refused token, undoing deferred steps) is
muser_ti/device_checks.py.
"""


import taichi as ti

from ..config import F16_MAX, F32_MAX
from .common import cached, f32_3d

TOKEN_FLAGS = 6  # non-finite q, k, v values; k, v values outside the f16 range (|x| > 65504); q values outside it
NEVER_STAMPED = -1  # flags start at 0 and only rise (atomic_max of stamps >= 1): no flag ever equals it
OPEN_GATE = 2**31 - 1  # a gate base no flag reaches: writes never wait on the scan (a host-checked token)
REFUSAL_RING = 256  # tokens whose flags are kept one by one between two looks at them (deferred checks)
FLAG_CELLS = TOKEN_FLAGS * (1 + REFUSAL_RING)  # the summary, then the ring; a layer table may follow


def refusal_of(n_heads: int, n_kv: int):
    """A ti.func: the flag a value sets (row r of [q heads | k heads | v heads] of row ``layer`` of q, k, v,
    dimension d), or -1 for none: non-finite q, k, v (0, 1, 2); k, v outside the f16 range (3, 4); q outside it (5).
    ``not |x| <= F32_MAX`` holds for NaN (every comparison with it is false) and for +-inf."""
    H, KV = n_heads, n_kv

    @ti.func
    def refusal(q: ti.template(), k: ti.template(), v: ti.template(), layer, r, d):
        x, kind = 0.0, 0
        if r < H:
            x = q[layer, r, d]
        elif r < H + KV:
            x, kind = k[layer, r - H, d], 1
        else:
            x, kind = v[layer, r - H - KV, d], 2
        a = ti.abs(x)
        flagged = -1
        if not a <= F32_MAX:
            flagged = kind
        elif a > F16_MAX:
            flagged = kind + 2 if kind > 0 else 5
        return flagged

    return refusal


def build_token_scan(n_heads: int, n_kv: int, head_dim: int, serial: bool = False):
    """The input checks of a device-resident token (Engine.step_device) in one launch of one loop.

    A flag is set to the scan's ``stamp`` (a count the engine raises every scan) rather than counted
    from zero, so no launch is spent clearing it.  Two records: the summary ``flags[kind]`` holds the
    latest stamp that set it (the host reads ``flags[kind] == stamp`` after a scan), and the ring
    ``flags[TOKEN_FLAGS * (1 + stamp % REFUSAL_RING) + kind]`` holds it per token, so the host can name the
    first refused token of many scanned without a look between them (deferred checks).
    What a value sets: refusal_of.  ``serial``: one thread (the CPU's per-layer token scans a few thousand values, sooner than its worker
    threads wake)."""
    H, KV, D = n_heads, n_kv, head_dim

    def build():
        @ti.func
        def flag(flags: ti.template(), stamp, kind):
            ti.atomic_max(flags[kind], stamp)
            if stamp >= 0:
                ti.atomic_max(flags[TOKEN_FLAGS * (1 + stamp % REFUSAL_RING) + kind], stamp)

        refusal = refusal_of(H, KV)

        @ti.func
        def check(q: ti.template(), k: ti.template(), v: ti.template(), flags: ti.template(), stamp, layer, r, d):
            """Row r of [q heads | k heads | v heads] of a layer, dimension d."""
            kind = refusal(q, k, v, layer, r, d)
            if kind >= 0:
                flag(flags, stamp, kind)

        @ti.kernel
        def scan(q: f32_3d, k: f32_3d, v: f32_3d, flags: ti.types.ndarray(dtype=ti.i32, ndim=1), stamp: ti.i32):
            ti.loop_config(serialize=serial)
            for layer, r, d in ti.ndrange(q.shape[0], H + 2 * KV, D):
                check(q, k, v, flags, stamp, layer, r, d)

        scan.check = check
        return scan

    return cached(("token_scan", H, KV, D, serial), build)


def build_row_scan(n_heads: int, n_kv: int, head_dim: int):
    """The token scan of a batch's layer (q [B, heads, d], k and v [B, kv heads, d]) with a record per row:
    ``flags[b, kind]`` holds the latest stamp that flagged row b for ``kind`` (TOKEN_FLAGS kinds, as
    build_token_scan's), so the host names the sequence as well as the layer (batch_launch.py)."""
    H, KV, D = n_heads, n_kv, head_dim

    def build():
        refusal = refusal_of(H, KV)

        @ti.kernel
        def row_scan(q: f32_3d, k: f32_3d, v: f32_3d, flags: ti.types.ndarray(dtype=ti.i32, ndim=2), stamp: ti.i32,
                     n_rows: ti.i32):
            for b, r, d in ti.ndrange(n_rows, H + 2 * KV, D):
                kind = refusal(q, k, v, b, r, d)
                if kind >= 0:
                    ti.atomic_max(flags[b, kind], stamp)

        return row_scan

    return cached(("row_scan", H, KV, D), build)


@ti.func
def token_accepted(flags: ti.template(), base) -> ti.i32:
    """1 unless a scan since stamp ``base`` flagged a token (build_token_scan): the gate of every write the
    one-dispatch step makes (kernels/one_dispatch.py).  base = this token's stamp: its own scan decides;
    base = the first stamp since the host last looked: one refused token closes the gate for every token
    after it until the host looks (deferred checks); base = OPEN_GATE: never closed."""
    ok = 1
    for i in ti.static(range(TOKEN_FLAGS)):
        if flags[i] >= base:
            ok = 0
    return ok
