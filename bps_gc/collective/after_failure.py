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
    at most ``bound`` s (a hung peer's collective blocks the teardown for gloo's whole timeout);
    and at exit (or at the process's end, if the teardown still blocks) a watchdog ends the
    process with status 1 if it still runs ``bound`` s later (the script caught the failure
    and exits with a status of its own, but a teardown blocks): faulthandler's thread, which
    runs without the GIL, even during finalization."""
    if exiting and abandoned is not None:
        linger()
        atexit._run_exitfuncs()  # the script's and the libraries' own, as the interpreter runs them
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        if abandoned == "KeyboardInterrupt":
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(1)
    if exiting:
        _end_within(bound)
    aborting = threading.Thread(target=_abort_process_groups, args=(rank,), name="bps_gc-abort", daemon=True)
    aborting.start()
    aborting.join(bound)
    if aborting.is_alive():
        log.warning("rank %d: a collective on the failed peer still holds its process group's teardown after "
                    "%g s; left to end with the process", rank, bound)
        if not exiting:  # the interpreter's end would wait for it: bound the end then
            atexit.register(_end_within, bound)


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
