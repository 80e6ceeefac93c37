"""Engine snapshots: a session's whole cache in one safetensors file, restored bit for bit.

What a snapshot holds (everything the next token depends on, nothing else):

* every plane's live rows, as f16 tensors in the engine's own layouts:
  ``swa.k`` / ``swa.v``   [n_swa_layers, capacity, n_kv_heads, head_dim]: the whole ring (a ring's
  rows are its live window; rows of a partially wrapped ring that no token owns are kept too, which
  costs nothing and keeps the plane bit-identical);
  ``nope.k`` / ``nope.v`` [n_nope_layers, n_kv_heads, len, head_dim]: rows [0, len) of the growing plane;
* with graph='serving', llama.cpp's cell-order SWA cache (``serving.k``, ``serving.v``, ``serving.pos``),
  since the cells attended (and so the pinned kernel's reduction lanes) depend on its history;
* in the header's JSON metadata: a format name and version, the geometry, the position, each plane's
  len / capacity / origin_logical / origin_physical / cap (the most rows it may hold: the per-session
  capacity), the route counts and last routes, and a SHA-256 over the state and every tensor's bytes.

Writes are atomic: the file is written under a temporary name in the same directory, flushed to
disk, then renamed over the destination, so a crash mid-save leaves either the old file or none, and
never one that loads; a save refuses a destination that exists and is not a regular file, and removes
the temporary files an interrupted save to the same path left.  Loads are all-or-nothing: the file is
read and checked completely (format, version, geometry, dtypes, shapes, missing or unknown tensors,
plane invariants, values, route counts, checksum) before the engine is touched or anything is
allocated for it; a refused file raises :class:`SnapshotError` and leaves the engine unchanged.

A file is untrusted input.  The checksum only tells that the contents are what was written (anyone can
compute one): every value is checked as if it were not there.  What a load allocates follows from the
tensors in the file and the geometry (the rings' rows are in the file; a NoPE plane is loaded into
the allocation its live rows need, planes.fresh_capacity, not the one the file names), never from a
number the file merely states.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import tempfile
from dataclasses import fields
from pathlib import Path

import numpy as np

from .config import NOPE, SWA, Geometry, geometry_from_dict
from .errors import ConfigError, SnapshotError, shown
from .kv_cache import PLANE_DTYPE, STATE_FIELDS as _STATE_FIELDS, KVCache
from .planes import PlaneState, fresh_capacity, plane_shape

FORMAT = "muser-ti-snapshot"
VERSION = 1
_META_KEY = "muser_ti"
_SUM_KEY = "sha256"


# ---- geometry <-> JSON -------------------------------------------------------------------------
def _geometry_dict(g: Geometry) -> dict:
    out = {f.name: getattr(g, f.name) for f in fields(g) if f.name != "source"}
    out["layer_pattern"] = list(g.layer_pattern)
    return out


def _geometry_diff(a: Geometry, b: Geometry) -> list[str]:
    da, db = _geometry_dict(a), _geometry_dict(b)
    return [f"{k}: file {da[k]!r} vs engine {db[k]!r}" for k in da if da[k] != db[k]]


def _checksum(meta_json: str, tensors: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256(meta_json.encode())
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}".encode())
        h.update(a.reshape(-1).view(np.uint8))
    return h.hexdigest()


# ---- save --------------------------------------------------------------------------------------
def file_meta(geometry: Geometry, session: dict) -> dict:
    """The header's metadata: format, version, geometry, and the session (a cache's state_dict meta with the
    engine's ``graph``, ``route_counts`` and ``routes``)."""
    return {"format": FORMAT, "version": VERSION, "geometry": _geometry_dict(geometry), "dtype": "float16", **session}


def save(path: str | os.PathLike, geometry: Geometry, tensors: dict[str, np.ndarray], session: dict) -> Path:
    """Write a session (Engine.snapshot_contents) to ``path`` (safetensors), atomically: temp file, fsync,
    rename."""
    from safetensors.numpy import save_file

    path = Path(path)
    if path.exists() and not path.is_file():  # a device node, a FIFO, a folder: never replaced by a rename
        raise SnapshotError(f"snapshot {path}: exists and is not a regular file; refusing to write over it")
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():  # named here: the first write would be the hidden temporary file's
        what = "is not a folder" if directory.exists() else "does not exist (save does not create folders)"
        raise SnapshotError(f"snapshot {path}: the folder {directory} {what}")
    for stray in directory.glob(f".{glob.escape(path.name)}.*.tmp"):  # an interrupted save's leftovers
        if stray.is_file() and not stray.is_symlink():
            stray.unlink(missing_ok=True)
    meta_json = json.dumps(file_meta(geometry, session), sort_keys=True)
    header = {_META_KEY: meta_json, _SUM_KEY: _checksum(meta_json, tensors)}
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise SnapshotError(f"snapshot {path}: cannot write in the folder {directory}: {exc.strerror}") from None
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=header)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):  # a full disk, a lost folder: named by the snapshot, not the temporary file
            raise SnapshotError(f"snapshot {path}: writing failed: {exc.strerror or exc}") from exc
        raise
    try:  # make the rename itself durable
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
    return path


# ---- load --------------------------------------------------------------------------------------
class _Snapshot:
    """A file read and checked in full: geometry, state and tensors (host copies)."""

    def __init__(self, path: Path, geometry: Geometry, meta: dict, tensors: dict[str, np.ndarray]):
        self.path, self.geometry, self.meta, self.tensors = path, geometry, meta, tensors

    @property
    def position(self) -> int:
        return self.meta["position"]

    def state(self, kind: str) -> PlaneState:
        p = self.meta["planes"][kind]
        return PlaneState(**{f: p[f] for f in _STATE_FIELDS})

    @property
    def load_meta(self) -> dict:
        """The meta a cache loads: a NoPE plane's capacity is what its live rows need (planes.fresh_capacity)."""
        planes = {kind: dict(p) for kind, p in self.meta["planes"].items()}
        if NOPE in planes:
            planes[NOPE]["capacity"] = fresh_capacity(planes[NOPE]["cap"], planes[NOPE]["len"])
        return {**self.meta, "planes": planes}

    def cap(self, kind: str) -> int:
        return self.meta["planes"][kind]["cap"]

    @property
    def session_capacity(self) -> int | None:
        """The Engine(capacity=...) argument the session was made with."""
        return KVCache.session_capacity(self.geometry, {kind: p["cap"] for kind, p in self.meta["planes"].items()})


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read(path: str | os.PathLike) -> _Snapshot:
    """Read and validate a snapshot file completely (nothing is touched); SnapshotError if refused."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    where = f"snapshot {path}"
    if not path.is_file():
        raise SnapshotError(f"{where}: no such file")
    try:
        with safe_open(str(path), framework="numpy") as f:
            header = f.metadata() or {}
            names = list(f.keys())
            tensors = {name: f.get_tensor(name) for name in names}
    except (SafetensorError, OSError, ValueError, TypeError) as exc:
        raise SnapshotError(f"{where}: not a readable safetensors file (truncated or corrupt?): {exc}") from None

    if _META_KEY not in header:
        raise SnapshotError(f"{where}: no '{_META_KEY}' metadata in the header: not a muser-ti snapshot")
    meta_json = header[_META_KEY]
    try:
        meta = json.loads(meta_json)
    except json.JSONDecodeError as exc:
        raise SnapshotError(f"{where}: metadata is not valid JSON: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise SnapshotError(f"{where}: format {meta.get('format') if isinstance(meta, dict) else meta!r}, expected {FORMAT!r}")
    if meta.get("version") != VERSION:
        raise SnapshotError(f"{where}: format version {meta.get('version')!r}; this build reads version {VERSION}")
    if meta.get("dtype") != "float16":
        raise SnapshotError(f"{where}: plane dtype {meta.get('dtype')!r}; the engine's planes are float16")
    if header.get(_SUM_KEY) != _checksum(meta_json, tensors):
        raise SnapshotError(f"{where}: checksum mismatch: the file's contents were changed or corrupted after it was written")
    try:
        geom = geometry_from_dict(meta["geometry"], source=f"{where} geometry")
    except (ConfigError, KeyError, TypeError) as exc:
        raise SnapshotError(f"{where}: bad geometry: {exc}") from None

    # State: every field present, integers, and the plane invariants the engine keeps.
    position = meta.get("position")
    if not _int(position) or not 0 <= position <= geom.max_context:
        raise SnapshotError(f"{where}: position {position!r} is not an integer in [0, max_context={geom.max_context}]")
    kinds = {kind for kind in (SWA, NOPE) if getattr(geom, f"{kind}_layers")}
    planes = meta.get("planes")
    if not isinstance(planes, dict) or set(planes) != kinds:
        raise SnapshotError(f"{where}: planes {sorted(planes) if isinstance(planes, dict) else planes!r}, "
                            f"expected {sorted(kinds)} for this geometry")
    for kind, p in planes.items():
        bad = [f for f in _STATE_FIELDS + ("cap",) if not (isinstance(p, dict) and _int(p.get(f)) and p.get(f) >= 0)]
        if bad:
            raise SnapshotError(f"{where}: {kind} plane: field(s) {bad} missing or not non-negative integers")
        st = PlaneState(**{f: p[f] for f in _STATE_FIELDS})
        problems = []
        if not 1 <= st.capacity <= p["cap"]:
            problems.append(f"capacity {st.capacity} not in [1, cap={p['cap']}]")
        if st.len > st.capacity:
            problems.append(f"len {st.len} > capacity {st.capacity}")
        if st.origin_physical >= st.capacity:
            problems.append(f"origin_physical {st.origin_physical} >= capacity {st.capacity}")
        if st.origin_logical + st.len != position:
            problems.append(f"origin_logical {st.origin_logical} + len {st.len} != position {position}")
        if kind == NOPE and (st.origin_physical or st.origin_logical):
            problems.append("a NoPE plane never wraps (origins must be 0)")
        if kind == SWA and st.capacity != p["cap"]:
            problems.append(f"ring capacity {st.capacity} != its cap {p['cap']}")
        if problems:
            raise SnapshotError(f"{where}: {kind} plane state is inconsistent: {'; '.join(problems)}")

    if KVCache.session_capacity(geom, {kind: p["cap"] for kind, p in planes.items()}) is False:
        raise SnapshotError(f"{where}: plane caps {({k: p['cap'] for k, p in planes.items()})} follow neither from the "
                            "geometry nor from any per-session capacity")

    # Tensors: exactly the expected names, dtypes and shapes.
    expected: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    KV, D = geom.n_kv_heads, geom.head_dim
    for kind in kinds:
        n = len(getattr(geom, f"{kind}_layers"))
        st = PlaneState(**{f: planes[kind][f] for f in _STATE_FIELDS})
        shape = plane_shape(geom, kind, n, st.capacity if kind == SWA else st.len)  # NoPE: live rows only
        expected[f"{kind}.k"] = expected[f"{kind}.v"] = (shape, np.dtype(PLANE_DTYPE))
    graph = meta.get("graph")
    if graph not in ("teacher", "serving"):
        raise SnapshotError(f"{where}: graph {graph!r}, expected 'teacher' or 'serving'")
    if graph == "serving" and SWA in kinds:
        from .pinned.llama_rung import LLAMA_KV_PAD, pad

        cells = pad(geom.window + geom.n_ubatch, LLAMA_KV_PAD)
        n_swa = len(geom.swa_layers)
        expected["serving.k"] = expected["serving.v"] = ((n_swa, cells, KV, D), np.dtype(PLANE_DTYPE))
        expected["serving.pos"] = ((cells,), np.dtype(np.int64))
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise SnapshotError(f"{where}: missing tensor(s) {missing}")
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise SnapshotError(f"{where}: unexpected tensor(s) {unknown}")
    for name, (shape, dtype) in expected.items():
        a = tensors[name]
        if a.dtype != dtype:
            raise SnapshotError(f"{where}: tensor {name!r} has dtype {a.dtype}, expected {dtype}")
        if a.shape != shape:
            raise SnapshotError(f"{where}: tensor {name!r} has shape {a.shape}, expected {shape}")
    for name in expected:
        if name != "serving.pos" and not np.isfinite(tensors[name]).all():  # f16: inf past 65504, or NaN
            where_bad = tuple(int(i) for i in np.argwhere(~np.isfinite(tensors[name]))[0])
            raise SnapshotError(f"{where}: tensor {name!r} holds {tensors[name][where_bad]} at {where_bad}: the planes hold "
                                f"finite f16 values only")
    if "serving.pos" in tensors:
        pos = tensors["serving.pos"]
        cells = np.arange(len(pos))
        held = pos >= 0
        if (pos < -1).any() or (pos >= position).any() or (pos[held] % len(pos) != cells[held]).any():
            raise SnapshotError(f"{where}: tensor 'serving.pos' is not llama.cpp's cell order for position {position} "
                                f"(each cell -1, or a token t < {position} with t % {len(pos)} its index)")
    from .ladder import ROUTES

    counts = meta.get("route_counts", {})
    if not isinstance(counts, dict) or any(r not in ROUTES or not _int(c) or c < 0 for r, c in counts.items()):
        raise SnapshotError(f"{where}: route_counts {shown(counts)}: expected a mapping of routes {list(ROUTES)} "
                            f"to non-negative integers")
    routes = meta.get("routes")
    if not isinstance(routes, list) or len(routes) != geom.n_layers or any(r is not None and r not in ROUTES
                                                                           for r in routes):
        raise SnapshotError(f"{where}: routes {shown(routes)}: expected one route of {list(ROUTES)} (or null) for "
                            f"each of the {geom.n_layers} layers")
    return _Snapshot(path, geom, meta, tensors)


def check_fits(snap: _Snapshot, cache: KVCache) -> None:
    """Refuse a snapshot that does not describe this cache's session (before anything is written)."""
    where = f"snapshot {snap.path}"
    diff = _geometry_diff(snap.geometry, cache.cfg)
    if diff:
        raise SnapshotError(f"{where}: saved for another geometry ({'; '.join(diff)})")
    for kind, ps in cache.planes.items():
        if snap.cap(kind) != ps.cap:
            raise SnapshotError(f"{where}: the {kind} plane may hold {snap.cap(kind)} rows in the file but "
                                f"{ps.cap} in this engine (a different per-session capacity)")
    if cache.serving is not None and snap.meta["graph"] != "serving":
        raise SnapshotError(f"{where}: saved from graph={snap.meta['graph']!r}; a serving engine needs llama.cpp's "
                            "cell-order cache, which that file does not hold")
