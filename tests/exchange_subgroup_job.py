"""bps_gc.torch.CompressedExchange on sub-groups, on 4 gloo ranks (torchrun or bpslaunch
--servers 0):
``python exchange_subgroup_job.py SPEC.json OUT``. Ranks {0, 1} and {2, 3} each average their
own named tensors over their own group, for a few steps of every codec in the spec; at step 1
the names come in reversed order (a part's codec follows its name). Then payloads of growing
lengths through the all_to_all (collective/all_to_all.py). Each rank saves every result and
what it sent, for the numpy re-computation."""
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]
import bps_gc.torch as bps  # noqa: E402
from bps_gc.collective.all_gather import Capacity, PayloadsMissing  # noqa: E402
from bps_gc.collective.all_to_all import all_to_all_bytes  # noqa: E402
from gloo_group import init_default_group  # noqa: E402

spec, out = json.load(open(sys.argv[1])), sys.argv[2]
init_default_group()  # torchrun or bpslaunch --servers 0
rank = dist.get_rank()
groups = [dist.new_group(ranks) for ranks in spec["groups"]]
mine = next(g for g, ranks in zip(groups, spec["groups"]) if rank in ranks)


def gradient(name, step, shape):
    """This rank's gradient of ``name`` at ``step``: the test recomputes it alike."""
    seed = [rank, step, sum(name.encode())]
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


saved = {}
for codec, params in spec["codecs"].items():
    exchange = bps.CompressedExchange(params)
    for step in range(spec["steps"]):
        shapes = list(spec["shapes"].items())
        if step == 1:
            shapes.reverse()
        tensors = {name: torch.from_numpy(gradient(name, step, shape)) for name, shape in shapes}
        exchange(tensors, group=mine, lr=spec["lr"]).wait()
        saved.update({f"{codec}/{step}/{name}": t.numpy() for name, t in tensors.items()})
# the all_to_all of payloads (collective/all_to_all.py) on the same groups: each part's payload
# to its destination alone, of lengths that grow from call to call (past the capacity the last
# calls learnt: a second all_to_all), as numpy arrays, then as tensors; then a rank without payloads
spec_a2a, capacity = spec["all_to_all"], Capacity()
for call, lengths in enumerate(spec_a2a["lengths"]):
    mine_payloads = [np.full(n + rank, 16 * rank + 4 * part + call, np.uint8) for part, n in enumerate(lengths)]
    if call == len(spec_a2a["lengths"]) - 1:
        mine_payloads = [torch.from_numpy(p) for p in mine_payloads]
    rows = all_to_all_bytes(mine_payloads, spec_a2a["destinations"], lambda work, what: work.wait(), mine, capacity)
    for sender, row in enumerate(rows):
        saved[f"a2a/{call}/{sender}/here"] = np.array([p is not None for p in row])
        saved.update({f"a2a/{call}/{sender}/{part}": np.asarray(p) for part, p in enumerate(row) if p is not None})
    saved[f"a2a/{call}/capacity"] = np.array(capacity.bytes)
try:
    all_to_all_bytes(None if dist.get_rank(mine) == 1 else [np.zeros(2, np.uint8)] * 3, spec_a2a["destinations"],
                     lambda work, what: work.wait(), mine, capacity)
    saved["a2a/missing"] = np.array("")
except PayloadsMissing as e:
    saved["a2a/missing"] = np.array(str(e))
np.savez(os.path.join(out, f"rank{rank}.npz"), **saved)
dist.barrier()
dist.destroy_process_group()
