"""Issue 42's "dense equals native" on the LM: the yardstick's GPT (example/pytorch/lm/gpt.py,
tiny), seeded, trained STEPS SGD steps on each rank's own batches of random bytes. fsdp_job.py
trains it as native HSDP and through the dense hooks on the (2, 2) mesh (the yardstick's
sharding, example/pytorch/lm/hsdp.py); fsdp_ps_job.py through the dense hooks with the
parameter server as the replicate reducer (2 hosts x 2 local ranks); ``reference`` recomputes
it in one process, without FSDP or bps_gc: SGD on the mean of the ranks' gradients."""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "example", "pytorch", "lm"))
from gpt import GPT, byte_loss  # noqa: E402

LAYERS, WIDTH, HEADS, CONTEXT, BATCH = 1, 32, 2, 32, 4
STEPS, LR = 10, 0.5


def model():
    torch.manual_seed(0)
    return GPT(LAYERS, WIDTH, HEADS, CONTEXT)


def batch(rank, step):
    """Rank ``rank``'s inputs and targets at ``step``: random bytes, the targets shifted by one."""
    xy = torch.randint(0, 256, (BATCH, CONTEXT + 1), generator=torch.Generator().manual_seed(1000 * rank + step))
    return xy[:, :-1], xy[:, 1:]


def train(net, rank, steps=STEPS):
    """``net`` (sharded or not) trained ``steps`` SGD steps on rank ``rank``'s batches."""
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        byte_loss(net(x), y).backward()
        opt.step()
    return {name: p.full_tensor().detach().numpy() for name, p in net.named_parameters()}


def reference(ranks, steps=STEPS):
    """{name: parameter} after ``steps`` SGD steps on the mean (in float64) of ``ranks`` ranks'
    gradients: what HSDP over those ranks computes."""
    net = model()
    for step in range(steps):
        grads = []
        for rank in range(ranks):
            x, y = batch(rank, step)
            net.zero_grad()
            byte_loss(net(x), y).backward()
            grads.append([p.grad.double() for p in net.parameters()])
        with torch.no_grad():
            for i, p in enumerate(net.parameters()):
                p -= LR * (sum(g[i] for g in grads) / ranks).float()
    return {name: p.detach().numpy() for name, p in net.named_parameters()}
