#!/usr/bin/env python
"""Soak: a long CPU decode session at a tiny geometry whose resident memory must stay flat.

The session fills its planes (the SWA ring wraps; the NoPE plane grows to max_context rows), then
keeps decoding for hundreds of thousands of tokens with speculative rollbacks, a snapshot every
``--save-every`` tokens, and two kinds of restore:

* a rollback by snapshot: when the position nears max_context, the session loads the snapshot taken
  when the planes first became full and goes on from there (further back than any ring's slack);
* a replay check: every ``--check-every`` tokens it loads the latest snapshot and replays the token
  that followed the save, which must give the same output bit for bit.

Every ``--sample-every`` tokens it samples VmRSS from /proc/self/status.  The result (JSON on stdout,
and in --out if given) reports RSS once the planes are full, at the end, the spread and the growth
after warm-up; docs/soak.md records a run.

    .venv/bin/python scripts/soak.py --tokens 300000            # ~15 min on a 2-core CPU
    .venv/bin/python -m pytest -m slow tests/test_soak.py        # the same check as a test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import muser_ti as mt
from muser_ti.reference import relative_error
from muser_ti.tolerances import F32_ROUTE_RTOL


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def soak(tokens: int = 300_000, window: int = 16, slack: int = 16, max_context: int = 2048, head_dim: int = 64,
         n_heads: int = 8, n_kv_heads: int = 2, pattern=("swa", "nope"), pinned: str = "off", seed: int = 0,
         save_every: int = 5_000, check_every: int = 20_000, sample_every: int = 5_000, ref_every: int = 10_000,
         workdir: str | None = None, log=print) -> dict:
    cfg = mt.geometry_from_dict(dict(
        name="soak", n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, n_layers=len(pattern),
        layer_pattern=list(pattern), window=window, max_context=max_context, attention_scale="auto",
        swa_ring_slack=slack))
    eng = mt.Engine(cfg, arch="cpu", pinned=pinned)
    rng = np.random.default_rng(seed)
    L, H, KV, D = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    tmp = Path(workdir or tempfile.mkdtemp(prefix="muser-soak-"))
    base_path, last_path = tmp / "base.safetensors", tmp / "last.safetensors"

    def token():
        return (rng.standard_normal((L, H, D), dtype=np.float32), rng.standard_normal((L, KV, D), dtype=np.float32),
                rng.standard_normal((L, KV, D), dtype=np.float32))

    counts = dict(steps=0, rewinds=0, rewound_tokens=0, saves=0, base_restores=0, replay_checks=0, ref_checks=0)
    samples: list[tuple[int, int]] = []  # (tokens stepped, VmRSS KiB)
    full_at = None  # tokens stepped when every plane was first full
    after_save = None  # (q, k, v, out) of the first token after the latest save
    pending = False  # a save was made and its next token is still to come
    headroom = 2 * slack + 8
    t0 = time.perf_counter()
    worst = 0.0
    while counts["steps"] < tokens:
        # a burst of tokens, then maybe a speculative rollback of part of it (never past the slack)
        burst = int(rng.integers(1, slack + 1))
        for _ in range(burst):
            if eng.position >= max_context - 1:
                break
            q, k, v = token()
            out = eng.step(q, k, v)
            counts["steps"] += 1
            n = counts["steps"]
            if pending:  # the first token after a save: what a replay from that save must give
                after_save, pending = (q, k, v, out), False
            if n % ref_every == 0:
                worst = max(worst, relative_error(out, eng.reference(q, k, v)))
                assert worst <= F32_ROUTE_RTOL or pinned != "off", f"token {n}: error {worst:.3g}"
                counts["ref_checks"] += 1
            if full_at is None and all(ps.state.capacity == ps.cap and (ps.kind == "nope" or ps.state.len == ps.cap)
                                       for ps in eng.planes.values()):
                # every plane at its final allocation (ring full; NoPE grown to max_context rows)
                full_at = n
                eng.save(base_path)  # the rollback-by-snapshot target
                log(f"planes full after {n} tokens (position {eng.position}); RSS {rss_kib() / 1024:.1f} MiB")
            if n % save_every == 0:
                eng.save(last_path)
                counts["saves"] += 1
                after_save, pending = None, True
            if n % check_every == max(save_every // 2, 1) and after_save is not None:  # between two saves
                eng.load(last_path)  # back to the latest snapshot: the next token must come out the same
                q0, k0, v0, out0 = after_save
                if not np.array_equal(eng.step(q0, k0, v0), out0):
                    raise AssertionError(f"token {n}: replay after restore differs from the original")
                counts["replay_checks"] += 1
            if n % sample_every == 0:
                samples.append((n, rss_kib()))
                rate = n / (time.perf_counter() - t0)
                log(f"{n:>8} tokens  position {eng.position:>5}  RSS {samples[-1][1] / 1024:7.1f} MiB  {rate:6.0f} tok/s")
            if counts["steps"] >= tokens:
                break
        drop = int(rng.integers(0, burst + 1)) if rng.random() < 0.5 else 0
        drop = min(drop, eng.position)
        if drop:
            if pending:  # the token after the save was rolled back before it was seen
                pending = False
            eng.rewind(eng.position - drop)
            counts["rewinds"] += 1
            counts["rewound_tokens"] += drop
        if eng.position >= max_context - headroom:
            if full_at is None:
                raise RuntimeError("reached max_context before the planes were full")
            eng.load(base_path)  # a rollback further than any ring holds
            pending = False
            counts["base_restores"] += 1

    elapsed = time.perf_counter() - t0
    warm = [r for n, r in samples if full_at is not None and n >= full_at]
    # Steady state: the planes are full and every periodic action (save, replay check, reference check,
    # base restore) has run at least once, so first-use allocations (code paths, numpy buffers) are done.
    steady_from = max(full_at or tokens, save_every, check_every, ref_every) + sample_every
    steady = [r for n, r in samples if n >= steady_from]
    result = dict(
        machine=f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}",
        geometry=dict(n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, layer_pattern=list(pattern),
                      window=window, swa_ring_slack=slack, max_context=max_context),
        pinned=pinned, tokens=counts["steps"], seconds=round(elapsed, 1),
        tokens_per_second=round(counts["steps"] / elapsed, 1), planes_full_after_tokens=full_at, **counts,
        worst_relative_error=worst,
        rss_mib=dict(
            at_planes_full=round(warm[0] / 1024, 1) if warm else None,
            final=round(samples[-1][1] / 1024, 1) if samples else None,
            min_after_full=round(min(warm) / 1024, 1) if warm else None,
            max_after_full=round(max(warm) / 1024, 1) if warm else None,
            growth_after_full=round((warm[-1] - warm[0]) / 1024, 2) if warm else None,
            spread_after_full=round((max(warm) - min(warm)) / 1024, 2) if warm else None,
            steady_from_tokens=steady_from,
            steady_first=round(steady[0] / 1024, 1) if steady else None,
            steady_growth=round((steady[-1] - steady[0]) / 1024, 2) if steady else None,
            steady_spread=round((max(steady) - min(steady)) / 1024, 2) if steady else None,
        ),
        samples=[[n, round(r / 1024, 1)] for n, r in samples],
    )
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=300_000)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--slack", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--pinned", default="off", choices=["off", "auto", "on"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=int, default=5_000)
    ap.add_argument("--check-every", type=int, default=20_000)
    ap.add_argument("--sample-every", type=int, default=5_000)
    ap.add_argument("--out", help="write the JSON result here too")
    ap.add_argument("--max-growth-mib", type=float, default=4.0,
                    help="exit 1 if RSS grows more than this in the steady state (planes full, every action run once)")
    a = ap.parse_args(argv)
    res = soak(tokens=a.tokens, window=a.window, slack=a.slack, max_context=a.max_context, pinned=a.pinned,
               seed=a.seed, save_every=a.save_every, check_every=a.check_every, sample_every=a.sample_every,
               log=lambda s: print(s, file=sys.stderr, flush=True))
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    growth = res["rss_mib"]["steady_growth"]
    return 0 if growth is not None and growth <= a.max_growth_mib else 1


if __name__ == "__main__":
    sys.exit(main())
