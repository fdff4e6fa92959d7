"""The communicator's other calls on torch.distributed: send/recv (ordered per name, CHOCO's
gossip), broadcast, barrier and the plain all_reduce PowerSGD's phases use; then init() after
shutdown(). Saves what each rank got. ``python collective_p2p_job.py OUT``."""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bps_gc.core as bps  # noqa: E402

out = sys.argv[1]
comm = bps.init()
rank, size = comm.rank, comm.size
right, left = (rank + 1) % size, (rank - 1) % size
got = {}
# a ring: everyone sends two messages under one name and one under another, then receives
sends = [comm.send(right, "model", np.full(3 + i, rank * 10 + i, np.float32)) for i in range(2)]
sends.append(comm.send(right, "other", b"from %d" % rank))
got["other"] = comm.recv(left, "other").tobytes().decode()
got["model"] = [comm.recv(left, "model").view(np.float32).tolist() for _ in range(2)]
for handle in sends:
    handle.wait()
x = np.full(5, float(rank), np.float64)
got["broadcast"] = comm.broadcast(x, 1, "x").tolist()
comm.barrier()
y = np.arange(4, dtype=np.float32) * (rank + 1)
got["all_reduce"] = comm.all_reduce(y).tolist()
bps.shutdown()
try:  # a second job in this process, on the process group init() made: refused at once
    bps.init()
    got["init after shutdown"] = "started"
except RuntimeError as e:
    got["init after shutdown"] = str(e)
json.dump(got, open(os.path.join(out, f"p2p{rank}.json"), "w"))
