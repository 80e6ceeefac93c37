#!/usr/bin/env python3
"""Summarise an ncu report of one producer launch (scripts/lab/run.sh profile):

    python scripts/lab/stall_report.py stalls-raw.csv stalls-sass.csv [0x800]

From the raw page: every stall reason's share of the cycles between a warp's instructions.  From the
SASS page: the instructions with the most stall samples, with their opcode totals, so the time spent
in the chunk staging, the score loop, the value loop and the barriers can be read off the code.  With a
third argument (a byte span such as 0x800): the stall samples and executed instructions of each span of
the kernel's code, with its commonest opcodes, so a region that waits more than it issues stands out.
"""

import csv
import sys
from collections import Counter


def rows(path):
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu prints its own notes before the table
    return list(csv.reader(lines))


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def stall_reasons(path) -> None:
    table = rows(path)
    if len(table) < 3:
        print(f"{path}: no raw metrics")
        return
    names, values = table[0], table[2]  # header, units, then one row per kernel launch
    found = []
    for name, value in zip(names, values):
        if "issue_stalled" in name and name.endswith(("per_issue_active.ratio", "per_warp_active.pct")):
            found.append((name.endswith(".pct"), _number(value), name))  # unparsable: 0, not printed
    print("stall reasons (ratio: warps stalled per issued instruction; pct: of warp-active cycles):")
    for _, value, name in sorted(found, reverse=True)[:40]:
        if value > 0:
            print(f"  {value:9.3f}  {name}")
    shared = [(name, value) for name, value in zip(names, values)
              if "mem_shared" in name and ("wavefronts" in name or "bank_conflicts" in name)]
    if shared:  # run.sh profile asks for these: the L1/shared pipe's work, loads and stores apart
        print("shared memory (wavefronts, bank conflicts):")
        for name, value in shared:
            print(f"  {_number(value):14.0f}  {name}")


def sass_table(path):
    """(header, rows, columns) of the SASS page: columns maps src, addr, samples, executed to their index;
    None where the page has no table."""
    table = rows(path)
    head_at = next((i for i, r in enumerate(table) if "Source" in r), None)  # a kernel-name row comes first
    if head_at is None:
        return None
    head = table[head_at]
    cols = {"src": head.index("Source"), "addr": head.index("Address"),
            "samples": next(i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling (All")),
            "executed": head.index("Instructions Executed")}
    return head, table[head_at + 1:], cols


def opcode(text: str) -> str:
    """A SASS line's opcode with its modifiers (LDS.128), past any predicate."""
    return (text.split()[1] if text.startswith("@") else text.split()[0]) if text else "?"


def sass_lines(sass, top: int = 30) -> None:
    head, body, cols = sass
    src, addr, samples, executed = cols["src"], cols["addr"], cols["samples"], cols["executed"]
    reasons = [(h, i) for i, h in enumerate(head) if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(_number(r[samples]) for r in body) or 1.0
    issued = sum(_number(r[executed]) for r in body) or 1.0
    by_reason, by_op, ran, widths = Counter(), Counter(), Counter(), Counter()
    for r in body:
        full = opcode(r[src].strip())
        op = full.split(".")[0]
        by_op[op] += _number(r[samples])
        ran[op] += _number(r[executed])
        if op in ("LDS", "STS", "LD", "ST", "LDG", "STG"):
            widths[full] += _number(r[executed])
        for h, i in reasons:
            by_reason[h] += _number(r[i])
    print(f"stall samples by reason (of {total:.0f}):")
    for h, n in by_reason.most_common(10):
        print(f"  {100 * n / total:6.2f} %  {h}")
    print(f"opcodes: share of the {issued:.0f} warp instructions executed, and of the stall samples:")
    for op, n in ran.most_common(16):
        print(f"  {op:10s} {100 * n / issued:5.1f} %  {100 * by_op[op] / total:5.1f} %")
    print("memory instructions by width (warp instructions executed):")
    for op, n in sorted(widths.items()):
        print(f"  {op:16s} {n:12.0f}")
    first = int(body[0][addr], 16)
    print(f"top {top} instructions by stall samples (offset from the kernel's first instruction):")
    for r in sorted(body, key=lambda r: -_number(r[samples]))[:top]:
        print(f"  {100 * _number(r[samples]) / total:6.2f} %  {int(r[addr], 16) - first:#07x}  {r[src].strip()}")


def regions(sass, span: int) -> None:
    _, body, cols = sass
    src, addr, samples, executed = cols["src"], cols["addr"], cols["samples"], cols["executed"]
    first = int(body[0][addr], 16)
    spans: dict[int, list] = {}
    for r in body:
        cell = spans.setdefault((int(r[addr], 16) - first) // span, [0.0, 0.0, Counter()])
        cell[0] += _number(r[samples])
        cell[1] += _number(r[executed])
        cell[2][opcode(r[src].strip()).split(".")[0]] += _number(r[executed])
    total = sum(c[0] for c in spans.values()) or 1.0
    issued = sum(c[1] for c in spans.values()) or 1.0
    print(f"code spans of {span:#x} bytes: share of the stall samples, of the executed instructions, their ratio")
    for k in sorted(spans):
        s_, e, ops = spans[k]
        if s_ / total < 0.003 and e / issued < 0.003:
            continue
        mix = " ".join(f"{op}:{100 * n / e:.0f}" for op, n in ops.most_common(5)) if e else ""
        print(f"  {k * span:#07x}  samples {100 * s_ / total:5.1f} %  instructions {100 * e / issued:5.1f} %  "
              f"ratio {s_ / total / max(e / issued, 1e-9):5.2f}  {mix}")


if __name__ == "__main__":
    stall_reasons(sys.argv[1])
    sass = sass_table(sys.argv[2])
    if sass is None:
        print(f"{sys.argv[2]}: no SASS table")
    else:
        sass_lines(sass)
        if len(sys.argv) > 3:
            regions(sass, int(sys.argv[3], 0))
