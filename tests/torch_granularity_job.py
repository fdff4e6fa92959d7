"""Trains a tiny torch network per configuration with bps_gc.torch.DistributedOptimizer (DGC,
entire-model granularity) and saves each rank's raw gradients, the parameters after each step,
the bytes it pushed per step and which gradients were declared compressed.
``python tests/torch_granularity_job.py SPEC OUT``."""
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bps_gc.core as core  # noqa: E402
import bps_gc.torch as bps  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_torch_net import batch, network  # noqa: E402


spec = json.load(open(sys.argv[1]))
bps.init()
rank = bps.rank()
saved = {}
for cfg in spec["configs"]:
    model = network()
    named = [(f"{cfg['name']}.{n}", p) for n, p in model.named_parameters()]
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), **cfg["optimizer"]),
                                   named_parameters=named, compression_params=cfg["compression_params"])
    for n, p in named:
        saved[f"{cfg['name']}/init/{n}"] = p.detach().numpy().copy()
        declaration = core.declaration(f"Gradient.{n}")
        saved[f"{cfg['name']}/compressed/{n}"] = np.array(-1 if declaration is None else declaration.compressed)
    core.metrics()  # reset
    for step, epoch in enumerate(spec["epochs"]):
        opt.set_epoch(epoch)
        x, y = batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        grads = torch.autograd.grad(loss, [p for _, p in named], retain_graph=True)
        for (n, _), g in zip(named, grads):
            saved[f"{cfg['name']}/{step}/grad/{n}"] = g.numpy().copy()
        loss.backward()
        opt.step()
        opt.zero_grad()
        saved[f"{cfg['name']}/{step}/pushed_wire"] = np.array(core.metrics().pushed_wire)
        for n, p in named:
            saved[f"{cfg['name']}/{step}/param/{n}"] = p.detach().numpy().copy()
np.savez(os.path.join(sys.argv[2], f"torch{rank}.npz"), **saved)
bps.shutdown()
