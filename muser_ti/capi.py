"""Taichi's C-API (``libtaichi_c_api.so``, shipped in Taichi's wheel) through ctypes: a runtime, AOT modules,
memory a framework owns imported zero-copy, kernel launches.

Why: a kernel launched through Taichi's Python path costs tens of microseconds of host time (argument
parsing, type checks, the launch context built in Python); through the C-API the same launch is one C call
with an argument array built once and patched in place.  The C-API runtime is a second Taichi runtime in the
process beside the Python one (they share the CUDA primary context on CUDA, and host memory on the CPU), so
arrays the Python runtime allocated (the planes) are imported by address like any other memory.

Only what the engine's layer path needs is bound here.  The structs follow ``taichi/taichi_core.h`` of 1.7.4
(``TI_C_API_VERSION`` 1007000, checked at load).
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from pathlib import Path

C_API_VERSION = 1007000  # taichi_core.h's TI_C_API_VERSION for Taichi 1.7.4: the struct layouts below are its

# TiArch
ARCH_IDS = {"vulkan": 1, "metal": 2, "cuda": 3, "cpu": 4}
# TiArgumentType
ARG_I32, ARG_F32, ARG_NDARRAY = 0, 1, 2
# TiDataType
DATA_TYPES = {"f16": 0, "f32": 1, "i32": 5, "u32": 10}
ERROR_NAMES = {0: "success", -1: "not supported", -2: "corrupted data", -3: "name not found", -4: "invalid argument",
               -5: "argument null", -6: "argument out of range", -7: "argument not found", -8: "invalid interop",
               -9: "invalid state", -10: "incompatible module", -11: "out of memory"}


class CApiError(RuntimeError):
    """The C-API refused a call or cannot be used here; the message says which and why."""


class NdShape(ctypes.Structure):
    _fields_ = [("dim_count", ctypes.c_uint32), ("dims", ctypes.c_uint32 * 16)]


class NdArray(ctypes.Structure):
    _fields_ = [("memory", ctypes.c_void_p), ("shape", NdShape), ("elem_shape", NdShape), ("elem_type", ctypes.c_uint32)]


class _ScalarValue(ctypes.Union):
    _fields_ = [("x8", ctypes.c_uint8), ("x16", ctypes.c_uint16), ("x32", ctypes.c_uint32), ("x64", ctypes.c_uint64)]


class _Scalar(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint32), ("value", _ScalarValue)]


class _TensorValueWithLength(ctypes.Structure):
    _fields_ = [("length", ctypes.c_uint32), ("data", ctypes.c_uint64 * 16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint32), ("contents", _TensorValueWithLength)]


class _Texture(ctypes.Structure):
    _fields_ = [("image", ctypes.c_void_p), ("sampler", ctypes.c_void_p), ("dimension", ctypes.c_uint32),
                ("extent", ctypes.c_uint32 * 4), ("format", ctypes.c_uint32)]


class ArgumentValue(ctypes.Union):
    _fields_ = [("i32", ctypes.c_int32), ("f32", ctypes.c_float), ("ndarray", NdArray), ("texture", _Texture),
                ("scalar", _Scalar), ("tensor", _Tensor)]


class Argument(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint32), ("value", ArgumentValue)]


def package_dir() -> Path:
    """Taichi's C-API folder inside its installed package (lib/, runtime/, include/)."""
    import taichi

    return Path(taichi.__file__).parent / "_lib" / "c_api"


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The C-API library, its functions typed; CApiError (naming the file) where it cannot load."""
    root = package_dir()
    path = root / "lib" / "libtaichi_c_api.so"
    if not path.is_file():
        raise CApiError(f"Taichi's C-API library is not in this Taichi install ({path} missing)")
    # the runtime finds its LLVM runtime modules (runtime_x64.bc, runtime_cuda.bc) through TI_LIB_DIR
    os.environ.setdefault("TI_LIB_DIR", str(root / "runtime"))
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise CApiError(f"Taichi's C-API library did not load: {exc}") from None
    vp, u32, u64 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64
    signatures = {
        "ti_get_version": (u32, []),
        "ti_get_last_error": (ctypes.c_int32, [ctypes.POINTER(u64), ctypes.c_char_p]),
        "ti_create_runtime": (vp, [u32, u32]),
        "ti_destroy_runtime": (None, [vp]),
        "ti_load_aot_module": (vp, [vp, ctypes.c_char_p]),
        "ti_destroy_aot_module": (None, [vp]),
        "ti_get_aot_module_kernel": (vp, [vp, ctypes.c_char_p]),
        "ti_launch_kernel": (None, [vp, vp, u32, vp]),
        "ti_import_cpu_memory": (vp, [vp, vp, ctypes.c_size_t]),
        "ti_import_cuda_memory": (vp, [vp, vp, ctypes.c_size_t]),
        "ti_set_cuda_stream": (None, [vp]),
        "ti_get_cuda_stream": (None, [ctypes.POINTER(vp)]),
        "ti_free_memory": (None, [vp, vp]),
        "ti_flush": (None, [vp]),
        "ti_wait": (None, [vp]),
    }
    for name, (res, args) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    version = lib.ti_get_version()
    if version != C_API_VERSION:
        raise CApiError(f"Taichi's C-API reports version {version}; the engine's bindings are for {C_API_VERSION} "
                        f"(Taichi 1.7.4)")
    return lib


def last_error() -> tuple[int, str]:
    lib = library()
    size = ctypes.c_uint64(0)
    lib.ti_get_last_error(ctypes.byref(size), None)
    buf = ctypes.create_string_buffer(size.value + 1)
    code = lib.ti_get_last_error(ctypes.byref(size), buf)
    return code, buf.value.decode(errors="replace")


def check(what: str) -> None:
    """Raise CApiError if the last C-API call failed."""
    code, message = last_error()
    if code != 0:
        raise CApiError(f"Taichi C-API {what}: {ERROR_NAMES.get(code, code)}{': ' + message if message else ''}")


# Where a C-API runtime keeps its compile configuration, for strict_fp(): Taichi 1.7.4's capi::LlvmRuntime is a
# vtable pointer, Runtime's std::array<uint64_t, 32> host_result_buffer_ and its Arch, then the
# unique_ptr<CompileConfig> cfg_ (c_api/src/taichi_llvm_impl.h).  In CompileConfig (taichi/program/compile_config.h)
# fast_math is the bool at byte 42; the bytes around it are the constructor's defaults, checked before the write.
CONFIG_POINTER_OFFSET = 8 + 32 * 8 + 8
FAST_MATH_OFFSET = 42
TAICHI_ARCH_IDS = {"cpu": 0, "cuda": 3}  # taichi/inc/archs.inc.h's order: x64, arm64, js, cuda, ...
# bytes 4..7 (debug, cfg_optimization, check_out_of_bound, validate_autodiff) and 28..47 (serial_schedule ..
# real_matrix_scalarize, fast_math at 42 still its default, true) as CompileConfig's constructor leaves them
CONFIG_SIGNATURE = {4: (0, 1, 0, 0), 28: (0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 1, 1, 1, 1)}


def strict_fp(handle: int, arch: str) -> None:
    """Turn the runtime's fast_math off, as the engine's Python runtime runs (backend.activate): the C-API's CUDA
    JIT compiles a module's IR to PTX with the runtime's own configuration, which defaults to fast math (fused
    multiply-adds, approximate division, flushed denormals), and ti_create_runtime takes none.  The same kernels
    must give the same bits on both launch paths, so the flag is cleared in place, after checking that the bytes
    around it are CompileConfig's defaults where Taichi 1.7.4 keeps them (CApiError otherwise: nothing written)."""
    config = ctypes.c_void_p.from_address(handle + CONFIG_POINTER_OFFSET).value
    if not config:
        raise CApiError("the C-API runtime has no compile configuration where Taichi 1.7.4 keeps it")
    raw = (ctypes.c_uint8 * 48).from_address(config)
    arch_id = int.from_bytes(bytes(raw[0:4]), "little")
    expected = all(tuple(raw[at:at + len(values)]) == values for at, values in CONFIG_SIGNATURE.items())
    if arch_id != TAICHI_ARCH_IDS[arch] or not expected:
        raise CApiError("the C-API runtime's compile configuration is not laid out as Taichi 1.7.4's; its fast_math "
                        "cannot be turned off, so compiled kernels would not give the Python path's bits")
    raw[FAST_MATH_OFFSET] = 0


class Runtime:
    """A C-API runtime on one arch ("cpu" | "cuda"), with memory imported by (address, bytes) once and modules
    loaded once by path.  Its compile configuration is the Python runtime's where it matters (strict_fp)."""

    def __init__(self, arch: str):
        if arch not in ("cpu", "cuda"):
            raise CApiError(f"the engine launches through Taichi's C-API on cpu and cuda, not {arch}")
        lib = library()
        self.arch, self.lib = arch, lib
        self.handle = lib.ti_create_runtime(ARCH_IDS[arch], 0)
        if not self.handle:
            check(f"ti_create_runtime({arch})")
            raise CApiError(f"Taichi C-API ti_create_runtime({arch}) returned no runtime")
        strict_fp(self.handle, arch)
        self._imported: dict[tuple[int, int], int] = {}
        self._modules: dict[str, int] = {}
        self._import = lib.ti_import_cuda_memory if arch == "cuda" else lib.ti_import_cpu_memory

    def load_module(self, path: Path) -> int:
        """The module saved in ``path`` (aot.py), loaded once."""
        module = self._modules.get(str(path))
        if module is None:
            module = self.lib.ti_load_aot_module(self.handle, str(path).encode())
            if not module:
                check(f"ti_load_aot_module({path})")
                raise CApiError(f"Taichi C-API could not load the AOT module {path}")
            self._modules[str(path)] = module
        return module

    def kernel(self, module: int, name: str) -> int:
        kernel = self.lib.ti_get_aot_module_kernel(module, name.encode())
        if not kernel:
            check(f"ti_get_aot_module_kernel({name})")
            raise CApiError(f"Taichi C-API: the AOT module has no kernel {name}")
        return kernel

    def memory(self, address: int, nbytes: int) -> int:
        """The TiMemory of ``nbytes`` at ``address`` (host memory on the CPU, device memory on CUDA), imported once;
        the caller keeps the memory alive while kernels use it.  An import is a (pointer, size) record: where the
        memory is freed and its address later reused for the same size, the record still names it."""
        key = (address, nbytes)
        mem = self._imported.get(key)
        if mem is None:
            mem = self._import(self.handle, address, nbytes)
            if not mem:
                check("import memory")
                raise CApiError(f"Taichi C-API could not import {nbytes} bytes at {address:#x}")
            self._imported[key] = mem
        return mem

    @property
    def imported(self) -> int:
        """Distinct (address, bytes) imported so far: Taichi 1.7.4 cannot free an imported CPU allocation, so each
        stays in the runtime's table for the process's life."""
        return len(self._imported)

    def wait(self) -> None:
        self.lib.ti_wait(self.handle)


def arguments(n: int):
    """A zeroed array of n TiArgument, to be filled once and patched in place between launches."""
    return (Argument * n)()


def set_ndarray(arg: Argument, memory: int, shape: tuple[int, ...], dtype: str) -> None:
    arg.type = ARG_NDARRAY
    nd = arg.value.ndarray
    nd.memory = memory
    nd.shape.dim_count = len(shape)
    for i, size in enumerate(shape):
        nd.shape.dims[i] = size
    nd.elem_shape.dim_count = 0
    nd.elem_type = DATA_TYPES[dtype]


def set_i32(arg: Argument, value: int) -> None:
    arg.type = ARG_I32
    arg.value.i32 = value


def set_f32(arg: Argument, value: float) -> None:
    arg.type = ARG_F32
    arg.value.f32 = value


__all__ = ["Argument", "CApiError", "Runtime", "arguments", "check", "last_error", "library", "package_dir",
           "set_f32", "set_i32", "set_ndarray"]
