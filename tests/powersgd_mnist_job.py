"""The MNIST demo model (example/demo/mnist_worker.py's MLP and real digits) trained twice in one
job under bpslaunch, with bps_gc.torch.DistributedOptimizer: dense, then with the compression
given, once per entry of a JSON list of compression_params (e.g. several seeds).
``python powersgd_mnist_job.py COMPRESSIONS_JSON EPOCHS OUT``: rank 0 writes accuracy.json,
{"dense": accuracy, "compressed": [accuracy per entry], "ratios": [wire ratio per entry]}."""
import json
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "example", "demo")]
import bps_gc.core as core  # noqa: E402
import bps_gc.torch as bps  # noqa: E402
from mnist_worker import accuracy, load_data, network  # noqa: E402

compressions, epochs, out = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
x, y, xv, yv = load_data(4000)
bps.init()
rank, size = bps.rank(), bps.size()
shard = np.arange(rank, len(x), size)
results = {"compressed": [], "ratios": []}
for run, params in [("dense", None)] + [(f"compressed{i}", c) for i, c in enumerate(compressions)]:
    model = network(128, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    opt = bps.DistributedOptimizer(opt, named_parameters=[(f"{run}.{n}", p) for n, p in model.named_parameters()],
                                   compression_params=params)
    core.metrics()
    for epoch in range(epochs):
        order = np.random.default_rng(epoch).permutation(shard)
        for start in range(0, len(order) - 31, 32):
            batch = order[start:start + 32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            opt.step()
    if params is None:
        results["dense"] = accuracy(model, xv, yv)
    else:
        results["compressed"].append(accuracy(model, xv, yv))
        results["ratios"].append(core.metrics().ratio)
if rank == 0:
    json.dump(results, open(os.path.join(out, "accuracy.json"), "w"))
bps.shutdown()
