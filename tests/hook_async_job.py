"""bps_gc.torch.comm_hook's asynchrony, under torchrun or bpslaunch --servers 0 on gloo. ``python hook_async_job.py SPEC.json OUT``.

spec "overlap": DDP on a model with large buckets (their reduction takes tens of milliseconds),
timing each hook call (until it returns) and its future (until it completes); then the hook
called directly on two buckets, several steps each, interleaved and none waited for before the
last, saving inputs, outputs and the order the futures completed in; the same with a threshold
codec, whose payloads' lengths vary.
spec "error": a codec that raises at step 1 on rank ``refuser`` only; every rank saves what
backward() raised.
spec "overlap_and_error": both, one after the other (one start-up for three tests), then a
few steps with BPS_GC_DEVICE_CODECS=torch (device chains on CPU tensors), saving every bucket
the hook saw, as ddp_hook_job.py's "record".
spec "cuda": that record on CUDA (NCCL).
spec "die": rank 1 kills itself (SIGKILL) before its step 2; rank 0 trains on (it must fail);
with "init", under bps_gc.torch.init() (the collective communicator and its heartbeat).
"""
import gc
import json
import os
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]
import bps_gc.torch as bps  # noqa: E402
from gloo_group import init_default_group  # noqa: E402
from grad_bucket import GradBucket  # noqa: E402
from bps_gc.compress import register_compressor, step_context  # noqa: E402
from bps_gc.compress.sparse import TopK  # noqa: E402

spec, out = json.load(open(sys.argv[1])), sys.argv[2]
THRESHOLD = {"compressor": "threshold", "threshold": 1.0}  # payloads of varying length
if spec.get("init"):
    bps.init()  # the collective communicator (torchrun's environment): its heartbeat watches waits
else:
    init_default_group("nccl" if spec["mode"] == "cuda" else "gloo")  # torchrun or bpslaunch --servers 0
rank, size = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)


@register_compressor("test_refuses")
class Refuses(TopK):
    """top-k, except that it refuses step 1 on rank ``spec["refuser"]``."""

    def compress(self, x, ctx=None):
        if step_context(ctx)["step"] == 1 and rank == spec.get("refuser"):
            raise ValueError(f"test_refuses: rank {rank} refuses step 1")
        return super().compress(x, ctx)


def train(model, hook, steps, width, on_step=None):
    model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        if on_step:
            on_step(step)
        g = torch.Generator().manual_seed(100 * rank + step)
        torch.nn.functional.mse_loss(model(torch.randn(4, width, generator=g)), torch.zeros(4, width)).backward()
        opt.step()
        opt.zero_grad()


def mlp(width, layers):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def overlap(spec):
    hook, calls = bps.comm_hook(spec["compression_params"]), []

    def timed(state, bucket):
        began = time.perf_counter()
        future = hook(state, bucket)
        returned = time.perf_counter()
        calls.append([returned - began, None])
        entry = calls[-1]

        def completed(f):
            entry[1] = time.perf_counter() - began
            return f.value()
        return future.then(completed)
    # find_unused_parameters: DDP all_reduces its bitmap on its group from backward's thread
    # while the hook's thread may still gather (on the hook's own group)
    train(DDP(mlp(1024, 4), bucket_cap_mb=4, find_unused_parameters=True), timed, spec["steps"], 1024)
    json.dump(calls, open(os.path.join(out, f"calls{rank}.json"), "w"))
    order(spec["compression_params"], "order")
    order(THRESHOLD, "order_threshold")


def order(params, name):
    hook, done, saved = bps.comm_hook(params), [], {}
    sizes = {0: [3000, 500], 1: [2000]}
    pending = []
    for step in range(3):
        for index in (0, 1):
            g = torch.Generator().manual_seed(1000 * rank + 10 * step + index)
            # scaled by step, so that a threshold codec's payloads outgrow the last step's
            # (the exchange's second all_gather) and then shrink (padded into the first)
            buffer = torch.randn(sum(sizes[index]), generator=g) * (1 + index) * (1, 2, 0.5)[step]
            saved[f"in{len(pending)}"] = buffer.clone().numpy()
            future = hook(None, GradBucket(index, sizes[index], buffer))
            future.then(lambda f, n=len(pending): done.append(n))
            pending.append(future)
    for n, future in enumerate(pending):
        saved[f"out{n}"] = future.wait().clone().numpy()
    time.sleep(0.1)  # the last then() callback runs after its future's waiters wake
    np.savez(os.path.join(out, f"{name}{rank}.npz"), done=np.array(done), **saved)


def error(spec):
    try:
        train(DDP(mlp(64, 2)), bps.comm_hook({"compressor": "test_refuses", "k": 0.1}), 3, 64)
        raised = None
    except Exception as e:  # what a training script sees
        raised = {"type": type(e).__name__, "message": str(e)}
    json.dump(raised, open(os.path.join(out, f"error{rank}.json"), "w"))


def die(spec):
    def on_step(step):
        if step == 2 and rank == 1:
            open(os.path.join(out, "killing-1"), "w").write(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
    train(DDP(mlp(256, 2)), bps.comm_hook({"compressor": "topk", "k": 0.01, "ef": "vanilla"}), 10**6, 256, on_step)


def record(spec, device, name):
    """DDP on ``device``, saving every bucket the hook saw (in, out, sizes) as ``name``{rank}.npz."""
    model = DDP(torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 40)).to(device),
                device_ids=[device] if device.type == "cuda" else None, bucket_cap_mb=0.004)
    hook, seen = bps.comm_hook(spec["compression_params"]), []
    position = {id(p): i for i, p in enumerate(model.parameters())}

    def recording(state, bucket):
        grads = bucket.buffer().detach().cpu().numpy()
        result = hook(state, bucket).wait()  # a CUDA future: this stream waits for the side stream
        seen.append((bucket.index(), grads, result.detach().cpu().numpy(), [g.numel() for g in bucket.gradients()],
                     [position[id(p)] for p in bucket.parameters()]))
        future = torch.futures.Future(devices=[device] if device.type == "cuda" else None)
        future.set_result(result)
        return future
    model.register_comm_hook(None, recording)
    for step in range(3):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 20, generator=g).to(device), torch.randn(8, 40, generator=g).to(device)
        torch.nn.functional.mse_loss(model(x), y).backward()
    np.savez(os.path.join(out, f"{name}{rank}.npz"), index=np.array([s[0] for s in seen]),
             device_chains=np.array([state.on_device for state in hook.compression.pipeline.codecs.batches.values()]),
             **{f"in{i}": s[1] for i, s in enumerate(seen)}, **{f"out{i}": s[2] for i, s in enumerate(seen)},
             **{f"sizes{i}": np.array(s[3]) for i, s in enumerate(seen)},
             **{f"params{i}": np.array(s[4]) for i, s in enumerate(seen)})


def cuda(spec):
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    record(spec, device, "cuda")


def overlap_and_error(spec):
    overlap(spec)
    error(spec)
    # the device chains' path (chains of torch operations, device reducers, tensors gathered
    # where they are) on CPU tensors: a hook made now reads the setting
    os.environ["BPS_GC_DEVICE_CODECS"] = "torch"
    record(spec, torch.device("cpu"), "torch")


{"overlap": overlap, "error": error, "overlap_and_error": overlap_and_error, "die": die,
 "cuda": cuda}[spec["mode"]](spec)
dist.barrier()  # no rank tears its pairs down under a peer still sending (ddp_hook_job.py)
gc.collect()
dist.destroy_process_group()
