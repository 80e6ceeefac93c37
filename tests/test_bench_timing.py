"""muser_ti/bench/timing.py: the per-step summary of a CUPTI trace (pure arithmetic on chrome-trace events)."""

import pytest

from muser_ti.bench import timing as cupti


def event(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


@pytest.mark.parametrize("spans, union", [
    ([], 0.0),
    ([(0, 10)], 10.0),
    ([(0, 10), (5, 20)], 20.0),  # overlapping
    ([(0, 10), (2, 4)], 10.0),  # nested
    ([(30, 40), (0, 10)], 20.0),  # unsorted, disjoint
])
def test_intervals_union(spans, union):
    assert cupti.intervals_union(spans) == union


def test_summary_counts_each_steps_kernels_until_the_next_step():
    """A step's kernels may end after its host span (the launch returns first): they are the step's
    until the next step starts; driver calls count only inside the host span."""
    events = [
        event("user_annotation", "step", 0, 100), event("user_annotation", "step", 200, 50),
        event("cuda_driver", "cuLaunchKernel", 5, 4), event("kernel", "producer", 10, 80),
        event("kernel", "reduce", 120, 10),  # after step 1's host span, before step 2: still step 1's
        event("cuda_driver", "cuLaunchKernel", 150, 3),  # outside both host spans: nobody's call
        event("cuda_driver", "cuLaunchKernel", 205, 6), event("kernel", "producer", 210, 60),
        event("kernel", "reduce", 260, 20),  # overlaps the producer: busy counts the union
        event("gpu_memcpy", "Memcpy DtoH", 281, 1),
    ]
    r = cupti.summarize_trace(events, 2)
    assert r["steps"] == 2
    assert r["wall_us"] == 75  # median of 100 and 50
    assert r["gpu_busy_us"] == 80  # median of step 1, 80 + 10, and step 2, the union 210..280 = 70
    assert r["gpu_span_us"] == 95  # step 1: 10..130 = 120; step 2: 70
    assert r["first_kernel_after_us"] == 10
    assert r["kernel_us"] == {"producer": 70, "reduce": 15}
    assert r["host_calls"] == {"cuLaunchKernel": {"count": 1, "us": 5}}
    # the timeline is the step before last, to the next step's start, every category it keeps
    assert r["timeline"] == [(5, 4, "cuda_driver", "cuLaunchKernel"), (10, 80, "kernel", "producer"),
                             (120, 10, "kernel", "reduce"), (150, 3, "cuda_driver", "cuLaunchKernel")]


def test_child_env_makes_the_package_importable_in_a_child():
    """A measurement's child process (fma_peak.probe, the CPU bench's sides) imports this package: the first
    PYTHONPATH entry is the folder that holds muser_ti/, wherever the helpers live in it."""
    import os
    from pathlib import Path

    first = Path(cupti.child_env()["PYTHONPATH"].split(os.pathsep)[0])
    assert (first / "muser_ti" / "__init__.py").is_file()
