"""The MXNet twin of tests/torch_granularity_job.py: trains the same configurations with
bps_gc.mxnet.DistributedTrainer and saves, in the same layout, each rank's gradients as pushed
(scaled by 1/(batch*size)), the parameters after each step, the bytes pushed for gradients per
step and which gradients were declared compressed.
``python tests/mxnet_granularity_job.py SPEC OUT``."""
import json
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bps_gc.core as core  # noqa: E402
import bps_gc.mxnet as bps  # noqa: E402

BATCH = 5
MXNET_OPTIMIZER = {"lr": "learning_rate", "momentum": "momentum", "weight_decay": "wd"}


def network():
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(16, activation="relu", in_units=6), gluon.nn.Dense(8, in_units=16))
    net.initialize(mx.init.Uniform(0.5))
    return net


def batch(rank, step):
    rng = np.random.default_rng(1000 * rank + step)
    return (nd.array(rng.standard_normal((BATCH, 6)).astype(np.float32)),
            nd.array(rng.standard_normal((BATCH, 8)).astype(np.float32)))


spec = json.load(open(sys.argv[1]))
bps.init()
rank, size = bps.rank(), bps.size()
saved = {}
loss_fn = gluon.loss.L2Loss()
for j, cfg in enumerate(spec["configs"]):
    net = network()
    params = net.collect_params()
    optimizer = {MXNET_OPTIMIZER[k]: v for k, v in cfg["optimizer"].items()}
    trainer = bps.DistributedTrainer(params, "sgd", optimizer, compression_params=cfg["compression_params"],
                                     prefix=f"c{j}.")
    names = sorted(params.keys())
    prefix = cfg["name"]
    for i, n in enumerate(names):
        saved[f"{prefix}/init/{n}"] = params[n].data().asnumpy().copy()
        declaration = core.declaration(f"c{j}.gradient_{i}")
        saved[f"{prefix}/compressed/{n}"] = np.array(-1 if declaration is None else declaration.compressed)
    broadcast = sum(params[n].data().size * 4 for n in names)  # the first step sends the parameters too
    core.metrics()  # reset
    scale = np.float32(1.0 / (BATCH * size))
    for step, epoch in enumerate(spec["epochs"]):
        trainer.set_epoch(epoch)
        x, y = batch(rank, step)
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        for n in names:
            saved[f"{prefix}/{step}/grad/{n}"] = params[n].grad().asnumpy() * scale
        trainer.step(BATCH)
        saved[f"{prefix}/{step}/pushed_wire"] = np.array(core.metrics().pushed_wire - (broadcast if step == 0 else 0))
        for n in names:
            saved[f"{prefix}/{step}/param/{n}"] = params[n].data().asnumpy().copy()
np.savez(os.path.join(sys.argv[2], f"torch{rank}.npz"), **saved)
bps.shutdown()
