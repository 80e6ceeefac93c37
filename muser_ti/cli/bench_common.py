"""What the bench command's CPU and GPU parts share: sessions at a depth, timed steps, and a row's
bandwidth, FLOP rate and floor (muser_ti/cli/bench.py, bench_gpu.py; the lab's tools use them too)."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import muser_ti as mt
from muser_ti.bandwidth import attention_flop

ROUTE_KIND = {"splitk": "swa", "interleaved": "nope"}
def prefill(eng: mt.Engine, n: int, rng, chunk: int = 4096) -> None:
    c = eng.cfg
    done = 0
    while done < n:
        m = min(chunk, n - done)
        shape = (m, c.n_layers, c.n_kv_heads, c.head_dim)
        eng.prefill(rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32))
        done += m


def random_token(c: mt.Geometry, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One decode token's q, k, v (float32, standard normal)."""
    return tuple(rng.standard_normal(shape, dtype=np.float32) for shape in
                 ((c.n_layers, c.n_heads, c.head_dim), (c.n_layers, c.n_kv_heads, c.head_dim),
                  (c.n_layers, c.n_kv_heads, c.head_dim)))


def rewound_median(eng: mt.Engine, call, repeats: int, warmup: int, settle=None) -> float:
    """Median seconds of ``call`` (one step) at the engine's depth; rewinds between repeats and ``settle``
    run untimed, and the last step is left in place, so the planes then hold what the timed steps attended."""
    p = eng.position
    times = []
    for _ in range(warmup + repeats):
        if eng.position > p:
            eng.rewind(p)
        if settle is not None:
            settle()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


def timed_step(eng: mt.Engine, rng, repeats: int, warmup: int = 2) -> tuple[float, np.ndarray]:
    """Median seconds of eng.step at the engine's depth (rewound_median), and the q it attended."""
    q, k, v = random_token(eng.cfg, rng)
    return rewound_median(eng, lambda: eng.step(q, k, v), repeats, warmup), q


def timed_device_step(eng: mt.Engine, rng, repeats: int, warmup: int = 2) -> float:
    """Median seconds of eng.step_device with q, k, v and out already on the device, to the device's
    completion (ti.sync inside the timing, and before it untimed)."""
    import taichi as ti

    dev = device_token(*random_token(eng.cfg, rng))
    out = ti.ndarray(ti.f32, dev[0].shape)
    return rewound_median(eng, lambda: (eng.step_device(*dev, out), ti.sync()), repeats, warmup, settle=ti.sync)


def device_token(*host: np.ndarray) -> list:
    """Float32 ndarrays holding the given host arrays (a token as step_device takes it)."""
    import taichi as ti

    dev = []
    for a in host:
        dev.append(ti.ndarray(ti.f32, a.shape))
        dev[-1].from_numpy(a)
    return dev


def layer_geometry(base: mt.Geometry, route: str, depth: int) -> mt.Geometry:
    kind = ROUTE_KIND[route]
    return base.with_overrides(name=f"{base.name}-1{kind}", n_layers=1, layer_pattern=(kind,),
                               window=depth, max_context=depth, swa_ring_slack=0)


def finish(row: dict, cfg: mt.Geometry, visibles: list[int], copy_gb_s: float = 0.0,
           fma_peak_gflop_s: float = 0.0) -> dict:
    """A row's bytes, rates and floor: the KV bytes at the measured copy bandwidth (GPU), or the FLOPs at the
    measured FMA peak (CPU, muser_ti.bench.fma_peak)."""
    kv_bytes = sum(visibles) * cfg.kv_bytes_per_row
    flop = attention_flop(cfg, sum(visibles))
    row["kv_mb"] = kv_bytes / 1e6
    row["ours_gb_s"] = kv_bytes / (row["ours_ms"] * 1e-3) / 1e9
    row["ours_gflop_s"] = flop / (row["ours_ms"] * 1e-3) / 1e9
    if copy_gb_s:
        row["byte_floor_ms"] = kv_bytes / (copy_gb_s * 1e9) * 1e3
        row["ours_over_floor"] = row["ours_ms"] / row["byte_floor_ms"]
    if fma_peak_gflop_s:
        row["flop_floor_ms"] = flop / (fma_peak_gflop_s * 1e9) * 1e3
        row["ours_over_floor"] = row["ours_ms"] / row["flop_floor_ms"]
    for peer in ("ggml", "torch", "numpy_ref"):
        if f"{peer}_ms" in row:
            row[f"ours_over_{peer}"] = row["ours_ms"] / row[f"{peer}_ms"]
    return row


def print_table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    cols = [("what", "what"), ("depth", "depth"), ("workgroups", "nwg"), ("ours_ms", "ours ms"), ("ggml_ms", "ggml ms"),
            ("ours_over_ggml", "ours/ggml"), ("torch_ms", "torch ms"), ("ours_over_torch", "ours/torch"),
            ("device_io_ms", "device I/O ms"), ("device_io_over_torch", "device I/O/torch"),
            ("numpy_ref_ms", "numpy f64 ms"), ("ours_gb_s", "ours GB/s"), ("ours_gflop_s", "ours GFLOP/s"),
            ("flop_floor_ms", "FLOP floor ms"), ("byte_floor_ms", "byte floor ms"), ("ours_over_floor", "ours/floor")]
    cols = [c for c in cols if any(c[0] in r for r in rows)]
    for _, name in cols:
        t.add_column(name, justify="right")
    for r in rows:
        t.add_row(*[(f"{r[k]:.3g}" if isinstance(r.get(k), float) else str(r.get(k, ""))) for k, _ in cols])
    # a log file is not a terminal: rich would fold the table into 80 columns and cut every figure to "0.04…"
    Console(width=None if sys.stdout.isatty() else 200).print(t)


def report(rows: list[dict], info: dict, args, argv, title: str) -> int:
    """Print the table and write the JSON (rows, machine, the command that made them)."""
    info = {**info, "command": "muser-bench " + " ".join(argv if argv is not None else sys.argv[1:]),
            "rows": rows}
    print_table(rows, title)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(info, indent=2))
    return 0
