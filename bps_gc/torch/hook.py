"""A DDP communication hook that sends any bps_gc codec's payloads instead of dense buckets.

    ddp_model.register_comm_hook(None, bps_gc.torch.comm_hook({"compressor": "onebit", "ef": "vanilla"}))

Like torch's own hooks (torch.distributed.algorithms.ddp_comm_hooks), the hook is
``hook(process_group, bucket) -> Future[Tensor]`` returning the bucket's average; the state DDP
hands it is the process group (None: the default group). Each gradient in a bucket is its own
partition, compressed layer-wise as a declared tensor would be (one onebit scale over a whole
bucket would mix layers of very different magnitudes); its codec chain (error feedback and
momentum state included) is kept per bucket index and position, keyed so seeds agree on every
rank. One all_gather carries a bucket's payloads. Payloads are all_gathered and every
rank runs the codec's reducer (bps_gc.collective.exchange), so the result is what the parameter
server would return for the same gradients. DDP regroups its buckets after the first step; a
bucket whose size changed starts with fresh codec state (PowerSGD's hook waits out the same
regrouping with ``start_powerSGD_iter``).

Without a compressor it is an all_reduce (in float16 with ``fp16``), as allreduce_hook and
fp16_compress_hook. The learning rate that error feedback rescales by is read from
``optimizer`` when given.
"""
import numpy as np
import torch
import torch.distributed as dist

from .. import compress
from ..collective import all_gather_bytes

KEY_BASE = 1 << 40  # bucket keys apart from declared tensors' (index << 16 | partition)


def bucket_key(index, position):
    """The codec key (seed source) of the ``position``-th gradient of DDP bucket ``index``."""
    return KEY_BASE | index << 16 | position


class CompressionHook:
    def __init__(self, compression_params=None, reducer=None, optimizer=None):
        self.params = compress.CompressionParams.from_dict(dict(compression_params or {}))
        self.optimizer = optimizer
        self.reducer = compress.choose_reducer(self.params, reducer)  # names both if they misfit
        phases = getattr(compress.REDUCERS.get(self.reducer), "phases", 1)  # "sum" is no class
        if phases > 1:
            raise ValueError(f"comm_hook: {self.params.compressor} reduces in {phases} phases, which "
                             "this one-gather hook does not run; use DistributedOptimizer (or "
                             "torch's powerSGD_hook)")
        self.buckets = {}  # bucket index -> (sizes, [(worker chain, reducer)], steps so far)

    def __call__(self, process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        if not self.params.compressed:
            return self._all_reduce(group, buffer)
        size = dist.get_world_size(group)
        wire_dtype = np.float16 if self.params.fp16 else np.float32
        grad = buffer.detach().to("cpu", torch.float32).numpy().astype(wire_dtype, copy=False)
        sizes = [g.numel() for g in bucket.gradients()]
        parts = self._state(bucket.index(), sizes, wire_dtype)
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        ctx = {"lr": float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else 0.0,
               "step": self._count_step(bucket.index())}
        payloads = [codec.compress(grad[bounds[i]:bounds[i + 1]], ctx) for i, (codec, _) in enumerate(parts)]
        gathered = all_gather_bytes(payloads, lambda work, what: work.wait(), group)
        total = np.empty(grad.size, wire_dtype)
        for i, (_, reducer) in enumerate(parts):
            chunk = total[bounds[i]:bounds[i + 1]]
            reducer.decode(reducer.reduce([rank[i] for rank in gathered], True, ctx), chunk, ctx)
            if reducer.summed:  # a majority vote is not averaged
                chunk /= chunk.dtype.type(size)
        buffer.copy_(torch.from_numpy(total))
        future = torch.futures.Future()
        future.set_result(buffer)
        return future

    def _state(self, index, sizes, dtype):
        """[(worker chain, reducer)] for the gradients of bucket ``index``."""
        state = self.buckets.get(index)
        if state is None or state[0] != sizes:
            keys = [bucket_key(index, position) for position in range(len(sizes))]
            state = [sizes, [(compress.build_chain(self.params, n, dtype, key=key, role="worker"),
                              compress.make_reducer(self.reducer, self.params, n, dtype, key))
                             for n, key in zip(sizes, keys)], 0]
            self.buckets[index] = state
        return state[1]

    def _count_step(self, index):
        """The step context's ``step``: how many times bucket ``index`` was reduced before."""
        state = self.buckets[index]
        state[2] += 1
        return state[2] - 1

    def _all_reduce(self, group, buffer):
        sent = buffer.to(torch.float16) if self.params.fp16 else buffer
        sent.div_(dist.get_world_size(group))  # first, so float16 does not overflow

        def written_back(future):
            if sent is not buffer:
                buffer.copy_(future.value()[0])
            return buffer
        return dist.all_reduce(sent, group=group, async_op=True).get_future().then(written_back)


def comm_hook(compression_params=None, reducer=None, optimizer=None):
    """A hook for ``DistributedDataParallel.register_comm_hook(process_group_or_None, hook)``;
    a plain function (DDP logs and checks hooks by their function name), its per-bucket codec
    state in ``hook.compression``."""
    compression = CompressionHook(compression_params, reducer, optimizer)

    def bps_gc_comm_hook(process_group, bucket):
        return compression(process_group, bucket)
    bps_gc_comm_hook.compression = compression
    return bps_gc_comm_hook
