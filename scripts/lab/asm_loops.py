"""The loops of a CPU kernel's assembly, with what each holds: the counts docs/PERF.md quotes.

    MUSER_TI_PRINT_ASM=1 python scripts/decode.py --arch cpu --tokens 2 --start-depth 64   # writes *.s here
    python scripts/lab/asm_loops.py taichi_kernel_cpu_llvm_ir_optimized_asm_0003.s

A loop is a jump back to an earlier label; it is printed with its instruction count and how many of them are fused
multiply-adds (all, and on ymm), multiplies, adds, broadcasts, f16 conversions (all, and on ymm), memory operands,
stores, sign extensions and lane inserts/extracts (gathers).  Nested loops print once each, inner first.
"""

import re
import sys

PATTERNS = {
    "fma": r"vfmadd", "fma_ymm": r"vfmadd\S*\s.*ymm", "mul": r"vmulp", "add": r"vaddp", "bcast": r"vbroadcastss",
    "cvt": r"vcvtph2ps", "cvt_ymm": r"vcvtph2ps.*ymm", "mem": r"\(%", "store": r"^v?mov\w*\s+%[xy]mm\d+, -?\d*\(%",
    "movslq": r"movslq", "lanes": r"vinsertps|vpinsr|vpextr|vextract",
}


def loops(text: str):
    """(label, instructions) of every loop, in the order their back-jumps appear."""
    labels, ins = {}, []
    for line in text.splitlines():
        m = re.match(r"^(\.LBB\S+):", line)
        if m:
            labels[m.group(1)] = len(ins)
        elif line.startswith("\t") and not line.strip().startswith("."):
            ins.append(line.strip())
    for i, t in enumerate(ins):
        m = re.match(r"j\w+\s+(\.LBB\S+)$", t)
        if m and m.group(1) in labels and labels[m.group(1)] <= i:
            yield m.group(1), ins[labels[m.group(1)]: i + 1]


def main(argv=None) -> int:
    for path in (argv if argv is not None else sys.argv[1:]):
        text = open(path).read()
        whole = [line.strip() for line in text.splitlines() if line.startswith("\t") and not line.strip().startswith(".")]
        print(f"{path}: {len(whole)} instructions; " + " ".join(
            f"{k}={sum(1 for b in whole if re.search(p, b))}" for k, p in PATTERNS.items()))
        for label, body in loops(text):
            if len(body) >= 8:
                print(f"  {label:10s} n={len(body):5d} " + " ".join(
                    f"{k}={sum(1 for b in body if re.search(p, b))}" for k, p in PATTERNS.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
