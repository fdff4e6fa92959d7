"""The rows of benchmark_synthetic.py's suite (issue 32), run by every rank under one launcher:
DDP with its own hooks, DDP with bps_gc's comm hook and three codecs, and bps_gc's
DistributedOptimizer, each training a fresh model on the same device and synthetic batch.

A row's codec time per step is the compress and decode of every bucket its gradients made (the
DDP buckets the hook saw; the optimizer's partitions), timed apart from the training steps on
the device's own timer: CUDA events on a GPU, perf_counter on the CPU. For DDP's hooks it is
their own arithmetic: fp16's casts; PowerSGD's P = MQ, orthogonalization, Q = M^T P and the
decode PQ^T of every matrix it compresses (its allreduces are communication, not codec).
"""
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmark_row_names import BASELINE, CODECS, COLLECTIVE_ROWS, PS_CODEC, PS_ROW, ROWS  # noqa: F401
START_POWERSGD_ITER = 2  # PowerSGD allreduces its first steps; the warm-up covers them


class DeviceTimer:
    """Median seconds of a function on ``device``'s own clock."""

    def __init__(self, device):
        self.device = device

    def median(self, fn, repeats):
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                began = time.perf_counter()
                fn()
                times.append(time.perf_counter() - began)
        return statistics.median(times)


def bps_codec_work(params, tensors):
    """compress + decode of one gradient per tensor of ``tensors`` with the chains the hook and
    ops.push_pull build for it (device chains on CUDA, numpy ones on the CPU by default)."""
    from bps_gc.torch.device import chain_for, uses_device_chain  # the hook's own choice of chain
    ctx = {"lr": 0.01, "step": 1}
    jobs = []
    for i, x in enumerate(tensors):
        chain = chain_for(params, x.numel(), np.float32, 1 + i, "worker", x)
        if uses_device_chain(x):
            out = torch.empty_like(x)
            jobs.append(lambda c=chain, x=x, out=out: c.decompress(c.compress(x, ctx), out))
        else:
            array = x.numpy()
            jobs.append(lambda c=chain, a=array: c.decompress(c.compress(a, ctx)))

    def work():
        for job in jobs:
            job()
    return work


def fp16_work(tensors):
    def work():
        for x in tensors:
            x.to(torch.float16).to(torch.float32)
    return work


def powersgd_work(shapes, rank, device):
    """PowerSGD's arithmetic on every gradient it compresses (more than one dimension, and worth
    it at this rank: its _should_compress); 1-D gradients it allreduces as they are."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    gen = torch.Generator(device=device).manual_seed(0)
    mats = []
    for shape in shapes:
        if len(shape) < 2:
            continue
        n, m = shape[0], int(np.prod(shape[1:]))
        r = min(n, m, rank)
        if psgd._should_compress(n, m, r, 2)[0]:
            mats.append((torch.randn(n, m, generator=gen, device=device), torch.randn(m, r, generator=gen, device=device)))

    def work():
        for matrix, q in mats:
            p = (matrix @ q).unsqueeze(0).contiguous()
            psgd._orthogonalize(p)
            q2 = matrix.t() @ p[0]
            p[0] @ q2.t()
    return work


def codec_seconds(label, layout, shapes, device, repeats):
    """Seconds per step of row ``label``'s codec over ``layout`` (gradient sizes per bucket or
    partition) and the model's gradient ``shapes``; None for plain allreduce rows."""
    gen = torch.Generator(device=device).manual_seed(0)
    tensors = [torch.randn(n, generator=gen, device=device) * 1e-3 for sizes in layout for n in sizes]
    if label.startswith("bps_gc hook "):
        work = bps_codec_work(CODECS[label[len("bps_gc hook "):]], tensors)
    elif label == PS_ROW:
        work = bps_codec_work(CODECS[PS_CODEC], tensors)
    elif label == "DDP fp16 hook":
        work = fp16_work(tensors)
    elif label.startswith("DDP PowerSGD rank "):
        work = powersgd_work(shapes, int(label.split()[-1]), device)
    else:
        return None
    return DeviceTimer(device).median(work, repeats)


def recording(hook, layout):
    """``hook`` that also records the sizes of each bucket's gradients into ``layout``."""
    def recorded(state, bucket):
        layout[bucket.index()] = [g.numel() for g in bucket.gradients()]
        return hook(state, bucket)
    return recorded


def no_communication(state, bucket):
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def ps_layout(model, partition_bytes, min_bytes):
    """The partitions DistributedOptimizer compresses: every gradient of at least ``min_bytes``,
    cut at ``partition_bytes`` (BytePS's rule; smaller ones go dense)."""
    per = max(1, partition_bytes // 4)
    out = []
    for p in model.parameters():
        n = p.numel()
        if n * 4 >= min_bytes:
            out.append([min(per, n - start) for start in range(0, n, per)])
    return out


class Rows:
    """Builds each row's (step function, bucket layout) on ``device`` for ``model_fn``."""

    def __init__(self, model_fn, device, x, y, lr=0.01):
        self.model_fn, self.device, self.x, self.y, self.lr = model_fn, device, x, y, lr

    def stepper(self, model, opt):
        def step():
            opt.zero_grad()
            F.cross_entropy(model(self.x), self.y).backward()
            opt.step()
        return step

    def ddp(self, hook=None, state=None, bucket_mb=25):
        from torch.nn.parallel import DistributedDataParallel as DDP
        torch.manual_seed(0)
        ids = [self.device.index] if self.device.type == "cuda" else None
        model = DDP(self.model_fn().to(self.device), device_ids=ids, bucket_cap_mb=bucket_mb)
        layout = {}
        if hook is not None:
            model.register_comm_hook(state, recording(hook, layout))
        return self.stepper(model, torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.9)), layout

    def build(self, label):
        import bps_gc.torch as bps
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        if label == BASELINE:
            return self.ddp(no_communication)
        if label == "DDP allreduce":
            return self.ddp(default_hooks.allreduce_hook)
        if label == "DDP fp16 hook":
            return self.ddp(default_hooks.fp16_compress_hook)
        if label.startswith("DDP PowerSGD rank "):
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=int(label.split()[-1]),
                                                start_powerSGD_iter=START_POWERSGD_ITER, use_error_feedback=True,
                                                warm_start=True)
            # gloo runs the phases of several buckets in a different order on each rank: one bucket
            return self.ddp(powerSGD_hook.powerSGD_hook, state, 1024 if dist.get_backend() == "gloo" else 25)
        if label.startswith("bps_gc hook "):
            return self.ddp(bps.comm_hook(CODECS[label[len("bps_gc hook "):]]))
        if label == PS_ROW:
            torch.manual_seed(0)
            model = self.model_fn().to(self.device)
            named = [(f"bench.{n}", p) for n, p in model.named_parameters()]
            bps.broadcast_parameters(named, root_rank=0)
            opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.9),
                                           named_parameters=named, compression_params=CODECS[PS_CODEC])
            from bps_gc.core import communicator
            cfg = communicator().cfg
            return self.stepper(model, opt), dict(enumerate(ps_layout(model, cfg.partition_bytes,
                                                                       cfg.min_compress_bytes)))
        raise ValueError(f"unknown row {label!r}; rows: {', '.join(ROWS)}")


def run_rows(labels, model_fn, device, x, y, warmup, iters, codec_repeats):
    """One dict per row: images/sec of this rank, ms per step, codec ms per step."""
    import bps_gc.torch as bps
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    shapes = [tuple(p.shape) for p in model_fn().parameters()]
    results = []
    for label in labels:
        step, layout = Rows(model_fn, device, x, y).build(label)
        for _ in range(max(warmup, START_POWERSGD_ITER + 1)):
            step()
        sync()
        bps.barrier()
        began = time.perf_counter()
        for _ in range(iters):
            step()
        sync()
        seconds = (time.perf_counter() - began) / iters
        sizes = [layout[i] for i in sorted(layout)]
        codec = codec_seconds(label, sizes, shapes, device, codec_repeats)
        results.append({"row": label, "images_per_sec": len(y) / seconds, "ms_per_step": 1e3 * seconds,
                        "codec_ms_per_step": None if codec is None else 1e3 * codec,
                        "buckets": len(sizes), "gradients": sum(len(s) for s in sizes)})
        del step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results
