"""A worker of the elastic join test (tests/test_elastic_join.py): parameters updated in place
by the mean of each step's push_pull (p -= lr * mean), every step's result, parameters, bps.size()
and bps.membership_epoch() saved. The ``victim`` rank, at step ``pause_at``, pushes the first
tensor only, says HALF and waits to be killed. Every worker stops ``after_join`` steps into the
membership epoch ``join_epoch`` (a joiner's first step is the first of them); a joiner starts at
the step elastic_start returns. With ``hold`` (a path), a member waits after its last step, before
its goodbye, until HOLD.<rank> exists. Run as ``python tests/elastic_join_job.py SPEC.json OUT_DIR``."""
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
import bps_gc.core as bps  # noqa: E402
from elastic_host import start_host  # noqa: E402
from reference import gradient, step_ctx  # noqa: E402

spec_path, out_dir = sys.argv[1], sys.argv[2]
spec = json.load(open(spec_path))
tensors = spec["tensors"]
rank, params, start = start_host(spec)
out, first_joined, step = {"sizes": [], "epochs": []}, None, start
while step < spec["max_steps"]:
    ctx = step_ctx(dict(spec, lrs=[0.1] * spec["max_steps"]), step)
    inputs = [gradient(rank, step, t) for t in tensors]
    if rank == spec["victim"] and step == spec["pause_at"] and not start:
        bps.push_pull(inputs[0], tensors[0]["name"], ctx=ctx)
        print("HALF", flush=True)
        time.sleep(600)  # killed here
    handles = [(t["name"], bps.push_pull(x, t["name"], ctx=ctx)) for t, x in zip(tensors, inputs)]
    for name, h in handles:
        result = h.wait()
        params[name] -= np.float32(spec["lr"]) * result
        out[f"{name}/{step}"] = result.copy()
        out[f"param.{name}/{step}"] = params[name].copy()
    out["sizes"].append(bps.size())
    out["epochs"].append(bps.membership_epoch())
    print("STEP", step, bps.size(), bps.membership_epoch(), flush=True)
    if first_joined is None and bps.membership_epoch() >= spec["join_epoch"]:
        first_joined = step
    if first_joined is not None and step >= first_joined + spec["after_join"] - 1:
        break
    step += 1
    time.sleep(spec["sleep"])
np.savez(os.path.join(out_dir, f"rank{rank}.{start}.npz"), start=start, **{k: np.array(v) for k, v in out.items()})
print("DONE", flush=True)
deadline = time.monotonic() + 60
while spec.get("hold") and not start and not os.path.exists(f"{spec['hold']}.{rank}") and time.monotonic() < deadline:
    time.sleep(0.05)
bps.shutdown()
