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


def test_the_floor_is_quoted_at_the_cpus_own_peak_and_says_which(tmp_path, monkeypatch):
    """muser-decode's FLOP floor: the C kernel at the CPU's widest vectors where it builds; the Taichi kernel's
    (lower) peak only where it cannot, and then the summary says so."""
    if not fma_peak.c_widths():
        pytest.skip("this CPU has no AVX2 + FMA")
    monkeypatch.setenv("MUSER_FMA_PEAK_CACHE", str(tmp_path))
    peak, by = fma_peak.floor_peak(repeats=1)
    assert peak > 0 and by == f"C, {max(fma_peak.c_widths())}-bit FMA, the best of 3 runs, kept in {tmp_path}/floor-peaks.json"
    monkeypatch.setenv("MUSER_FMA_PEAK_CACHE", str(tmp_path / "elsewhere"))  # no kept peak, and no compiler:
    monkeypatch.setattr(fma_peak, "c_binary", lambda width: (_ for _ in ()).throw(RuntimeError("no compiler")))
    monkeypatch.setattr(fma_peak, "probe", lambda: {"gflop_s": 1.5})
    assert fma_peak.floor_peak() == (1.5, "Taichi's kernel: no C FMA kernel built here")


def test_the_floor_peak_is_the_best_of_several_runs_kept_per_machine(tmp_path, monkeypatch):
    """One run's peak moves with what else the host runs; the floor is quoted at the best of several, measured
    once per CPU model and core count and kept, so every later run quotes the same one."""
    monkeypatch.setenv("MUSER_FMA_PEAK_CACHE", str(tmp_path))
    runs = iter([{"gflop_s": 151.0, "width": 256}, {"gflop_s": 201.0, "width": 256}, {"gflop_s": 180.0, "width": 256}])
    assert fma_peak.kept_peak(lambda: next(runs))[0] == 201.0
    kept = __import__("json").loads((tmp_path / "floor-peaks.json").read_text())
    assert kept[fma_peak.machine()]["runs"] == [151.0, 201.0, 180.0]

    def never():
        raise AssertionError("measured again")

    peak, by = fma_peak.kept_peak(never)
    assert peak == 201.0 and by.startswith("C, 256-bit FMA, the best of 3 runs, kept in ")
    monkeypatch.setattr(fma_peak, "machine", lambda: "another CPU, 64 cores")  # a machine it has not measured
    assert fma_peak.kept_peak(lambda: {"gflop_s": 3000.0, "width": 512})[0] == 3000.0
    (tmp_path / "floor-peaks.json").write_text("{not json")  # a broken file is measured anew, not an error
    assert fma_peak.kept_peak(lambda: {"gflop_s": 5.0, "width": 256})[0] == 5.0
