"""A worker's side of the cluster tests: push_pull a described tensor set for some steps and save
every result (``out``: a tensor reduced into a new array, its input
checked unchanged, on every step, from the second or on odd ranks; else in place). Run as a worker process: ``python tests/cluster_job.py SPEC.json OUT_DIR``.

Tensors with a ``set`` (several tests' tensor sets in one launch) run set after set, each its
steps (every tensor declared first, in the spec's order, as the oracle numbers them); the
metrics file then holds each set's counters by set name (``metrics()`` restarts them)."""
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
results, metrics = {}, {}
reduced = []  # (address, elements) of each all_reduce, with views in the spec (the collective's)
if any("view" in t for t in spec["tensors"]):
    import torch.distributed as dist
    all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        reduced.append((tensor.data_ptr(), tensor.numel()))
        return all_reduce(tensor, *args, **kwargs)
    dist.all_reduce = recording_all_reduce


def laid_out(tensors, inputs):
    """``view``: the inputs of one view name, copied back to back into one flat array in the
    spec's (the push) order, become views of it, on every rank or (``view_ranks`` "odd") odd
    ranks only; returns the inputs and {view name: its flat array}."""
    flats = {}
    for _, t in tensors:
        if "view" in t and (t.get("view_ranks") != "odd" or rank % 2 == 1):
            flats.setdefault(t["view"], []).append(t)
    for view, members in flats.items():
        flats[view] = np.empty(sum(int(np.prod(t["shape"])) for t in members), members[0]["dtype"])
    offsets = dict.fromkeys(flats, 0)
    for k, (_, t) in enumerate(tensors):
        if "view" in t and t["view"] in flats:
            n, at = inputs[k].size, offsets[t["view"]]
            flats[t["view"]][at:at + n] = inputs[k].reshape(-1)
            inputs[k] = flats[t["view"]][at:at + n].reshape(inputs[k].shape)
            offsets[t["view"]] += n
    return inputs, flats


sets = list(dict.fromkeys(t.get("set") for t in spec["tensors"]))  # in the spec's order
for tensor_set in sets:
    tensors = [(i, t) for i, t in enumerate(spec["tensors"]) if t.get("set") == tensor_set]
    for step in range(spec["steps"]):
        ctx = step_ctx(spec, step)
        handles = []
        inputs, flats = laid_out(tensors, [gradient(rank, step, t) for _, t in tensors])  # as after a backward
        reduced.clear()
        def into_another(t):  # ``out``: True, "later" (from the 2nd step on), "odd ranks"; else in place
            way = t.get("out")
            return way is True or (way == "later" and step > 0) or (way == "odd ranks" and rank % 2 == 1)

        for (i, t), x in zip(tensors, inputs):
            out = np.empty_like(x) if into_another(t) else None
            handles.append((t["name"], bps.push_pull(x, t["name"], average=t.get("average", True),
                                                      priority=-i, ctx=ctx, out=out)))
        for name, h in handles:
            results[f"{name}/{step}"] = h.wait().copy()
        if flats:  # the views whose whole flat array gloo reduced, as it is (no copy)
            ways = metrics.setdefault(f"{tensor_set}:in place", [])
            ways.append(sorted(v for v, f in flats.items() if (f.ctypes.data, f.size) in reduced))
        for (_, t), x in zip(tensors, inputs):  # a reduce into another output leaves its input alone
            if into_another(t) and x.tobytes() != gradient(rank, step, t).tobytes():
                sys.exit(f"push_pull({t['name']!r}, out=...) changed its input")
    m = bps.metrics()
    metrics[tensor_set] = {"pushed_raw": m.pushed_raw, "pushed_wire": m.pushed_wire, "pulled_wire": m.pulled_wire,
                           "ratio": m.ratio, "messages": m.messages, "shared_bytes": m.shared_bytes}
if spec.get("held"):  # what each tensor's codecs hold after the steps, the shared scratch apart
    from held_bytes import held_bytes
    tensors = bps.communicator().tensors.values()
    codecs = {t.name: [(p.codec, p.reducer) for p in t.partitions if p.codec is not None] for t in tensors}
    shared = held_bytes([next((p.reducer.scratch for t in tensors for p in t.partitions
                               if getattr(p.reducer, "scratch", None) is not None), None)])
    json.dump({"scratch": shared, "tensors": {name: held_bytes(c) - shared for name, c in codecs.items() if c}},
              open(os.path.join(out_dir, f"held{rank}.json"), "w"))
np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **results)
json.dump(metrics if sets != [None] else metrics[None], open(os.path.join(out_dir, f"metrics{rank}.json"), "w"))
bps.shutdown()
