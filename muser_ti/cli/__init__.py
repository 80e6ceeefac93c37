"""The commands: muser-decode (decode.py), muser-sweep (sweep.py), muser-bench (bench.py).

Each is also ``python scripts/NAME.py`` from a checkout, and ``python -m muser_ti.cli.NAME``.
"""

from __future__ import annotations

import contextlib
import os
import sys


@contextlib.contextmanager
def stdout_for_data(enabled: bool = True):
    """While active, everything written to the process's standard output, Taichi's C++ logs and Python
    prints alike, goes to standard error instead; yields a text stream on the real standard output, for
    the machine-readable result alone (``--json``).  Disabled, it yields sys.stdout and moves nothing."""
    if not enabled:
        yield sys.stdout
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    real_stdout = sys.stdout
    sys.stdout = sys.stderr
    data = os.fdopen(os.dup(saved), "w")
    try:
        yield data
    finally:
        data.flush()
        data.close()
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        sys.stdout = real_stdout
