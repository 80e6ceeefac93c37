"""The host's side of the device's input checks: a token that lives on the device is checked there (the token
scan, kernels/token_scan.py), and the host decides when to read what the scan found.

Each scan gets a stamp (a count raised every scan) and flags a bad token with it, so nothing is cleared
between scans.  The host reads the flags after each token (``device_checks="per_token"``: a refused token is
named at once, from a host copy), once a per-layer token commits (token.py: one wait a token, not one a
layer), or at its next synchronisation (``"deferred"``: ``look`` names the first refused token of many, and
``InFlight`` undoes it and every step after it, none of which the device wrote).
"""

from __future__ import annotations

import taichi as ti

from . import inputs
from .errors import EngineError
from .kernels.token_scan import FLAG_CELLS, REFUSAL_RING, TOKEN_FLAGS, build_token_scan
from .kv_cache import KVCache

REFUSAL_KINDS = ("a non-finite value in q", "a non-finite value in k", "a non-finite value in v",
                 "a k value outside the f16 plane's range (|x| <= 65504)",
                 "a v value outside the f16 plane's range (|x| <= 65504)",
                 "a q value outside the f16 range (|x| <= 65504)")  # the scan's flags, in order


class DeviceChecks:
    """An engine's token scan, its flags on the device, and the stamps the host has and has not looked at."""

    def __init__(self, cfg, transfer, graphs, gpu: bool, download_token, extra_cells: int = 0):
        self.cfg, self.transfer, self.graphs, self.gpu = cfg, transfer, graphs, gpu
        self.download_token = download_token  # the launcher's: a device token's host copy, for refuse()
        self.scan = build_token_scan(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        # a summary and a ring of every token's flags (token_scan.build_token_scan); the one-dispatch step
        # keeps its layer table in the ``extra_cells`` after them (kernels/one_dispatch.py)
        self.flags = ti.ndarray(ti.i32, (FLAG_CELLS + extra_cells,))
        self.flags.fill(0)
        self.scans = 0  # the stamp of the last scan
        self._verdict = (0, False)  # (stamp, flagged) of the last scan the host looked at
        self.base = 1  # the first stamp the host has not looked at (deferred checks)

    def next_stamp(self) -> int:
        """The stamp of a scan about to be launched."""
        self.scans += 1
        return self.scans

    @property
    def unlooked(self) -> int:
        """Scans since the host last looked at the flags (deferred checks keep at most REFUSAL_RING)."""
        return self.scans - self.base + 1

    def look(self) -> tuple[int, list[str]] | None:
        """Read the flags once (one device wait): the first token refused since the last look, as (its stamp,
        what was wrong with it), or None; either way every scan so far is then looked at."""
        start, end = self.base, self.scans
        if end < start:
            return None
        flags = self.transfer.download(self.flags, self.flags.shape)
        self.base = end + 1
        if flags[:TOKEN_FLAGS].max() < start:
            return None
        for stamp in range(start, end + 1):
            cells = flags[TOKEN_FLAGS * (1 + stamp % REFUSAL_RING):][:TOKEN_FLAGS]
            kinds = [REFUSAL_KINDS[i] for i in range(TOKEN_FLAGS) if cells[i] == stamp]
            if kinds:
                return stamp, kinds
        raise AssertionError(f"a scan since stamp {start} flagged a token, but the ring of the last "
                             f"{REFUSAL_RING} scans names none: more scans than the ring holds went unlooked")

    def scan_token(self, q, k, v) -> None:
        """Refuse a device token step() would refuse: flags from one kernel, then, only when one is set,
        the host check on a copy, which names the first bad value."""
        stamp = self.next_stamp()
        if self.gpu:  # through a one-dispatch graph: Taichi's Python launch path costs more
            self.graphs.run([(self.scan, (q, k, v, self.flags, stamp))], (q, k, v))
        else:
            self.scan(q, k, v, self.flags, stamp)
        if self.flagged():
            self.refuse(q, k, v)

    def flagged(self) -> bool:
        """Did the last scan (stamp self.scans) flag its token?  One device wait per scan, however often asked."""
        if self._verdict[0] != self.scans:
            flags = self.transfer.download(self.flags, self.flags.shape)[:TOKEN_FLAGS]
            self._verdict = (self.scans, bool((flags == self.scans).any()))
            self.base = self.scans + 1  # every scan so far is looked at
        return self._verdict[1]

    def refuse(self, q, k, v) -> None:
        """Raise for a token the scan flagged, naming its first bad value (the host check on a copy)."""
        inputs.step_token(self.cfg, *self.download_token(q, k, v))
        raise EngineError("step_device: the device scan flagged the token but its host copy passes the checks")  # a bug


class InFlight:
    """Deferred checks: the step_device tokens the host has counted but not yet seen the device accept, with
    what undoes each (the position, the plane states and the routes before it, its route mix)."""

    def __init__(self):
        self._steps: list[tuple] = []

    def __bool__(self) -> bool:
        return bool(self._steps)

    def add(self, stamp: int, position: int, states: dict, routes_before: list, mix: tuple) -> None:
        self._steps.append((stamp, position, states, routes_before, mix))

    def settle(self, refused, cache: KVCache, routes) -> None:
        """Forget the steps the device accepted; where it refused one (``refused`` = DeviceChecks.look()'s
        (stamp, what was wrong)), undo it and every step after it, none of which the device wrote, and raise."""
        steps, self._steps = self._steps, []
        if refused is None:
            return
        stamp, what = refused
        undone = [step for step in steps if step[0] >= stamp]
        for _, _, _, routes_before, mix in reversed(undone):
            routes.undo(mix, routes_before)
        _, position, states, _, _ = undone[0]
        cache.commit(states, position)
        raise EngineError(f"step_device: the token at position {position} was refused by the device scan "
                          f"({'; '.join(what)}); it and the {len(undone) - 1} token(s) after it were not written, and "
                          f"the engine is back at position {position}")


__all__ = ["DeviceChecks", "InFlight", "REFUSAL_KINDS"]
