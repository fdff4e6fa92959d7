"""bps_gc.torch.CompressedExchange on sub-groups, under torchrun on 4 gloo ranks:
``python exchange_subgroup_job.py SPEC.json OUT``. Ranks {0, 1} and {2, 3} each average their
own named tensors over their own group, for a few steps of every codec in the spec; at step 1
the names come in reversed order (a part's codec follows its name). Each rank saves every
result and what it sent, for the numpy re-computation."""
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]
import bps_gc.torch as bps  # noqa: E402

spec, out = json.load(open(sys.argv[1])), sys.argv[2]
dist.init_process_group("gloo")
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
np.savez(os.path.join(out, f"rank{rank}.npz"), **saved)
dist.barrier()
dist.destroy_process_group()
