"""A worker of tests/test_barrier.py: BARRIERS barriers back to back. Before each, a rank
records in its own file how many it has entered; after each, it checks that every rank has
entered as many. A barrier that returns early exits 3, naming it. Then rank 0 enters two
barriers at once, from two threads, while the others enter them one after the other. Last, each
rank prints what init() after shutdown() did (refused: the scheduler ends the job)."""
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bps_gc.core as bps  # noqa: E402

out, barriers = sys.argv[1], int(sys.argv[2])


def entered(rank):
    try:
        with open(f"{out}.{rank}") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


bps.init()
me, size = bps.rank(), bps.size()
for i in range(1, barriers + 1):
    with open(f"{out}.{me}.tmp", "w") as f:
        f.write(str(i))
    os.replace(f"{out}.{me}.tmp", f"{out}.{me}")
    if me == 0:
        time.sleep(0.001)  # the others are in the barrier already
    bps.barrier()
    behind = [r for r in range(size) if entered(r) < i]
    if behind:
        print(f"rank {me}: barrier {i} returned before ranks {behind} entered it", flush=True)
        sys.exit(3)
if me == 0:
    both = [threading.Thread(target=bps.barrier) for _ in range(2)]
    for t in both:
        t.start()
    for t in both:
        t.join(30)
    if any(t.is_alive() for t in both):
        print("rank 0: two barriers from two threads did not both complete", flush=True)
        os._exit(4)
else:
    time.sleep(0.5)  # rank 0's two barriers reach the scheduler first
    bps.barrier()
    bps.barrier()
bps.shutdown()
try:  # the scheduler ends the job now: another init() in this process is refused at once
    bps.init()
    print(f"rank {me}: init() after shutdown() started", flush=True)
except RuntimeError as e:
    print(f"rank {me}: {e}", flush=True)
