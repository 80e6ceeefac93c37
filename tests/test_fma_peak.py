"""muser_ti.bench.fma_peak's C kernel: built with the system's compiler, it reports a peak per vector width."""

import shutil

import pytest

from muser_ti.bench import fma_peak

pytestmark = pytest.mark.skipif(not (shutil.which("gcc") or shutil.which("cc")), reason="no C compiler")


@pytest.mark.parametrize("width", fma_peak.c_widths() or [256])
def test_the_c_kernel_runs_twelve_chains_and_reports_its_width(width, tmp_path, monkeypatch):
    if width not in fma_peak.c_widths():
        pytest.skip(f"this CPU has no {width}-bit FMA")
    monkeypatch.setenv("MUSER_FMA_PEAK_CACHE", str(tmp_path))
    out = fma_peak.c_peak(width, threads=1, repeats=1, iters=200_000)
    assert out["width"] == width and out["threads"] == 1 and out["gflop_s"] > 0
    assert fma_peak.c_binary(width).parent == tmp_path  # built once, kept in the cache
    dis = __import__("subprocess").run(["objdump", "-d", str(fma_peak.c_binary(width))], capture_output=True,
                                       text=True).stdout if shutil.which("objdump") else ""
    if dis:
        reg = {256: "ymm", 512: "zmm"}[width]
        assert sum(1 for line in dis.splitlines() if "vfmadd" in line and reg in line) == fma_peak.C_CHAINS
