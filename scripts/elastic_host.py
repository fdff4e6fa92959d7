"""The start every worker host of the elastic jobs shares (scripts/chaos_worker.py,
tests/elastic_join_job.py): the spec's tensors declared, parameters linspace(-1, 1) until
elastic_start hands a joiner the live workers' ones."""
import os
import sys

import numpy as np

import bps_gc.core as bps


def start_host(spec):
    """(rank, parameters by name, first step): a joiner's is the step elastic_start returns."""
    bps.init()
    rank = bps.rank()
    if os.environ.get("ELASTIC_QUIT_AFTER_INIT") == os.environ.get("BYTEPS_LOCAL_RANK", "0"):
        sys.exit(f"worker {rank} quits once registered (ELASTIC_QUIT_AFTER_INIT): a joining host's rank failing")
    for t in spec["tensors"]:
        bps.declare(t["name"], shape=tuple(t["shape"]), dtype=t["dtype"], **t.get("params", {}))
    params = {t["name"]: np.linspace(-1, 1, int(np.prod(t["shape"])), dtype=np.float32) for t in spec["tensors"]}
    start = bps.elastic_start(params)
    say(f"START {start}")
    return rank, params, start


def say(line):
    """``line`` in one write: a host's local ranks share its launcher's stdout, and print's
    pieces (each argument, the newline) interleave with a host-mate's."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
