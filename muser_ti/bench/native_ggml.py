"""ggml built natively for this machine, as llama.cpp builds it by default: the CPU bench's peer.

    python -m muser_ti.bench.native_ggml            # build (once; minutes) and print what was built, as JSON

The pinned rung keeps the ggml that ``pip install ggml-python==0.0.45`` built for the x86-64 AVX2 baseline
(scripts/setup.sh): its numerics must not depend on the machine.  A llama.cpp user does not run that build;
llama.cpp's CMake turns GGML_NATIVE on (``-march=native``), so ggml's CPU kernels use every vector extension
the machine has (AVX-512 where there is one; f16 arithmetic in half precision only where AVX512-FP16 is there).
This module builds that ggml from the same source, the pinned ggml-python 0.0.45's sdist (its vendor/ggml,
v0.15.3), with cmake, into a cache folder apart from the venv:

    ~/.cache/muser-ti/ggml-native/ggml-python-0.0.45-<host ISA tag>/
        lib/         libggml.so, libggml-base.so, libggml-cpu.so (GGML_NATIVE=ON, Release, OpenMP as pinned)
        py/ggml/     a copy of the venv's ggml-python package with lib/ holding those libraries
        build.json   what was built, with which flags, on which CPU

A process that puts ``py/`` first on PYTHONPATH (``child_env``) imports that package instead of the venv's, so
everything that goes through ggml-python (muser_ti.pinned.ggml's GgmlFlashAttn among it) runs on the native
build, and ``ggml_cpu_has_avx512()`` there says what it was built for.  The folder's name carries the host's ISA
flags, so a cache moved to another CPU is never used for it.  ``MUSER_GGML_NATIVE_CACHE`` moves the cache.
Nothing here is imported by the engine.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from ..pinned.ggml import PINNED_GGML_PYTHON_VERSION, PINNED_GGML_VERSION

CACHE_ENV = "MUSER_GGML_NATIVE_CACHE"
LIBS = ("libggml.so", "libggml-base.so", "libggml-cpu.so")
# the /proc/cpuinfo flags that decide which of ggml's x86 kernels -march=native compiles in (ggml-cpu's
# CMakeLists and simd-mappings.h); avx512_fp16 is the one that makes ggml compute f16 in half precision
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa(flags: set[str] | None = None) -> list[str]:
    """The vector extensions that matter to ggml's CPU kernels, present on this CPU, in a fixed order."""
    flags = cpu_flags() if flags is None else flags
    return [f for f in ISA_FLAGS if f in flags]


def has_avx512_fp16(flags: set[str] | None = None) -> bool:
    """True where ggml's native build does f16 arithmetic in half precision (``_mm512_fmadd_ph``: Sapphire
    Rapids and later Xeons).  Elsewhere, AVX-512 or not, ggml converts f16 to f32 and computes in f32."""
    return "avx512_fp16" in (cpu_flags() if flags is None else flags)


def isa_summary(flags: set[str] | None = None) -> str:
    """A short name for the build's vector ISA: 'AVX-512 (no AVX512-FP16)', 'AVX2+FMA', ..."""
    have = set(isa(flags))
    if "avx512f" in have:
        return "AVX-512" + (" with AVX512-FP16" if "avx512_fp16" in have else " (no AVX512-FP16)")
    if "avx2" in have:
        return "AVX2" + ("+FMA" if "fma" in have else "")
    return "SSE"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "muser-ti" / "ggml-native")


def build_dir() -> Path:
    """This host's build folder: the pinned version and a hash of the CPU's ISA flags in its name."""
    tag = hashlib.sha256(" ".join(isa()).encode()).hexdigest()[:10]
    return cache_root() / f"ggml-python-{PINNED_GGML_PYTHON_VERSION}-{tag}"


def built() -> Path | None:
    """The build folder if its build is complete (build.json is written last), else None."""
    d = build_dir()
    return d if (d / "build.json").is_file() and all((d / "py" / "ggml" / "lib" / n).is_file() for n in LIBS) else None


def info() -> dict:
    d = built()
    return json.loads((d / "build.json").read_text()) if d else {}


def describe() -> str:
    """'ggml v0.15.3 native (GGML_NATIVE=ON: AVX-512 (no AVX512-FP16))' or why there is none."""
    i = info()
    if not i:
        return f"ggml native: not built (python -m muser_ti.bench.native_ggml builds it into {build_dir()})"
    return f"ggml v{i['ggml_version']} native (GGML_NATIVE=ON: {i['isa_summary']})"


def _venv_package() -> Path:
    """The installed ggml-python package folder (its Python files are copied beside the native libraries)."""
    import importlib.util

    spec = importlib.util.find_spec("ggml")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"ggml-python is not installed (pip install ggml-python=={PINNED_GGML_PYTHON_VERSION})")
    return Path(list(spec.submodule_search_locations)[0])


def _sdist(work: Path, log) -> Path:
    """The pinned ggml-python's source distribution, from pip's usual index (pip's cache makes a rerun free)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(work),
           f"ggml-python=={PINNED_GGML_PYTHON_VERSION}"]
    subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    found = sorted(work.glob("ggml_python-*.tar.gz")) + sorted(work.glob("ggml-python-*.tar.gz"))
    if not found:
        raise RuntimeError(f"pip download left no sdist in {work}")
    with tarfile.open(found[0]) as tar:
        tar.extractall(work, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(work)
    src = next(p for p in work.iterdir() if p.is_dir() and (p / "vendor" / "ggml" / "CMakeLists.txt").is_file())
    return src / "vendor" / "ggml"


def cmake_args(src: Path, build: Path) -> list[str]:
    """Configure ggml as ggml-python's CMakeLists does (shared libraries, OpenMP, Release, rpath $ORIGIN), with
    GGML_NATIVE on, as llama.cpp's default build has it; no tests, no examples."""
    return ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
            "-DGGML_NATIVE=ON", "-DGGML_OPENMP=ON", "-DGGML_BUILD_TESTS=OFF", "-DGGML_BUILD_EXAMPLES=OFF",
            "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON", "-DCMAKE_INSTALL_RPATH=$ORIGIN"] + (
        ["-G", "Ninja"] if shutil.which("ninja") else [])


def ensure_built(log=None, jobs: int | None = None) -> Path:
    """Build the native ggml into build_dir() unless it is there; the folder appears whole or not at all."""
    done = built()
    if done:
        return done
    for tool in ("cmake", "cc", "c++"):
        if not shutil.which(tool):
            raise RuntimeError(f"building ggml natively needs {tool} on PATH")
    target = build_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    log = log if log is not None else sys.stderr
    t0 = time.time()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".building-") as tmp:
        work = Path(tmp)
        (work / "sdist").mkdir()
        src = _sdist(work / "sdist", log)
        build = work / "build"
        subprocess.run(cmake_args(src, build), check=True, stdout=log, stderr=subprocess.STDOUT)
        subprocess.run(["cmake", "--build", str(build), "-j", str(jobs or os.cpu_count() or 1)], check=True,
                       stdout=log, stderr=subprocess.STDOUT)
        out = work / "out"
        pkg = out / "py" / "ggml"
        shutil.copytree(_venv_package(), pkg, ignore=shutil.ignore_patterns("__pycache__", "lib"))
        (pkg / "lib").mkdir()
        (out / "lib").mkdir()
        for name in LIBS:
            lib = next(iter(sorted(build.rglob(name))), None)
            if lib is None:
                raise RuntimeError(f"the build made no {name}")
            shutil.copy2(lib.resolve(), pkg / "lib" / name)
            # a library asks for its siblings by soname (libggml-base.so.0): give them that name too
            soname = _soname(pkg / "lib" / name)
            if soname and soname != name:
                shutil.copy2(lib.resolve(), pkg / "lib" / soname)
            shutil.copy2(lib.resolve(), out / "lib" / name)
        meta = {"ggml_python_version": PINNED_GGML_PYTHON_VERSION, "ggml_version": PINNED_GGML_VERSION,
                "cmake": cmake_args(Path("<sdist>/vendor/ggml"), Path("<build>"))[5:],
                "isa": isa(), "isa_summary": isa_summary(), "avx512_fp16": has_avx512_fp16(),
                "cpu": _cpu_name(), "compiler": _compiler(), "build_s": round(time.time() - t0, 1),
                "compile_flags": "-march=native (GGML_NATIVE=ON)"}
        (out / "build.json").write_text(json.dumps(meta, indent=2))
        if target.exists():
            shutil.rmtree(target)
        os.replace(out, target)
    return target


def _soname(lib: Path) -> str:
    try:
        dyn = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
    except OSError:
        return ""
    for line in dyn.splitlines():
        if "(SONAME)" in line:
            return line.split("[", 1)[1].rstrip("]")
    return ""


def _cpu_name() -> str:
    from .timing import machine

    return machine().get("cpu", "")


def _compiler() -> str:
    try:
        return subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        return ""


def child_env(native: bool = True) -> dict:
    """The environment for a bench child: timing.child_env(), and with ``native`` the native build's ggml-python
    package first on PYTHONPATH (so ``import ggml`` loads the native libraries there)."""
    from .timing import child_env as base_env

    env = base_env()
    if native:
        d = built()
        if d is None:
            raise RuntimeError(describe())
        env["PYTHONPATH"] = os.pathsep.join([str(d / "py"), env["PYTHONPATH"]])
    return env


def loaded_build() -> dict:
    """In a process that imported ggml: which build it loaded (its folder, and what the library says it has)."""
    import ggml

    lib_dir = Path(ggml.__file__).parent / "lib"
    has = {n: bool(getattr(ggml, f"ggml_cpu_has_{n}")()) for n in ("avx2", "fma", "f16c", "avx512", "avx512_vnni",
                                                                   "avx512_bf16") if hasattr(ggml, f"ggml_cpu_has_{n}")}
    d = built()
    return {"lib_dir": str(lib_dir), "native": bool(d) and lib_dir.resolve() == (d / "py" / "ggml" / "lib").resolve(),
            "cpu_has": has}


def main() -> int:
    d = ensure_built()
    print(json.dumps({"dir": str(d), **info()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
