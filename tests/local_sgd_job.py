"""Trains small torch networks with bps_gc.torch.LocalSGD (or DistributedOptimizer, the
synchronous baseline) and saves, per step, each rank's gradients, parameters, BatchNorm
buffers and wire bytes. ``python tests/local_sgd_job.py SPEC OUT``."""
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bps_gc.core as core  # noqa: E402
import bps_gc.torch as bps  # noqa: E402


def network(kind):
    torch.manual_seed(0)  # the same initial weights on every rank
    if kind == "exact":  # weights on a 1/16 grid, integer data: every float32 operation is exact
        model = torch.nn.Linear(4, 3)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.round(p * 16) / 16)
        return model
    if kind == "bn":
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                   torch.nn.Linear(8, 4))
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))


def loss_of(kind, model, rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    if kind == "exact":
        x = torch.randint(-2, 3, (8, 4), generator=g).float()
        c = torch.randint(-2, 3, (8, 3), generator=g).float()
        return (model(x) * c).sum()
    x = torch.randn(5, 6, generator=g) + 3 * rank  # each rank its own data distribution
    y = torch.randn(5, 8 if kind == "mlp" else 4, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)


spec = json.load(open(sys.argv[1]))
bps.init()
rank = bps.rank()
saved = {}
for cfg in spec["configs"]:
    name, kind = cfg["name"], cfg["model"]
    model = network(kind)
    named = [(f"{name}.{n}", p) for n, p in model.named_parameters()]
    opt = torch.optim.SGD(model.parameters(), **cfg["optimizer"])
    if cfg["algorithm"] == "sync":
        opt = bps.DistributedOptimizer(opt, named_parameters=named)
    else:
        opt = bps.LocalSGD(opt, named, local_steps=cfg["local_steps"], local_from_epoch=cfg.get("local_from_epoch", 0),
                           compression_params=cfg.get("compression_params"))
    for n, p in named:
        saved[f"{name}/init/param/{n}"] = p.detach().numpy().copy()
    core.metrics()  # reset the byte counters
    for step in range(cfg["steps"]):
        if cfg["algorithm"] != "sync":
            opt.set_epoch(step // cfg["steps_per_epoch"])
            saved[f"{name}/{step}/synchronizes"] = np.array(opt.synchronizes())
        loss = loss_of(kind, model, rank, step)
        grads = torch.autograd.grad(loss, [p for _, p in named], retain_graph=True)
        for (n, _), g in zip(named, grads):
            saved[f"{name}/{step}/grad/{n}"] = g.numpy().copy()
        loss.backward()
        opt.step()
        opt.zero_grad()
        for n, p in named:
            saved[f"{name}/{step}/param/{n}"] = p.detach().numpy().copy()
        for n, b in model.named_buffers():
            saved[f"{name}/{step}/buffer/{n}"] = b.numpy().copy()
        m = core.metrics()
        saved[f"{name}/{step}/bytes"] = np.array(m.pushed_wire + m.pulled_wire)
        saved[f"{name}/{step}/pushed"] = np.array(m.pushed_wire)
np.savez(os.path.join(sys.argv[2], f"local{rank}.npz"), **saved)
bps.shutdown()
