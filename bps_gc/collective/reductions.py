"""The collective communicator's reductions that are not one codec's payload exchange (a part
of ``Collective``): PowerSGD-like two-phase reductions (comm/phased.py), run with the bucket,
one all_reduce per phase for all of its matrices; and majority's sign vote, summed now.
"""
import time

import numpy as np
import torch
import torch.distributed as dist

from ..comm.phased import PhasedReduction, run_phases
from .buckets import Handle, PhasedEntry
from .coded import WORDS


class PhasesAndVotes:
    """``add_phased`` (a two-phase tensor into the pending bucket) and ``exchange_phased``
    (the bucket's phases, on the exchange thread: given to the buckets); ``vote_signs``
    (majority's vote, now)."""

    def __init__(self, shared, lifecycle, buckets, sum_ranks):
        """``shared``: shared.Shared; ``lifecycle``: its waits; ``buckets``: where two-phase
        tensors go (buckets.py: its ``add`` and ``deliver``); ``sum_ranks``: the plain in-place sum over ranks
        (``Collective._sum``: one level or two)."""
        self.shared, self.buckets, self.size = shared, buckets, shared.size
        self.drain, self.wait, self.issue = lifecycle.drain, lifecycle.wait, lifecycle.issue
        self.add, self.deliver, self._sum = buckets.add, buckets.deliver, sum_ranks

    def add_phased(self, tensor, wire, out, average, ctx):
        """Two phases (comm/phased.py), both with the bucket on the exchange thread (a tensor's
        steps in order there, so error feedback sees each step in turn). One level here; thc
        with two levels goes through the host's sums instead (two_level_reductions.py)."""
        reduction = PhasedReduction(tensor, wire, wire, ctx, self.size, carrier=WORDS)
        handle = Handle(self.buckets, out, self.buckets.pending)
        return self.add(handle, "phased", PhasedEntry(reduction, wire, out, average), wire.nbytes, tensor.name)

    def exchange_phased(self, phased):
        """Both phases of every two-phase reduction in the bucket: one all_reduce each."""
        start, counters = time.perf_counter(), self.shared.counters
        summing = counters.communicate_seconds
        run_phases([entry.reduction for entry in phased], self._sum_phase)
        counters.compress_seconds += time.perf_counter() - start - (counters.communicate_seconds - summing)
        for entry in phased:
            self.deliver(entry.wire, entry.out, entry.average)

    def _sum_phase(self, fused):
        """One phase's buffers (comm/phased.py ``fused_sums``) summed over ranks, counted."""
        start = time.perf_counter()
        self._sum(fused)
        # with two levels each rank hands torch.distributed its 1/L share of the host's sum
        levels = self.shared.levels
        handed = fused.nbytes // (levels.local_size if levels is not None else 1)
        counters = self.shared.counters
        counters.pushed_wire += handed
        counters.pulled_wire += handed
        counters.communicate_seconds += time.perf_counter() - start

    def vote_signs(self, tensor, wire, ctx):
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
        self.wait(self.issue(dist.all_reduce(votes, async_op=True)), f"all_reduce of {tensor.name!r}'s signs")
        tally = votes.numpy()
        wire[...] = np.nan if tally[-1] else np.where(tally[:-1] < 0, -1, 1)
