"""Where the one-dispatch step and the graph route part, bit for bit: partials or output, which class.

tests/test_step_device.py::test_one_dispatch_step_gives_the_graph_routes_bits asserts that the one-dispatch
step (kernels/one_dispatch.py) gives the graph route's output bits.  When it fails on a device, this says at
which stage: each class's partials [M, S, O] (the producers' output) and each layer's output, per token,
with the largest difference in units in the last place.  Equal partials and different outputs put the
difference in the reducer; different partials, in the producer.  The tokens are the test's (window 48,
40 prefilled rows, tests/sessions.py's Session and seed):

    python3 scripts/lab/step_bits.py --arch vulkan --geom gqa16-d128 --dist peaked --tokens 4
"""

import argparse
import importlib.util
import json
from pathlib import Path

import numpy as np

import muser_ti as mt
from muser_ti.config import NOPE, SWA
from muser_ti.planes import visible_span

# the test suite's sessions (tests/sessions.py), loaded by path: the same tokens the test draws
_spec = importlib.util.spec_from_file_location("sessions", Path(__file__).resolve().parents[2] / "tests" / "sessions.py")
_sessions = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_sessions)
GEOMETRIES, Session, geometry = _sessions.GEOMETRIES, _sessions.Session, _sessions.geometry


def ulps(a: np.ndarray, b: np.ndarray) -> int:
    """The largest distance between a and b in f32 units in the last place (0: the same bits)."""
    def line(x):  # f32 bits, sign-magnitude, onto a monotone integer line
        i = np.ascontiguousarray(x, np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)

    d = np.abs(line(a) - line(b))
    return int(d.max()) if d.size else 0


def compare(arch: str, geom: str, dist: str, tokens: int, seed: int) -> list[dict]:
    cfg = geometry(window=48, pattern=("swa", "swa", "swa", "nope"), **GEOMETRIES[geom])
    one = Session(mt.Engine(cfg, arch=arch, pinned="off"), seed=seed, dist=dist)
    graph = mt.Engine(cfg, arch=arch, pinned="off")
    graph.launcher.step_kernel = None  # every step through the graph route
    assert one.eng.one_dispatch_step, f"{arch} has no one-dispatch step for {geom}"
    one.prefill(40, also=graph)
    rows = []
    for t in range(tokens):
        q, k, v = one.token()
        p = one.eng.position
        a, b = one.eng.step(q, k, v), graph.step(q, k, v)
        one.record(k, v)
        row = dict(arch=arch, geom=geom, dist=dist, token=t, position=p,
                   launches=[one.eng.launches_last_step, graph.launches_last_step])
        for kind in (NOPE, SWA):
            layers = one.eng.planes[kind].layers
            nwg, _ = one.eng.split_geometry(visible_span(cfg, kind, p)[1], len(layers))
            pa = one.eng.launcher.partials_for(kind, len(layers), nwg).to_numpy()[:, :, :nwg]
            pb = graph.launcher.partials_for(kind, len(layers), nwg).to_numpy()[:, :, :nwg]
            row[f"{kind}_partials_ulps"] = {"M": ulps(pa[..., 0], pb[..., 0]), "S": ulps(pa[..., 1], pb[..., 1]),
                                            "O": ulps(pa[..., 2:], pb[..., 2:])}
            row[f"{kind}_out_ulps"] = {int(layer): ulps(a[layer], b[layer]) for layer in layers}
        row["out_mismatched"] = int((a != b).sum())
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="vulkan")
    ap.add_argument("--geom", action="append", choices=list(GEOMETRIES), help="repeatable; default: all")
    ap.add_argument("--dist", action="append", help="repeatable; default: peaked, normal")
    ap.add_argument("--tokens", type=int, default=3)
    ap.add_argument("--seed", type=int, default=21, help="the test's seed")
    a = ap.parse_args()
    for geom in a.geom or list(GEOMETRIES):
        for dist in a.dist or ["peaked", "normal"]:
            for row in compare(a.arch, geom, dist, a.tokens, a.seed):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
