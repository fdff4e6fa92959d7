"""A worker of tests/test_device_bindings.py: push_pulls torch tensors through bps_gc.torch
(the parameter server or torch.distributed, whichever the environment starts), then trains the
tiny network with DistributedOptimizer, and saves every result with the names of the tensors
that went through device chains. ``python tests/device_bindings_job.py SPEC.json OUT_DIR``;
the spec is cluster_job.py's (reference.py recomputes its push_pulls), plus ``device`` (where
the tensors live) and the compression_params of DistributedOptimizer (``optimizer``), LocalSGD
(``local_sgd``) and CHOCO-SGD (``choco``), each trained ``optimizer_steps`` steps if present."""
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bps_gc.torch as bps  # noqa: E402
from bps_gc.torch import device as device_codecs  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import gradient, step_ctx  # noqa: E402
from tiny_torch_net import batch, network  # noqa: E402

spec = json.load(open(sys.argv[1]))
device = torch.device(spec.get("device", "cpu"))
if device.type == "cuda":  # one GPU per local rank where there are enough, else all share one
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("BYTEPS_LOCAL_RANK", "0")))
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
bps.init()
rank = bps.rank()
TORCH = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16}
for t in spec["tensors"]:
    bps.declare(t["name"], shape=tuple(t["shape"]), dtype=TORCH[t["dtype"]], reducer=t.get("reducer"),
                **t.get("params", {}))
results = {}
for step in range(spec["steps"]):
    ctx = step_ctx(spec, step)
    tensors = [torch.from_numpy(gradient(rank, step, t)).to(device) for t in spec["tensors"]]
    handles = [bps.push_pull_async(x, average=t.get("average", True), name=t["name"], priority=-i, ctx=ctx)
               for i, (t, x) in enumerate(zip(spec["tensors"], tensors))]
    for t, h in zip(spec["tensors"], handles):
        results[f"{t['name']}/{step}"] = bps.synchronize(h).cpu().numpy().copy()
# the class of each tensor's first device chain (HostBridge: its numpy chain behind it)
chains = {t["name"]: type(parts[0].codec).__name__ for t, x in zip(spec["tensors"], tensors)
          if device_codecs.uses_device_chain(x) for parts in [device_codecs.device_partitions(t["name"], x)]
          if parts}


def train(name, wrap, steps):
    """``steps`` steps of the tiny network (rank-specific data) under the wrapping optimizer."""
    model = network().to(device)
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
               [(f"{name}.{n}", p) for n, p in model.named_parameters()])
    for step in range(steps):
        x, y = (v.to(device) for v in batch(rank, step))
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        for n, p in model.named_parameters():
            results[f"{name}/{step}/{n}"] = p.detach().cpu().numpy().copy()
    return opt


# the tensors sent dense that the communicator sums on the device (torch.distributed only)
dense_on_device = sorted(t["name"] for t, x in zip(spec["tensors"], tensors) if device_codecs.uses_device_chain(x)
                         and device_codecs.reduces_dense_on_device(t["name"]))
paths = {"chains": chains, "dense_on_device": dense_on_device}
if "optimizer" in spec:
    train("optimizer", lambda opt, named: bps.DistributedOptimizer(
        opt, named_parameters=named, compression_params=spec["optimizer"]), spec["optimizer_steps"])
if "local_sgd" in spec:
    train("local", lambda opt, named: bps.LocalSGD(opt, named, local_steps=2,
                                                   compression_params=spec["local_sgd"]),
          spec["optimizer_steps"])
# CHOCO takes CUDA parameters only with device chains (numpy mode keeps it on the CPU)
if "choco" in spec and (device.type == "cpu" or device_codecs.uses_device_chain(torch.empty(0, device=device))):
    opt = train("choco", lambda opt, named: bps.DecentralizedOptimizer(
        opt, named, algorithm="choco", topology="complete", consensus_stepsize=0.5,
        compression_params=spec["choco"]), spec["optimizer_steps"])
    opt.finish()
    paths["choco_gossip"] = type(opt.gossip).__name__
try:  # a user error on either path: raised at the call, naming the tensor
    bps.push_pull_async(torch.zeros(7, device=device), name="topk")
    paths["wrong_shape"] = None
except ValueError as e:
    paths["wrong_shape"] = str(e)
on_device = device_codecs.device_chain_names()
np.savez(os.path.join(sys.argv[2], f"rank{rank}.npz"), **results)
json.dump({"device_chains": on_device, **paths}, open(os.path.join(sys.argv[2], f"paths{rank}.json"), "w"))
bps.shutdown()
