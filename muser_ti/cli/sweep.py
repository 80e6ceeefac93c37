"""Geometry sweeps: short measured decodes over a grid of configs, with CSV, Markdown and plots.

    muser-sweep --config tiny.yaml                   # configs/sweeps/tiny.yaml; results in out/sweeps/ (or: python scripts/sweep.py)
    muser-sweep --config depth.yaml --dry-run        # validate and list the points
    muser-sweep --config depth.yaml --out docs/sweeps   # the committed results (the project's own runs)

A sweep file names a base model config, ``fixed`` values applied to every point, and ``axes``
whose cartesian product gives the points (keys: see AXES below).  Every point is validated before
anything runs.  A bare file name resolves to configs/sweeps/, as muser-decode's resolve to configs/.
Results are appended to the CSV one point at a time, so an interrupted sweep resumes where it stopped:
points whose key is already in the CSV are skipped.  They go to ``out/sweeps/`` under the current folder
unless --out names another: the results committed in docs/sweeps/ are documentation, never a run to resume,
and only a command that names that folder writes there.

How a point is measured (see docs/bandwidth.md for why):
  * prefill depth-1 tokens (chunked), then ``warmup`` + ``steps`` steps each at position depth-1
    (every step is rewound by one token, so all timed steps attend exactly ``depth`` keys);
  * time per step: median wall time of the timed steps;
  * time per route: the same session on single-class sub-geometries (only the SWA layers, only the
    NoPE layers).  All layers of a class share one plane state, so in one token a class takes one
    route; the sub-geometry's step time is that route's time.  (The engine exposes no per-route
    timer, and this uses only its public API.)
  * error: the last timed step against the float64 reference, per route over that route's layers.
"""

from __future__ import annotations

import csv
import itertools
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import muser_ti as mt
from muser_ti import backend, bandwidth, ladder
from muser_ti.cli import ArgumentParser, Interrupted, guarded, need, progress_bars
from muser_ti.config import NOPE, SWA, SWEEP_DIR, read_yaml, resolve_config_path, top_level
from muser_ti.planes import PlaneError, PlaneSet
from muser_ti.reference import relative_error
GEOMETRY_AXES = ("n_heads", "n_kv_heads", "head_dim", "n_layers", "layer_pattern", "window", "swa_ring_slack",
                 "max_context")
ENGINE_AXES = ("arch", "pinned", "graph", "capacity")
AXES = GEOMETRY_AXES + ENGINE_AXES + ("depth",)
RUN_KEYS = {"steps": 3, "warmup": 1, "check": True, "check_max_depth": None, "seed": 0, "prefill_chunk": 1024,
            "per_route": True, "floor_gbps": None}
ENGINE_DEFAULTS = {"arch": "cpu", "pinned": "auto", "graph": "teacher", "capacity": None}
DEFAULT_OUT = Path("out") / "sweeps"  # under the current folder; /out/ is ignored by git


class SweepError(ValueError):
    """The sweep file or one of its points is invalid; raised before anything runs."""


# ---- the sweep file -----------------------------------------------------------------------------
@dataclass
class Point:
    values: dict  # axis and fixed values for this point
    geometry: mt.Geometry
    depth: int
    engine: dict  # arch, pinned, graph, capacity

    @property
    def key(self) -> str:
        return json.dumps(self.values, sort_keys=True)


@dataclass
class Sweep:
    name: str
    path: Path
    base: mt.Geometry
    fixed: dict
    axes: dict
    run: dict
    points: list[Point] = field(default_factory=list)


def _check_value(src: str, axis: str, value):
    """Type/range checks the geometry validator does not cover (engine and session axes)."""
    if axis == "arch" and value not in ("auto", "cpu", "cuda", "vulkan", "metal"):
        raise SweepError(f"{src}: arch {value!r}: expected one of auto, cpu, cuda, vulkan, metal")
    if axis == "pinned" and value not in ("auto", "on", "off"):
        raise SweepError(f"{src}: pinned {value!r}: expected auto, on or off")
    if axis == "graph" and value not in ("teacher", "serving"):
        raise SweepError(f"{src}: graph {value!r}: expected teacher or serving")
    if axis in ("capacity", "depth") and value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise SweepError(f"{src}: {axis} {value!r}: expected a positive integer")


def _pinned_status(arch: str) -> tuple[bool, str]:
    """mt.pinned_library_status, looked up at call time, with or without the arch argument."""
    try:
        return mt.pinned_library_status(arch)
    except TypeError:
        return mt.pinned_library_status()


def _resolve_point(src: str, base: mt.Geometry, values: dict) -> Point:
    """Validate one point without building anything on a device."""
    if isinstance(values.get("pinned"), bool):  # YAML 1.1 reads a bare on/off as true/false
        values["pinned"] = "on" if values["pinned"] else "off"
    for axis, value in values.items():
        _check_value(src, axis, value)
    geo_changes = {a: values[a] for a in GEOMETRY_AXES if a in values}
    try:
        g = base.with_overrides(**geo_changes)
    except mt.ConfigError as exc:
        raise SweepError(f"{src}: point {values}: {exc}") from None
    engine = {a: values.get(a, ENGINE_DEFAULTS[a]) for a in ENGINE_AXES}
    depth = values.get("depth", min(g.window, g.max_context))
    if depth > g.max_context:
        raise SweepError(f"{src}: point {values}: depth {depth} passes max_context={g.max_context}")
    # The planes' own pre-write checks, on host bookkeeping only: can this session reach the depth?
    cap = engine["capacity"]
    for kind, layers in ((SWA, g.swa_layers), (NOPE, g.nope_layers)):
        if not layers:
            continue
        limit = (cap if cap is not None else g.swa_ring_capacity) if kind == SWA else min(cap or g.max_context, g.max_context)
        try:
            ps = PlaneSet(g, kind, layers, limit)
            if depth > 1:
                ps.state = ps.check_prefill(0, depth - 1)
            ps.check_append(depth - 1)
        except PlaneError as exc:
            raise SweepError(f"{src}: point {values}: {exc}") from None
    if engine["graph"] == "serving" and engine["pinned"] != "on":
        raise SweepError(f"{src}: point {values}: graph=serving stages llama.cpp's cells for its kernel: it needs pinned=on")
    if engine["pinned"] == "on":
        loaded, why = _pinned_status(engine["arch"])
        if not loaded:
            what = "pinned=on" if engine["pinned"] == "on" else "graph=serving"
            raise SweepError(f"{src}: point {values}: {what} needs the pinned llama library, which is unavailable: {why}")
    return Point(values, g, depth, engine)


def resolve_sweep_path(name_or_path: str | Path) -> Path:
    """A bare file name (no directory part) that is not a file here resolves to configs/sweeps/; anything
    else is a path (load_config's rule, one folder down)."""
    p = Path(name_or_path)
    if p.parent == Path(".") and not p.exists():
        p = SWEEP_DIR / p
    return p


def load_sweep(path: str | Path) -> Sweep:
    """Read and validate a sweep file and every one of its points (a bare name resolves to configs/sweeps/)."""
    path = resolve_sweep_path(path)
    raw = read_yaml(path, f"no such sweep file (bare names resolve to {SWEEP_DIR})", SweepError)
    src = str(path)
    if not isinstance(raw, dict):
        raise SweepError(f"{src}: expected a mapping with keys name, base, fixed, axes, run at the top level, got "
                         f"{top_level(raw)}")
    unknown = sorted(set(raw) - {"name", "description", "base", "fixed", "axes", "run"})
    if unknown:
        raise SweepError(f"{src}: unknown key(s) {unknown}; allowed: name, description, base, fixed, axes, run")
    if "base" not in raw or "axes" not in raw:
        raise SweepError(f"{src}: needs 'base' (a model config) and 'axes' (what to vary)")
    base_path = Path(raw["base"])
    if not base_path.is_absolute() and (path.parent / base_path).is_file():
        base_path = path.parent / base_path  # relative to the sweep file first, then configs/
    try:
        base = mt.load_config(resolve_config_path(base_path) if not base_path.is_file() else base_path)
    except mt.ConfigError as exc:
        raise SweepError(f"{src}: base: {exc}") from None
    fixed = raw.get("fixed") or {}
    axes = raw["axes"]
    run = dict(RUN_KEYS)
    for section, mapping in (("fixed", fixed), ("axes", axes), ("run", raw.get("run") or {})):
        if not isinstance(mapping, dict):
            raise SweepError(f"{src}: '{section}' must be a mapping")
    for section, mapping in (("fixed", fixed), ("axes", axes)):
        bad = sorted(set(mapping) - set(AXES))
        if bad:
            raise SweepError(f"{src}: {section}: unknown axis {bad}; axes are {list(AXES)}")
    both = sorted(set(fixed) & set(axes))
    if both:
        raise SweepError(f"{src}: {both} both fixed and swept")
    if not axes:
        raise SweepError(f"{src}: axes: nothing to vary")
    for axis, values in axes.items():
        if not isinstance(values, list) or not values:
            raise SweepError(f"{src}: axes: {axis}: expected a non-empty list of values, got {values!r}")
    bad = sorted(set(raw.get("run") or {}) - set(RUN_KEYS))
    if bad:
        raise SweepError(f"{src}: run: unknown option(s) {bad}; options are {list(RUN_KEYS)}")
    run.update(raw.get("run") or {})
    for k in ("steps", "prefill_chunk"):
        if isinstance(run[k], bool) or not isinstance(run[k], int) or run[k] < 1:
            raise SweepError(f"{src}: run: {k} {run[k]!r}: expected a positive integer")
    if isinstance(run["warmup"], bool) or not isinstance(run["warmup"], int) or run["warmup"] < 0:
        raise SweepError(f"{src}: run: warmup {run['warmup']!r}: expected an integer >= 0")
    name = raw.get("name") or path.stem
    sweep = Sweep(name, path, base, fixed, axes, run)
    names = list(axes)
    for combo in itertools.product(*(axes[a] for a in names)):
        values = dict(fixed) | dict(zip(names, combo))
        sweep.points.append(_resolve_point(src, base, values))
    return sweep


# ---- measuring one point ------------------------------------------------------------------------
def _session(g, point: Point, run: dict, rng_seed: int, check: bool):
    """Prefill to depth-1, then warmup + timed steps at position depth-1 (rewound after each)."""
    eng = mt.Engine(g, **point.engine)
    rng = np.random.default_rng(rng_seed)
    L, H, KV, D = g.n_layers, g.n_heads, g.n_kv_heads, g.head_dim
    done, target = 0, point.depth - 1
    while done < target:  # chunked: a [131072, L, KV, D] f32 array at once would not fit
        n = min(run["prefill_chunk"], target - done)
        eng.prefill(rng.standard_normal((n, L, KV, D), dtype=np.float32),
                    rng.standard_normal((n, L, KV, D), dtype=np.float32))
        done += n
    times, err, read = [], None, None
    for i in range(run["warmup"] + run["steps"]):
        q = rng.standard_normal((L, H, D), dtype=np.float32)
        k = rng.standard_normal((L, KV, D), dtype=np.float32)
        v = rng.standard_normal((L, KV, D), dtype=np.float32)
        t0 = time.perf_counter()
        out = eng.step(q, k, v)
        dt = time.perf_counter() - t0
        if i >= run["warmup"]:
            times.append(dt)
        if i == run["warmup"] + run["steps"] - 1:  # inspect the last step before the rewind moves position
            read = eng.kv_bytes_last_step()
            if check:
                ref = eng.reference(q, k, v)
                err = {r: relative_error(out[ls], ref[ls]) for r, ls in _layers_by_route(eng.routes).items()}
        eng.rewind(point.depth - 1)  # every timed step attends exactly `depth` keys
    return eng, times, err, read


def _layers_by_route(routes) -> dict[str, list[int]]:
    by = {}
    for layer, r in enumerate(routes):
        by.setdefault(r, []).append(layer)
    return by


def measure_copy_gbps(mb: int = 128) -> float:
    """This machine's copy bandwidth (read + write bytes per second, best of 5): the floor's rate."""
    a = np.ones(mb * 1 << 20, np.uint8)
    b = np.empty_like(a)
    best = min(_timed(np.copyto, b, a) for _ in range(5))
    return 2 * a.nbytes / best / 1e9


def _timed(f, *args) -> float:
    t0 = time.perf_counter()
    f(*args)
    return time.perf_counter() - t0


def measure_point(point: Point, run: dict, floor_gbps: float) -> dict:
    g = point.geometry
    check = run["check"] and (run["check_max_depth"] is None or point.depth <= run["check_max_depth"])
    eng, times, err, read = _session(g, point, run, run["seed"], check)
    routes = list(eng.routes)
    by_route = _layers_by_route(routes)
    row = {"key": point.key} | {a: json.dumps(v) if isinstance(v, list) else v for a, v in point.values.items()}
    row |= {
        "model": g.name, "n_layers": g.n_layers, "n_swa": len(g.swa_layers), "n_nope": len(g.nope_layers),
        "window": g.window, "n_kv_heads": g.n_kv_heads, "head_dim": g.head_dim, "depth": point.depth,
        "arch": eng.arch, "pinned": point.engine["pinned"], "pinned_loaded": eng.pinned_loaded,
        "graph": eng.graph, "capacity": point.engine["capacity"] or "", "steps": len(times),
        "step_s": statistics.median(times), "step_s_min": min(times), "launches": eng.launches_last_step,
        "kv_bytes": read, "kv_bytes_model": bandwidth.kv_bytes(g, point.depth),
        "floor_gbps": floor_gbps, "routes": ";".join(f"{r}:{len(ls)}" for r, ls in by_route.items()),
    }
    row["gbps"] = row["kv_bytes"] / row["step_s"] / 1e9
    row["floor_s"] = row["kv_bytes"] / (floor_gbps * 1e9)
    row["err_max"] = max(err.values()) if err else ""
    # Per-route time from single-class sub-geometries (see the module docstring).
    route_time = {}
    classes = [(k, ls) for k, ls in ((SWA, g.swa_layers), (NOPE, g.nope_layers)) if ls]
    for kind, layers in classes:
        if len(classes) == 1:
            sub_routes, sub_times = routes, times
        elif run["per_route"]:
            sub = g.with_overrides(layer_pattern=[kind], n_layers=len(layers))
            sub_eng, sub_times, _, _ = _session(sub, point, run, run["seed"] + 1, False)
            sub_routes = sub_eng.routes
            del sub_eng
        else:
            continue
        for r in set(sub_routes):
            route_time[r] = statistics.median(sub_times)
    for r in ladder.ROUTES:
        ls = by_route.get(r, [])
        rbytes = sum(bandwidth.visible_rows(g, g.layer_kinds[i], point.depth) for i in ls) * g.kv_bytes_per_row
        row[f"{r}_layers"] = len(ls)
        row[f"{r}_bytes"] = rbytes
        row[f"{r}_floor_s"] = rbytes / (floor_gbps * 1e9) if ls else ""
        row[f"{r}_s"] = route_time.get(r, "") if ls else ""
        row[f"{r}_err"] = err.get(r, "") if err and ls else ""
    return row


# ---- CSV with resume ----------------------------------------------------------------------------
def columns(sweep: Sweep) -> list[str]:
    cols = ["key"] + list(sweep.fixed) + list(sweep.axes)
    fixed = ["model", "n_layers", "n_swa", "n_nope", "window", "n_kv_heads", "head_dim", "depth", "arch", "pinned",
             "pinned_loaded", "graph", "capacity", "steps", "step_s", "step_s_min", "launches", "kv_bytes",
             "kv_bytes_model", "gbps", "floor_gbps", "floor_s", "err_max", "routes"]
    per_route = [f"{r}_{c}" for r in ladder.ROUTES for c in ("layers", "s", "bytes", "floor_s", "err")]
    return list(dict.fromkeys(cols + fixed + per_route))  # axis names that are also result names appear once


def read_rows(csv_path: Path, cols: list[str]) -> list[dict]:
    if not csv_path.exists():
        return []
    with csv_path.open(newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames != cols:
            raise SweepError(f"{csv_path}: written by a different sweep layout (columns differ); "
                             f"rerun with --fresh to start over")
        return list(reader)


# ---- the job ------------------------------------------------------------------------------------
def run_sweep(sweep: Sweep, out_dir: Path, fresh: bool = False, quiet: bool = False, plots: bool = True) -> dict:
    """Measure the points not yet in ``out_dir``'s CSV; Ctrl-C becomes Interrupted, naming what is kept."""
    need("rich", "muser-sweep", "its progress bar")
    if plots:
        need("matplotlib", "muser-sweep", "its plots; --no-plots writes the CSV and the table without it")
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    csv_path = out_dir / f"{sweep.name}.csv"
    cols = columns(sweep)
    done = set() if fresh else {r["key"] for r in read_rows(csv_path, cols)}
    todo = [p for p in sweep.points if p.key not in done]
    for arch in dict.fromkeys(p.engine["arch"] for p in todo):
        backend.activate(arch)  # a backend this machine lacks fails here, before anything is written
    out_dir.mkdir(parents=True, exist_ok=True)
    if fresh and csv_path.exists():
        csv_path.unlink()
    floor = sweep.run["floor_gbps"] or (measure_copy_gbps() if todo else None)
    new_file = not csv_path.exists()
    already = len(sweep.points) - len(todo)
    # no bar for a sweep with nothing left to run: main's line says so (a bar would read "0/0")
    with csv_path.open("a", newline="") as f, progress_bars(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            disable=quiet or not todo) as progress:
        writer = csv.DictWriter(f, fieldnames=cols)
        if new_file:
            writer.writeheader()
        resumed = f", resuming: {already} of {len(sweep.points)} points already in the CSV" if already else ""
        task = progress.add_task(f"{sweep.name}{resumed}", total=len(todo))
        measured = 0
        try:
            for p in todo:
                label = ", ".join(f"{a}={p.values[a]}" for a in sweep.axes)
                progress.update(task, description=f"{sweep.name}: {label}")
                writer.writerow(measure_point(p, sweep.run, floor))
                f.flush()  # one point at a time: an interrupted sweep keeps what it measured
                measured += 1
                progress.advance(task)
        except KeyboardInterrupt:
            raise Interrupted(f"interrupted after {measured} of {len(todo)} point(s); {len(done) + measured} are in "
                              f"{csv_path}, and the same command resumes from there") from None
    from .sweep_report import write_markdown, write_plots

    rows = read_rows(csv_path, cols)
    md = write_markdown(sweep, rows, out_dir)
    pngs = write_plots(sweep, rows, out_dir) if plots else []
    return {"executed": len(todo), "skipped": len(sweep.points) - len(todo), "csv": csv_path, "md": md, "png": pngs}


def outcome(name: str, executed: int, skipped: int, csv_path: Path) -> str:
    """What a run did: measured every point, resumed after the CSV's, or found them all there."""
    if not executed:
        return f"{name}: all {skipped} points already in {csv_path}; nothing to run (--fresh measures them again)"
    if skipped:
        return f"{name}: resumed: ran {executed} point(s) after the {skipped} already in {csv_path}"
    return f"{name}: ran {executed} point(s) into {csv_path}"


def parser() -> ArgumentParser:
    ap = ArgumentParser(prog="muser-sweep", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True,
                    help="sweep file: a path, or a bare name in configs/sweeps/ (tiny.yaml, depth.yaml, ...); required, "
                         "no default")
    ap.add_argument("--out", default=str(DEFAULT_OUT),
                    help="output folder, under the current folder unless absolute (the committed results are in "
                         "docs/sweeps/)")
    ap.add_argument("--fresh", action="store_true", help="discard this sweep's CSV in --out and measure every point again")
    ap.add_argument("--dry-run", action="store_true", help="validate and list the points; run nothing")
    ap.add_argument("--no-plots", action="store_true", help="write the CSV and the table only (no matplotlib needed)")
    return ap


@guarded(SweepError)
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    sweep = load_sweep(args.config)
    if args.dry_run:
        for p in sweep.points:
            print(p.key)
        print(f"{len(sweep.points)} points, all valid")
        return 0
    res = run_sweep(sweep, Path(args.out), fresh=args.fresh, plots=not args.no_plots)
    print(outcome(sweep.name, res["executed"], res["skipped"], res["csv"]))
    print(f"wrote {res['md']}" + "".join(f", {p}" for p in res["png"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
