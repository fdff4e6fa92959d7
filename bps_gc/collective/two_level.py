"""The communicator's side of two levels (levels.py): joining them at start, and a bucket's
compressed tensors (every reducer, majority included) reduced as the parameter server's two
levels do: partition p of the tensor declared i-th is owned by local rank (i + p) mod L
(roles/worker_host.py's rule), which compresses the host's sum of it once with that
partition's chain; the owners of every host exchange payloads and run the server's reducer.
Dense buckets and the plain all_reduce (PowerSGD's two phases, local SGD) are levels.py's sum.
"""
import time

import numpy as np

from ..roles.worker_host import partition_owner
from .levels import HostLevels
from .rendezvous import host_key


class TwoLevels:
    """Mixed into Collective (which provides wait, _issue, counters, cfg, rank, size)."""

    levels = None  # HostLevels when two levels run

    def join_levels(self):
        self.levels = HostLevels.join(self.rank, self.size, host_key(self.cfg), self.local_rank,
                                      self.local_size, self.cfg.hierarchy, wait=self.level_wait)
        return self.levels

    def level_wait(self, work, what):
        """Wait for one of the levels' collectives; None counts one this rank skips (every rank
        counts the same collectives, which departure.py compares)."""
        if work is None:
            self.issued += 1
            return
        self.wait(self._issue(work), what)

    def reduce_coded_on_hosts(self, coded):
        """Two levels of a bucket's compressed tensors ``coded``: [(tensor, wire, out, average,
        ctx, None)], one round per wire dtype (their wires back to back)."""
        by_dtype = {}
        for entry in coded:
            by_dtype.setdefault(entry[1].dtype, []).append(entry)
        for entries in by_dtype.values():
            start = time.perf_counter()
            flat = np.concatenate([entry[1] for entry in entries])
            parts, offset = [], 0
            for tensor, wire, _, _, ctx, _ in entries:
                parts += [(offset + part.start, offset + part.stop,
                           partition_owner(tensor.index, p, self.local_size), part.codec, part.reducer, ctx)
                          for p, part in enumerate(tensor.partitions)]
                offset += wire.size
            names = ", ".join(repr(entry[0].name) for entry in entries[:3])
            sent, received = self.levels.reduce_coded(flat, parts, f"all_gather of {names}'s payloads")
            self.counters.pushed_wire += sent
            self.counters.pulled_wire += received
            self.counters.communicate_seconds += time.perf_counter() - start
            offset = 0
            for tensor, wire, out, average, _, _ in entries:
                total = flat[offset:offset + wire.size]
                offset += wire.size
                self._deliver(total, out, average and tensor.partitions[0].reducer.summed)
