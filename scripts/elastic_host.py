"""The start every worker host of the elastic jobs shares (scripts/chaos_worker.py,
tests/elastic_join_job.py): the spec's tensors declared, parameters linspace(-1, 1) until
elastic_start hands a joiner the live workers' ones."""
import os
import signal
import sys
import time

import numpy as np

import bps_gc.core as bps


def start_host(spec):
    """(rank, parameters by name, first step): a joiner's is the step elastic_start returns.
    ELASTIC_HANG_BEFORE_INIT / ELASTIC_DIE_AFTER_INIT name a local rank of a joining host that
    never reaches the scheduler (it hangs until its launcher stops it) / dies (SIGKILL) once
    registered (scripts/elastic_netns.py --half-join). The spec's ``stall_copy`` (a path): a
    joiner's copy of the parameters stalls once the donor's header came, until that path exists
    (60 s at most), its I/O thread heartbeating: a join stuck after every rank registered
    (tests/test_elastic_join.py)."""
    local_rank = os.environ.get("BYTEPS_LOCAL_RANK", "0")
    if os.environ.get("ELASTIC_HANG_BEFORE_INIT") == local_rank:
        say(f"local rank {local_rank} hangs before it registers (ELASTIC_HANG_BEFORE_INIT)")
        while True:
            time.sleep(1)
    bps.init()
    rank = bps.rank()
    if os.environ.get("ELASTIC_DIE_AFTER_INIT") == local_rank:
        say(f"worker {rank} dies once registered (ELASTIC_DIE_AFTER_INIT): a joining host's rank failing")
        os.kill(os.getpid(), signal.SIGKILL)
    for t in spec["tensors"]:
        bps.declare(t["name"], shape=tuple(t["shape"]), dtype=t["dtype"], **t.get("params", {}))
    params = {t["name"]: np.linspace(-1, 1, int(np.prod(t["shape"])), dtype=np.float32) for t in spec["tensors"]}
    start = bps.elastic_start(stalled(params, spec["stall_copy"]) if spec.get("stall_copy") else params)
    say(f"START {start}")
    return rank, params, start


def stalled(params, path):
    """elastic_start's callable form of ``params``: on the joiner (``wanted``: the donor's
    arrays) it says STALLED and waits for ``path`` before handing them."""
    def copy_into(wanted=None):
        if wanted is not None:
            say("STALLED in the parameters' copy")
            deadline = time.monotonic() + 60
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.05)
        return params
    return copy_into


def say(line):
    """``line`` in one write: a host's local ranks share its launcher's stdout, and print's
    pieces (each argument, the newline) interleave with a host-mate's."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
