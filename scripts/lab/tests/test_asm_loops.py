"""scripts/lab/asm_loops.py finds a kernel's loops and counts what they hold, on a hand-written listing."""

import importlib.util
import re
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "asm_loops.py"
spec = importlib.util.spec_from_file_location("asm_loops", SCRIPT)
asm_loops = importlib.util.module_from_spec(spec)
spec.loader.exec_module(asm_loops)

LISTING = """\
\t.text
producer:
\tmovl\t$0, %eax
.LBB0_1:
\tvbroadcastss\t(%rsi,%rax,4), %ymm1
\tvfmadd231ps\t%ymm1, %ymm2, %ymm0
\tvmulps\t%xmm1, %xmm2, %xmm3
\tvcvtph2ps\t%xmm4, %ymm4
\tvmovups\t%ymm0, 32(%rsp)
\tmovslq\t%ecx, %rcx
\tvinsertps\t$16, (%rdi), %xmm5, %xmm5
\taddq\t$1, %rax
\tcmpq\t%rdx, %rax
\tjne\t.LBB0_1
.LBB0_2:
\tvaddps\t%ymm0, %ymm0, %ymm0
\tjmp\t.LBB0_3
.LBB0_3:
\tretq
"""


def test_finds_the_back_jump_and_counts_its_body():
    found = list(asm_loops.loops(LISTING))
    assert [label for label, _ in found] == [".LBB0_1"]  # the forward jump to .LBB0_3 is no loop
    body = found[0][1]
    assert len(body) == 10
    counts = {k: sum(1 for b in body if re.search(p, b)) for k, p in asm_loops.PATTERNS.items()}
    assert counts == {"fma": 1, "fma_ymm": 1, "mul": 1, "add": 0, "bcast": 1, "cvt": 1, "cvt_ymm": 1, "mem": 3,
                      "store": 1, "movslq": 1, "lanes": 1}
