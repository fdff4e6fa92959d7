"""The recomputation of bps_gc.torch.DiLoCo over the tests' MLP sharded with FSDP2 inside each
replica (fsdp_job.py mode "diloco", a (2, 2) mesh: rank = 2 x replica + shard), in one process
with torch alone: each replica an unsharded copy of the model, its inner SGD step on the mean
of its two ranks' gradients (what FSDP2's reduce-scatter hands each shard), and every
``sync_every`` steps the replicas' pseudo-gradients (global copy - local) averaged (dense, or
each parameter's shards through the numpy chains of fsdp_inhost_oracle.expected_call, named
``<fqn>#shard<i>``), the paper's outer step on the global copy (torch's SGD, lr 0.7, momentum 0.9,
Nesterov), and both replicas restarted from it."""
import copy

import numpy as np
import torch

from fsdp_inhost_oracle import PARAMS, expected_call

WIDTHS = (16, 32, 32, 8)


def batch(rank, step):
    """fsdp_job.train's batch of ``rank`` at ``step`` (one micro-batch)."""
    g = torch.Generator().manual_seed(1000 * rank + 10 * step)
    return torch.randn(4, WIDTHS[0], generator=g), torch.randn(4, WIDTHS[-1], generator=g)


def averaged(pseudo, sync, params):
    """{name: the replicas' averaged pseudo-gradient} (``pseudo``: each replica's {name: tensor})."""
    if params is None:
        return {name: (pseudo[0][name] + pseudo[1][name]) / 2 for name in pseudo[0]}
    out = {}
    for name, shape in PARAMS:
        rows = shape[0] // 2  # the MLP's rows split evenly over 2 shards
        shards = [expected_call([p[name].numpy()[rows * i:rows * (i + 1)].reshape(-1) for p in pseudo], i,
                                [(name, shape)], sync, run="diloco", params=params) for i in range(2)]
        out[name] = torch.from_numpy(np.concatenate(shards).reshape(shape))
    return out


def diloco_reference(steps, sync_every, params=None):
    """[[{name: float32 array} of each replica] after every step]."""
    torch.manual_seed(0)  # fsdp_job.build's model
    model = torch.nn.Sequential(torch.nn.Linear(WIDTHS[0], WIDTHS[1]), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTHS[1], WIDTHS[2]), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTHS[2], WIDTHS[3]))
    replicas = [copy.deepcopy(model) for _ in range(2)]
    inner = [torch.optim.SGD(m.parameters(), lr=0.1) for m in replicas]
    global_copy = {name: p.detach().clone() for name, p in model.named_parameters()}
    outer = torch.optim.SGD(list(global_copy.values()), lr=0.7, momentum=0.9, nesterov=True)
    history = []
    for step in range(steps):
        for r, (m, opt) in enumerate(zip(replicas, inner)):
            grads = []
            for rank in (2 * r, 2 * r + 1):
                x, y = batch(rank, step)
                m.zero_grad()
                torch.nn.functional.mse_loss(m(x), y).backward()
                grads.append([p.grad.clone() for p in m.parameters()])
            for p, a, b in zip(m.parameters(), *grads):
                p.grad = (a + b) / 2
            opt.step()
        if (step + 1) % sync_every == 0:
            with torch.no_grad():
                pseudo = [{name: global_copy[name] - p for name, p in m.named_parameters()} for m in replicas]
                for name, mean in averaged(pseudo, (step + 1) // sync_every - 1, params).items():
                    global_copy[name].grad = mean
                outer.step()
                for m in replicas:
                    for name, p in m.named_parameters():
                        p.copy_(global_copy[name])
        history.append([{name: p.detach().numpy().copy() for name, p in m.named_parameters()} for m in replicas])
    return history
