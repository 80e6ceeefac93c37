"""The folded layer kernel's producer against the separate serial producer, on the CPU, through the C-API (the lab).

kernels/layer_kernel.py folds a layer's scan, store, producer and merge into one kernel; its producer part runs the
same per-item ti.func as kernels/producer.serial_producer_kernel, but inside a larger kernel, which LLVM may compile
differently.  This times, on one thread and in one process, alternating call by call over the same arguments:

* ``serial``  the serial producer kernel (every item of the layer, first 0, stride 1);
* ``fold``    the folded kernel with parts = LAYER_PRODUCE (the same items, nothing else);
* ``all``     the folded kernel with every part (scan, store, producer, merge): what a short layer launches.

    python scripts/lab/fold_cost.py --depth 2048 --depth 32768 --calls 30
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main() -> None:
    import muser_ti as mt
    from muser_ti import aot, layer_launch
    from muser_ti.config import load_config
    from muser_ti.kernels.layer_kernel import LAYER_ALL, LAYER_PRODUCE
    from muser_ti.planes import visible_span, window_of

    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, action="append")
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    cfg = load_config("glimmer.yaml")
    for depth in args.depth or [2048, 32768]:
        eng = mt.Engine(cfg, arch="cpu", launch="capi")
        rng = np.random.default_rng(0)
        L, H, KV, D = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        for start in range(0, depth, 1024):
            n = min(1024, depth - start)
            eng.prefill(rng.standard_normal((n, L, KV, D), dtype=np.float32),
                        rng.standard_normal((n, L, KV, D), dtype=np.float32))
        launcher = eng.launcher
        compiled = launcher.compiled_layers()
        serial = {"splitk": launcher.producer_one[launcher.splitk],
                  "interleaved": launcher.producer_one[launcher.interleaved]}
        path, _ = aot.module_dir("cpu", {name: (k, ("fold_cost serial", name, depth > 0)) for name, k in serial.items()})
        module = compiled.rt.load_module(path)
        handles = {name: compiled.rt.kernel(module, name) for name in serial}
        packed = layer_launch.ArgumentArrays()
        t = eng.token()
        q, k, v = (rng.standard_normal(s, dtype=np.float32) for s in ((L, H, D), (L, KV, D), (L, KV, D)))
        for layer in (0, cfg.nope_layers[0]):
            t.next_layer = layer
            t.attend(layer, q[layer], k[layer], v[layer])  # the layer's arguments, filled as the path fills them
            p, new_states, routes, _ = t.plans[0]
            route, kind = routes[layer], cfg.layer_kinds[layer]
            st = new_states[kind]
            nwg, nsg = launcher.split_geometry(visible_span(cfg, kind, p)[1], t.route_sizes[0][route])
            grp = eng.cache.token_group(layer)
            staging = launcher.layer_device_arrays()
            sargs = (*staging[:3], eng.cache.k[kind], eng.cache.v[kind], launcher.partials_for(kind, 1, nwg),
                     launcher._no_visits, grp.layers_dev, grp.slots_dev, 1, p, window_of(cfg, kind), st.capacity,
                     st.origin_logical, st.origin_physical, nwg, nsg, cfg.attention_scale, 0, 1)
            s_packed = packed(("serial", route), sargs, len(sargs), compiled.imported, compiled.rt)
            fold = compiled._args[layer]["args"]
            launch, handle = compiled._launch, compiled._handle
            times = {"serial": [], "fold": [], "all": []}

            def run_fold(parts):
                fold[layer_launch._PARTS].value.i32 = parts
                fold[layer_launch._FIRST].value.i32, fold[layer_launch._STRIDE].value.i32 = 0, 1
                launch(handle, compiled.k[route], layer_launch.LAYER_ARGS, fold)

            ways = {"serial": lambda: launch(handle, handles[route], len(sargs), s_packed),
                    "fold": lambda: run_fold(LAYER_PRODUCE), "all": lambda: run_fold(LAYER_ALL)}
            for i in range(args.calls + 3):
                for name in (list(ways) if i % 2 else list(ways)[::-1]):
                    t0 = time.perf_counter()
                    ways[name]()
                    if i >= 3:
                        times[name].append(time.perf_counter() - t0)
            med = {name: statistics.median(ts) * 1e6 for name, ts in times.items()}
            print(f"depth {depth:>6} layer {layer} ({route}, {KV * nwg} items): serial producer {med['serial']:8.1f} us,"
                  f" fold's producer {med['fold']:8.1f} us ({med['fold'] / med['serial']:.3f}x), fold whole "
                  f"{med['all']:8.1f} us", flush=True)
        t.abandon()


if __name__ == "__main__":
    main()
