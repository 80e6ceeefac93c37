"""Test backends: every engine test runs once per arch in --arch (default: cpu and vulkan).

Vulkan runs on Mesa's software driver lavapipe in CI; where no Vulkan device exists the Vulkan
tests are skipped with that reason, never silently dropped.
"""

import sys
from pathlib import Path

import pytest

from muser_ti import backend


def pytest_addoption(parser):
    parser.addoption("--arch", action="append", default=None,
                     help="backend(s) for engine tests: cpu, vulkan, cuda, metal (repeatable; default cpu + vulkan)")
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run the I-th of N parts of the suite, whole test files each (a device call is time-boxed; "
                          "files keep their kernels together, so each part compiles only its own)")
    parser.addoption("--only-ids", default=None, metavar="FILE",
                     help="run only the collected tests whose node id is a line of FILE (the tests a time-boxed "
                          "device call did not reach; on the H200's image run it without xdist, docs/PERF.md run 28)")


def _shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard {text!r}: expected I/N with integers, for example 1/2") from None
    if not 1 <= i <= n:
        raise pytest.UsageError(f"--shard {text!r}: I must be in 1..N")
    return i, n


def _only_ids(config, items):
    """--only-ids FILE: keep the tests named there; a name that matches nothing is an error, not a silent skip."""
    path = config.getoption("only_ids")
    if path is None:
        return
    try:
        wanted = {line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()}
    except OSError as exc:
        raise pytest.UsageError(f"--only-ids {path!r}: cannot read it: {exc}") from None
    missing = wanted - {item.nodeid for item in items}
    if missing:
        raise pytest.UsageError(f"--only-ids {path!r}: {len(missing)} node id(s) match no collected test, "
                                f"for example {sorted(missing)[0]!r}")
    kept, dropped = [], []
    for item in items:
        (kept if item.nodeid in wanted else dropped).append(item)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def pytest_collection_modifyitems(config, items):
    """--only-ids FILE (_only_ids); --shard I/N: keep the test files whose place in the sorted list of collected
    files is I-1 mod N."""
    _only_ids(config, items)
    text = config.getoption("shard")
    if text is None:
        return
    i, n = _shard(text)
    file_of = {item: item.nodeid.split("::")[0] for item in items}
    mine = set(sorted(set(file_of.values()))[i - 1::n])
    kept, dropped = [], []
    for item in items:
        (kept if file_of[item] in mine else dropped).append(item)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept


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
