"""scripts/lab/wake_latency.py: the PM QoS request holds inside the block only, and bad requests are named."""

import importlib.util
import os
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "wake_latency.py"
spec = importlib.util.spec_from_file_location("wake_latency", SCRIPT)
wake = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wake)

writable = os.access(wake.PM_QOS_FILE, os.W_OK)
needs_pm_qos = pytest.mark.skipif(not writable, reason=f"{wake.PM_QOS_FILE} is absent or not writable here "
                                                       f"(it needs root and a Linux kernel that has it)")


@needs_pm_qos
@pytest.mark.parametrize("max_us", [0, 7])
def test_the_request_holds_inside_the_block_and_ends_with_it(max_us):
    before = wake.current_wake_latency_us()
    assert before is not None, f"{wake.PM_QOS_FILE} is writable but could not be read back"
    if before <= max_us:
        pytest.skip(f"another request already holds the latency at {before} us, at or below {max_us}")
    with wake.hold_wake_latency(max_us) as held:
        assert held == max_us
        assert wake.current_wake_latency_us() == max_us
    assert wake.current_wake_latency_us() == before


@needs_pm_qos
def test_the_request_ends_when_the_block_raises():
    before = wake.current_wake_latency_us()
    if before == 0:
        pytest.skip("another request already holds the latency at 0 us: the release could not be seen")
    with pytest.raises(KeyError):
        with wake.hold_wake_latency(0):
            assert wake.current_wake_latency_us() == 0
            raise KeyError("inside")
    assert wake.current_wake_latency_us() == before


@pytest.mark.parametrize("bad", [-1, 2.5, True, "0", wake.MAX_LATENCY_US + 1])
def test_a_bad_latency_is_named_with_its_range(bad):
    with pytest.raises(wake.WakeLatencyError, match=r"max_us: expected an integer in \[0, 2000000000\].*got"):
        with wake.hold_wake_latency(bad):
            pass


def test_a_missing_file_is_named(tmp_path):
    missing = tmp_path / "no_such_pm_qos"
    with pytest.raises(wake.WakeLatencyError, match=f"cannot open {missing} for writing"):
        with wake.hold_wake_latency(0, path=str(missing)):
            pass
    assert wake.current_wake_latency_us(str(missing)) is None


def test_the_idle_driver_is_read_from_sysfs(tmp_path):
    (tmp_path / "current_driver").write_text("haltpoll\n")
    (tmp_path / "current_governor_ro").write_text("menu\n")
    got = wake.cpuidle_description(str(tmp_path))
    assert got["current_driver"] == "haltpoll" and got["current_governor_ro"] == "menu"
    assert wake.cpuidle_description(str(tmp_path / "absent")).keys() <= {"wake_latency_us"}
