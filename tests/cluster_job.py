"""A worker's side of the cluster tests: push_pull a described tensor set for some steps and save
every result. Run as a worker process: ``python tests/cluster_job.py SPEC.json OUT_DIR``."""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bps_gc.core as bps  # noqa: E402
from reference import gradient, step_ctx  # noqa: E402

spec_path, out_dir = sys.argv[1], sys.argv[2]
spec = json.load(open(spec_path))
if spec.get("shm_off_worker") == int(os.environ.get("DMLC_WORKER_ID", -1)):
    os.environ["BPS_GC_SHM"] = "0"  # this worker offers no shared memory (tests/test_shm.py)
bps.init()
rank = bps.rank()
for t in spec["tensors"]:
    bps.declare(t["name"], shape=tuple(t["shape"]) if spec.get("declare_shapes", True) else None,
                dtype=t["dtype"], reducer=t.get("reducer"), **t.get("params", {}))
results = {}
for step in range(spec["steps"]):
    ctx = step_ctx(spec, step)
    handles = []
    inputs = [gradient(rank, step, t) for t in spec["tensors"]]  # all ready, as after a backward
    for i, (t, x) in enumerate(zip(spec["tensors"], inputs)):
        handles.append((t["name"], bps.push_pull(x, t["name"], average=t.get("average", True),
                                                  priority=-i, ctx=ctx)))
    for name, h in handles:
        results[f"{name}/{step}"] = h.wait().copy()
m = bps.metrics()
np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **results)
json.dump({"pushed_raw": m.pushed_raw, "pushed_wire": m.pushed_wire, "pulled_wire": m.pulled_wire,
           "ratio": m.ratio, "messages": m.messages, "shared_bytes": m.shared_bytes},
          open(os.path.join(out_dir, f"metrics{rank}.json"), "w"))
bps.shutdown()
