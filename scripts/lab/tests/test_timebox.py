"""The lab's time-box options (scripts/lab/timebox.py): --only-ids and --shard, which time-boxed device
calls use to run the part of the suite a cut call did not reach."""

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

PLUGIN = (Path(__file__).resolve().parent.parent / "timebox.py").read_text(encoding="utf-8")
FILES = {
    "test_a": "import pytest\n@pytest.mark.parametrize('x', ['p q', 'r'])\ndef test_one(x):\n    assert x\n",
    "test_b": "def test_two():\n    assert True\n\ndef test_three():\n    assert True\n",
}


@pytest.fixture
def suite(pytester):
    pytester.makeconftest(PLUGIN)  # the plugin's hooks, as a conftest
    pytester.makepyfile(**FILES)
    return pytester


def test_only_ids_runs_exactly_the_named_tests(suite):
    ids = suite.path / "ids.txt"
    ids.write_text("test_a.py::test_one[p q]\n\ntest_b.py::test_three\n", encoding="utf-8")
    result = suite.runpytest("-v", "--only-ids", str(ids))
    result.assert_outcomes(passed=2, deselected=2)
    result.stdout.fnmatch_lines(["*test_a.py::test_one?p q? PASSED*", "*test_b.py::test_three PASSED*"])


def test_only_ids_refuses_a_name_that_matches_nothing(suite):
    ids = suite.path / "ids.txt"
    ids.write_text("test_b.py::test_two\ntest_b.py::test_four\n", encoding="utf-8")
    result = suite.runpytest("--only-ids", str(ids))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--only-ids*1 node id(s) match no collected test*test_b.py::test_four*"])


def test_only_ids_refuses_a_file_it_cannot_read(suite):
    result = suite.runpytest("--only-ids", str(suite.path / "absent.txt"))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--only-ids*cannot read it*"])


def test_shards_split_whole_files_and_cover_the_suite_once(suite):
    first = suite.runpytest("--shard", "1/2")
    second = suite.runpytest("--shard", "2/2")
    first.assert_outcomes(passed=2, deselected=2)  # test_a.py: its two cases
    second.assert_outcomes(passed=2, deselected=2)  # test_b.py
    bad = suite.runpytest("--shard", "3/2")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
