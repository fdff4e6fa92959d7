"""The communicator's side of two levels (levels.py): joining them at start, and a bucket's
single-phase tensors reduced as the parameter server's two levels do: dense ones summed
(levels.py's all_reduce), compressed ones (every reducer, majority included) so: partition p
of the tensor declared i-th is owned by local rank (i + p) mod L (ps/worker/host.py's
rule), which compresses the host's sum of it once with that partition's chain; the owners of
every host exchange payloads and run the server's reducer. thc (comm/phased.py ``host_first``)
alike, its owners' phases summed across hosts instead of payloads gathered.
The plain all_reduce (PowerSGD's two phases, local SGD) is levels.py's sum too.
"""
import time

import numpy as np
import torch
import torch.distributed as dist

from ..comm.phased import PhasedReduction, phases, run_phases
from ..comm.placement import partition_owner
from .coded import WORDS, CodedPart, in_wire_dtype
from .exchange.two_levels import reduce_coded_on_hosts
from .levels import HostLevels
from .rendezvous import host_key


class TwoLevelReductions:
    """The communicator's part for two levels (the levels themselves: levels.HostLevels):
    ``join_levels`` (at start: sets ``shared.levels`` when two levels run) and
    ``exchange_coded_on_hosts`` (a bucket's single-phase tensors, on the exchange thread)."""

    def __init__(self, cfg, shared, lifecycle, local_rank, local_size):
        """``shared``: shared.Shared; ``lifecycle``: its waits (lifecycle.py); this rank's place
        on its host."""
        self.cfg, self.shared, self.rank, self.size = cfg, shared, shared.rank, shared.size
        self.local_rank, self.local_size = local_rank, local_size
        self.wait, self.issue = lifecycle.wait, lifecycle.issue

    def join_levels(self):
        levels = self.shared.levels = HostLevels.join(self.rank, self.size, host_key(self.cfg), self.local_rank,
                                                      self.local_size, self.cfg.hierarchy, wait=self.level_wait)
        if levels is not None and self.shared.heartbeat is not None:
            self.shared.heartbeat.catch_sigterm()  # a host's launcher stops the siblings of a failed rank
        return levels

    def level_wait(self, work, what):
        """Wait for one of the levels' collectives; None counts one this rank skips (every rank
        counts the same collectives, which departure.py compares)."""
        if work is None:
            self.issue(None)
            return
        self.wait(self.issue(work), what)

    def exchange_coded_on_hosts(self, coded):
        """Two levels of a bucket's single-phase tensors ``coded``: [buckets.CodedEntry] (the bucket's ``on_hosts``) (``wire``
        in the tensor's dtype), dense and compressed apart, one round per
        dtype and wire dtype (their buffers back to back in shared memory): each ``wire`` is
        copied into the host's memory and each result straight into its ``out``, divided on the
        way when averaging."""
        groups = {}
        for entry in coded:
            tensor = entry.tensor
            key = (tensor.compressed, phases(tensor) > 1, entry.wire.dtype, tensor.wire_dtype)
            groups.setdefault(key, []).append(entry)
        for (compressed, phased, dtype, wire_dtype), entries in groups.items():
            start = time.perf_counter()
            names = ", ".join(repr(entry.tensor.name) for entry in entries[:3]) + (" ..." if len(entries) > 3 else "")
            sources = [entry.wire for entry in entries]
            outs, spills = [], []
            for entry in entries:
                tensor, wire, out = entry.tensor, entry.wire, entry.out
                divide = entry.average and (not compressed or tensor.partitions[0].reducer.summed)
                target = out.reshape(-1) if out.dtype == dtype and out.flags.c_contiguous else None
                if target is None:  # another dtype or layout: through a copy, as Buckets.deliver does
                    target = np.empty(wire.size, dtype)
                    spills.append((target, out))
                outs.append((target, dtype.type(self.size) if divide else None))
            if phased:
                sent, received = self._phases_across_hosts(entries, sources, outs, wire_dtype, names)
            elif compressed:
                sent, received = reduce_coded_on_hosts(self.shared.levels, sources, outs, self._owned_parts(entries),
                                                       f"all_gather of {names}'s payloads", wire_dtype)
            else:
                self.shared.levels.reduce_dense(sources, outs, f"all_reduce of {names}", wire_dtype)
                sent = received = sum(w.size for w in sources) * wire_dtype.itemsize // self.local_size
            for target, out in spills:
                np.copyto(out, target.reshape(out.shape), casting="unsafe")
            counters = self.shared.counters
            counters.pushed_wire += sent
            counters.pulled_wire += received
            counters.communicate_seconds += time.perf_counter() - start

    def _phases_across_hosts(self, entries, sources, outs, wire_dtype, names):
        """thc's two levels (comm/phased.py ``host_first``): each partition's owner sums it over
        the host, the owners' phase buffers (their own partitions only) are summed across hosts
        by one all_reduce per phase on the owners' group, one summand per host, and each owner
        decodes its partitions before the host copies them out. Returns (sent, received) bytes."""
        levels, wait = self.shared.levels, self.level_wait
        parts = self._owned_parts(entries)
        handed = []

        def across(result, mine):
            source, back = in_wire_dtype(result, mine, wire_dtype)  # fp16: only this rank's parts are cast
            reductions, offset = [], 0
            for entry in entries:
                tensor = entry.tensor
                owned = [CodedPart(offset + part.start, offset + part.stop, part.codec, part.reducer)
                         for p, part in enumerate(tensor.partitions)
                         if partition_owner(tensor.index, p, self.local_size) == self.local_rank]
                reductions.append(PhasedReduction(tensor, source, source, entry.ctx, self.size // self.local_size,
                                                  owned, WORDS))
                offset += entry.wire.size

            def summed(fused):
                what = f"all_reduce of {names}'s thc phase across hosts"
                if levels.hosts > 1 and fused.size:
                    wait(dist.all_reduce(torch.from_numpy(fused), group=levels.cross_group, async_op=True), what)
                else:  # every rank counts the collective alike
                    wait(None, what)
                handed.append(fused.nbytes if levels.hosts > 1 else 0)
            run_phases(reductions, summed)
            back(source)
        levels.reduce_owned_into(sources, outs, parts, across, wait)
        return sum(handed), sum(handed)

    def _owned_parts(self, entries):
        """[coded.CodedPart] of the entries' partitions, back to back, each with its owner."""
        parts, offset = [], 0
        for entry in entries:
            tensor = entry.tensor
            parts += [CodedPart(offset + part.start, offset + part.stop, part.codec, part.reducer, entry.ctx,
                                partition_owner(tensor.index, p, self.local_size), f"{tensor.name}#{p}")
                      for p, part in enumerate(tensor.partitions)]
            offset += entry.wire.size
        return parts
