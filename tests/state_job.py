"""A training job that checkpoints and resumes its codec state on the parameter server (issue 33).

``python tests/state_job.py SPEC.json OUT_DIR``, the same command every time: each rank trains
parameters ``w`` of the spec's tensors with SGD on ``grad = gradient(rank, step) + 0.5 w``
averaged by push_pull, for ``steps`` steps. With ``save_at``, after that step each rank writes
OUT_DIR/ckpt{rank}.bin (encode_state of the step, the parameters and bps_gc.core.state_dict(),
written to a temporary file, then renamed); with ``hang_after_save`` the first run then waits to
be killed. A run that finds its checkpoint loads it (after ``load_delay[rank]`` seconds) and
goes on from the step after. The final
parameters go to OUT_DIR/final{rank}.npz.
"""
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bps_gc.core as bps  # noqa: E402
from bps_gc.compress.state_bytes import decode_state, encode_state  # noqa: E402
from reference import gradient, step_ctx  # noqa: E402

spec_path, out_dir = sys.argv[1], sys.argv[2]
spec = json.load(open(spec_path))
bps.init()
rank = bps.rank()
ckpt = os.path.join(out_dir, f"ckpt{rank}.bin")
params = {}
for t in spec["tensors"]:
    bps.declare(t["name"], shape=tuple(t["shape"]), dtype=t["dtype"], reducer=t.get("reducer"),
                **t.get("params", {}))
    params[t["name"]] = np.zeros(t["shape"], t["dtype"])
start = 0
if os.path.exists(ckpt):
    saved = decode_state(open(ckpt, "rb").read())
    start = int(saved["step"]) + 1
    for name in params:
        params[name][...] = saved[f"param/{name}"]
    # the other ranks' first pushes reach the servers before this rank's restore: it must win
    time.sleep(spec.get("load_delay", {}).get(str(rank), 0))
    bps.load_state_dict({k[len("bps/"):]: v for k, v in saved.items() if k.startswith("bps/")})
    print(f"rank {rank} resumed at step {start}", flush=True)
for step in range(start, spec["steps"]):
    ctx = step_ctx(spec, step)
    grads = {t["name"]: gradient(rank, step, t) + params[t["name"]] * 0.5 for t in spec["tensors"]}
    handles = [(name, bps.push_pull(g, name, average=True, ctx=ctx)) for name, g in grads.items()]
    for name, h in handles:
        params[name] -= np.asarray(ctx["lr"], params[name].dtype) * h.wait()
    if step == spec.get("save_at") and start == 0:
        state = {"step": step, **{f"param/{n}": w for n, w in params.items()},
                 **{f"bps/{k}": v for k, v in bps.state_dict().items()}}
        with open(ckpt + ".tmp", "wb") as f:
            f.write(encode_state(state))
        os.replace(ckpt + ".tmp", ckpt)
        print(f"rank {rank} saved at step {step}", flush=True)
        if spec.get("hang_after_save"):
            time.sleep(600)  # the test kills every process of the job now
np.savez(os.path.join(out_dir, f"final{rank}.npz"), **params)
bps.shutdown()
