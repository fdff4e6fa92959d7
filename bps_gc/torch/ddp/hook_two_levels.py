"""The DDP hook's two levels (several ranks per host; bps_gc.collective.levels,
docs/ddp_hook.md "Several ranks per host"): which levels DDP's group reduces through, and a
dense or compressed host bucket through them, on the hook's exchanging thread."""
import logging

import numpy as np
import torch
import torch.distributed as dist

from ...collective.levels import levels_from_env
from .dtypes import wire_dtype
from .futures import current, settle
from .gradient_codecs import key_owner

log = logging.getLogger("bps_gc.torch")
HOST_DTYPES = (torch.float32, torch.float64, torch.float16)  # dense buckets the host level sums as numpy


class HookTwoLevels:
    """CompressionHook's part for two levels (collective/levels.py): the HostLevels of each DDP group (or None where it
    runs flat), and a bucket reduced through them. ``traffic`` (core.hook_traffic) counts its
    bytes; ``waiter(group, index)`` gives the wait of a bucket's collectives (the hook's); it goes
    with each call into the shared HostLevels."""

    def __init__(self, params, traffic, waiter):
        self.params, self.traffic, self.waiter = params, traffic, waiter
        self.levels = {}  # DDP's process group -> its HostLevels, or None where it runs flat

    def for_group(self, group):
        """The two levels that DDP's ``group`` reduces through, or None (flat): joined by the
        first call, which every rank makes at the same point. On backward's thread, before the
        hook returns: joining gathers on the default group, which DDP's own collectives use too,
        so they never interleave differently on different ranks."""
        if group not in self.levels:
            levels = None
            backend = dist.get_backend_config() if hasattr(dist, "get_backend_config") else dist.get_backend()
            if dist.get_world_size(group) != dist.get_world_size():
                log.info("comm_hook: DDP's group is not every rank: one level")
            elif "gloo" not in backend and "mpi" not in backend:  # the host level's syncs are CPU collectives
                log.info("comm_hook: default backend %s has no CPU collectives: one level", backend)
            else:
                levels = levels_from_env(self._wait(group, "the first"))
            self.levels[group] = levels
        return self.levels[group]

    def all_reduce(self, levels, group, index, buffer, future, stream):
        """On the exchanging thread: a dense bucket summed through the two levels, averaged."""
        with current(stream):
            def reduce():
                if stream is not None:
                    stream[0].wait_event(stream[1])
                wait = self._wait(group, index)  # this bucket's, given with each call
                size, what = dist.get_world_size(group), f"all_reduce of DDP bucket {index}"
                raw = buffer.numel() * buffer.element_size()  # the wire: this rank's share of the host's
                wire = buffer.numel() * (2 if self.params.fp16 else buffer.element_size()) // levels.local_size
                self.traffic.add(pushed_raw=raw, pulled_raw=raw, pushed_wire=wire, pulled_wire=wire)
                if buffer.is_cuda:
                    sent = buffer.to(torch.float16) if self.params.fp16 else buffer
                    sent.div_(size)  # first, so float16 does not overflow
                    levels.reduce_tensor(sent, what, wait)
                    if sent is not buffer:
                        buffer.copy_(sent)
                    return buffer
                # host sums in the bucket's dtype (numpy has no bfloat16: float32), float16 across hosts with fp16
                host = buffer.detach() if buffer.dtype in HOST_DTYPES else buffer.detach().float()
                total = levels.all_reduce(host.numpy(), what, np.float16 if self.params.fp16 else None, wait)
                total /= total.dtype.type(size)
                if host.data_ptr() != buffer.data_ptr():
                    buffer.copy_(host)
                return buffer
            settle(future, reduce)

    def exchange(self, job, grad):
        """A host bucket's gradients (a gradient_codecs.BucketJob) through the two levels
        (levels.reduce_coded): each one's owner local rank sums it over the host and compresses
        the sum once; the owners of every host gather payloads and run the reducer; the host
        shares the decoded results."""
        levels, group, index, buffer, parts, ctx = job.levels, job.group, job.index, job.buffer, job.parts, job.ctx
        flat = grad.numpy()
        owned = [part._replace(ctx=ctx, owner=key_owner(key, levels.local_size)) for part, key in zip(parts, job.keys)]
        sent, received = levels.reduce_coded(flat, owned, f"all_gather of DDP bucket {index}'s payloads",
                                             wire_dtype(buffer, self.params.fp16), self._wait(group, index))
        self.traffic.add(pushed_wire=sent, pulled_wire=received)
        size = flat.dtype.type(dist.get_world_size(group))
        for part in owned:
            if part.reducer.summed:  # a majority vote is not averaged
                flat[part.start:part.stop] /= size
        if grad.data_ptr() != buffer.data_ptr():
            buffer.copy_(grad)
        return buffer

    def _wait(self, group, index):
        """The wait of the levels' collectives for bucket ``index`` (None: one this rank skips)."""
        wait = self.waiter(group, index)
        return lambda work, what: None if work is None else wait(work, what)
