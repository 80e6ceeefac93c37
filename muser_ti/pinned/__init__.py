"""The pinned llama rung (chapter §16.5.2): llama.cpp's own vec kernel, a named version checked at load.

Off macOS it is ggml-python 0.0.45's ``ggml_flash_attn_ext`` (ggml v0.15.3) reading the planes in place
(ggml.py); on macOS the Metal bridge of metal_pinned/ over mirror planes (metal_bridge.py, mirror.py; never
run).  llama_rung.py holds the teacher graph's ring view and the serving graph's cell-order cache; vec.py
the engine's side of a vec step.  docs/pinned-rung.md tells the whole story.
"""

from __future__ import annotations

from .. import backend
from . import llama_rung


# pinned="auto" uses the rung only where its numerics stay within their bound on every input the engine accepts.
# Nowhere today: llama.cpp's CPU kernel keeps its V accumulator in f16, which saturates on ordinary input (flat
# attention over 8,193 rows of V = 1 comes out 0.5 off, over 2,001 rows of V = 40 0.12 off, docs/pinned-rung.md),
# and the Metal kernel has never run.  pinned="on" takes it where it is loaded, for llama.cpp's bits.
AUTO_REASON = ("pinned='auto' leaves it off: its f16 V accumulator can leave its bound on accepted input "
               "(docs/pinned-rung.md); pinned='on' uses it")


def pinned_status(arch: str = "auto") -> tuple[bool, str]:
    """(loaded, description): can llama.cpp's vec kernel read planes on ``arch`` in this process?

    Without it the ladder falls to the project's own kernels, as §16.0 says it does when the
    metallib is missing.
    """
    return llama_rung.pinned_status(backend.resolve_arch(arch))


__all__ = ["AUTO_REASON", "pinned_status"]
