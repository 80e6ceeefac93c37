"""Ctrl-C held back while the engine commits a token, so an interrupt lands before the commit or after it.

Every commit is also made safe against any exception by running its (idempotent) writes again (Engine's
commit sections); this takes the common interrupt, SIGINT, out of the commit altogether.  Only the main
thread may install a signal handler; elsewhere nothing is held back (and the retry still applies).
"""

from __future__ import annotations

import contextlib
import signal
import threading


_holding = [False]  # the main thread is inside a held_back block: a nested one has nothing to add


@contextlib.contextmanager
def held_back():
    """SIGINT during the block is delivered (as KeyboardInterrupt, or to the handler that was there) at its end.
    Nested inside another, a block is the outer one's (a batch's step holds it once for all its sequences)."""
    if _holding[0] or threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.getsignal(signal.SIGINT)
    try:  # installed inside the try: whatever interrupts this function, the previous handler is back after it
        signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
        _holding[0] = True
        yield
    finally:
        _holding[0] = False
        signal.signal(signal.SIGINT, previous)
        if caught:
            if callable(previous):  # Python's default handler raises KeyboardInterrupt here
                previous(signal.SIGINT, caught[0])
            elif previous != signal.SIG_IGN:  # SIG_DFL (or a C handler): the signal again, to its own action
                signal.raise_signal(signal.SIGINT)


def atomically(commit) -> None:
    """Run ``commit`` (a commit section: device writes, then bookkeeping that sets rather than steps) so that
    it happens or not, never half: Ctrl-C is held back through it, and if anything raises inside it, it runs
    once more, which completes it (its writes land where they landed), before the exception goes on."""
    with held_back():
        try:
            commit()
        except BaseException:
            commit()
            raise


__all__ = ["atomically", "held_back"]
