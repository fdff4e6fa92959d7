"""The exchange's two levels (several ranks per host; collective/levels.py, docs/ddp_hook.md
"Several ranks per host"): compressed parts through the levels (``reduce_coded_on_hosts``, the
collective's buckets and the pipeline alike: the step across hosts is a job of the driver), and
the pipeline's part (``TwoLevelExchange``): which levels a process group reduces through, and a
dense or compressed job's buffer through them, on the pipeline's gathering thread."""
import logging

import numpy as np
import torch
import torch.distributed as dist

from ..coded import in_wire_dtype
from ..levels import levels_from_env
from .codecs import key_owner
from .driver import Driver, Inline, waiter
from .jobs import Job, Segment
from .tensors import current, wire_dtype

log = logging.getLogger("bps_gc.torch")
HOST_DTYPES = (torch.float32, torch.float64, torch.float16)  # dense buffers the host level sums as numpy


class Wire:
    """The payload bytes a rank sent and received across hosts (the driver's ``count``; its
    seconds are the caller's)."""

    def __init__(self):
        self.sent = self.received = 0

    def count(self, pushed_wire=0, pulled_wire=0, **seconds):
        self.sent += pushed_wire
        self.received += pulled_wire


def reduce_coded_on_hosts(levels, sources, outs, parts, what="all_gather of payloads", wire_dtype=None,
                          wait=None):
    """The two levels (levels.HostLevels) of compressed parts of ``sources`` (flat arrays of one
    dtype, back to back) into ``outs`` ([(flat array, divisor or None)], as
    ``HostLevels.reduce_dense``): ``parts`` [coded.CodedPart] of the joined buffer, each with its
    owner local rank and step context. The owner sums its parts over the host; across hosts
    the driver compresses each owned sum once, gathers the owners' payloads on the cross-host
    group and runs the reducer (one host, or no part owned here: nothing crosses, the gather
    is counted as skipped under ``what``); each part ends as the reducer's decoded reply (the
    sum, divided only where ``outs`` says). ``wire_dtype``: the codecs' dtype, when not the
    sources' (fp16: the host's sum is cast for them). Returns this rank's payload bytes (sent,
    received)."""
    wait = wait or levels.wait
    wire_dtype = sources[0].dtype if wire_dtype is None else np.dtype(wire_dtype)
    wire = Wire()
    driver = Driver(wire.count, Inline, Inline, Inline)

    def across(result, mine):
        wired, back = in_wire_dtype(result, mine, wire_dtype)  # fp16: only the owned parts are cast
        crosses = bool(mine) and levels.hosts > 1
        driver.run(Job([Segment(mine, None, wired)], wait, levels.cross_group, skipped=None if crosses else what))
        back(wired)
    levels.reduce_owned_into(sources, outs, parts, across, wait)
    return wire.sent, wire.received


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
        """A compressed job's parts through the two levels (reduce_coded_on_hosts): each one's
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
        sent, received = reduce_coded_on_hosts(levels, [flat], [(flat, None)], owned,
                                               f"all_gather of DDP bucket {job.index}'s payloads",
                                               wire_dtype(buffer, self.params.fp16), job.wait)
        self.traffic.add(pushed_wire=sent, pulled_wire=received)
        size = flat.dtype.type(segment.divisor)
        for part in owned:
            if part.reducer.summed:  # a majority vote is not averaged
                flat[part.start:part.stop] /= size
        if grad.data_ptr() != buffer.data_ptr():
            buffer.copy_(grad)
