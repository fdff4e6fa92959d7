"""Trains a small torch network per configuration with bps_gc.torch and saves, per step, each
rank's raw gradients and the parameters after the step. ``python tests/torch_job.py SPEC OUT``."""
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
    opt = torch.optim.SGD(model.parameters(), **cfg["optimizer"])
    compression = bps.Compression.fp16 if cfg.get("fp16") else bps.Compression.none
    opt = bps.DistributedOptimizer(opt, named_parameters=named, compression=compression,
                                   compression_params=cfg.get("compression_params"))
    for n, p in named:
        saved[f"{cfg['name']}/init/{n}"] = p.detach().numpy().copy()
    for step in range(spec["steps"]):
        x, y = batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        grads = torch.autograd.grad(loss, [p for _, p in named], retain_graph=True)
        for (n, _), g in zip(named, grads):
            saved[f"{cfg['name']}/{step}/grad/{n}"] = g.numpy().copy()
        loss.backward()
        opt.step()
        opt.zero_grad()
        for n, p in named:
            saved[f"{cfg['name']}/{step}/param/{n}"] = p.detach().numpy().copy()
m = bps.metrics() if hasattr(bps, "metrics") else None
np.savez(os.path.join(sys.argv[2], f"torch{rank}.npz"), **saved)
bps.shutdown()
