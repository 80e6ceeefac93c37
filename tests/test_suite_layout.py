"""The suite's own layout under pytest-xdist: what the default run's time depends on (docs/testing.md)."""

import os

import pytest


def test_a_modules_tests_run_as_one_group(request):
    """--dist loadgroup keeps a module's tests on one arch in one worker (conftest.py names the groups): its
    shared fixtures are built once and its worker's Taichi stays on one arch.  A pytest or pytest-xdist that
    loses the group (pytest 9.2 with xdist 3.8.0 did) sends every test out alone, and the suite ran several
    minutes longer."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not request.config.getvalue("loadgroup"):
        pytest.skip("runs under pytest-xdist's --dist loadgroup (the default addopts), not in one process")
    assert request.node.nodeid.endswith("@" + __name__.rsplit(".", 1)[-1]), request.node.nodeid
