"""Daemon threads joined when the interpreter exits (``join_at_exit``).

A daemon thread still inside torch's C++ (settling a future, finishing a collective or an op)
when the interpreter finalizes is stopped mid-unwind as it takes the GIL back, and the process
aborts ("terminate called without an active exception", status 134) after a script that ended
well, or instead of its one line after a failure. So the transports' helper threads (the
collective's job threads, the parameter server's exchange waiters) are stopped and joined at
exit, within one bound for all of them: one blocked on a dead peer is left to die with the
process, and a failing job's exit stays prompt.
"""
import atexit
import time
import weakref

EXIT_JOIN_SECONDS = 2.0
_threads = weakref.WeakKeyDictionary()  # thread -> what stops it (None: it ends by itself)
_exiting = False  # bps_gc's own exit handler has begun: the interpreter ends after it


def mark_exiting():
    global _exiting
    _exiting = True


def exiting():
    """Whether the interpreter is ending (bps_gc's exit handler runs), not a script's own
    shutdown() that may be followed by more work (saving a checkpoint after a failure)."""
    return _exiting


def join_at_exit(thread, stop=None):
    """Join ``thread`` at exit, after calling ``stop()`` (to end a thread that waits for work)."""
    _threads[thread] = stop


@atexit.register
def _join_all(seconds=EXIT_JOIN_SECONDS):
    deadline = time.monotonic() + seconds
    for thread, stop in list(_threads.items()):
        if stop is not None:
            stop()
        thread.join(max(0.0, deadline - time.monotonic()))
