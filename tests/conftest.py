"""Test backends: every engine test runs once per arch in --arch (default: cpu and vulkan).

Vulkan runs on Mesa's software driver lavapipe in CI; where no Vulkan device exists the Vulkan
tests are skipped with that reason, never silently dropped.  lavapipe runs the cases that differ on
Vulkan (its kernels, the one-dispatch step, the device scan, transfers): a case marked ``not_on_lavapipe``
repeats what the CPU and the Vulkan cases left to lavapipe check (its test says why) and is skipped there,
with that reason; a hardware Vulkan device runs every case.
"""

import os
import signal
import sys

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers share two cores: OpenMP's threads (torch's, ggml's) busy-wait for each other, and with another
    # worker on the other core a model's forward took several times as long: one intra-op thread a worker for
    # torch, and waiting threads that sleep (set before any test module imports torch or ggml).  Neither changes
    # what is computed; the engine's own kernels keep Taichi's threads.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from muser_ti import backend


def pytest_addoption(parser):
    parser.addoption("--arch", action="append", default=None,
                     help="backend(s) for engine tests: cpu, vulkan, cuda, metal (repeatable; default cpu + vulkan)")


LAVAPIPE_REASON = ("lavapipe (CI's software Vulkan) runs the cases that differ on Vulkan; this one repeats what the CPU "
                   "and those cases check (not_on_lavapipe, docs/testing.md)")


def pytest_configure(config):
    config.addinivalue_line("markers", "not_on_lavapipe: a case lavapipe skips (it repeats what the CPU and the "
                                       "Vulkan cases lavapipe runs check); hardware Vulkan runs it")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    callspec = getattr(item, "callspec", None)
    if callspec is None or callspec.params.get("arch") != "vulkan" or item.get_closest_marker("not_on_lavapipe") is None:
        return
    if not backend.has_hardware_vulkan():
        pytest.skip(LAVAPIPE_REASON)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker reads the groups (its hook has no order of its own)
def pytest_collection_modifyitems(config, items):
    """pytest-xdist's groups (--dist loadgroup, pyproject.toml): a module's tests on one arch run in one worker, so
    its module-scoped fixtures (a built model, a prefilled cache) are made once and the worker's Taichi stays on
    one arch for the group.  The groups go out heaviest first (the real clients' modules, then the arch groups,
    the CPU's before lavapipe's), so no worker is left with a long group at the end while the other idles."""
    def group(item):
        callspec = getattr(item, "callspec", None)
        arch = callspec.params.get("arch") if callspec is not None else None
        # no brackets in the name: pytest-xdist takes a group from the node id's last "@" only where no "]"
        # follows it, and a name with one left every test a group of its own (scattered over both workers,
        # each switching Taichi's arch and rebuilding what its module shares)
        return f"{item.module.__name__}-{arch}" if arch else item.module.__name__

    def rank(item):
        name = item.module.__name__
        if name in HEAVY_MODULES:
            return (0, HEAVY_MODULES.index(name))
        callspec = getattr(item, "callspec", None)
        arch = callspec.params.get("arch") if callspec is not None else None
        return (1, 0 if arch is None else 1 + ARCH_ORDER.get(arch, len(ARCH_ORDER)))

    for item in items:
        item.add_marker(pytest.mark.xdist_group(group(item)))
    items.sort(key=rank)  # stable: pytest's own order within each rank


# the modules that take longest, each one group (their models are built once per module): first out
HEAVY_MODULES = ("test_mlx_lm_integration", "test_transformers_integration", "test_model_command", "test_install",
                 "test_commands")
ARCH_ORDER = {"cpu": 0, "cuda": 1, "vulkan": 2, "metal": 3}


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

