"""A worker of the elastic-membership tests (tests/test_elastic.py): push_pull the described
tensors each step and save every result and bps.size(). The ``victim`` rank, at step
``pause_at``, pushes the first tensor only (those listed in ``half``), says HALF and waits to be killed: it dies half-way
through a round. The ``stall_rank``, at step ``stall_at``, says STALL before pushing anything
and waits (to be stopped); with ``stall_after_push`` it first posts every tensor of that step
(its host pushes them) and never waits: silent during the pull. Every rank says PULLED at
``stall_at`` once it has that step's results. The ``silent_rank`` says SILENT before pushing
anything of step ``silent_at`` and waits (to be stopped). ``gates`` ({step: path}): members wait
before that step until the path exists; a joining host (the victim's, started again) says JOINING
and runs from the step ``elastic_start`` returns; its ``join_victim`` rank, at that first step,
posts ``half`` like the victim, says HALF and waits to be killed (a joiner dying once admitted).
Every rank says PUSHED at the steps ``pushed_at`` (default [``pause_at``]) once it posted them. Tensors under ``refused`` are declared last, each refusal printed.
``entire`` (a tensor description): one more array, reduced as one vector (granularity
'entiremodel', bps_gc.algorithms.entire_model: every rank pushes its chunks, also under two
levels), posted last each step (the victim's ``half`` pushes it too when it lists ``"entire"``).
Run as ``python tests/elastic_job.py SPEC.json OUT_DIR``."""
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bps_gc.core as bps  # noqa: E402
from bps_gc.algorithms.entire_model import EntireModel  # noqa: E402
from reference import gradient, step_ctx  # noqa: E402

spec_path, out_dir = sys.argv[1], sys.argv[2]
spec = json.load(open(spec_path))
bps.init()
rank = bps.rank()
for t in spec["tensors"]:
    bps.declare(t["name"], shape=tuple(t["shape"]), dtype=t["dtype"], **t.get("params", {}))
for t in spec.get("refused", []):  # codecs BPS_GC_ELASTIC refuses: declared last, keys of their own
    try:
        bps.declare(t["name"], shape=tuple(t["shape"]), dtype=t["dtype"], **t.get("params", {}))
        print("ACCEPTED", t["name"], flush=True)
    except ValueError as e:
        print("REFUSED", e, flush=True)
entire = spec.get("entire")
model = EntireModel(entire["name"], [entire["shape"]], entire["dtype"], entire["params"]) if entire else None


def post(inputs, ctx, which):
    """push_pull the tensors ``which`` (indices, or "entire") of this step: [(name, a callable
    that waits and returns the result)]."""
    posted = [(spec["tensors"][i]["name"], bps.push_pull(inputs[i], spec["tensors"][i]["name"], ctx=ctx).wait)
              for i in which if i != "entire"]
    if "entire" in which:
        arrays = [gradient(rank, ctx["step"], entire)]
        handles = model.post(arrays, ctx)
        posted.append((entire["name"], lambda: model.finish(handles, arrays)[0].reshape(-1)))
    return posted


if bps.joining():
    print("JOINING", flush=True)
start = bps.elastic_start({})  # no parameters: every result depends on the step alone
results, sizes = {}, []
for step in range(start, spec["steps"]):
    deadline = time.monotonic() + 60
    gate = spec.get("gates", {}).get(str(step))
    while gate and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.02)
    ctx = step_ctx(spec, step)
    inputs = [gradient(rank, step, t) for t in spec["tensors"]]
    everything = list(range(len(inputs))) + ["entire"] * (model is not None)
    if rank == spec.get("stall_rank") and step == spec["stall_at"]:
        if spec.get("stall_after_push"):
            posted = post(inputs, ctx, everything)
        print("STALL", flush=True)
        time.sleep(600)  # stopped here (SIGSTOP): silent, not dead
    if rank == spec.get("silent_rank") and step == spec["silent_at"]:
        print("SILENT", flush=True)
        time.sleep(600)  # stopped here (SIGSTOP) before its host pushes the step
    if (rank == spec.get("victim") and step == spec["pause_at"] and not start) or \
            (rank == spec.get("join_victim") and start and step == start):
        posted = post(inputs, ctx, spec.get("half", [0]))
        print("HALF", flush=True)
        time.sleep(600)  # killed here
    handles = post(inputs, ctx, everything)
    if step in spec.get("pushed_at", [spec["pause_at"]]):
        print("PUSHED", step, flush=True)
    for name, wait in handles:
        results[f"{name}/{step}"] = wait().copy()
    if step == spec.get("stall_at"):
        print("PULLED", step, flush=True)
    sizes.append(bps.size())
np.savez(os.path.join(out_dir, f"rank{rank}.npz"), sizes=np.array(sizes), **results)
print("DONE", flush=True)
bps.shutdown()
