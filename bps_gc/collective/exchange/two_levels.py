"""The pipeline's two levels (several ranks per host; collective/levels.py, docs/ddp_hook.md
"Several ranks per host"): which levels a process group reduces through, and a dense or
compressed job's buffer through them, on the pipeline's gathering thread."""
import logging

import numpy as np
import torch
import torch.distributed as dist

from ..levels import levels_from_env
from .codecs import key_owner
from .driver import waiter
from .tensors import current, wire_dtype

log = logging.getLogger("bps_gc.torch")
HOST_DTYPES = (torch.float32, torch.float64, torch.float16)  # dense buffers the host level sums as numpy


class TwoLevelExchange:
    """The pipeline's part for two levels: the HostLevels of each process group (or None where
    it runs flat), and a job (jobs.TensorJob) reduced through them. ``params``: the codec's
    CompressionParams (``fp16``); ``traffic`` (comm.metrics.Counters) counts its bytes."""

    def __init__(self, params, traffic):
        self.params, self.traffic = params, traffic
        self.levels = {}  # process group -> its HostLevels, or None where it runs flat

    def for_group(self, group, comm):
        """The two levels that ``group`` reduces through, or None (flat): joined by the first
        call (its collectives waited for through ``comm``, driver.waiter), which every rank makes at the same point. On the caller's thread (backward's),
        before the call returns: joining gathers on the default group, which DDP's own
        collectives use too, so they never interleave differently on different ranks."""
        if group not in self.levels:
            levels = None
            backend = dist.get_backend_config() if hasattr(dist, "get_backend_config") else dist.get_backend()
            if dist.get_world_size(group) != dist.get_world_size():
                log.info("comm_hook: DDP's group is not every rank: one level")
            elif "gloo" not in backend and "mpi" not in backend:  # the host level's syncs are CPU collectives
                log.info("comm_hook: default backend %s has no CPU collectives: one level", backend)
            else:
                levels = levels_from_env(waiter(group, "the first", comm))
            self.levels[group] = levels
        return self.levels[group]

    def all_reduce(self, job):
        """On the gathering thread: a dense buffer summed through the two levels, averaged."""
        with current(job.stream):
            job.settle(self._all_reduce)

    def _all_reduce(self, job):
        if job.stream is not None:
            job.stream.wait_for_backward()
        segment, levels = job.segment, job.levels
        buffer, what = segment.buffer, f"all_reduce of DDP bucket {job.index}"
        raw = buffer.numel() * buffer.element_size()  # the wire: this rank's share of the host's
        wire = buffer.numel() * (2 if self.params.fp16 else buffer.element_size()) // levels.local_size
        self.traffic.add(pushed_raw=raw, pulled_raw=raw, pushed_wire=wire, pulled_wire=wire)
        if buffer.is_cuda:
            sent = buffer.to(torch.float16) if self.params.fp16 else buffer
            sent.div_(segment.divisor)  # first, so float16 does not overflow
            levels.reduce_tensor(sent, what, job.wait)
            if sent is not buffer:
                buffer.copy_(sent)
            return buffer
        # host sums in the buffer's dtype (numpy has no bfloat16: float32), float16 across hosts with fp16
        host = buffer.detach() if buffer.dtype in HOST_DTYPES else buffer.detach().float()
        total = levels.all_reduce(host.numpy(), what, np.float16 if self.params.fp16 else None, job.wait)
        total /= total.dtype.type(segment.divisor)
        if host.data_ptr() != buffer.data_ptr():
            buffer.copy_(host)
        return buffer

    def exchange(self, job):
        """A compressed job's parts through the two levels (levels.reduce_coded): each one's
        owner local rank (by its seed key) sums it over the host and compresses the sum once;
        the owners of every host gather payloads and run the reducer; the host shares the
        decoded results, averaged into the buffer."""
        segment, levels = job.segment, job.levels
        if segment.failure is not None:  # the host's other ranks stop at this rank's exit (their waits name it)
            failure = segment.failure
            raise RuntimeError(f"bps_gc comm_hook: DDP bucket {job.index}: {type(failure).__name__}: {failure}")
        grad, buffer = segment.grad, segment.buffer
        flat = grad.numpy()
        owned = [part._replace(ctx=segment.ctx, owner=key_owner(key, levels.local_size))
                 for part, key in zip(segment.parts, segment.keys)]
        sent, received = levels.reduce_coded(flat, owned, f"all_gather of DDP bucket {job.index}'s payloads",
                                             wire_dtype(buffer, self.params.fp16), job.wait)
        self.traffic.add(pushed_wire=sent, pulled_wire=received)
        size = flat.dtype.type(segment.divisor)
        for part in owned:
            if part.reducer.summed:  # a majority vote is not averaged
                flat[part.start:part.stop] /= size
        if grad.data_ptr() != buffer.data_ptr():
            buffer.copy_(grad)
