#!/usr/bin/env python3
"""What each argument of a Taichi dispatch costs the host, on one backend.

    python scripts/lab/arg_cost.py --arch cuda

A one-thread kernel with A array arguments (1-d or 4-d) and S i32 scalars, dispatched through a
one-dispatch ti.graph as the engine's step is: the host's time in Graph.run, the device idle before
each run (the issue, not the work).  Taichi needs a kernel's source file, so the kernels are written
to a temporary directory.  The slope per argument says what a step saves by binding fewer
(docs/lab/runs.md, run 13).  Medians; rows are printed as JSON lines and written to --json.
"""

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {1: (4,), 4: (2, 2, 2, 2)}


def kernel_with(ti, folder: Path, arrays: int, scalars: int, ndim: int):
    params = [f"a{i}: ti.types.ndarray(dtype=ti.f32, ndim={ndim})" for i in range(arrays)]
    params += [f"s{i}: ti.i32" for i in range(scalars)]
    index = ", ".join(["0"] * ndim)
    path = folder / f"k_{arrays}_{scalars}_{ndim}.py"
    path.write_text(f"import taichi as ti\n\n\ndef k({', '.join(params)}):\n    for _ in range(1):\n"
                    f"        a0[{index}] += 1.0\n")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return ti.kernel(mod.k)


def graph_run_us(ti, kernel, arrays: int, scalars: int, ndim: int, repeats: int) -> float:
    values = {f"a{i}": ti.ndarray(ti.f32, SHAPES[ndim]) for i in range(arrays)}
    values |= {f"s{i}": i for i in range(scalars)}
    symbols = [ti.graph.Arg(ti.graph.ArgKind.NDARRAY, n, dtype=ti.f32, ndim=ndim) for n in values if n[0] == "a"]
    symbols += [ti.graph.Arg(ti.graph.ArgKind.SCALAR, n, ti.i32) for n in values if n[0] == "s"]
    builder = ti.graph.GraphBuilder()
    builder.dispatch(kernel, *symbols)
    graph = builder.compile()
    graph.run(values)
    ts = []
    for _ in range(repeats + 10):
        ti.sync()
        t0 = time.perf_counter()
        graph.run(values)
        ts.append(time.perf_counter() - t0)
    ti.sync()
    return statistics.median(ts[10:]) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="cuda")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    import taichi as ti

    ti.init(arch=getattr(ti, args.arch), offline_cache=False, log_level="warn")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ndim in (1, 4):
            for arrays, scalars in ((1, 0), (4, 0), (8, 0), (16, 0), (1, 8), (1, 16), (1, 32), (16, 16)):
                kernel = kernel_with(ti, Path(tmp), arrays, scalars, ndim)
                row = {"arch": args.arch, "ndim": ndim, "arrays": arrays, "scalars": scalars,
                       "graph_run_us": graph_run_us(ti, kernel, arrays, scalars, ndim, args.repeats)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
