"""muser_ti.bench.native_ggml: the CPU bench's peer is ggml built natively; what it detects and where it keeps it.

The build itself (minutes: cmake over ggml v0.15.3) is not run here; where a build is already in the cache, a
child process pointed at it loads the native libraries and not the venv's AVX2-baseline ones."""

import json
import subprocess
import sys

import pytest

from muser_ti.bench import native_ggml as ng

ZEN5 = {"avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN5 | {"avx512_fp16", "amx_tile", "amx_int8", "amx_bf16"}


def test_avx512_fp16_is_what_makes_ggml_compute_in_half_precision():
    assert not ng.has_avx512_fp16(ZEN5)
    assert ng.has_avx512_fp16(SAPPHIRE_RAPIDS)
    assert ng.isa_summary(ZEN5) == "AVX-512 (no AVX512-FP16)"
    assert ng.isa_summary(SAPPHIRE_RAPIDS) == "AVX-512 with AVX512-FP16"
    assert ng.isa_summary({"avx", "avx2", "fma"}) == "AVX2+FMA"
    assert ng.isa({"sse2", "avx2", "avx512_fp16", "avx512f"}) == ["avx2", "avx512f", "avx512_fp16"]


def test_the_cache_folder_names_the_pinned_version_and_the_hosts_isa(tmp_path, monkeypatch):
    monkeypatch.setenv(ng.CACHE_ENV, str(tmp_path))
    d = ng.build_dir()
    assert d.parent == tmp_path and d.name.startswith("ggml-python-0.0.45-")
    assert ng.built() is None and ng.info() == {}
    assert "not built" in ng.describe()
    with pytest.raises(RuntimeError, match="not built"):
        ng.child_env(native=True)
    assert "PYTHONPATH" in ng.child_env(native=False)


def test_cmake_turns_ggml_native_on():
    args = ng.cmake_args(ng.build_dir(), ng.build_dir())
    assert "-DGGML_NATIVE=ON" in args and "-DBUILD_SHARED_LIBS=ON" in args and "-DCMAKE_BUILD_TYPE=Release" in args


@pytest.mark.skipif(ng.built() is None, reason="no native ggml in the cache (python -m muser_ti.bench.native_ggml)")
def test_a_child_pointed_at_the_build_loads_it():
    code = "import json; from muser_ti.bench import native_ggml as n; print(json.dumps(n.loaded_build()))"
    native = json.loads(subprocess.run([sys.executable, "-c", code], env=ng.child_env(True), capture_output=True,
                                       text=True, check=True).stdout.splitlines()[-1])
    assert native["native"] and native["lib_dir"].startswith(str(ng.built()))
    assert native["cpu_has"].get("avx512", False) == ("avx512f" in ng.cpu_flags())
    baseline = json.loads(subprocess.run([sys.executable, "-c", code], env=ng.child_env(False), capture_output=True,
                                         text=True, check=True).stdout.splitlines()[-1])
    assert not baseline["native"]
