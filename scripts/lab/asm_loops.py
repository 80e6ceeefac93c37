"""The loops of a CPU kernel's assembly, with what each holds: the counts docs/PERF.md quotes.

Two sources, and only the second is the code that runs:

    python scripts/lab/asm_loops.py --jit --depth 2048        # the code that runs (see below)
    MUSER_TI_PRINT_ASM=1 python scripts/decode.py --arch cpu --tokens 2 --start-depth 64   # writes *.s here
    python scripts/lab/asm_loops.py taichi_kernel_cpu_llvm_ir_optimized_asm_0003.s

**What ``MUSER_TI_PRINT_ASM`` prints is not what runs.**  Taichi 1.7.4 (runtime/cpu/jit_cpu.cpp) emits that
listing from its optimiser's target machine, made with ``getHostCPUName()`` and an empty feature string; the JIT
then compiles the module again with ``JITTargetMachineBuilder::detectHost()``, which adds every host feature,
with default TargetOptions, so with fast_math on the listing has FMAs the running code has not (the JIT fuses
nothing).  Where LLVM 15 does not know the CPU (Zen 5 is ``generic``) the listing is SSE2 with software f16
conversion while the code that runs has AVX-512; where it does (an Ice Lake Xeon is ``icelake-server``) the
instructions agree but for the FMAs.  docs/lab/taichi-cpu-target.md has the source and the measurements.

``--jit`` shows the code that runs: it starts the engine on the CPU in this process, steps it at ``--depth``
keys (every kernel of the step compiled and run), copies every anonymous executable mapping of the process (the
JIT's code sections; /proc/self/maps) to ``--out`` (default jit_code.bin), disassembles it with ``objdump -D -b
binary -m i386:x86-64`` and counts the same things, plus the packed FP operations by register width.  Function
names are not known there (the JIT's symbol table is not reachable from Python): a loop is a backward jump.

A loop is a jump back to an earlier label (address); it is printed with its instruction count and how many of
them are fused multiply-adds (all, and on ymm), multiplies, adds, broadcasts, f16 conversions (all, and on ymm),
memory operands, stores, sign extensions and lane inserts/extracts (gathers).  Nested loops print once each,
inner first.
"""

import argparse
import re
import subprocess
import sys
from pathlib import Path

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


# packed FP arithmetic by register width, and scalar FP arithmetic: the vector width the code really uses
WIDTHS = {
    "xmm_packed": r"^v?(add|sub|mul|div|max|min|fmadd\w*|fmsub\w*|fnmadd\w*|sqrt)p[sd]\s.*%xmm\d+$",
    "ymm_packed": r"^v(add|sub|mul|div|max|min|fmadd\w*|fmsub\w*|fnmadd\w*|sqrt)p[sd]\s.*%ymm\d+$",
    "zmm_packed": r"^v(add|sub|mul|div|max|min|fmadd\w*|fmsub\w*|fnmadd\w*|sqrt)p[sd]\s.*%zmm\d+(\{|$)",
    "scalar": r"^v?(add|sub|mul|div|max|min|fmadd\w*|fmsub\w*|fnmadd\w*|sqrt)s[sd]\s",
    "cvt_zmm": r"vcvtph2ps.*zmm",
}


def counts(body, patterns) -> str:
    return " ".join(f"{k}={sum(1 for b in body if re.search(p, b))}" for k, p in patterns.items())


def objdump_instructions(text: str):
    """(address, 'mnemonic operands') of every instruction in ``objdump -d`` output."""
    for line in text.splitlines():
        m = re.match(r"^\s*([0-9a-f]+):\t(?:[0-9a-f]{2} )+\s*\t(.+)$", line)
        if m:
            yield int(m.group(1), 16), re.sub(r"\s+#.*$", "", m.group(2)).strip()


def objdump_loops(ins: list, max_span: int = 1 << 16):
    """(start address, instructions) of every backward jump's loop in a disassembly with no labels."""
    where = {a: i for i, (a, _) in enumerate(ins)}
    for i, (a, t) in enumerate(ins):
        m = re.match(r"j\w+\s+(?:0x)?([0-9a-f]+)\b", t)
        if m:
            target = int(m.group(1), 16)
            if target <= a and a - target < max_span and target in where:
                yield target, [x for _, x in ins[where[target]: i + 1]]


def jit_code(out: Path) -> list[tuple[int, Path]]:
    """Copy every anonymous executable mapping of this process (the JIT's code) into a file of its own,
    ``out``.0, ``out``.1, ...; return each one's (address, file)."""
    import ctypes

    regions = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        f = line.split()
        if len(f) == 5 and f[1].startswith("r-x"):  # no path: anonymous, i.e. JIT code (and libffi trampolines)
            lo, hi = (int(x, 16) for x in f[0].split("-"))
            path = out.with_name(f"{out.name}.{len(regions)}")
            path.write_bytes(ctypes.string_at(lo, hi - lo))
            regions.append((lo, path))
    return regions


def run_engine(config: str, depth: int, arch: str = "cpu") -> None:
    """Compile and run every kernel of a step at ``depth`` keys in this process."""
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import muser_ti as mt

    cfg = mt.load_config(config)
    cfg = cfg.with_overrides(max_context=max(cfg.max_context, depth + 4))
    eng = mt.Engine(cfg, arch=arch, pinned="off")
    rng = np.random.default_rng(0)
    shape = (depth - 1, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
    eng.prefill(rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32))
    for _ in range(2):
        q = rng.standard_normal((cfg.n_layers, cfg.n_heads, cfg.head_dim), dtype=np.float32)
        k = rng.standard_normal((cfg.n_layers, cfg.n_kv_heads, cfg.head_dim), dtype=np.float32)
        eng.step(q, k, k)


def jit_main(args) -> int:
    run_engine(args.config, args.depth)
    out = Path(args.out)
    regions = jit_code(out)
    dis, size = [], 0
    for lo, path in regions:  # one objdump a region, at its own address
        text = subprocess.run(["objdump", "-D", "-b", "binary", "-m", "i386:x86-64", f"--adjust-vma={lo:#x}",
                               str(path)], capture_output=True, text=True, check=True).stdout
        dis.extend(objdump_instructions(text))
        size += path.stat().st_size
    body = [t for _, t in dis]
    print(f"JIT code that runs ({len(regions)} regions, {size} bytes, {out}.N): {len(body)} instructions; "
          + counts(body, PATTERNS) + " " + counts(body, WIDTHS))
    for start, loop in objdump_loops(dis):
        if len(loop) >= 8:
            print(f"  {start:#x} n={len(loop):5d} " + counts(loop, PATTERNS) + " " + counts(loop, WIDTHS))
    return 0


def main(argv=None) -> int:
    argv = argv if argv is not None else sys.argv[1:]
    if "--jit" in argv:
        ap = argparse.ArgumentParser(description="the JIT code a CPU step runs, counted")
        ap.add_argument("--jit", action="store_true")
        ap.add_argument("--config", default="glimmer.yaml")
        ap.add_argument("--depth", type=int, default=2048)
        ap.add_argument("--out", default="jit_code.bin")
        return jit_main(ap.parse_args(argv))
    for path in argv:
        text = open(path).read()
        whole = [line.strip() for line in text.splitlines() if line.startswith("\t") and not line.strip().startswith(".")]
        print(f"{path} (Taichi's listing, not the code that runs: see --jit): {len(whole)} instructions; "
              + counts(whole, PATTERNS) + " " + counts(whole, WIDTHS))
        for label, body in loops(text):
            if len(body) >= 8:
                print(f"  {label:10s} n={len(body):5d} " + counts(body, PATTERNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
