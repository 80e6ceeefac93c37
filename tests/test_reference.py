"""The chapter's worked examples, reproduced by the project's own functions."""

import numpy as np
import pytest

from muser_ti import reference
from muser_ti.planes import PlaneState

Q = np.array([1.0, 0.0])
K = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
V = np.array([[2.0], [3.0], [4.0]])


def test_figure_16_1_attention_end_to_end():
    scores = K @ Q / np.sqrt(2)
    np.testing.assert_allclose(scores, [0.7071, 0.0, 0.7071], atol=1e-4)
    w = reference.softmax(scores)
    np.testing.assert_allclose(w, [0.4011, 0.1978, 0.4011], atol=1e-4)
    out = reference.attention(Q, K, V)
    assert round(float(out[0]), 4) == 3.0000


def test_figure_16_2_running_table():
    rows, out = reference.online_softmax_table(K @ Q / np.sqrt(2), V)
    assert [round(r.corr, 4) for r in rows] == [0.0, 1.0, 1.0]  # rescale fires only on the first row
    assert [round(r.sum, 4) for r in rows] == [1.0, 1.4931, 2.4931]
    # The figure carries 4-digit intermediates (0.4931 * 3 = 1.4793); exact arithmetic gives 3.47921.
    assert [float(r.acc[0]) for r in rows] == pytest.approx([2.0, 3.4793, 7.4793], abs=1.5e-4)
    assert round(float(out[0]), 4) == 3.0000


def test_merging_partials_is_exact():
    rng = np.random.default_rng(1)
    s = rng.standard_normal(50) * 4
    v = rng.standard_normal((50, 3))
    whole = reference.softmax(s) @ v
    parts = []
    for lo, hi in ((0, 7), (7, 20), (20, 50)):
        m = s[lo:hi].max()
        w = np.exp(s[lo:hi] - m)
        parts.append((m, w.sum(), w @ v[lo:hi]))
    np.testing.assert_allclose(reference.merge_partials(parts[::-1]), whole, rtol=1e-12)


def test_gather_follows_origins_not_position_modulo_capacity():
    # A ring of 4 whose origin sits at physical 3 after wrapping: logical 7 lives at slot (3 + 7 - 5) % 4 = 1.
    st = PlaneState(len=4, capacity=4, origin_logical=5, origin_physical=3)
    plane = np.arange(4)[:, None, None] * np.ones((4, 1, 2))
    rows = reference.gather(plane, st, np.array([5, 6, 7, 8]), reference.TOKEN_MAJOR)
    assert rows[:, 0, 0].tolist() == [3, 0, 1, 2]
    with pytest.raises(ValueError, match="plane holds logical"):
        reference.gather(plane, st, np.array([4, 5]), reference.TOKEN_MAJOR)
