"""Two levels on torch.distributed (BPS_GC_HIERARCHY=host, the default with several local ranks
per host), as the parameter server's two levels (ps/worker/host.py) do it:

1. the host's ranks reduce-scatter: each local rank owns a share of the buffer and sums it over
   the host's ranks, in local-rank order (host tensors: in shared memory, wire/shm.py;
   CUDA tensors: NCCL's reduce_scatter on the host's group);
2. across hosts, local rank i of every host forms group i (gloo or NCCL), which reduces share i:
   a sum (dense), or, for a compressed share, an all_gather of each host's payload, compressed
   once from the host's sum by the share's owner (its codec state lives there), and the
   reducer the server would run;
3. the host all-gathers the shares (shared memory, or NCCL's all_gather on the host's group).

So each host sends and receives one copy of the buffer across the network, and a codec sees
the host's sum, as on the parameter server (docs/local_ranks.md). Rank r is host r // L's local
rank r % L (bpslaunch: DMLC_WORKER_ID * L + BYTEPS_LOCAL_RANK; torchrun: GROUP_RANK * L +
LOCAL_RANK); hosts of different sizes run flat, and so does a job on one host unless
BPS_GC_HIERARCHY=host asks for two levels there (its traffic never leaves the host, and codecs
keep compressing each rank's own gradient, as single-machine torchrun jobs always did).

Host memory: per size class, every local rank offers a slot (its input) and a result (its
shares' sums) from its memfd arena once, in an all_gather on the host's group; a round is copy
in, sync, sum and cross-host step, sync, copy out (dense: the sums and cross-host steps stripe
by stripe, then per stripe a wait, a sync and its copy out; see ``reduce_dense``). A peer reads
this rank's slot only before its first sync after the sums and its result only before the next
round's first sync, so one slot and one result suffice (ps/worker/local.py's argument). The memory
is freed by the kernel with its last user.
"""
import json
import logging

import numpy as np
import torch
import torch.distributed as dist

from ..comm import NodeFailure
from ..comm.host_sum import add_in_order
from ..config import ConfigError
from ..wire import shm
from .all_gather import all_gather_bytes
from .rendezvous import collective_config, host_key

log = logging.getLogger("bps_gc.collective")
MIN_CAPACITY = 1 << 16  # size classes: powers of two from 64 KiB (few distinct buffers)
# dense sums cross hosts in stripes of L shares of this many bytes each, so that the network
# carries one stripe while the host sums the next and copies earlier ones out
PIPELINE_BYTES = 1 << 20


def plain_wait(work, what):
    """For callers without a heartbeat (the DDP hook has its own fault handling); ``work`` None
    stands for a collective this rank skipped (nothing to wait for)."""
    if work is not None:
        work.wait()


def host_layout(table, hierarchy):
    """(local size, problem): ``table`` is every rank's (host key, local rank, local size) in
    rank order. Two levels need rank = host index * L + local rank with one L on every host;
    ``problem`` says why not (None when they can run)."""
    if hierarchy == "flat":
        return None, "BPS_GC_HIERARCHY=flat"
    keys = sorted({key for key, _, _ in table})
    sizes = {}
    for key, _, size in table:
        sizes.setdefault(size, []).append(key)
    if len(sizes) > 1:
        shown = "; ".join(f"host(s) {sorted(set(k))[:4]} run {s}" for s, k in sorted(sizes.items()))
        return None, f"hosts run different numbers of local ranks ({shown})"
    local_size = table[0][2]
    if local_size == 1:
        return None, "one rank per host"
    if len(keys) == 1 and hierarchy != "host":  # nothing crosses a network: codecs see each rank's own
        return None, "one host (BPS_GC_HIERARCHY=host would sum it in shared memory)"
    for rank, (key, local_rank, _) in enumerate(table):
        if rank != keys.index(key) * local_size + local_rank:
            return None, (f"rank {rank} is local rank {local_rank} of host {key}, not rank "
                          f"host * {local_size} + local rank")
    return local_size, None


class HostLevels:
    """The two levels themselves: the host's group and shared memory, the cross-host groups,
    and the sums through them (the communicator's part that runs its buckets through them:
    two_level_reductions.TwoLevelReductions; the exchange pipeline's: exchange/two_levels.py,
    whose ``reduce_coded_on_hosts`` is the compressed parts' step across hosts).
    ``wait(work, what)`` waits for a collective (the communicator's watches the heartbeat;
    None: a skipped one, for its count). Each reduction takes the wait of its caller
    (``wait=``; the one given here when None), so a HostLevels shared by callers with
    different waits (the DDP hook's buckets) needs no swap."""

    def __init__(self, rank, size, local_size, wait=plain_wait):
        self.rank, self.size, self.local_size, self.wait = rank, size, local_size, wait
        self.local_rank, self.host, self.hosts = rank % local_size, rank // local_size, size // local_size
        # every rank creates every group, in the same order (torch.distributed's rule)
        self.host_group, _ = dist.new_subgroups_by_enumeration(
            [list(range(h * local_size, (h + 1) * local_size)) for h in range(self.hosts)])
        self.cross_group, _ = dist.new_subgroups_by_enumeration(
            [list(range(i, size, local_size)) for i in range(local_size)])
        self.arena, self.peer_maps = shm.Arena(), shm.PeerMaps()
        self.buffers = {}  # capacity -> (slots, results): uint8 views, by local rank
        self.sync_flag = torch.zeros(1, dtype=torch.int32)

    @classmethod
    def join(cls, rank, size, host_key, local_rank, local_size, hierarchy, wait=plain_wait):
        """Every rank calls it at the same point: the HostLevels, or None where the job runs
        flat (a ValueError when BPS_GC_HIERARCHY=host cannot be met)."""
        mine = torch.tensor([host_key, local_rank, local_size], dtype=torch.int64)
        table = [torch.empty_like(mine) for _ in range(size)]
        wait(dist.all_gather(table, mine, async_op=True), "all_gather of the ranks' hosts")
        rows = [tuple(int(v) for v in t) for t in table]
        layout, problem = host_layout(rows, hierarchy)
        if problem is None and not shm.supported():
            problem = "this host has no shared memory (memfd)"
        if problem is not None:
            if hierarchy == "host":
                raise ValueError(f"BPS_GC_HIERARCHY=host: {problem}; set BPS_GC_HIERARCHY=flat")
            log.info("rank %d: one level (%s)", rank, problem)
            return None
        return cls(rank, size, layout, wait)

    # ------------------------------------------------------------------ host memory

    def _buffers(self, nbytes, wait):
        capacity = max(MIN_CAPACITY, 1 << (nbytes - 1).bit_length())
        found = self.buffers.get(capacity)
        if found is not None:
            return found
        slot_offer, slot = self.arena.allocate(capacity)
        result_offer, result = self.arena.allocate(capacity)
        offer = np.frombuffer(json.dumps({"slot": slot_offer, "result": result_offer}).encode(), np.uint8)
        gathered = all_gather_bytes([offer], wait, self.host_group)
        slots, results, problem = [], [], None
        for index, (blob,) in enumerate(gathered):
            if index == self.local_rank:
                slots.append(slot)
                results.append(result)
                continue
            try:
                offers = json.loads(blob.tobytes())
                slots.append(self.peer_maps.view(offers["slot"], capacity))
                results.append(self.peer_maps.view(offers["result"], capacity))
            except (shm.ShmUnavailable, ValueError, KeyError, TypeError) as e:
                problem = f"cannot map local rank {index}'s memory ({e})"
        flag = torch.tensor([problem is not None], dtype=torch.int32)  # every local rank fails alike
        wait(dist.all_reduce(flag, group=self.host_group, async_op=True), "all_reduce of shared memory checks")
        if int(flag):
            problem = problem or "a local rank cannot map the memory of another"
            raise NodeFailure(f"bps_gc: rank {self.rank}: two levels: {problem}; the local ranks of a host "
                              f"must run on it (or set BPS_GC_HIERARCHY=flat)")
        self.buffers[capacity] = (slots, results)
        return slots, results

    def _sync(self, what, wait):
        wait(dist.all_reduce(self.sync_flag, group=self.host_group, async_op=True), what)

    def _load(self, sources, padded, wait):
        """Copy ``sources`` (flat arrays of one dtype) back to back into this rank's slot, zero
        the rest up to ``padded`` elements and wait for the host's other ranks to do so;
        returns (slots, results) as arrays of that dtype, ``padded`` long."""
        dtype = sources[0].dtype
        slots, results = self._buffers(padded * dtype.itemsize, wait)
        view = (lambda b: b[:padded * dtype.itemsize].view(dtype))
        slots, results = [view(s) for s in slots], [view(r) for r in results]
        mine, offset = slots[self.local_rank], 0
        for source in sources:
            mine[offset:offset + source.size] = source
            offset += source.size
        mine[offset:] = 0  # the padding is summed too: no stale NaN
        self._sync("host sync before the sums", wait)
        return slots, results

    def share(self, n, index):
        """The elements [start, stop) of an ``n``-element buffer that local rank ``index`` owns in
        the NCCL path: an equal cut of the buffer padded to a multiple of L (no share is empty)."""
        step = max(1, -(-n // self.local_size))
        return index * step, (index + 1) * step

    def stripes(self, n, itemsize):
        """(share, count): the dense layout of an ``n``-element buffer, ``count`` stripes of L
        shares of ``share`` elements each; local rank i owns the i-th share of every stripe. A
        buffer of up to L x PIPELINE_BYTES is one stripe: an equal cut, padded to L shares."""
        count = max(1, -(-n // (max(1, PIPELINE_BYTES // itemsize) * self.local_size)))
        return max(1, -(-n // (count * self.local_size))), count  # padding: < count x L elements

    # ------------------------------------------------------------------ reductions

    def all_reduce(self, array, what="all_reduce", wire_dtype=None, wait=None):
        """Sum a host array (numpy) over every rank, in place; returns it. ``wire_dtype``: the
        host's sums cross in it (float16 with fp16), cast back after."""
        flat = array.reshape(-1)
        self.reduce_dense([flat], [(flat, None)], what, wire_dtype, wait)
        return array

    def reduce_dense(self, sources, outs, what="all_reduce", wire_dtype=None, wait=None):
        """The sum over every rank of ``sources`` (flat arrays of one dtype, back to back) into
        ``outs``: [(flat array, divisor or None)] of the same sizes, divided on the way out.
        Pipelined by stripes (``stripes``): the host sums of every share are issued across hosts
        as they are made, so stripe k crosses the network while stripe k+1 is summed, and the
        host copies stripe k out while later ones cross. Each element is summed as without
        stripes: over the host's ranks in local-rank order, then across hosts by one all_reduce
        (two hosts: the same bits; more: gloo's ring order within the stripe's share)."""
        wait = wait or self.wait
        dtype = sources[0].dtype
        wire = dtype if wire_dtype is None else np.dtype(wire_dtype)
        share, count = self.stripes(sum(s.size for s in sources), dtype.itemsize)
        stripe = share * self.local_size
        slots, results = self._load(sources, count * stripe, wait)
        mine, crossing = results[self.local_rank], []
        for k in range(count):
            start = k * stripe + self.local_rank * share
            out = mine[start:start + share]
            add_in_order([slot[start:start + share] for slot in slots], out)
            carried = out if wire == dtype else out.astype(wire)
            work = None
            if self.hosts > 1:
                work = dist.all_reduce(torch.from_numpy(carried), group=self.cross_group, async_op=True)
            crossing.append((work, carried, out))
        for k, (work, carried, out) in enumerate(crossing):
            if work is not None:
                wait(work, f"{what} across hosts")
            if carried is not out:
                out[...] = carried
            self._sync("host sync after the sums", wait)
            base = k * stripe
            self._copy_out(results, [(base + i * share, base + (i + 1) * share, i)
                                     for i in range(self.local_size)], outs)

    def reduce_owned_into(self, sources, outs, parts, across, wait=None):
        """Two levels with the step across hosts given: ``parts`` (coded.CodedPart, or anything
        with ``start``, ``stop`` and ``owner``: the owner local rank) of ``sources`` (flat arrays of one dtype, back to back). Each owner sums its parts
        over the host (local-rank order) into its result; ``across(result, mine)`` (``mine``:
        this rank's parts) turns those into the sums over every rank, in place; then each part is
        copied from its owner's result into ``outs`` (as ``reduce_dense``). Used by compressed
        parts (exchange/two_levels.py ``reduce_coded_on_hosts``: payloads gathered across hosts
        by the exchange's driver) and by thc (its phases summed across hosts)."""
        wait = wait or self.wait
        n = sum(s.size for s in sources)
        slots, results = self._load(sources, self.local_size * max(1, -(-n // self.local_size)), wait)
        mine = [part for part in parts if part.owner == self.local_rank]
        result = results[self.local_rank]
        for part in mine:
            add_in_order([slot[part.start:part.stop] for slot in slots], result[part.start:part.stop])
        across(result, mine)
        self._sync("host sync after the sums", wait)
        self._copy_out(results, [(part.start, part.stop, part.owner) for part in parts], outs)

    @staticmethod
    def _copy_out(results, pieces, outs):
        """Each piece (start, stop, owner) of the joined buffer, from its owner's result into the
        ``outs`` it overlaps (padding beyond them is dropped), divided where they say so (one
        pass; the same bits as copying, then dividing). ``pieces`` ascend, as ``outs`` do."""
        ends = np.cumsum([dest.size for dest, _ in outs])
        for start, stop, owner in pieces:
            first = int(np.searchsorted(ends, start, side="right"))
            for index in range(first, len(outs)):
                dest, divisor = outs[index]
                base = int(ends[index]) - dest.size
                if base >= stop:
                    break
                a, b = max(start, base), min(stop, base + dest.size)
                if divisor is None:
                    dest[a - base:b - base] = results[owner][a:b]
                else:
                    np.divide(results[owner][a:b], divisor, out=dest[a - base:b - base])

    def all_reduce_cuda(self, tensor, what="all_reduce", wait=None):
        """Sum a CUDA tensor over every rank, in place, with NCCL: reduce_scatter on the host's
        group, all_reduce of the share across hosts, all_gather on the host's group."""
        wait = wait or self.wait
        flat = tensor.view(-1)
        start, stop = self.share(flat.numel(), self.local_rank)
        step = stop - start
        padded = torch.zeros(step * self.local_size, dtype=flat.dtype, device=flat.device)
        padded[:flat.numel()] = flat
        share = torch.empty(step, dtype=flat.dtype, device=flat.device)
        wait(dist.reduce_scatter_tensor(share, padded, group=self.host_group, async_op=True),
                  f"{what}: reduce_scatter on the host")
        if self.hosts > 1:
            wait(dist.all_reduce(share, group=self.cross_group, async_op=True), f"{what} across hosts")
        wait(dist.all_gather_into_tensor(padded, share, group=self.host_group, async_op=True),
                  f"{what}: all_gather on the host")
        flat.copy_(padded[:flat.numel()])
        return tensor

    def reduce_tensor(self, tensor, what="all_reduce", wait=None):
        """The sum of a torch tensor over every rank, in place: CUDA with NCCL, else in shared
        memory (the DDP hook's dense buckets)."""
        if tensor.is_cuda:
            return self.all_reduce_cuda(tensor, what, wait)
        if tensor.is_contiguous():
            self.all_reduce(tensor.numpy(), what, wait=wait)
        else:
            tensor.copy_(torch.from_numpy(self.all_reduce(tensor.contiguous().numpy(), what, wait=wait)))
        return tensor

    def close(self):
        self.buffers, self.peer_maps = {}, shm.PeerMaps()
        self.arena.close()


def levels_from_env(wait=plain_wait, environ=None):
    """Two levels for a caller beside the communicator (the DDP hook): its own groups and
    memory on the initialized default group, or None where the job runs flat (or the
    environment names no local ranks). Every rank calls it at the same point."""
    try:
        cfg, local_rank, local_size = collective_config(environ)
    except ConfigError:
        return None
    return HostLevels.join(dist.get_rank(), dist.get_world_size(), host_key(cfg, environ), local_rank,
                           local_size, cfg.hierarchy, wait)


__all__ = ["HostLevels", "host_layout", "levels_from_env", "plain_wait"]
