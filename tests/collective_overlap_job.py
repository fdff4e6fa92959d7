"""DistributedOptimizer on the collective transport (torchrun, 2 gloo ranks): times spent inside
its gradient hooks' push_pull_async against the time until step() returns, per step, and the
parameters after the last step. ``python tests/collective_overlap_job.py OUT``."""
import json
import os
import sys
import time

import numpy as np
import torch

import bps_gc.torch as bps
import bps_gc.torch.ops as ops

bps.init()
rank = bps.rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
                               compression_params={"compressor": "topk", "k": 0.01, "ef": "vanilla"})
inside, first_call = [], []
push_pull_async = ops.push_pull_async


def timed(*args, **kwargs):  # the optimizer's gradient hooks call ops.push_pull_async
    start = time.perf_counter()
    first_call.append(start)
    handle = push_pull_async(*args, **kwargs)
    inside.append(time.perf_counter() - start)
    return handle


ops.push_pull_async = timed
steps = []
for step in range(6):
    inside.clear(), first_call.clear()
    x = torch.randn(32, 1024, generator=torch.Generator().manual_seed(rank * 100 + step))
    model(x).square().mean().backward()
    opt.step()
    ended = time.perf_counter()
    opt.zero_grad()
    steps.append([sum(inside), ended - first_call[0]])
json.dump(steps, open(os.path.join(sys.argv[1], f"steps{rank}.json"), "w"))
np.savez(os.path.join(sys.argv[1], f"params{rank}.npz"), *[p.detach().numpy() for p in model.parameters()])
bps.shutdown()
