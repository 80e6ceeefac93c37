"""Will this run compile kernels, and did it?  muser-decode's "compiling kernels" line and its first step's words.

Taichi compiles a kernel the first time a process calls it, unless its offline cache (``~/.cache/taichi/ticache``
unless TI_OFFLINE_CACHE_FILE_PATH says otherwise) holds it: one file ``T<key>.tic`` a kernel, the key a hash of
the kernel's IR and the compile settings, so a kernel whose source or geometry changed is a new file.  Taichi
writes the kernels a process compiled when its program ends (``ti.reset()``, or exit), and nothing in its API
says whether a call compiled or loaded (its compile-time counter counts the loads too; the time a load takes
is no guide either, as a cached CPU kernel is still JIT-linked).  So:

* After the fact, exactly: a run compiled iff, once it has made Taichi write its cache (``Watch.finish``), the
  folder holds ``.tic`` files it did not hold when the run began.  (Another process compiling into the same
  folder at the same time would count too; nothing else adds files there.)
* Before the run, from what earlier runs saw: a run that ended leaves a marker in Taichi's cache folder, named
  by what selects its kernels (Taichi's version, the arch, the geometry, the options, and the source of the
  package's files that define kernels), listing the cache files it added.  A session is warm iff its marker is
  there and every file it lists still is: a cache folder deleted, cleaned by ``ti cache clean`` or switched
  makes it cold.  The package's other files are left out of the name: editing the engine's bookkeeping leaves
  the kernels, and their cache files, as they were.  Where a change outside those files does change a
  kernel, the run compiles without the notice, and its summary still says it compiled.

The check reads the kernel files (a few hundred kB) and lists one folder: milliseconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

MARKERS = "muser_ti_warm"  # the markers' folder inside Taichi's cache folder
PACKAGE = Path(__file__).resolve().parents[1]
NOT_ENGINE = ("cli", "bench", "integrations")  # the package's folders whose kernels no session runs
DEFINES_KERNELS = re.compile(r"@ti\.(kernel|func)\b|ti\.kernel\(")


def _cache_folder() -> Path | None:
    """Taichi's offline cache folder for the running Taichi, or None where the cache is off."""
    import taichi as ti

    cfg = ti.lang.impl.current_cfg()
    return Path(cfg.offline_cache_file_path) if cfg.offline_cache else None


def kernel_sources() -> list[Path]:
    """The package's files that define Taichi kernels or functions: the source a kernel's IR comes from."""
    files = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] not in NOT_ENGINE and DEFINES_KERNELS.search(path.read_text()):
            files.append(path)
    return files


def session_key(geometry, arch: str, **options) -> str:
    """A digest of what selects a session's kernels: Taichi's version, the arch, the geometry (its name and
    source aside), the engine's options, and the files that define kernels."""
    import taichi as ti

    h = hashlib.sha256()
    fields = {k: v for k, v in dataclasses.asdict(geometry).items() if k not in ("name", "source")}
    h.update(json.dumps([ti.__version__, arch, fields, options], sort_keys=True, default=str).encode())
    for path in kernel_sources():
        h.update(path.relative_to(PACKAGE).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:24]


def cache_files(folder: Path | None) -> set[str]:
    """The kernel files in Taichi's cache folder (none where the cache is off or not yet made)."""
    if folder is None or not folder.is_dir():
        return set()
    return {p.name for p in folder.glob("T*.tic")}


class Watch:
    """One run's view of Taichi's cache: ``cold`` before it (the prediction), ``finish()`` after (the fact)."""

    def __init__(self, key: str):
        self.key = key
        self.folder = _cache_folder()
        self.before = cache_files(self.folder)
        self.cold = not self._marked_warm()

    def _marker(self) -> Path | None:
        return None if self.folder is None else self.folder / MARKERS / self.key

    def _listed(self) -> set[str] | None:
        """The cache files this session's marker lists; None without a (readable) marker."""
        marker = self._marker()
        if marker is None or not marker.is_file():
            return None
        try:
            listed = json.loads(marker.read_text() or "[]")
            return {str(name) for name in listed} if isinstance(listed, list) else None
        except (OSError, ValueError):
            return None  # a broken marker: the session is cold until a run writes it again

    def _marked_warm(self) -> bool:
        listed = self._listed()
        return listed is not None and listed <= self.before

    def finish(self) -> bool:
        """End Taichi's program, so that it writes the kernels it compiled into its cache (call once the engine is
        no longer used), and return whether this run compiled any; record the session as warm for the next."""
        from .. import backend

        backend.release()
        if self.folder is None:
            return True  # no offline cache: every run compiles
        now = cache_files(self.folder)
        added = now - self.before
        marker = self._marker()
        if added or not self._marked_warm():
            try:
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text(json.dumps(sorted(((self._listed() or set()) & now) | added)))
            except OSError:
                pass  # a read-only cache: the next run is predicted cold, and its summary says what happened
        return bool(added)


def shown_folder() -> str:
    """Taichi's cache folder as a user would type it (``~`` for the home folder)."""
    folder = _cache_folder()
    if folder is None:
        return "nowhere: Taichi's offline cache is off"
    try:
        return "~/" + folder.relative_to(Path.home()).as_posix()
    except ValueError:
        return str(folder)
