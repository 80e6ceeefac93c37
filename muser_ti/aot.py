"""The engine's kernels compiled ahead of time for Taichi's C-API (muser_ti/capi.py), cached on disk.

A set of kernels (name -> the Taichi kernel and the key it was built from) is saved with ``ti.aot.Module`` into
a folder under ``~/.cache/muser-ti/aot/`` (``MUSER_AOT_CACHE`` names another), keyed by the arch, Taichi's
version, the kernels' keys and the source of muser_ti/kernels/: a later process, or a later engine of the same
geometry, loads the folder instead of compiling.  A cold cache compiles on first use, as Taichi's own kernel
cache does; the folder is written beside its final place and renamed into it, so a process that stops half way
leaves no module that looks whole.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import taichi as ti

CACHE_ENV = "MUSER_AOT_CACHE"
COMPLETE = "metadata.json"  # what ti.aot.Module.save writes: its presence marks a finished module


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "muser-ti" / "aot")


@lru_cache(maxsize=1)
def kernel_sources_digest() -> str:
    """A digest of the kernels' source (muser_ti/kernels/): a changed kernel never loads a stale module."""
    h = hashlib.sha256()
    root = Path(__file__).parent / "kernels"
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def module_key(arch: str, kernels: dict[str, tuple]) -> str:
    spec = repr((arch, ti.__version__, sorted((name, repr(key)) for name, (_, key) in kernels.items()),
                 kernel_sources_digest()))
    return hashlib.sha256(spec.encode()).hexdigest()[:24]


def module_dir(arch: str, kernels: dict[str, tuple]) -> tuple[Path, bool]:
    """(the saved module's folder, whether it was compiled now) for ``kernels``: name -> (Taichi kernel, key), on
    the active Taichi arch ``arch``."""
    path = cache_root() / f"{arch}-{module_key(arch, kernels)}"
    if (path / COMPLETE).is_file():
        return path, False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    try:
        save(kernels, tmp)
        try:
            tmp.rename(path)
        except OSError:  # another process finished the same module first: theirs is as good
            if not (path / COMPLETE).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path, True


def save(kernels: dict[str, tuple], folder: Path) -> None:
    """What ``ti.aot.Module(...).add_kernel(...).save(folder)`` writes, through the module builder it wraps:
    ti.aot.Module finalises the runtime's root field builder, which a runtime allows once, and an engine may
    build several modules in one runtime (its kernels take arrays only, no fields)."""
    from taichi.aot.utils import produce_injected_args
    from taichi.lang import impl

    builder = impl.get_runtime().prog.make_aot_module_builder(impl.current_cfg().arch, [])
    for name, (kernel_fn, _) in kernels.items():
        kernel = kernel_fn._primal
        kernel.ensure_compiled(*produce_injected_args(kernel))
        builder.add(name, kernel.kernel_cpp)
    builder.dump(str(folder), "")
    (folder / "__content__").write_text("\n".join(f"kernel:{name}" for name in kernels))
    (folder / "__version__").write_text(".".join(str(x) for x in ti.__version__))


__all__ = ["cache_root", "module_dir", "module_key", "save"]
