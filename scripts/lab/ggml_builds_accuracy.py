"""tests/test_ggml_flash_attn.py::test_large_magnitudes's error, per ggml build: is the native build less accurate?

    python scripts/lab/ggml_builds_accuracy.py            # this process's ggml (the venv's AVX2 baseline)
    PYTHONPATH=$(python -c 'from muser_ti.bench import native_ggml as n; print(n.built() / "py")') \\
        python scripts/lab/ggml_builds_accuracy.py        # the native build (muser_ti.bench.native_ggml)

Prints, per (layout, rows), ggml's max error as a fraction of max|V| against the test's Q-rounded float64
reference, the build it ran (ggml_cpu_has_avx512), and writes the outputs to --out (.npz) so two builds' outputs
can be compared with --diff A.npz B.npz.  ggml v0.15.3 converts f16 to f32 and computes in f32 on x86 unless the
CPU has AVX512-FP16 (GGML_F16_VEC on __AVX512FP16__); AVX-512 alone changes the vector width, not the precision.
"""

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def load_test_module():
    sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("tfa", ROOT / "tests" / "test_ggml_flash_attn.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--diff", nargs=2, default=None)
    args = ap.parse_args(argv)
    if args.diff:
        a, b = (np.load(p) for p in args.diff)
        for k in a.files:
            scale = np.abs(a[k]).max()
            print(f"{k}: max |A - B| {np.abs(a[k] - b[k]).max():.3g} ({np.abs(a[k] - b[k]).max() / scale:.2e} of max|out|)")
        return 0
    t = load_test_module()
    import ggml

    from muser_ti.bench import native_ggml

    errs, outs = {}, {}
    t.assert_close = lambda out, ref, V, tol=t.TOL: errs.setdefault(key, t.__dict__["_err"](out, ref, V))
    t._err = lambda out, ref, V: float(np.abs(out - ref).max() / np.abs(V.astype(np.float64)).max())
    real_attend = t.GgmlFlashAttn.attend

    def attend(self, *a, **kw):
        out = real_attend(self, *a, **kw)
        outs[key] = out.copy()
        return out

    t.GgmlFlashAttn.attend = attend
    for layout in t.LAYOUTS:
        for n_rows in (31, 33, 2048):
            key = f"{layout}/{n_rows}"
            t.test_large_magnitudes.__wrapped__(layout, n_rows) if hasattr(t.test_large_magnitudes, "__wrapped__") \
                else t.test_large_magnitudes(layout, n_rows)
    build = native_ggml.loaded_build()
    print(json.dumps({"build": build, "avx512": bool(ggml.ggml_cpu_has_avx512()),
                      "max_err_of_max_v": errs, "worst": max(errs.values())}))
    if args.out:
        np.savez(args.out, **{k.replace("/", "_"): v for k, v in outs.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
