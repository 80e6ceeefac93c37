"""Test backends: every engine test runs once per arch in --arch (default: cpu and vulkan).

Vulkan runs on Mesa's software driver lavapipe in CI; where no Vulkan device exists the Vulkan
tests are skipped with that reason, never silently dropped.
"""

import signal
import sys

import pytest

from muser_ti import backend


def pytest_addoption(parser):
    parser.addoption("--arch", action="append", default=None,
                     help="backend(s) for engine tests: cpu, vulkan, cuda, metal (repeatable; default cpu + vulkan)")


def pytest_generate_tests(metafunc):
    if "arch" in metafunc.fixturenames:
        archs = metafunc.config.getoption("arch") or ["cpu", "vulkan"]
        metafunc.parametrize("arch", archs, indirect=True, scope="session")


@pytest.fixture(scope="session")
def arch(request):
    """Start Taichi on the arch once; pytest groups the tests by arch so it switches only once."""
    name = request.param
    # A failed test's traceback (pytest keeps the last in sys.last_*) holds its frames, and so arrays of
    # the runtime the switch is about to reset: freed after it, they crashed the process, a segfault that
    # hid the failures' report.  Dropped here, they go with backend.activate's collection
    for attr in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, attr):
            setattr(sys, attr, None)
    try:
        backend.activate(name)
    except backend.BackendError as exc:
        pytest.skip(f"{name} backend unavailable on this machine: {exc}")
    return name


@pytest.fixture
def default_sigint():
    """SIGINT's default Python handler (KeyboardInterrupt) for one test: a suite started as a background job
    (`cmd &`) inherits SIGINT ignored, which a test of Ctrl-C must not."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)

