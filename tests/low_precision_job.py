"""Low-precision gradients through bps_gc under torchrun (2 ranks, CPU):
``python low_precision_job.py SPEC.json OUT``.

Both parts in one launch (each where the spec has its key):
spec["hook"]: for each of its "cases" ({name: [compression_params, reducer]}),
bps_gc.torch.comm_hook called on float16, then bfloat16 buckets (GradBucket) for a few steps,
saving each bucket's gradients in and result out as float32, for the numpy re-computation; and
the message DistributedOptimizer gives for bfloat16 parameters.
spec["amp"]: for each of its "cases" ({name: compression_params}),
example/pytorch/torch_device.MixedPrecision (autocast float16 and a gradient scaler) with
DistributedOptimizer on a small network; rank 1 puts an inf into one step's input, so that step
must be skipped on both ranks. Saves each step's parameters, scale and the first weight's
gradient as its codec got it.
"""
import json
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "example", "pytorch")]
import bps_gc.torch as bps  # noqa: E402
from grad_bucket import GradBucket  # noqa: E402
from torch_device import MixedPrecision  # noqa: E402

spec, out = json.load(open(sys.argv[1])), sys.argv[2]
bps.init()
rank = bps.rank()
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def hook_run(spec):
    for case, (params, reducer) in spec["cases"].items():
        for name, dtype in DTYPES.items():
            hook_steps(f"{case}_{name}", dtype, params, reducer)


def hook_steps(name, dtype, params, reducer):
    opt = torch.optim.SGD([torch.zeros(1)], lr=0.1)
    hook = bps.comm_hook(params, reducer=reducer, optimizer=opt)
    layout = {0: [300, 20], 1: [500]}
    saved = {"index": [], "dtype": []}
    call = 0
    for step in range(3):
        for index, sizes in layout.items():
            g = torch.Generator().manual_seed(1000 * rank + 10 * step + index)
            buffer = (torch.randn(sum(sizes), generator=g) * 1e-2).to(dtype)
            saved[f"in{call}"] = buffer.float().numpy().copy()
            result = hook(None, GradBucket(index, sizes, buffer)).wait()
            saved["index"].append(index)
            saved["dtype"].append(str(result.dtype))
            saved[f"sizes{call}"] = np.array(sizes)
            saved[f"out{call}"] = result.float().numpy().copy()
            call += 1
    try:
        model = torch.nn.Linear(4, 4).to(torch.bfloat16)
        bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
        saved["optimizer_bfloat16"] = "accepted"
    except TypeError as e:
        saved["optimizer_bfloat16"] = str(e)
    np.savez(os.path.join(out, f"hook{rank}_{name}.npz"), **{k: np.array(v) for k, v in saved.items()})


def amp_run(spec):
    from bps_gc.torch import ops
    push = ops.push_pull_async
    pushed = []  # the first layer's weight gradient as the codec gets it, each step

    def recording(tensor, *a, name=None, **k):
        if name and name.endswith("0.weight"):
            pushed.append(tensor.detach().clone().tolist())
        return push(tensor, *a, name=name, **k)
    ops.push_pull_async = recording
    for case, params in spec["cases"].items():
        amp_steps(spec, case, params, pushed)


def amp_steps(spec, case, params, pushed):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),  # names of its own per case
                                   named_parameters=[(f"{case}.{n}", p) for n, p in model.named_parameters()],
                                   compression_params=params)
    amp = MixedPrecision(torch.device("cpu"), torch.float16, init_scale=spec["init_scale"])
    steps = []
    for step in range(spec["steps"]):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        if rank == 1 and step == spec["inf_step"]:
            x[0, 0] = float("inf")
        opt.zero_grad()
        with amp.autocast():
            loss = torch.nn.functional.mse_loss(model(x), y)
        amp.backward_and_step(loss, opt)
        steps.append({"scale": amp.scaler.get_scale(), "grad_dtype": str(model[0].weight.grad.dtype),
                      "pushed": pushed.pop(),
                      "params": [p.detach().tolist() for p in model.parameters()]})
    json.dump({"steps": steps, "precision": amp.describe()}, open(os.path.join(out, f"amp{rank}_{case}.json"), "w"))


for mode, run in (("hook", hook_run), ("amp", amp_run)):  # the hook first: amp_run wraps ops.push_pull_async
    if mode in spec:
        run(spec[mode])
bps.shutdown()
