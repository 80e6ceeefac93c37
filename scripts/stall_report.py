#!/usr/bin/env python3
"""Summarise an ncu report of one producer launch (scripts/device_run.sh stalls):

    python scripts/stall_report.py stalls-raw.csv stalls-sass.csv

From the raw page: every stall reason's share of the cycles between a warp's instructions.  From the
SASS page: the instructions with the most stall samples, with their opcode totals, so the time spent
in the chunk staging, the score loop, the value loop and the barriers can be read off the code.
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


def sass_lines(path, top: int = 30) -> None:
    table = rows(path)
    head_at = next((i for i, r in enumerate(table) if "Source" in r), None)  # a kernel-name row comes first
    if head_at is None:
        print(f"{path}: no SASS table")
        return
    head, body = table[head_at], table[head_at + 1:]
    src, addr = head.index("Source"), head.index("Address")
    samples = next(i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling (All"))
    executed = head.index("Instructions Executed")
    reasons = [(h, i) for i, h in enumerate(head) if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(_number(r[samples]) for r in body) or 1.0
    issued = sum(_number(r[executed]) for r in body) or 1.0
    by_reason, by_op, ran = Counter(), Counter(), Counter()
    for r in body:
        text = r[src].strip()
        op = (text.split()[1] if text.startswith("@") else text.split()[0]).split(".")[0] if text else "?"
        by_op[op] += _number(r[samples])
        ran[op] += _number(r[executed])
        for h, i in reasons:
            by_reason[h] += _number(r[i])
    print(f"stall samples by reason (of {total:.0f}):")
    for h, n in by_reason.most_common(10):
        print(f"  {100 * n / total:6.2f} %  {h}")
    print(f"opcodes: share of the {issued:.0f} warp instructions executed, and of the stall samples:")
    for op, n in ran.most_common(16):
        print(f"  {op:10s} {100 * n / issued:5.1f} %  {100 * by_op[op] / total:5.1f} %")
    first = int(body[0][addr], 16)
    print(f"top {top} instructions by stall samples (offset from the kernel's first instruction):")
    for r in sorted(body, key=lambda r: -_number(r[samples]))[:top]:
        print(f"  {100 * _number(r[samples]) / total:6.2f} %  {int(r[addr], 16) - first:#07x}  {r[src].strip()}")


if __name__ == "__main__":
    stall_reasons(sys.argv[1])
    sass_lines(sys.argv[2])
