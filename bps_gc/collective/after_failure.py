"""How a rank's process ends after its job failed (a peer died, hung or left mid-job).

Collectives may still be pending on a failed or departing peer, each holding a Python callback
(a wait's wake-up, an exchange's write-back, FSDP2's own). Settled during the interpreter's
finalization (the peer's socket closes then, or the group's destructor fails them), the callback
runs on gloo's thread, which cannot take the GIL back then: the process aborts (status 134,
"terminate called ... gloo::IoException") after its one line. And a peer that hangs rather than
dies never answers: the group's destructor then joins gloo's thread for the group's whole
timeout (30 minutes by default) and the rank never exits.
"""
import atexit
import faulthandler
import logging
import os
import signal
import sys
import threading

import torch.distributed as dist

log = logging.getLogger("bps_gc.collective")
_devnull = None  # faulthandler writes its dump here: it must stay open until the process ends


def failure_bound(cfg):
    """Twice the heartbeat's bound: how long the heartbeat may take to name a dead or departed
    peer on a busy host, and how long a failed rank's teardown may take."""
    return 2 * (cfg.heartbeat_timeout + cfg.heartbeat_interval)


def end_after_failure(rank, bound, exiting, abandoned=None, linger=lambda: None):
    """End this rank's part after its job failed. ``exiting``: the process is ending (bps_gc's
    exit handler runs), else a script's own shutdown() that more work may follow.

    At exit, a script that ends on the uncaught failure (``abandoned``, its exception's name)
    waits with ``linger()`` (until the ranks still running have read its end, as its
    finalization used to give them time to), runs the other exit handlers and ends as Python
    would end it (status 1; by SIGINT after Ctrl-C), without the finalization where gloo's
    threads abort it. Otherwise every process group is aborted (the script's own too: the failed
    peer broke it), so that what can fail fails now, while Python runs: on a thread waited for
    at most ``bound`` s (a hung peer's collective blocks the teardown for gloo's whole timeout).
    A process whose teardown still blocks at exit ends there with status 1, after the exit
    handlers, without the finalization: beside gloo's blocked thread that crashed it (SIGSEGV,
    seen once in the suite). A watchdog, faulthandler's thread (it runs without the GIL), ends
    a process still running ``bound`` s after its exit began (an exit handler that blocks)."""
    if exiting and abandoned is not None:
        linger()
        _end_now(interrupted=abandoned == "KeyboardInterrupt")
    if exiting:
        _end_within(bound)
    aborting = threading.Thread(target=_abort_process_groups, args=(rank,), name="bps_gc-abort", daemon=True)
    aborting.start()
    aborting.join(bound)
    if aborting.is_alive():
        log.warning("rank %d: a collective on the failed peer still holds its process group's teardown after "
                    "%g s; the process ends with status 1 at its exit", rank, bound)
        if exiting:
            _end_if_blocked(aborting, bound)
        atexit.register(_end_if_blocked, aborting, bound)  # the script goes on: at its exit


def _end_if_blocked(aborting, bound):
    if aborting.is_alive():
        atexit.unregister(_end_if_blocked)  # _end_now runs the exit handlers: not this one again
        _end_within(bound)  # the watchdog (again), for the exit handlers _end_now runs
        _end_now()


def _end_now(interrupted=False):
    """End as the interpreter would after an uncaught exception (status 1; by SIGINT after
    Ctrl-C), without its finalization: the exit handlers run (the script's and the libraries'
    own), the streams are flushed."""
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(1)


def _end_within(seconds):
    global _devnull
    if _devnull is None:
        _devnull = open(os.devnull, "w")
    faulthandler.dump_traceback_later(seconds, exit=True, file=_devnull)


def _abort_process_groups(rank):
    try:
        dist.distributed_c10d._abort_process_group()
    except RuntimeError as e:
        log.warning("rank %d: aborting the process groups after the failure failed: %s", rank, e)
