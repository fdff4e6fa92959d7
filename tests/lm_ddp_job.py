"""Two ranks of the LM (example/pytorch/lm) under DDP with bps_gc's dense hook, under torchrun or
bpslaunch --servers 0.
``python lm_ddp_job.py OUT STEPS``: every rank trains the tiny GPT on its own windows of a fixed
random byte string (stdlib_text.train_batch with its rank), SGD with clipping, and saves its
final parameters to OUT/rank<r>.pt (``train``: the same in a launch of several runs,
tests/lm_fsdp_job.py). SGD, not Adam: Adam would blow the float noise of gradients
that are zero in exact arithmetic (the key bias's) up to whole steps."""
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "example", "pytorch", "lm")]
import bps_gc.torch as bps  # noqa: E402
from gpt import GPT, byte_loss  # noqa: E402
from stdlib_text import train_batch  # noqa: E402
from gloo_group import init_default_group  # noqa: E402

TEXT = np.random.default_rng(7).integers(0, 256, 4000).astype(np.uint8)
SHAPE = dict(layers=1, width=32, heads=2, context=16)  # the test's one-process oracle uses the same
BATCH = 4


def train(out, steps):
    """The DDP training on the default process group (made by the caller)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(**SHAPE)
    net = DDP(model)
    net.register_comm_hook(None, bps.comm_hook(None, named_parameters=model.named_parameters()))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(steps):
        x, y = (torch.from_numpy(a) for a in train_batch(TEXT, 0, rank, step, BATCH, SHAPE["context"]))
        opt.zero_grad()
        byte_loss(net(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    torch.save(model.state_dict(), os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()


if __name__ == "__main__":
    init_default_group()  # torchrun or bpslaunch --servers 0
    train(sys.argv[1], int(sys.argv[2]))
    dist.destroy_process_group()
