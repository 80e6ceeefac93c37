"""scripts/lab/step_bits.py's distance in units in the last place, which says how far two routes' bits part."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "step_bits.py"
spec = importlib.util.spec_from_file_location("step_bits", SCRIPT)
step_bits = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step_bits)

TINY = np.float32(np.finfo(np.float32).smallest_subnormal)


@pytest.mark.parametrize("a, b, want", [
    (1.0, 1.0, 0),
    (1.0, np.nextafter(np.float32(1.0), np.float32(2.0)), 1),  # the next float up
    (-0.1756591796875, -0.1756591945886612, 1),  # run 29's first mismatch, as the test printed it
    (0.0, -0.0, 0),  # the same number, two bit patterns
    (TINY, -TINY, 2),  # across zero: +tiny, 0, -tiny
    (1.0, 2.0, 1 << 23),  # an octave: 2^23 floats
])
def test_ulps_counts_the_floats_between(a, b, want):
    x, y = np.array([a], np.float32), np.array([b], np.float32)
    assert step_bits.ulps(x, y) == want
    assert step_bits.ulps(y, x) == want


def test_ulps_is_the_largest_over_an_array():
    a = np.linspace(-3, 3, 101, dtype=np.float32)
    b = a.copy()
    b[17] = np.nextafter(b[17], np.float32(10))
    b[60] = np.nextafter(np.nextafter(b[60], np.float32(-10)), np.float32(-10))
    assert step_bits.ulps(a, b) == 2
    assert step_bits.ulps(a, a) == 0
