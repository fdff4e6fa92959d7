"""The DDP hook's buckets of a codec whose reducer sums in plain phases and says it runs in the
hook (``in_hook``: thc's scale histogram, then its packed codes): each phase of the whole
bucket is one all_reduce (thc: of float64 words) over the hook's own group, on the exchanging
thread (the one issuing the hook's collectives), so no payload is gathered. Each gradient is a partition
(keys as hook.py's ``bucket_key``) with a float32 numpy chain on the host (the codes are the
wire: ``fp16`` changes nothing); the bucket's average is written back into DDP's buffer. Every
rank runs the phases flat: the sums are the same sums whatever the host layout.
"""
import types

import numpy as np
import torch
import torch.distributed as dist

from .. import compress
from ..comm.phased import PhasedReduction
from .hook_futures import current, settle, value


class PhasedBuckets:
    """Mixed into CompressionHook (which provides params, optimizer, exchanger, traffic,
    _future, _side_group, _waiter and hook_state.HookState's per-gradient codecs)."""

    def _phased_call(self, group, bucket, buffer):
        from .hook import bucket_key
        index, sizes = bucket.index(), [g.numel() for g in bucket.gradients()]
        gradients = self._gradient_ids(bucket, index, len(sizes))
        state = self.phased_buckets.get(index)
        if state is None or state[0] != sizes or state[1] != gradients:
            # each gradient's chain is its own (hook_state.py), kept when DDP regroups and saved by name
            codecs, _ = self._codecs_for(index, gradients, sizes, buffer, lambda i: bucket_key(index, i))
            bounds = [0]
            for n in sizes:
                bounds.append(bounds[-1] + n)
            parts = [types.SimpleNamespace(codec=codec.chain, start=bounds[i], stop=bounds[i + 1])
                     for i, codec in enumerate(codecs)]
            state = self.phased_buckets[index] = [sizes, gradients, types.SimpleNamespace(partitions=parts), codecs]
        ctx = {"lr": float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else 0.0,
               "step": self._next_step(state[3])}
        side = self._side_group(group)
        future, stream = self._future(buffer)
        self.exchanger.submit(lambda: self._phased_stage(side, index, buffer, state[2], ctx, future, stream))
        return future.then(value)

    def _phased_stage(self, group, index, buffer, tensor, ctx, future, stream):
        wait = self._waiter(group, index)

        def summed(array, what):
            sent = torch.from_numpy(array)
            wait(dist.all_reduce(sent, group=group, async_op=True), what)
            self.traffic.add(pushed_wire=array.nbytes, pulled_wire=array.nbytes)  # core.metrics()
            return array

        def work():
            if stream is not None:
                stream[0].wait_event(stream[1])
            grad = buffer.detach().to("cpu", torch.float32).numpy().copy()
            raw = buffer.numel() * buffer.element_size()
            self.traffic.add(pushed_raw=raw, pulled_raw=raw)
            size = dist.get_world_size(group)
            reduction = PhasedReduction(tensor, grad, grad, ctx, size)
            first = summed(reduction.first(), "all_reduce of the first phase")
            reduction.finish(summed(reduction.second(first), "all_reduce of the second phase"))
            grad /= grad.dtype.type(size)
            buffer.copy_(torch.from_numpy(grad))
            return buffer
        with current(stream):
            settle(future, work)
