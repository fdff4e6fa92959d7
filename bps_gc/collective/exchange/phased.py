"""The pipeline's jobs of a codec whose reducer sums in plain phases (comm/phased.py: thc's
scale histogram, then its packed codes; PowerSGD's P, then Q): each phase of the whole buffer
is one all_reduce (thc: of int64 words; PowerSGD: float32) on the job's group, on the gathering
thread (the one issuing the pipeline's collectives), so no payload is gathered. Each part has a
float32 numpy chain on the host (the codes are the wire: ``fp16`` changes nothing; PowerSGD
views a part in its shape); the average is written back into the buffer. With two levels, for
thc (``host_first``), each part's owner local rank (by its seed key) sums it over the host in
shared memory, encodes that sum, and sums its phase buffers with the owners of the other hosts
(one summand per host: comm/phased.py ``host_first``); then the host copies the decoded parts out.
"""
import functools

import torch
import torch.distributed as dist

from ...comm.phased import PhasedReduction, run_phases
from ..coded import WORDS
from .codecs import key_owner
from .tensors import current


class PhasedExchange:
    """The pipeline's part for phased codecs: ``run(job)`` (a jobs.TensorJob whose parts' codecs
    are phased chains), on the gathering thread. ``traffic`` (comm.metrics.Counters) counts its
    bytes."""

    def __init__(self, traffic):
        self.traffic = traffic

    def run(self, job):
        with current(job.stream):
            job.settle(self._reduce)

    def _sum(self, job, group, fused):
        """One phase's buffers summed over ``group`` (None: a collective this rank skips)."""
        work = None
        if group is not None:
            work = dist.all_reduce(torch.from_numpy(fused), group=group, async_op=True)
            self.traffic.add(pushed_wire=fused.nbytes, pulled_wire=fused.nbytes)  # core.metrics()
        job.wait(work, f"all_reduce of DDP bucket {job.index}'s thc phase")

    def _sum_across_hosts(self, job, cross, fused):
        """Two levels: the owners' buffers with those of the other hosts (``cross``: None with one
        host; every rank counts the collective alike, an empty one too)."""
        self._sum(job, cross if fused.size else None, fused)

    def _reduce(self, job):
        if job.stream is not None:
            job.stream.wait_for_backward()
        segment, levels = job.segment, job.levels
        buffer = segment.buffer
        grad = buffer.detach().to("cpu", torch.float32).numpy().copy()
        size = dist.get_world_size(job.group)
        if levels is None:  # one level: every rank's phase buffers
            run_phases([PhasedReduction(segment, grad, grad, segment.ctx, size, carrier=WORDS)],
                       functools.partial(self._sum, job, job.group))
        else:  # each part's owner by its seed key (codecs.key_owner)
            parts = [part._replace(owner=key_owner(key, levels.local_size))
                     for part, key in zip(segment.parts, segment.keys)]
            cross = levels.cross_group if levels.hosts > 1 else None

            def across(result, mine):
                owned = [part for part in parts if part.owner == levels.local_rank]
                run_phases([PhasedReduction(segment, result, result, segment.ctx, size // levels.local_size, owned,
                                            WORDS)], functools.partial(self._sum_across_hosts, job, cross))
            levels.reduce_owned_into([grad], [(grad, None)], parts, across, job.wait)
        grad /= grad.dtype.type(size)
        buffer.copy_(torch.from_numpy(grad))
        return buffer
