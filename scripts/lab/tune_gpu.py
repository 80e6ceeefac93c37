#!/usr/bin/env python3
"""GPU tuning measurements that need one process per backend, not one per variant.

    python scripts/lab/tune_gpu.py tiles --arch cuda --depths 2048,131072 --variants ";block;unroll=1"
    python scripts/lab/tune_gpu.py step --arch cuda --depth 2048
    python scripts/lab/tune_gpu.py trace --depths 2048,131072 --trace-dir out/traces
    python scripts/lab/tune_gpu.py launch --arch cuda
    python scripts/lab/tune_gpu.py paths --arch cuda --depths 2048,131072
    python scripts/lab/tune_gpu.py stephost --arch cuda --depth 2048
    python scripts/lab/tune_gpu.py pipeline --arch vulkan --depth 2048
    python scripts/lab/tune_gpu.py readback --arch vulkan --rounds 3
    python scripts/lab/tune_gpu.py wake --arch vulkan --depths 2048 --rounds 3     # as root

tiles: one NoPE layer (interleaved producer + reducer) per depth, prefilled once; every tile variant
(a tile choice, "" = the default plan) is built, checked against the float64 reference on
the same planes, and timed: device time from Taichi's kernel profiler where it is on (CUDA), the
wall time of 20 back-to-back launches, and with --graph K the device's time per layer with the host's
launches and waits taken out: K and 3K producer + reducer pairs replayed as one ti.graph each, to
completion, the difference over 2K pairs (the run's fixed costs, a Vulkan wait among them, cancel; each
dispatch's host issue, ~8-21 us in a graph, runs under the one before it wherever a pair takes longer).
Vulkan has no profiler here, and its Python launches cost more than a shallow layer's kernels (run 26).
A variant that fails the accuracy bound is reported as such.

step: where a whole 52-layer step's wall time goes at one depth: input checks, the uploads, the
replayed graph alone, the download, against the full step, with the CUDA driver copies and with
Taichi's from_numpy/to_numpy (transfer.py); with --graph K also the step graph's device time, as tiles
takes it.

trace (CUDA, needs torch): the step's timeline from CUPTI through torch.profiler, both ways in (numpy
through step(), device arrays through step_device()): per step its wall time, the time the GPU ran
kernels, the idle gaps between them, each kernel's device time, and the host's driver calls by name.
Taichi launches through the driver API on the primary context, so CUPTI sees its kernels and calls.

launch: what one Taichi dispatch costs the host, apart from any kernel's work: graphs of 1 and 8
dispatches of a one-thread kernel with 2, 10 scalar or 7 array arguments, timed without a sync (the
host's issue time) and with one; and the same kernels called from Python.

paths: the one-dispatch step (kernels/one_dispatch.py) against the graph route, in one process and on the
same engine, in alternating rounds of each: step() and step_device(), to the device's completion,
with the host's time inside Taichi's graph launch (C++ included).  --paths one,direct,graph picks them;
"direct" is the one dispatch (and step_device's scan) launched from Python instead of a ti.graph, which
came back sooner on the H200's Vulkan in three of four single measurements (docs/lab/runs.md, run 26).
Run 11 also kept the CUDA driver's default memory pool (Taichi's per-launch buffers) across
synchronisations: no change, so it is gone.
Between processes on the lent H200 the host's speed moved torch's launch-bound step by 1.7x (run 11),
more than the difference measured here.

stephost: where the host's time in a one-dispatch step goes, at one depth: the step's own graph replayed
with the values it was given through Taichi's Python wrapper (Graph.run) and through its C++ entry
(jit_run), the CompileConfig copy the wrapper makes per run, the engine's own entry (replay.py, which
calls jit_run), and the engine's Python share of step_device: the same call with the graph run and the
flags read stubbed out, rewound after each (rewind_us apart).  (Run 13 also timed kernels with the
step's arguments and trivial bodies; those had its 32 arguments and are gone with them.)

readback: what it costs the host to learn a few device flags after a kernel wrote them (step_device's
one wait a token): an idle sync, the engine's download with nothing to wait for, the kernel and a sync,
and the kernel followed by each way of reading an i32 array back (transfer.py's download, to_numpy,
indexing it from Python) or a kernel that returns the flagged bits as its value.

wake (as root): readback's ways and whole steps (step and step_device, each to the device's completion),
with the CPUs' wake-up latency free, then held at 0 (scripts/lab/wake_latency.py: the idle loop polls instead
of halting), then free again, --rounds rounds each, on one engine per depth.  On a VM a waiting thread's
vCPU may halt until the device's interrupt wakes it.  On lavapipe here (run 27) the engine's download after a
kernel fell from 727-788 to 320-340 us held, and stayed there in the same process after the release, so
"free after held" is its own phase, not a round of "free".

pipeline: where a pipelined step_device token's wall time goes with deferred checks (bench.py's
"pipelined_deferred"): N tokens issued back to back, then eng.sync() and ti.sync(); per token, the host's
issue (until the N calls return) and the wait after them, for N = 16, 64 and 192, and an idle ti.sync() alone.
If the total per token tracks the issue, the host bounds the token, not the device.

Every figure is a median; rows are printed as JSON lines and written to --json.
"""


import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import muser_ti as mt
from muser_ti import inputs
from muser_ti.cli.bench_common import device_token, layer_geometry, prefill, random_token, rewound_median
from muser_ti.cli.bench_gpu import cupti_layer_row
from muser_ti.bench.timing import graph_repeat_us, median_time as median_s, recorded_dispatches
from muser_ti.bench.timing import profile_calls, summarize_trace
from muser_ti.kernels.common import HEAD_MAJOR
from muser_ti.kernels.producer import addressing, build_gpu_producer, tile_plan
from muser_ti.kernels.producer.gpu_common import SHARED_BUDGET_BYTES
from muser_ti.kernels.split_geometry import gpu_items_cap, gpu_target_workgroups
from muser_ti.reference import relative_error
from muser_ti.replay import graph_arg
from muser_ti.tolerances import F32_ROUTE_RTOL


def emit(row: dict, rows: list) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)


def tiles(args, rows) -> None:
    import taichi as ti

    base = mt.load_config(args.config)
    profiled = os.environ.get("MUSER_TI_KERNEL_PROFILER") == "1"
    rng = np.random.default_rng(args.seed)
    producers: dict = {}  # plan -> kernel, built once and reused at every depth
    for depth in args.depths:
        cfg = layer_geometry(base, "interleaved", depth)
        eng = mt.Engine(cfg, arch=args.arch, force="interleaved", pinned="off")
        prefill(eng, depth - 1, rng)
        q, k, v = random_token(cfg, rng)
        eng.step(q, k, v)
        ref = eng.reference(q, k, v)
        st, p, layers = eng.planes["nope"].state, eng.position - 1, tuple(cfg.nope_layers)
        budget = SHARED_BUDGET_BYTES[eng.arch]
        default = None
        for variant in args.variants:
            row = {"what": "tile variant", "arch": eng.arch, "depth": depth, "variant": variant or "default"}
            # a variant: "block" or "warp" (the tile), "unroll=N" (the warp tile's), "wg=N" (the split's
            # workgroup target, MUSER_GPU_TARGET_WORKGROUPS), comma-separated
            parts = [x for x in variant.split(",") if x]
            tile = next((x for x in parts if x in ("block", "warp")), None)
            unroll = [int(x[7:]) for x in parts if x.startswith("unroll=")]
            target = [x[3:] for x in parts if x.startswith("wg=")]
            if target:
                os.environ["MUSER_GPU_TARGET_WORKGROUPS"] = target[0]
            else:
                os.environ.pop("MUSER_GPU_TARGET_WORKGROUPS", None)
            eng.launcher.target = gpu_target_workgroups()  # an engine keeps the target it was made with
            eng.launcher.items_cap = gpu_items_cap(eng.launcher.target, cfg.n_layers * cfg.n_kv_heads)
            try:
                plan = tile_plan(cfg.heads_per_kv, cfg.head_dim, budget, eng.arch, tile=tile,
                                 unroll=unroll[0] if unroll else None)
            except ValueError as exc:
                emit({**row, "error": str(exc)}, rows)
                continue
            row["plan"] = {"kind": type(plan).__name__, **dataclasses.asdict(plan)}
            if (plan, eng.launcher.items_cap) not in producers:
                producers[plan, eng.launcher.items_cap] = build_gpu_producer(
                    plan, cfg.n_kv_heads, bypass=True, record=False, at=addressing(HEAD_MAJOR, cfg.n_kv_heads),
                    items_cap=eng.launcher.items_cap)
            producer = producers[plan, eng.launcher.items_cap]

            def launch():
                eng.launcher.run_producer(producer, eng.launcher.reduce_v2, "nope", layers, st, p, eng.launcher.k_cur, eng.launcher.v_cur, eng.launcher.out)

            eng.launcher.out.fill(float("nan"))  # the variant must write every output itself
            t0 = time.perf_counter()
            launch()
            ti.sync()
            row["first_launch_s"] = round(time.perf_counter() - t0, 2)  # the compile, at the first depth
            out = eng.launcher.out.to_numpy()
            row["rel_err"] = float(relative_error(out, ref)) if np.isfinite(out).all() else float("nan")
            row["bits_as_default"] = bool(np.array_equal(out, default)) if default is not None else True
            default = out if default is None else default
            row["accurate"] = row["rel_err"] <= F32_ROUTE_RTOL
            if profiled:
                dev = []
                for _ in range(args.repeats):
                    ti.sync()
                    ti.profiler.clear_kernel_profiler_info()
                    launch()
                    ti.sync()
                    dev.append(ti.profiler.get_kernel_profiler_total_time())
                row["device_us"] = statistics.median(dev) * 1e6

            def burst():
                for _ in range(20):
                    launch()
                ti.sync()

            row["wall_us"] = median_s(burst, args.repeats) / 20 * 1e6
            if args.graph:
                row["graph_us"] = graph_repeat_us(recorded_dispatches(eng.launcher, launch), args.graph, args.repeats)
            row["workgroups"] = eng.split_geometry(depth, 1)[0]
            emit(row, rows)
        os.environ.pop("MUSER_GPU_TARGET_WORKGROUPS", None)



def step(args, rows) -> None:
    import taichi as ti

    cfg = mt.load_config(args.config)
    rng = np.random.default_rng(args.seed)
    eng = mt.Engine(cfg, arch=args.arch, pinned="off")
    prefill(eng, args.depth - 1, rng)
    q, k, v = random_token(cfg, rng)
    p = eng.position
    recorded = []
    replay = eng.launcher.graphs.run
    eng.launcher.graphs.run = lambda d, external=(): (recorded.append(list(d)), replay(d, external))[1]

    def one_step():
        if eng.position > p:
            eng.rewind(p)
        eng.step(q, k, v)

    row = {"what": "step breakdown", "arch": eng.arch, "depth": args.depth, "transfer": eng.launcher.transfer.path}
    row["step_us"] = median_s(one_step, args.repeats, warmup=3) * 1e6
    out_fast = eng.launcher.out.to_numpy()
    dispatches = recorded[-1]
    row["checks_us"] = median_s(lambda: inputs.step_token(eng.cfg, q, k, v), args.repeats) * 1e6

    def graph_only():
        replay(dispatches)
        ti.sync()

    row["graph_us"] = median_s(graph_only, args.repeats) * 1e6
    row["sync_us"] = median_s(ti.sync, args.repeats) * 1e6
    if args.graph:  # the graph's device time alone, its host issue and waits taken out (graph_repeat_us)
        row["graph_device_bound_us"] = graph_repeat_us(dispatches, args.graph, args.repeats)
    if os.environ.get("MUSER_TI_KERNEL_PROFILER") == "1":  # device time of the graph's kernels (CUDA)
        dev = []
        for _ in range(args.repeats):
            ti.sync()
            ti.profiler.clear_kernel_profiler_info()
            graph_only()
            dev.append(ti.profiler.get_kernel_profiler_total_time())
        row["graph_device_us"] = statistics.median(dev) * 1e6
    # each dispatch of the graph launched on its own, then synchronised: which kernel the time is in
    row["dispatch_us"] = {f"{i}:{getattr(kernel, '__name__', 'kernel')}": median_s(
        lambda: (kernel(*a), ti.sync()), args.repeats) * 1e6 for i, (kernel, a) in enumerate(dispatches)}
    row["upload_q_taichi_us"] = median_s(lambda: (eng.launcher.q.from_numpy(q), ti.sync()), args.repeats) * 1e6
    row["download_taichi_us"] = median_s(lambda: eng.launcher.out.to_numpy(), args.repeats) * 1e6
    # the engine's own copies (transfer.py, row["transfer"]: the driver on CUDA, a copy kernel elsewhere)
    row["upload_q_transfer_us"] = median_s(lambda: eng.launcher.transfer.upload(eng.launcher.q, q), args.repeats) * 1e6
    row["download_transfer_us"] = median_s(lambda: eng.launcher.transfer.download(eng.launcher.out, q.shape), args.repeats) * 1e6
    if eng.launcher.transfer.path == "cuMemcpy":
        eng.launcher.transfer._driver = None  # the same step through Taichi's copies
        row["step_taichi_copies_us"] = median_s(one_step, args.repeats, warmup=2) * 1e6
        row["same_output_both_paths"] = bool(np.array_equal(eng.launcher.out.to_numpy(), out_fast))
    row["launches"] = eng.launches_last_step
    emit(row, rows)


def trace(args, rows) -> None:
    """The step's timeline through torch.profiler (CUPTI): see the module docstring."""
    import taichi as ti
    import torch

    cfg = mt.load_config(args.config)
    rng = np.random.default_rng(args.seed)
    torch.zeros(1, device="cuda")  # CUDA up before the profiler starts
    for depth in args.depths:
        eng = mt.Engine(cfg, arch=args.arch, pinned="off")
        prefill(eng, depth - 1, rng)
        q, k, v = random_token(cfg, rng)
        dev = device_token(q, k, v)
        out = ti.ndarray(ti.f32, q.shape)
        p = eng.position

        def rewound():
            if eng.position > p:
                eng.rewind(p)
            ti.sync()

        for way, call in (("step", lambda: eng.step(q, k, v)),
                          ("step_device", lambda: (eng.step_device(*dev, out), ti.sync()))):
            for _ in range(3):  # compile and warm, untimed
                rewound()
                call()
            ti.sync()
            path = Path(args.trace_dir) / f"trace-{eng.arch}-{depth}-{way}.json"
            events = profile_calls(call, args.repeats, before=rewound, after=ti.sync, path=path)
            row = {"what": "step trace", "arch": eng.arch, "depth": depth, "way": way, "trace": path.name,
                   **summarize_trace(events, args.repeats)}
            row["python_top"] = python_profile(call, args.repeats, before=rewound)
            emit(row, rows)
        if args.layers:
            trace_layer(args, rows, base_cfg=cfg, depth=depth, rng=rng)


def trace_layer(args, rows, base_cfg, depth: int, rng) -> None:
    """One NoPE layer's producer + reducer under CUPTI (bench.cupti_layer_row)."""
    cfg = layer_geometry(base_cfg, "interleaved", depth)
    eng = mt.Engine(cfg, arch=args.arch, force="interleaved", pinned="off")
    prefill(eng, depth - 1, rng)
    eng.step(*random_token(cfg, rng))
    path = Path(args.trace_dir) / f"trace-{eng.arch}-{depth}-layer.json"
    emit({"what": "layer trace", "arch": eng.arch, "depth": depth, "way": "one NoPE layer", "trace": path.name,
          "workgroups": eng.split_geometry(depth, 1)[0], **cupti_layer_row(eng, "interleaved", args.repeats, path),
          "python_top": []}, rows)


def readback_ways(eng: mt.Engine) -> dict:
    """The ways to learn a few device flags that a kernel just wrote (readback's rows), on eng's arch."""
    import taichi as ti

    from muser_ti.kernels.token_scan import TOKEN_FLAGS
    from muser_ti.transfer import Transfer

    shape = (TOKEN_FLAGS + eng.cfg.n_layers,)
    flags = ti.ndarray(ti.i32, shape)
    flags.fill(0)
    transfer = Transfer()

    @ti.kernel
    def mark(f: ti.types.ndarray(dtype=ti.i32, ndim=1), stamp: ti.i32):
        for i in range(TOKEN_FLAGS):
            ti.atomic_max(f[i], stamp * (i == TOKEN_FLAGS - 1))

    @ti.kernel
    def flagged_bits(f: ti.types.ndarray(dtype=ti.i32, ndim=1), stamp: ti.i32) -> ti.i32:
        bits = 0  # no loop at the kernel's top level: one serial task, so one thread writes bits
        for i in ti.static(range(TOKEN_FLAGS)):
            if f[i] == stamp:
                bits |= 1 << i
        return bits

    stamp = [0]

    def marked(read):
        def call():
            stamp[0] += 1
            mark(flags, stamp[0])
            got = read()
            assert got == 1 << (TOKEN_FLAGS - 1), (got, stamp[0])  # each way must see this stamp's flag
        return call

    def bits_of(host):
        return sum(1 << i for i in range(TOKEN_FLAGS) if host[i] == stamp[0])

    return {
        "idle sync": ti.sync,
        # the download with no kernel to wait for: its own fixed cost (copy kernel, buffers, one more wait)
        "idle transfer.download": lambda: transfer.download(flags, shape),
        "kernel + sync": lambda: (mark(flags, 0), ti.sync()),
        "kernel + transfer.download": marked(lambda: bits_of(transfer.download(flags, shape))),
        "kernel + to_numpy": marked(lambda: bits_of(flags.to_numpy())),
        "kernel + index from Python": marked(lambda: bits_of([flags[i] for i in range(TOKEN_FLAGS)])),
        "kernel + returning kernel": marked(lambda: flagged_bits(flags, stamp[0])),
    }


def readback(args, rows) -> None:
    """Ways to read the token flags back, each after a kernel that wrote them: see the module docstring."""
    ways = readback_ways(mt.Engine(mt.load_config(args.config), arch=args.arch, pinned="off"))
    for _ in range(args.rounds):  # alternating rounds: a slow spell of the host falls on every way
        for name, call in ways.items():
            row = {"what": "readback", "arch": args.arch, "way": name,
                   "median_us": median_s(call, args.repeats, warmup=3) * 1e6}
            emit(row, rows)


def wake(args, rows) -> None:
    """Readback's ways and whole steps with the CPUs' wake-up latency free, held at 0 (scripts/lab/wake_latency.py),
    then free again, on one engine per depth: see the module docstring."""
    import taichi as ti

    from wake_latency import cpuidle_description, hold_wake_latency

    cfg = mt.load_config(args.config)
    rng = np.random.default_rng(args.seed)
    idle = cpuidle_description()
    for depth in args.depths:
        eng = mt.Engine(cfg, arch=args.arch, pinned="off")
        prefill(eng, depth - 1, rng)
        base = eng.position
        q, k, v = random_token(cfg, rng)
        dev = device_token(q, k, v)
        out = ti.ndarray(ti.f32, q.shape)
        ways = readback_ways(eng)
        steps = {"step + sync": lambda: (eng.step(q, k, v), ti.sync()),
                 "step_device + sync": lambda: (eng.step_device(*dev, out), ti.sync())}
        times: dict = {}
        # phases, not alternation: on lavapipe here, once held the latency stayed low for the process after
        # release (run 27), so a free round after a held one would not measure "free"; the third phase says
        # whether this host keeps it too
        for phase in ("free", "held", "free after held"):
            with hold_wake_latency(0) if phase == "held" else contextlib.nullcontext():
                for _ in range(args.rounds):
                    for name, call in ways.items():
                        times.setdefault((phase, name), []).append(median_s(call, args.repeats, warmup=3))
                    for name, call in steps.items():
                        eng.rewind(base)
                        times.setdefault((phase, name), []).append(
                            rewound_median(eng, call, args.repeats, warmup=2, settle=ti.sync))
        for (phase, name), ts in times.items():
            emit({"what": "wake latency", "arch": eng.arch, "depth": depth, "phase": phase, "way": name,
                  "median_us": statistics.median(ts) * 1e6, "round_medians_us": [t * 1e6 for t in ts],
                  "cpuidle": idle}, rows)


def python_profile(call, repeats: int, before, top: int = 12) -> list:
    """The host's Python time in ``call`` by function (cProfile, own time), the largest first; ``before``
    runs unprofiled ahead of each call."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(repeats):
        before()
        prof.enable()
        call()
        prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(((v[2] / repeats * 1e6, v[3] / repeats * 1e6, f"{Path(k[0]).name}:{k[1]}:{k[2]}")
                   for k, v in stats.items()), reverse=True)[:top]
    return [{"fn": name, "own_us": round(own, 1), "cum_us": round(cum, 1)} for own, cum, name in rows]


def launch(args, rows) -> None:
    """Host cost per dispatch: see the module docstring."""
    import taichi as ti

    mt.Engine(mt.load_config(args.config), arch=args.arch, pinned="off")  # Taichi up on the arch
    a1, a3 = ti.types.ndarray(dtype=ti.f32, ndim=1), ti.types.ndarray(dtype=ti.f32, ndim=3)

    @ti.kernel
    def two(x: a1, n: ti.i32):
        for _ in range(1):
            x[0] = n

    @ti.kernel
    def scalars(x: a1, n: ti.i32, b: ti.i32, c: ti.i32, d: ti.i32, e: ti.i32, f: ti.i32, g: ti.i32, h: ti.i32,
                s: ti.f32):
        for _ in range(1):
            x[0] = n + b + c + d + e + f + g + h + s

    @ti.kernel
    def arrays(x: a1, y: a3, z: a3, w: a3, u: a3, v: a1, n: ti.i32):
        for _ in range(1):
            x[0] = y[0, 0, 0] + z[0, 0, 0] + w[0, 0, 0] + u[0, 0, 0] + v[0] + n

    x, y = ti.ndarray(ti.f32, (4,)), ti.ndarray(ti.f32, (2, 2, 2))
    cases = {"2 args": (two, [x, 1]), "10 scalar args": (scalars, [x, 1, 2, 3, 4, 5, 6, 7, 8, 1.0]),
             "7 array args": (arrays, [x, y, y, y, y, x, 1])}
    for label, (kernel, kargs) in cases.items():
        for n in (1, 8):
            builder = ti.graph.GraphBuilder()
            symbols = [graph_arg(f"a{j}", a) for j, a in enumerate(kargs)]
            for _ in range(n):
                builder.dispatch(kernel, *symbols)
            graph = builder.compile()
            values = {f"a{j}": a for j, a in enumerate(kargs)}
            graph.run(values)
            ti.sync()
            issue = median_s(lambda: graph.run(values), args.repeats * 4, warmup=3)
            ti.sync()
            synced = median_s(lambda: (graph.run(values), ti.sync()), args.repeats * 4, warmup=3)
            emit({"what": "launch cost", "arch": args.arch, "kernel": label, "dispatches": n,
                  "graph_issue_us": issue * 1e6, "graph_issue_per_dispatch_us": issue / n * 1e6,
                  "graph_synced_us": synced * 1e6}, rows)
        kernel(*kargs)
        ti.sync()
        direct = median_s(lambda: kernel(*kargs), args.repeats * 4, warmup=3)
        ti.sync()
        emit({"what": "launch cost", "arch": args.arch, "kernel": label, "python_call_issue_us": direct * 1e6}, rows)
    emit({"what": "launch cost", "arch": args.arch, "idle_sync_us": median_s(ti.sync, args.repeats * 4) * 1e6}, rows)


PATHS = {  # paths' names: (--paths key, the one-dispatch step kernel?, its dispatches launched from Python?)
    "one dispatch": ("one", True, False),
    "one dispatch, launched from Python": ("direct", True, True),  # no ti.graph: run 26's lead on Vulkan
    "graph route": ("graph", False, False),
}


def paths(args, rows) -> None:
    """One-dispatch step against the graph route: see the module docstring."""
    import taichi as ti

    from muser_ti import replay

    wanted = set(args.paths.split(","))
    known = {key for key, _, _ in PATHS.values()}
    if wanted - known:
        raise SystemExit(f"paths --paths: {sorted(wanted - known)}; expected some of {sorted(known)}")
    chosen = [path for path, (key, _, _) in PATHS.items() if key in wanted]
    cfg = mt.load_config(args.config)
    rng = np.random.default_rng(args.seed)
    in_run = [0.0]
    run = replay._Compiled.run

    def timed_run(self, flat):  # the host's time in Taichi's graph launch (C++ included)
        t0 = time.perf_counter()
        run(self, flat)
        in_run[0] += time.perf_counter() - t0

    replay._Compiled.run = timed_run
    for depth in args.depths:
        eng = mt.Engine(cfg, arch=args.arch, pinned="off")
        if not eng.one_dispatch_step:
            raise SystemExit(f"paths: {eng.arch} has no one-dispatch step")
        prefill(eng, depth - 1, rng)
        base = eng.position
        q, k, v = random_token(cfg, rng)
        dev = device_token(q, k, v)
        out = ti.ndarray(ti.f32, q.shape)
        one = eng.launcher.step_kernel
        calls = {"step": lambda: (eng.step(q, k, v), ti.sync()),
                 "step_device": lambda: (eng.step_device(*dev, out), ti.sync())}
        times, launches, runs = {}, {}, {}
        graphed = eng.launcher.graphs.run
        direct = lambda dispatches, external=(): [kernel(*a) for kernel, a in dispatches]  # noqa: E731
        for _ in range(args.rounds):
            for path in chosen:
                _, one_dispatch, from_python = PATHS[path]
                eng.launcher.step_kernel = one if one_dispatch else None
                eng.launcher.graphs.run = direct if from_python else graphed
                for way, call in calls.items():
                    eng.rewind(base)
                    in_run[0] = 0.0
                    times.setdefault((path, way), []).append(rewound_median(eng, call, args.repeats, warmup=2,
                                                                            settle=ti.sync))
                    runs.setdefault((path, way), []).append(in_run[0] / (args.repeats + 2))
                    launches[path, way] = eng.launches_last_step
        eng.launcher.step_kernel, eng.launcher.graphs.run = one, graphed
        for (path, way), ts in times.items():
            emit({"what": "step path", "arch": eng.arch, "depth": depth, "path": path, "way": way,
                  "median_us": statistics.median(ts) * 1e6, "round_medians_us": [t * 1e6 for t in ts],
                  "graph_run_us": statistics.median(runs[path, way]) * 1e6, "launches": launches[path, way]}, rows)
    replay._Compiled.run = run


def stephost(args, rows) -> None:
    """The one dispatch's host time, taken apart: see the module docstring."""
    import taichi as ti
    from taichi.lang import impl

    from muser_ti import replay

    cfg = mt.load_config(args.config)
    rng = np.random.default_rng(args.seed)
    eng = mt.Engine(cfg, arch=args.arch, pinned="off")
    prefill(eng, args.depth - 1, rng)
    q, k, v = random_token(cfg, rng)
    dev = device_token(q, k, v)
    out = ti.ndarray(ti.f32, q.shape)
    seen = []  # the step's compiled graph and its arguments, as the engine's replay ran them
    run = replay._Compiled.run
    replay._Compiled.run = lambda self, flat: (seen.append((self, list(flat))), run(self, flat))[1]
    eng.step_device(*dev, out)
    ti.sync()
    replay._Compiled.run = run
    compiled, flat_list = seen[-1]
    graph, values = compiled.graph, dict(zip(compiled.names, flat_list))
    repeats = args.repeats * 4

    def host_time(call):
        """Median host time of call(), the device idle before each (the issue, not the work)."""
        ts = []
        for _ in range(repeats + 3):
            ti.sync()
            t0 = time.perf_counter()
            call()
            ts.append(time.perf_counter() - t0)
        ti.sync()
        return statistics.median(ts[3:]) * 1e6

    names = list(values)
    row = {"what": "step host parts", "arch": eng.arch, "depth": args.depth, "arguments": len(names),
           "arrays": sum(isinstance(values[n], ti.Ndarray) for n in names)}
    row["step_graph_run_us"] = host_time(lambda: graph.run(values))
    flat = {n: (a.arr if isinstance(a, ti.Ndarray) else a) for n, a in values.items()}
    config = impl.get_runtime().prog.config()
    row["step_jit_run_us"] = host_time(lambda: graph._compiled_graph.jit_run(config, flat))
    row["config_copy_us"] = host_time(lambda: impl.get_runtime().prog.config())
    row["engine_replay_run_us"] = host_time(lambda: compiled.run(flat_list))  # the engine's own entry
    # the engine's Python share of step_device: the same calls with the graph run and the flags read stubbed
    # out (nothing reaches the device, so each call is a fresh token's bookkeeping; rewound every time)
    base, download = eng.position, eng.launcher.transfer.download
    replay._Compiled.run = lambda self, flat: None
    eng.launcher.transfer.download = lambda dev, shape: np.zeros(shape, np.int32)
    try:
        row["engine_python_us"] = host_time(lambda: (eng.step_device(*dev, out), eng.rewind(base)))
        row["rewind_us"] = host_time(lambda: eng.rewind(base))
    finally:
        replay._Compiled.run, eng.launcher.transfer.download = run, download
    emit(row, rows)


def pipeline(args, rows) -> None:
    """Issue against wait for pipelined step_device tokens: see the module docstring."""
    import taichi as ti

    cfg = mt.load_config(args.config)
    rng = np.random.default_rng(args.seed)
    lengths = (16, 64, 192)  # under REFUSAL_RING (256), where the engine would look at the flags itself
    longest = lengths[-1]
    eng = mt.Engine(cfg.with_overrides(swa_ring_slack=max(cfg.swa_ring_slack, longest)), arch=args.arch,
                    pinned="off", device_checks="deferred")
    prefill(eng, args.depth - longest, rng)
    dev = device_token(*random_token(cfg, rng))
    out = ti.ndarray(ti.f32, dev[0].shape)
    base = eng.position
    row = {"what": "pipelined step_device (deferred checks)", "arch": eng.arch, "depth": args.depth,
           "idle_sync_us": median_s(ti.sync, args.repeats) * 1e6}
    for n in lengths:
        issue, total = [], []
        for _ in range(args.repeats + 2):
            eng.rewind(base)
            ti.sync()
            t0 = time.perf_counter()
            for _ in range(n):
                eng.step_device(*dev, out)
            t1 = time.perf_counter()
            eng.sync()
            ti.sync()
            issue.append((t1 - t0) / n)
            total.append((time.perf_counter() - t0) / n)
        row[f"issue_{n}_us"] = statistics.median(issue[2:]) * 1e6
        row[f"total_{n}_us"] = statistics.median(total[2:]) * 1e6
    hot = []  # 16 tokens issued right behind 16 untimed ones: the device already busy, no idle gap before
    for _ in range(args.repeats + 2):
        eng.rewind(base)
        ti.sync()
        for _ in range(16):
            eng.step_device(*dev, out)
        t0 = time.perf_counter()
        for _ in range(16):
            eng.step_device(*dev, out)
        eng.sync()
        ti.sync()
        hot.append((time.perf_counter() - t0) / 16)
    row["total_16_behind_16_us"] = statistics.median(hot[2:]) * 1e6
    eng.rewind(base)
    emit(row, rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("tiles", "step", "trace", "launch", "paths", "stephost", "readback", "wake",
                                     "pipeline"))
    ap.add_argument("--arch", default="cuda")
    ap.add_argument("--config", default="glimmer.yaml")
    ap.add_argument("--depths", default="2048,131072", help="tiles, trace, paths, wake: comma-separated key counts")
    ap.add_argument("--depth", type=int, default=2048, help="step: the depth")
    ap.add_argument("--variants", default="", help='tiles: variants separated by ";" ("" = default; "block", '
                    '"warp,unroll=1", "wg=528")')
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--graph", type=int, default=0, metavar="K",
                    help="tiles, step: also the device time from K and 3K copies in one graph (0: off)")
    ap.add_argument("--rounds", type=int, default=5, help="paths, readback, wake: alternating rounds of each")
    ap.add_argument("--paths", default="one,graph", help="paths: which, of one, direct and graph")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace-dir", default="out/traces", help="trace: where the chrome traces go")
    ap.add_argument("--layers", action="store_true", help="trace: also one NoPE layer's kernels per depth")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.depths = [int(x) for x in args.depths.split(",") if x]
    args.variants = args.variants.split(";")
    rows: list = []
    {"tiles": tiles, "step": step, "trace": trace, "launch": launch, "paths": paths,
     "stephost": stephost, "readback": readback, "wake": wake, "pipeline": pipeline}[args.mode](args, rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"argv": sys.argv, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
