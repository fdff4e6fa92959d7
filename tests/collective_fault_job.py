"""A rank that reduces until told to stop, for the fault tests: writes OUT/pid<rank> once
joined, then loops over a dense and a compressed tensor. ``python collective_fault_job.py OUT``."""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bps_gc.core as bps  # noqa: E402

out = sys.argv[1]
bps.init()
rank = bps.rank()
bps.declare("dense", shape=(1000,), dtype=np.float32)
bps.declare("topk", shape=(100_000,), dtype=np.float32, compressor="topk", k=0.01)
with open(os.path.join(out, f"pid{rank}"), "w") as f:
    f.write(str(os.getpid()))
deadline = time.monotonic() + 120
try:
    while time.monotonic() < deadline:
        bps.push_pull(np.ones(1000, np.float32), "dense").wait()
        bps.push_pull(np.ones(100_000, np.float32), "topk").wait()
except bps.NodeFailure as e:
    print(f"rank {rank}: NodeFailure: {e}", file=sys.stderr, flush=True)
    sys.exit(3)
