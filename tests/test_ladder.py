"""The ladder's predicates, clause by clause, against an independent truth table."""

import itertools

import pytest

from muser_ti import ladder
from muser_ti.planes import PlaneState

STATES = [
    PlaneState(len=0, capacity=64),
    PlaneState(len=1, capacity=64),
    PlaneState(len=31, capacity=64),
    PlaneState(len=32, capacity=64),
    PlaneState(len=64, capacity=64),  # exactly full, unwrapped
    PlaneState(len=64, capacity=64, origin_logical=10, origin_physical=10),  # full, wrapped
    PlaneState(len=63, capacity=64, origin_logical=10, origin_physical=10),  # partially wrapped
    PlaneState(len=32, capacity=80, origin_logical=50, origin_physical=50),  # partially wrapped, len % 32 == 0
    PlaneState(len=16, capacity=16),  # tiny: capacity < 32
    PlaneState(len=16, capacity=16, origin_logical=3, origin_physical=3),  # tiny, full, wrapped
    PlaneState(len=40, capacity=40, origin_logical=7, origin_physical=7),  # full ring, window not a multiple of 32
]


def truth(st, loaded, strict):
    """The predicates restated independently from the chapter's text."""
    source = loaded or strict
    rows = source and st.len >= 1 and st.capacity >= 32 and (not st.is_wrapped or st.len == st.capacity)
    return rows, rows and st.len % 32 == 0


@pytest.mark.parametrize("st, loaded, strict", list(itertools.product(STATES, (False, True), (False, True))))
def test_predicates_truth_table(st, loaded, strict):
    rows, swa = truth(st, loaded, strict)
    assert ladder.llama_vec_rows(st, loaded, strict) == rows
    assert ladder.llama_swa(st, loaded, strict) == swa
    assert ladder.choose_route("swa", st, loaded, strict) == ("llama_vec_swa" if swa else "splitk")
    assert ladder.choose_route("nope", st, loaded, strict) == ("llama_vec_nope" if rows else "interleaved")


def test_no_library_falls_to_own_kernels():
    for st in STATES:
        assert ladder.choose_route("swa", st, False, False) == ladder.SPLITK
        assert ladder.choose_route("nope", st, False, False) == ladder.INTERLEAVED


def test_cross_vendor_switch_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(ladder.STRICT_ENV, raising=False)
    assert not ladder.strict_attention()
    monkeypatch.setenv(ladder.STRICT_ENV, "1")
    assert ladder.strict_attention()
    monkeypatch.setenv(ladder.STRICT_ENV, "")  # set to anything, empty included (var_os(..).is_some())
    assert ladder.strict_attention()


def test_forcing_routes():
    full = PlaneState(len=64, capacity=64)
    assert ladder.select("swa", full, True, False, "splitk", 0) == "splitk"  # fallbacks always allowed
    assert ladder.select("swa", full, True, False, "llama_vec_swa", 0) == "llama_vec_swa"
    with pytest.raises(ladder.RouteError, match="predicate fails"):
        ladder.select("swa", PlaneState(len=63, capacity=64), True, False, "llama_vec_swa", 3)
    with pytest.raises(ladder.RouteError, match="predicate fails"):
        ladder.select("nope", full, False, False, "llama_vec_nope", 3)
    with pytest.raises(ladder.RouteError, match="serves swa layers; layer 3 is nope"):
        ladder.select("nope", full, True, False, "splitk", 3)
    with pytest.raises(ladder.RouteError, match="unknown route"):
        ladder.select("nope", full, True, False, "flash", 3)


@pytest.mark.parametrize("plane, loaded, route, words", [
    (PlaneState(len=63, capacity=64), True, "llama_vec_swa", "len 63 is not a multiple of 32"),
    (PlaneState(len=64, capacity=64), False, "llama_vec_nope", "pinned='on' puts it in use"),
    (PlaneState(len=16, capacity=16), True, "llama_vec_nope", "capacity 16 is under 32 rows"),
    (PlaneState(len=40, capacity=64, origin_logical=30, origin_physical=8), True, "llama_vec_nope",
     "partially wrapped"),
])
def test_a_failing_forced_route_names_the_clause_that_fails(plane, loaded, route, words):
    """A forced vec route whose predicate fails says which clause, and what would make it hold."""
    kind = ladder.ROUTE_KIND[route]
    with pytest.raises(ladder.RouteError) as info:
        ladder.select(kind, plane, loaded, False, route, 2)
    assert f"{route!r} forced on layer 2 but its predicate fails: " in str(info.value)
    assert words in str(info.value) and len(ladder.failing_clauses(route, plane, loaded, False)) == 1
