"""A worker of tests/test_barrier.py (two levels: hosts of 2 local ranks): ROUNDS times, declares
N more tensors kept by the servers' ``outer_sgd`` reducer, enters a barrier, and at once fetches
the server state of the round's last ten, the last declared first. A tensor's partition is
declared to the servers by its owner only (one local rank of the host), and each server reads
every worker's socket on its own, so a host-mate's fetch succeeds only if the barrier waited
for the owner's declarations to reach the servers. Prints how many it fetched."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bps_gc import core  # noqa: E402

rounds, n = int(sys.argv[1]), int(sys.argv[2])
core.init()
comm = core.communicator()
fetched = 0
for r in range(rounds):
    names = [f"r{r}.t{i}" for i in range(n)]
    for name in names:
        comm.declare(name, shape=(8,), dtype=np.float32, reducer="outer_sgd", compressor="identity")
    core.barrier()
    fetched += sum(len(comm.server_values(name, "global_copy")) == 8 for name in reversed(names[-10:]))
print(f"rank {core.rank()}: fetched {fetched}", flush=True)
core.shutdown()
