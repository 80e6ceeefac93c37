"""The lab's pytest plugin for time-boxed device calls: --shard and --only-ids.

A call on the lent GPU machine has a time limit, and a cold suite outruns it, so the lab's runner
(scripts/lab/run.sh tests) runs the suite in parts and, in the next call, exactly the tests a cut call
did not reach (scripts/lab/suite_results.py writes that list).  Loaded with ``-p timebox`` and
scripts/lab on PYTHONPATH, as run.sh does; the product's own test runs never load it.
"""

from pathlib import Path

import pytest


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run the I-th of N parts of the suite, whole test files each (a device call is time-boxed; "
                          "files keep their kernels together, so each part compiles only its own)")
    parser.addoption("--only-ids", default=None, metavar="FILE",
                     help="run only the collected tests whose node id is a line of FILE (the tests a time-boxed "
                          "device call did not reach; run it without xdist: on the device's image xdist took "
                          "node ids as 0 items)")


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
