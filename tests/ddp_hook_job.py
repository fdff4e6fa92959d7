"""DDP with bps_gc.torch.comm_hook, under torchrun or bpslaunch --servers 0. ``python ddp_hook_job.py SPEC.json OUT``.

spec "record": a small network for a few steps (in spec["dtype"], float32 by default), saving
every bucket the hook saw (index, this rank's gradients in, the averaged result out, as float64
when the bucket is bfloat16: numpy has none) for the numpy re-computation, what
bps_gc.core.metrics() reports without init(), and the bytes the hook's codecs hold after the steps.
spec "mnist": the demo's MLP on its real digits (example/demo/mnist_worker.py's data and model),
dense DDP or the hook, saving the final validation accuracy.
spec "runs": [[NAME, SPEC], ...]: each of those in turn in this one launch, its files in OUT/NAME
(one start-up for several checks; metrics() resets at each record's read).
"""
import gc
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "example", "demo")]
import bps_gc.core  # noqa: E402
import bps_gc.torch as bps  # noqa: E402
from gloo_group import init_default_group  # noqa: E402
from held_bytes import array_bytes, held_bytes  # noqa: E402

spec, out = json.load(open(sys.argv[1])), sys.argv[2]
init_default_group()  # torchrun or bpslaunch --servers 0
rank, size = dist.get_rank(), dist.get_world_size()


def record(spec, out):
    torch.manual_seed(0)
    dtype = getattr(torch, spec.get("dtype", "float32"))
    model = DDP(torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 40)).to(dtype),
                bucket_cap_mb=0.004)  # a few buckets of ~1000 floats
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = bps.comm_hook(spec["compression_params"], reducer=spec.get("reducer"), optimizer=opt)
    seen = []
    position = {id(p): i for i, p in enumerate(model.parameters())}

    def recording(state, bucket):
        grads = bucket.buffer().detach().double().numpy() if dtype == torch.bfloat16 else \
            bucket.buffer().detach().clone().numpy()
        result = hook(state, bucket).wait()
        result = result.double() if dtype == torch.bfloat16 else result
        sizes = np.array([g.numel() for g in bucket.gradients()])
        params = np.array([position[id(p)] for p in bucket.parameters()])  # whose gradients these are
        seen.append((bucket.index(), grads, result.detach().clone().numpy(), sizes, params))
        fut = torch.futures.Future()
        fut.set_result(result)
        return fut

    model.register_comm_hook(None, recording)
    for step in range(spec["steps"]):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 20, generator=g).to(dtype), torch.randn(8, 40, generator=g).to(dtype)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    np.savez(os.path.join(out, f"hook{rank}.npz"), index=np.array([s[0] for s in seen]),
             **{f"in{i}": s[1] for i, s in enumerate(seen)}, **{f"out{i}": s[2] for i, s in enumerate(seen)},
             **{f"sizes{i}": s[3] for i, s in enumerate(seen)}, **{f"params{i}": s[4] for i, s in enumerate(seen)})
    json.dump(vars(bps_gc.core.metrics()), open(os.path.join(out, f"metrics{rank}.json"), "w"))
    codec_state = hook.compression.codec_state().state_dict()  # by parameter name (collective/exchange/codecs.py)
    # what the codecs hold between steps: their state, and their in-call buffers (shared)
    json.dump({"held": held_bytes([hook.compression]), "state": array_bytes(codec_state.values())},
              open(os.path.join(out, f"held{rank}.json"), "w"))
    json.dump({k: v if isinstance(v, (int, float, str)) else type(v).__name__ for k, v in codec_state.items()},
              open(os.path.join(out, f"codec_state{rank}.json"), "w"))


def mnist(spec, out):
    from mnist_worker import accuracy, load_data, network
    x, y, xv, yv = load_data(4000)
    model = DDP(network(128, 0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if spec.get("compression_params"):
        model.register_comm_hook(None, bps.comm_hook(spec["compression_params"], reducer=spec.get("reducer"),
                                                     optimizer=opt))
    shard = np.arange(rank, len(x), size)
    for epoch in range(spec["epochs"]):
        order = np.random.default_rng(epoch).permutation(shard)
        for start in range(0, len(order) - 31, 32):
            batch = order[start:start + 32]
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            opt.step()
            opt.zero_grad()
    json.dump({"accuracy": accuracy(model.module, xv, yv)}, open(os.path.join(out, f"mnist{rank}.json"), "w"))


MODES = {"record": record, "mnist": mnist}
for name, run in spec["runs"] if "runs" in spec else [("", spec)]:
    os.makedirs(os.path.join(out, name), exist_ok=True)
    MODES[run["mode"]](run, os.path.join(out, name))
# Gloo finishes a collective on one rank while its last sends may still be draining to the
# other: a barrier first, so that no rank tears its pairs down under a peer (an abort at exit,
# seen on a loaded CI machine), and the DDP reducer is collected before the group goes.
dist.barrier()
gc.collect()
dist.destroy_process_group()
