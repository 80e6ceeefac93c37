"""The soak (scripts/soak.py) as a test: kept out of the default run (``slow``).

    .venv/bin/python -m pytest -m slow tests/test_soak.py -s      # ~10 min on a 2-core CPU

A 200,000-token CPU session at a tiny geometry (d 64, an SWA layer with window 16 and 16 rows of
slack, a NoPE layer of 2,048 rows), with rollbacks, a snapshot every 5,000 tokens, bit-for-bit
replays from the latest snapshot and rollbacks by snapshot past any ring's slack.  Resident memory
must stay flat once the planes are full.  docs/soak.md records a 300,000-token run.
"""

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location("soak", Path(__file__).resolve().parent.parent / "scripts" / "soak.py")
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)


def test_resident_memory_stays_flat_over_a_long_session(tmp_path):
    res = soak.soak(tokens=200_000, workdir=str(tmp_path), log=print)
    rss = res["rss_mib"]
    print(rss)
    assert res["planes_full_after_tokens"] is not None
    assert res["replay_checks"] >= 5 and res["base_restores"] >= 10 and res["rewinds"] >= 1000
    assert rss["steady_growth"] <= 4.0, f"RSS grew {rss['steady_growth']} MiB in the steady state: {res['samples']}"
