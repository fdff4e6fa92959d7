"""A rank that leaves the job in one of several ways, for tests/test_collective_departure.py:
``python collective_departure_job.py OUT KIND`` with KIND ``reduce`` (a dense and a compressed
tensor each step), ``gossip`` (a message to and from the next rank each step, as CHOCO's ring
does) or ``reduce+gossip`` (both each step). MODE_<rank>=raise raises at step 5; STEPS_<rank>
ends after that many steps (default: until the other ranks fail, at most 120 s). Writes
OUT/pid<rank>, prints RUNNING at step 2 and DONE when its steps are done."""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bps_gc.core as bps  # noqa: E402

out, kind = sys.argv[1], sys.argv[2]
bps.init()
rank, size = bps.rank(), bps.size()
steps = int(os.environ.get(f"STEPS_{rank}", "1000000000"))
mode = os.environ.get(f"MODE_{rank}", "")
bps.declare("dense", shape=(1000,), dtype=np.float32)
bps.declare("topk", shape=(100_000,), dtype=np.float32, compressor="topk", k=0.01)
with open(os.path.join(out, f"pid{rank}"), "w") as f:
    f.write(str(os.getpid()))
deadline = time.monotonic() + 120
step = 0
while step < steps and time.monotonic() < deadline:
    if "reduce" in kind.split("+"):
        bps.push_pull(np.ones(1000, np.float32), "dense").wait()
        bps.push_pull(np.ones(100_000, np.float32), "topk").wait()
    if "gossip" in kind.split("+"):
        sent = bps.send((rank + 1) % size, "model", np.full(1000, rank, np.float32))
        got = bps.recv((rank - 1) % size, "model")
        sent.wait()
        assert got.size == 4000
    if step == 2:
        print("RUNNING", flush=True)
    if step == 5 and mode == "raise":
        raise RuntimeError("the training script failed")
    step += 1
print("DONE", step, flush=True)
bps.shutdown()
