"""A sweep's reports: a Markdown table and three plots (time against the floor, route mix, error).

Made from the sweep's CSV rows (muser_ti/cli/sweep.py), so a report can be redrawn without measuring.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import numpy as np

import muser_ti as mt
from muser_ti import ladder
from muser_ti.config import CONFIG_DIR, SWEEP_DIR

def _num(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _x_axis(sweep) -> str:
    """Plot against depth if it varies, else the first numeric axis, else the first axis (categorical)."""
    if "depth" in sweep.axes:
        return "depth"
    for a, vals in sweep.axes.items():
        if all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
            return a
    return next(iter(sweep.axes))


def _series(sweep, rows: list[dict], x: str) -> dict[str, list[dict]]:
    """Rows grouped by every varying axis except x, in sweep order; each group sorted along x."""
    others = [a for a in sweep.axes if a != x and len(sweep.axes[a]) > 1]
    groups: dict[str, list[dict]] = {}
    for r in rows:
        label = ", ".join(f"{a}={r[a]}" for a in others) or sweep.name
        groups.setdefault(label, []).append(r)
    order = {json.dumps(v) if isinstance(v, list) else str(v): i for i, v in enumerate(sweep.axes[x])}
    for g in groups.values():
        g.sort(key=lambda r: order.get(r[x], 1e9))
    return groups


def write_markdown(sweep, rows: list[dict], out_dir: Path) -> Path:
    axes = list(sweep.axes)
    head = axes + ([] if "depth" in axes else ["depth"]) + ["routes (layers)", "step ms"] + [f"{r} ms" for r in ladder.ROUTES] + [
        "KV MB", "GB/s", "floor ms", "max rel err"]
    lines = [f"# Sweep `{sweep.name}`", "",
             f"Made by `muser-sweep --config {_rel(sweep.path, SWEEP_DIR)} --out {_rel(out_dir)}` on "
             f"{platform.machine()} ({os.cpu_count()} logical CPUs, {platform.processor() or platform.system()}). "
             f"Base {sweep.base.name} ({_rel(Path(sweep.base.source), CONFIG_DIR)}), fixed {sweep.fixed or 'nothing'}, "
             f"run options {sweep.run}.", "",
             "Times are medians of the timed steps (each at exactly `depth` keys); per-route times come from "
             "single-class sub-geometries; the floor is the KV bytes read at the copy bandwidth in the "
             "`floor_gbps` column. Empty cells: that route was not taken.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r[a] for a in axes] + ([] if "depth" in axes else [r["depth"]]) + [r["routes"].replace(";", " "), _ms(r["step_s"])]
        cells += [_ms(r[f"{rt}_s"]) for rt in ladder.ROUTES]
        cells += [f"{int(r['kv_bytes']) / 1e6:.3f}", f"{float(r['gbps']):.2f}", _ms(r["floor_s"], 4),
                  f"{float(r['err_max']):.1e}" if r["err_max"] else "not checked"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    path = out_dir / f"{sweep.name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _ms(x, digits=2):
    v = _num(x)
    return "" if v is None else f"{v * 1e3:.{digits}f}"


def _rel(p: Path, shipped: Path | None = None) -> str:
    """A path as a command line here would give it: a bare name for a file in the ``shipped`` folder (the
    commands resolve bare names there), else relative to the current folder where it is inside it."""
    path = Path(p).resolve()
    if shipped is not None and path.parent == shipped.resolve():
        return path.name
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


PANEL = (5.0, 3.8)  # inches a panel (at 110 dpi: 550 x 418 pixels)
MAX_COLUMNS = 3  # panels a row: a figure stays readable at a page's width (three panels, about 1,650 pixels)


def grid(n: int) -> tuple[int, int]:
    """(rows, columns) for n panels: at most MAX_COLUMNS a row, the rows as even as they can be."""
    rows = -(-n // MAX_COLUMNS)
    return rows, -(-n // rows)


def write_plots(sweep, rows: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    x = _x_axis(sweep)
    groups = _series(sweep, rows, x)
    numeric = all(_num(r[x]) is not None for r in rows)
    colors = {r: f"C{i}" for i, r in enumerate(ladder.ROUTES)}

    def xs(g):
        return [float(r[x]) for r in g] if numeric else list(range(len(g)))

    def frame(title, ylabel, logy=True):
        n = len(groups)
        rows, cols = grid(n)
        # constrained layout keeps the figure's title clear of the first row's (tight_layout overlaps them)
        fig, axs = plt.subplots(rows, cols, figsize=(PANEL[0] * cols, PANEL[1] * rows), squeeze=False, sharey=True,
                                layout="constrained")
        panels = list(axs.flat)
        for ax in panels[n:]:
            ax.set_visible(False)  # the last row's empty places
        for ax, (label, g) in zip(panels, groups.items()):
            ax.set_title(label if n > 1 else title, fontsize=9)
            ax.set_xlabel(x)
            if numeric and max(xs(g)) / max(min(xs(g)), 1) > 50:
                ax.set_xscale("log", base=2)
            if logy:
                ax.set_yscale("log")
            if not numeric:
                ax.set_xticks(xs(g), [r[x] for r in g], rotation=30, fontsize=7)
            ax.grid(True, alpha=0.3)
        for row in axs:
            row[0].set_ylabel(ylabel)
        fig.suptitle(f"{sweep.name}: {title}", fontsize=10)
        return fig, panels[:n]

    paths = []
    # 1. time per token against x, per route, with the bandwidth floor (dashed) of the same bytes.
    fig, axs = frame("time per decode step (attention stack)", "seconds")
    for ax, g in zip(axs, groups.values()):
        ax.plot(xs(g), [float(r["step_s"]) for r in g], "k-o", ms=3, label="whole step")
        ax.plot(xs(g), [float(r["floor_s"]) for r in g], "k--", lw=1, label="floor: all KV bytes at copy BW")
        for rt in ladder.ROUTES:
            pts = [(xv, _num(r[f"{rt}_s"]), _num(r[f"{rt}_floor_s"])) for xv, r in zip(xs(g), g) if _num(r[f"{rt}_s"])]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", ms=3, color=colors[rt], label=rt)
                ax.plot([p[0] for p in pts], [p[2] for p in pts], "--", lw=1, color=colors[rt], label=f"{rt} floor")
        ax.legend(fontsize=6)
    paths.append(_save(fig, out_dir / f"{sweep.name}-time.png"))
    # 2. route mix: share of layers on each route at each x.
    fig, axs = frame("route mix (share of layers per route)", "share of layers", logy=False)
    for ax, g in zip(axs, groups.values()):
        bottom = np.zeros(len(g))
        width = [0.6] * len(g) if not numeric else None
        for rt in ladder.ROUTES:
            share = np.array([int(r[f"{rt}_layers"]) / int(r["n_layers"]) for r in g])
            if share.any():
                pos = list(range(len(g)))
                ax.bar(pos, share, bottom=bottom, color=colors[rt], label=rt, width=width or 0.6)
                bottom += share
        ax.set_xscale("linear")
        ax.set_xticks(range(len(g)), [r[x] for r in g], rotation=45, fontsize=7)
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=6)
    paths.append(_save(fig, out_dir / f"{sweep.name}-routes.png"))
    # 3. error per route against the float64 reference, with the bounds of tolerances.py.
    fig, axs = frame("relative error vs float64 reference, per route", "max |out-ref| / max |ref|")
    for ax, g in zip(axs, groups.values()):
        for rt in ladder.ROUTES:
            pts = [(xv, _num(r[f"{rt}_err"])) for xv, r in zip(xs(g), g) if _num(r[f"{rt}_err"]) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [max(p[1], 1e-12) for p in pts], "o-", ms=3, color=colors[rt], label=rt)
        # the bounds as tolerances.py names them today (looked up softly: that module is being reworked)
        for name, color in (("F32_ROUTE_RTOL", "grey"), ("LLAMA_CPU_RTOL", "brown")):
            bound = getattr(mt.tolerances, name, None)
            if bound:
                ax.axhline(bound, color=color, ls=":", lw=1, label=name)
        ax.legend(fontsize=6)
    paths.append(_save(fig, out_dir / f"{sweep.name}-error.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
