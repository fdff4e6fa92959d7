"""The collective communicator's reductions that are not one codec's payload exchange (a part
of ``Collective``): PowerSGD-like two-phase reductions (comm/phased.py), run with the bucket,
one all_reduce per phase for all of its matrices; and majority's sign vote, summed now.
"""
import time

import numpy as np
import torch
import torch.distributed as dist

from ..comm.phased import PhasedReduction, host_first, summands
from ..comm.placement import partition_owner
from .buckets import Handle


class PhasesAndVotes:
    """``_reduce_in_phases`` (a two-phase tensor into the pending bucket) and ``_reduce_phased``
    (the bucket's phases, on the exchange thread); ``_reduce_signs`` (majority's vote, now)."""

    def __init__(self, shared, lifecycle, buckets, sum_ranks):
        """``shared``: shared.Shared; ``lifecycle``: its waits; ``buckets``: where two-phase
        tensors go (buckets.py); ``sum_ranks``: the plain in-place sum over ranks
        (``Collective._sum``: one level or two)."""
        self.shared, self.buckets, self.size = shared, buckets, shared.size
        self.drain, self.wait, self._issue = lifecycle.drain, lifecycle.wait, lifecycle._issue
        self._add, self._deliver, self._sum = buckets._add, buckets._deliver, sum_ranks

    def _reduce_in_phases(self, tensor, wire, out, average, ctx):
        """Two phases (comm/phased.py), both with the bucket on the exchange thread (a tensor's
        steps in order there, so error feedback sees each step in turn). With two levels and
        ``host_first`` (thc) the host's ranks sum ``wire`` first and each partition's owner
        encodes that sum: one summand per host."""
        levels = self.shared.levels
        on_host = levels is not None and host_first(tensor)
        local = levels.local_size if levels is not None else 1
        owns = (lambda p: partition_owner(tensor.index, p, local) == levels.local_rank) if on_host else None
        reduction = PhasedReduction(tensor, wire, wire, ctx, summands(tensor, self.size, local), owns)
        handle = Handle(self.buckets, out, self.buckets.pending)
        return self._add(handle, "phased", (reduction, None, wire, out, average),
                         wire.nbytes, tensor.name)

    def _reduce_phased(self, phased):
        """Both phases of every two-phase reduction in the bucket: one all_reduce each."""
        on_host = [entry[2] for entry in phased if entry[0].on_host]
        for dtype in dict.fromkeys(w.dtype for w in on_host):  # the host's sums, in shared memory
            wires = [w for w in on_host if w.dtype == dtype]  # only (levels.py), before any encoding
            self.shared.levels.reduce_dense(wires, [(w, None) for w in wires], "host sum before thc",
                                            across_hosts=False)
        start = time.perf_counter()
        firsts = [entry[0].first() for entry in phased]
        self.shared.counters.compress_seconds += time.perf_counter() - start
        p_sums = self._sum_phase(firsts)
        q_sums = self._sum_phase([entry[0].second(p_sum) for entry, p_sum in zip(phased, p_sums)])
        for (reduction, _, wire, out, average), q_sum in zip(phased, q_sums):
            reduction.finish(q_sum)
            self._deliver(wire, out, average)

    def _sum_phase(self, buffers):
        """The buffers summed over ranks by one all_reduce of their concatenation per element
        type (PowerSGD's float32, thc's float64); the sums, in order."""
        start = time.perf_counter()
        counters = self.shared.counters
        sums = [None] * len(buffers)
        for dtype in dict.fromkeys(b.dtype for b in buffers):
            picked = [i for i, b in enumerate(buffers) if b.dtype == dtype]
            fused = np.concatenate([buffers[i] for i in picked])
            self._sum(fused)
            # with two levels each rank hands torch.distributed its 1/L share of the host's sum
            levels = self.shared.levels
            handed = fused.nbytes // (levels.local_size if levels is not None else 1)
            counters.pushed_wire += handed
            counters.pulled_wire += handed
            for i, summed in zip(picked, np.split(fused, np.cumsum([buffers[i].size for i in picked])[:-1])):
                sums[i] = summed
        counters.communicate_seconds += time.perf_counter() - start
        return sums

    def _reduce_signs(self, tensor, wire, ctx):
        """majority: each rank's decoded signs, summed by all_reduce; the vote's sign (ties +1).
        The last element counts ranks whose push held a non-finite value: then the result is
        NaN everywhere, as the parameter server's majority reply says (reducers.py)."""
        for part in tensor.partitions:
            chunk = wire[part.start:part.stop]
            part.codec.decompress(part.codec.compress(chunk, ctx), chunk)
        votes = np.empty(wire.size + 1, np.int32)
        votes[:-1] = (wire > 0).astype(np.int32) - (wire < 0)
        votes[-1] = not np.isfinite(wire).all()
        votes = torch.from_numpy(votes)
        self.drain()
        self.shared.counters.pushed_wire += votes.numel() // 8 + 1
        self.shared.counters.pulled_wire += votes.numel() // 8 + 1
        self.wait(self._issue(dist.all_reduce(votes, async_op=True)), f"all_reduce of {tensor.name!r}'s signs")
        tally = votes.numpy()
        wire[...] = np.nan if tally[-1] else np.where(tally[:-1] < 0, -1, 1)
