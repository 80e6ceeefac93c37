"""scripts/lab/suite_results.py: what time-boxed device calls of the suite reached, read from their logs."""

import gzip
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "suite_results.py"
spec = importlib.util.spec_from_file_location("suite_results", SCRIPT)
suite_results = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite_results)

# lines as pytest -v writes them through xdist (a shard call) and alone (a TEST_IDS call's parts, concatenated:
# a part cut by its limit ends mid-line, and the next part's header follows on that line)
XDIST_LOG = """\
tests/test_a.py::test_one[cuda-gqa4-d64]
[gw3] [ 12%] PASSED tests/test_a.py::test_one[cuda-gqa4-d64] 
[gw0] [ 25%] SKIPPED tests/test_a.py::test_two[vulkan] 
[gw1] [ 37%] FAILED tests/test_a.py::test_three[vulkan-k: value 70000 at layer 2, kv head 1, d 7 overflows] 
[gw1] linux -- Python 3.12.3 /usr/bin/python3
FAILED tests/test_a.py::test_four - assert 0
"""
PLAIN_LOG = """\
tests/test_b.py::test_five[cuda-a b] PASSED                                [ 50%]
tests/test_b.py::test_six[cuda] SKIPPED (needs ggml (absent))             [ 75%]
tests/test_b.py::test_seven[cuda-32-128-] ============================= test session starts ====
tests/test_a.py::test_three[vulkan-k: value 70000 at layer 2, kv head 1, d 7 overflows] PASSED [100%]
"""


def test_each_result_line_gives_its_id_and_outcome():
    assert suite_results.outcomes_in(XDIST_LOG) == {
        "tests/test_a.py::test_one[cuda-gqa4-d64]": "PASSED",
        "tests/test_a.py::test_two[vulkan]": "SKIPPED",
        "tests/test_a.py::test_three[vulkan-k: value 70000 at layer 2, kv head 1, d 7 overflows]": "FAILED",
    }  # the -rfE summary line names test_four but is not a result line; nothing says test_four ran
    assert suite_results.outcomes_in(PLAIN_LOG) == {
        "tests/test_b.py::test_five[cuda-a b]": "PASSED",
        "tests/test_b.py::test_six[cuda]": "SKIPPED",
        "tests/test_a.py::test_three[vulkan-k: value 70000 at layer 2, kv head 1, d 7 overflows]": "PASSED",
    }  # test_seven was cut mid-line: not reached


def test_a_later_log_wins_and_a_changed_outcome_is_named():
    last, differing = suite_results.merge({"1": {"t1": "FAILED", "t2": "PASSED"}, "2": {"t1": "PASSED"}})
    assert last == {"t1": "PASSED", "t2": "PASSED"}
    assert differing == {"t1": ["FAILED", "PASSED"]}


@pytest.fixture
def collected(monkeypatch):
    ids = ["tests/test_a.py::test_one[cuda-gqa4-d64]", "tests/test_a.py::test_two[vulkan]",
           "tests/test_a.py::test_three[vulkan-k: value 70000 at layer 2, kv head 1, d 7 overflows]",
           "tests/test_a.py::test_four", "tests/test_b.py::test_five[cuda-a b]", "tests/test_b.py::test_six[cuda]",
           "tests/test_b.py::test_seven[cuda-32-128-]"]
    monkeypatch.setattr(suite_results, "collect", lambda archs, tests: list(ids))
    return ids


def test_the_files_say_what_ran_and_what_is_left(tmp_path, collected, capsys):
    (tmp_path / "1.log").write_text(XDIST_LOG)
    (tmp_path / "2.log.gz").write_bytes(gzip.compress(   # a call's log as docs/perf keeps it
        (PLAIN_LOG + "[gw0] [ 99%] PASSED tests/test_c.py::test_gone \n").encode()))
    rc = suite_results.main([str(tmp_path / "1.log"), str(tmp_path / "2.log.gz"), "--out", str(tmp_path / "out")])
    assert rc == 0  # test_three failed in the first log and passed in the second
    results = (tmp_path / "out" / "results.txt").read_text().splitlines()
    assert "PASSED tests/test_a.py::test_three[vulkan-k: value 70000 at layer 2, kv head 1, d 7 overflows]" in results
    assert "SKIPPED tests/test_b.py::test_six[cuda]" in results
    assert len(results) == 6  # five collected ids and test_gone, which no collection has
    assert (tmp_path / "out" / "unreached.txt").read_text().splitlines() == [
        "tests/test_a.py::test_four", "tests/test_b.py::test_seven[cuda-32-128-]"]
    out = capsys.readouterr().out
    assert "7 collected: 3 passed, 2 skipped, 2 not reached" in out
    assert "outcomes differ between logs: tests/test_a.py::test_three" in out and "FAILED then PASSED" in out
    assert "named by a log, not collected here: tests/test_c.py::test_gone" in out


def test_a_failure_left_standing_fails_the_command(tmp_path, collected):
    (tmp_path / "1.log").write_text(XDIST_LOG)
    assert suite_results.main([str(tmp_path / "1.log"), "--out", str(tmp_path / "out")]) == 1


@pytest.mark.parametrize("name, data", [("absent.log", None), ("cut.log.gz", gzip.compress(b"x" * 999, mtime=0)[:20])],
                         ids=["absent", "cut gzip"])
def test_a_log_that_cannot_be_read_is_named(tmp_path, collected, capsys, name, data):
    if data is not None:
        (tmp_path / name).write_bytes(data)
    with pytest.raises(SystemExit):
        suite_results.main([str(tmp_path / name), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "cannot read log" in err and name in err
    assert not (tmp_path / "out").exists()  # nothing written from a partial read
