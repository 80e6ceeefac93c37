"""Is Taichi's kernel cache cold for this session?  muser-decode's "compiling kernels" line.

Taichi compiles a kernel the first time a process calls it and keeps the result in its offline cache
(``~/.cache/taichi/ticache`` unless TI_OFFLINE_CACHE_FILE_PATH says otherwise); a later run loads it from
there in a few seconds.  Which kernels a session calls depends on the arch, the geometry, the options and
the package's own source, and Taichi cannot be asked whether it holds them without compiling them.  So
a session that has run its first step leaves a marker of its own in Taichi's cache folder, named by a
digest of all of those; a session whose marker is missing (or whose cache folder is gone, or off) starts
cold.  The check reads the package's source files (a few hundred kB) and one path: milliseconds.  Deleting
Taichi's cache folder deletes the markers with it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

MARKERS = "muser_ti_warm"  # the markers' folder inside Taichi's cache folder
PACKAGE = Path(__file__).resolve().parents[1]
NOT_ENGINE = ("cli", "bench", "integrations")  # the package's folders whose source no engine kernel depends on


def _cache_folder() -> Path | None:
    """Taichi's offline cache folder for the running Taichi, or None where the cache is off."""
    import taichi as ti

    cfg = ti.lang.impl.current_cfg()
    return Path(cfg.offline_cache_file_path) if cfg.offline_cache else None


def session_key(geometry, arch: str, **options) -> str:
    """A digest of what the session's kernels depend on: Taichi's version, the arch, the geometry (its
    name and source aside), the engine's options and the engine's source files (the commands', the
    benchmarks' and the integrations' aside)."""
    import taichi as ti

    h = hashlib.sha256()
    fields = {k: v for k, v in dataclasses.asdict(geometry).items() if k not in ("name", "source")}
    h.update(json.dumps([ti.__version__, arch, fields, options], sort_keys=True, default=str).encode())
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] in NOT_ENGINE:
            continue
        h.update(path.relative_to(PACKAGE).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:24]


def is_cold(key: str) -> bool:
    folder = _cache_folder()
    return folder is None or not (folder / MARKERS / key).is_file()


def mark_warm(key: str) -> None:
    """Record that a session with this key has compiled its kernels (best effort: a read-only cache is cold)."""
    folder = _cache_folder()
    if folder is None:
        return
    try:
        (folder / MARKERS).mkdir(parents=True, exist_ok=True)
        (folder / MARKERS / key).touch()
    except OSError:
        pass


def shown_folder() -> str:
    """Taichi's cache folder as a user would type it (``~`` for the home folder)."""
    folder = _cache_folder()
    if folder is None:
        return "nowhere: Taichi's offline cache is off"
    try:
        return "~/" + folder.relative_to(Path.home()).as_posix()
    except ValueError:
        return str(folder)
