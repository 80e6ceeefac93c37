"""A GPU step's dispatches replayed as one compiled ``ti.graph``: one host call instead of a Python launch
per kernel (tens of microseconds each, docs/PERF.md).

A graph is compiled once per dispatch structure: the kernels in order, which arguments are arrays, and
which arrays are the same one.  Scalars (position, origins, split geometry) are graph arguments, so one
graph serves every token until a plane is reallocated or the route mix changes.  The arrays a caller
hands in (``external``: step_device's q, k, v and out) may be new objects every token: they are keyed
by their place among the caller's arrays, dtype and rank (what a graph argument fixes), not by
identity, so a caller that passes the same array twice gets a graph of its own.  An array bound by
several dispatches is one graph argument: Taichi converts every argument of a run on every run
(microseconds each).

This sits inside the host's share of every short step, so the per-run work is kept to a key made in
one comprehension, one dict, and Taichi's C++ entry, ``jit_run``, called directly: ``Graph.run`` only
flattens the same dict again and copies the compile config (a few microseconds a run).  ``jit_run`` is
Taichi 1.7.4's (the version pinned in pyproject.toml); where a Taichi lacks it, ``Graph.run`` runs
instead.
"""

import taichi as ti
from taichi.lang import impl


def graph_arg(name: str, a):
    """The symbolic graph argument that stands for ``a`` (an ndarray, a float or an int)."""
    if isinstance(a, ti.Ndarray):
        return ti.graph.Arg(ti.graph.ArgKind.NDARRAY, name, dtype=a.dtype, ndim=len(a.shape))
    if isinstance(a, float):
        return ti.graph.Arg(ti.graph.ArgKind.SCALAR, name, ti.f32)
    return ti.graph.Arg(ti.graph.ArgKind.SCALAR, name, ti.i32)


class _Compiled:
    """One compiled graph and how a run's flat argument list maps onto its arguments."""

    __slots__ = ("graph", "names", "is_array", "jit_run")

    def __init__(self, dispatches, flat, key_args):
        names, first = [], {}
        for j, sig in enumerate(key_args):
            if isinstance(sig, type):  # a scalar: an argument of its own
                names.append(f"s{j}")
            else:  # an array: one argument per distinct array
                names.append(first.setdefault(sig, f"a{len(first)}"))
        symbols = {name: graph_arg(name, a) for name, a in zip(names, flat)}
        builder = ti.graph.GraphBuilder()
        j = 0
        for kernel, args in dispatches:
            builder.dispatch(kernel, *[symbols[names[j + i]] for i in range(len(args))])
            j += len(args)
        self.graph = builder.compile()
        self.names = names
        self.is_array = [not isinstance(sig, type) for sig in key_args]
        compiled = getattr(self.graph, "_compiled_graph", None)
        self.jit_run = getattr(compiled, "jit_run", None)

    def run(self, flat) -> None:
        if self.jit_run is not None:
            self.jit_run(impl.get_runtime().prog.config(),
                         dict(zip(self.names, [a.arr if arr else a for a, arr in zip(flat, self.is_array)])))
        else:
            self.graph.run(dict(zip(self.names, flat)))


class GraphReplay:
    """Compiled graphs by dispatch structure (one Engine's)."""

    def __init__(self):
        self._compiled: dict[tuple, _Compiled] = {}

    def __len__(self) -> int:
        return len(self._compiled)

    def run(self, dispatches, external=()) -> None:
        """Run ``dispatches`` (a list of (kernel, args)) as one graph; ``external`` as the module says."""
        place = {id(a): i for i, a in enumerate(external)}
        flat = [a for _, args in dispatches for a in args]
        # an array: ("caller", its place, dtype, rank) or its id; a scalar: its type
        key_args = tuple([(("caller", place[id(a)], a.dtype, len(a.shape)) if id(a) in place else id(a))
                          if isinstance(a, ti.Ndarray) else type(a) for a in flat])
        key = (tuple([(id(kernel), len(args)) for kernel, args in dispatches]), key_args)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = _Compiled(dispatches, flat, key_args)
        compiled.run(flat)


__all__ = ["GraphReplay", "graph_arg"]
