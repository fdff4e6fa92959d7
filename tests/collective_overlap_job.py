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

# dense twins, one with gradient_as_bucket_view: the same parameters, its gradients views that
# keep their memory from the second step on, each flat buffer what gloo all_reduced
import torch.distributed as dist  # noqa: E402

class Twin(torch.nn.Module):
    """Its layers registered in the reverse of their use: the first guess of the layout (the
    reverse of the parameters') is wrong, and the first step lays the buffer out again."""
    def __init__(self):
        super().__init__()
        self.last, self.first = torch.nn.Linear(64, 8), torch.nn.Linear(32, 64)

    def forward(self, x):
        return self.last(torch.relu(self.first(x)))


reduced, all_reduce = [], dist.all_reduce
dist.all_reduce = lambda tensor, *args, **kwargs: reduced.append(tensor.data_ptr()) or all_reduce(tensor, *args, **kwargs)
twins, opts = [], []
for views in (False, True):
    torch.manual_seed(1)
    twin = Twin()
    opts.append(bps.DistributedOptimizer(torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=[(f"{views}.{n}", p) for n, p in twin.named_parameters()],
                                         gradient_as_bucket_view=views))
    twins.append(twin)
kept = []
for step in range(4):
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank * 100 + step))
    for twin, opt in zip(twins, opts):
        reduced.clear()
        twin(x).square().mean().backward()
        opt.step()
    flat = opts[1]._flat
    grads = [p.grad.data_ptr() for p in twins[1].parameters()]
    kept.append({"ptrs": grads, "views": grads == [flat.views[id(p)].data_ptr() for p in twins[1].parameters()],
                 "flat_reduced": [b.data_ptr() in reduced for b in flat.buffers.values()]})
    for twin, opt in zip(twins, opts):
        twin.zero_grad() if step == 1 else opt.zero_grad()  # the module's drops the views: copied back
json.dump(kept, open(os.path.join(sys.argv[1], f"views{rank}.json"), "w"))
np.savez(os.path.join(sys.argv[1], f"twins{rank}.npz"), *[p.detach().numpy() for t in twins for p in t.parameters()])
bps.shutdown()
