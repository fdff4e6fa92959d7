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

import torch.distributed as dist

log = logging.getLogger("bps_gc.collective")
_devnull = None  # faulthandler writes its dump here: it must stay open until the process ends


def end_after_failure(rank, seconds=None, abandoned=None, linger=lambda: None):
    """``seconds`` None: a script's own shutdown() after a failure (more work may follow): abort
    every process group (its own too: the failed peer broke it), so that what can fail fails
    now, while Python runs, and not at finalization.

    ``seconds`` given: the process is ending. A watchdog then ends it with status 1 if it still
    runs ``seconds`` later (a hung peer's collective blocks a teardown): faulthandler's thread,
    which runs without the GIL, even during finalization. If the script ends on an uncaught
    error (``abandoned``, its exception's name), the other exit handlers run now and the process
    ends as Python would end it (status 1; by SIGINT after Ctrl-C), without the finalization
    where gloo's threads abort it; first it waits with ``linger()`` (until the ranks still
    running have read its end, as its finalization used to give them time to). Otherwise (the script caught the failure and
    exits with a status of its own) the groups are aborted and the interpreter ends as usual."""
    global _devnull
    if seconds is not None:
        if _devnull is None:
            _devnull = open(os.devnull, "w")
        faulthandler.dump_traceback_later(seconds, exit=True, file=_devnull)
        if abandoned is not None:
            linger()
            atexit._run_exitfuncs()  # the script's and the libraries' own, as the interpreter runs them
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            if abandoned == "KeyboardInterrupt":
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            os._exit(1)
    try:
        dist.distributed_c10d._abort_process_group()
    except RuntimeError as e:
        log.warning("rank %d: aborting the process groups after the failure failed: %s", rank, e)
