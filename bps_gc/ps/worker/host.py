"""Two levels (BPS_GC_HIERARCHY=host): a host's local ranks sum in shared memory, push once.

The local ranks of a worker host reduce-scatter each tensor in shared memory: each owns some
of the tensor's partitions (partition p of the tensor declared i-th belongs to local rank
(i + p) mod local_size), sums them over the host's ranks in local-rank order, compresses that
sum once with its own codec chain (so error feedback and momentum live with the owner),
pushes it to the partition's server, and receives the result into its shared result buffer;
then every rank of the host copies every partition out of its owner's result (an all-gather).
Servers count one push per host. The protocol is local.py's (READY, sum, SUMMED, copy
out) among the host's ranks, with the push and pull between the sum and SUMMED; see
docs/local_ranks.md for what changes when a codec sees the host's sum. thc runs its two phases
there instead (``forward_phases``): the owners of a partition on every host sum its scale
histogram and codes through phase tensors of their own (``phase_tensors``). ``HostShares`` is
the division of the host's sums that LocalReduce runs (not a kind of it): its collaborators are
named, none of them the Worker.
"""
import numpy as np

from ...comm import NodeFailure
from ...comm.phased import PhasedReduction, owner_phase_names, phases, size_for
from ...comm.placement import partition_owner
from ...wire import shm
from ...wire.sockets import host_of
from ...wire.wire import encode_context
from .commands import InitKey, SendPush
from .local import LocalReduce, one_host
from .push import Push


def may_use(cfg):
    """Whether this worker offers the shared-memory endpoint the host level needs (decided
    before the join; the scheduler's address book says whether the job uses it)."""
    return cfg.local_size > 1 and cfg.hierarchy != "flat" and shm.supported()


def host_members(book, cfg, host):
    """The address book's entries of this host's local ranks; NodeFailure naming the problem if
    one runs elsewhere or cannot share memory."""
    first = cfg.worker_id * cfg.local_size
    members = [w for w in book["workers"] if first <= w["rank"] < first + cfg.local_size]
    for w in members:
        if host_of(w["address"]) != host or not str(w.get("local", "")).startswith("ipc://@bps_gc/reduce/"):
            raise NodeFailure(
                f"BPS_GC_HIERARCHY=host: local rank {w['rank'] - first} of DMLC_WORKER_ID={cfg.worker_id} "
                f"(worker {w['rank']}) is at {w['address']} without shared memory with this rank at "
                f"{host}; the local ranks of a worker host must run on it (set BPS_GC_HIERARCHY=flat "
                f"to push from every rank)")
    return members


class InnerTensor:
    """What a Handle needs of a tensor, for the owner's pushes of its share: it must not clear
    the user's tensor's ``busy`` flag, and its pulled bytes are counted once, by the copy out."""

    def __init__(self, name):
        self.name, self.busy, self.auxiliary = name, False, True
        self.pushed_by = None  # the host level carries no tensor of one local rank's own (carries)


class HostShares:
    """Two levels' division of the host's shared-memory sums (local.LocalReduce runs their
    protocol and is given this at connect): which local rank owns each partition, and what its
    owner does with its share of the host's sum before SUMMED: push it (compressed once), pull
    the job's sum into the same place. Made by ``connect`` from ``cfg`` and the job's ``size``;
    its collaborators come with ``attach`` once the worker's I/O runs."""

    def __init__(self, cfg, size):
        self.local_rank, self.local_size, self.size = cfg.local_rank, cfg.local_size, size
        self.per_rank = set()  # names of the tensors every rank pushes itself (see ``place``)
        self.pushed_by = {}  # thc's phase tensors -> the local rank that pushes them (``phase_tensors``)
        self.io = self.counters = self.compressed_pushes = self.run_phases = self.handle = None
        self.words = None

    def attach(self, io, counters, compressed_pushes, run_phases, handle, words):
        """``io``: the worker's WorkerIO (its pushes go out there); ``counters``: its Counters;
        ``compressed_pushes``: compressing.CompressedPushes; ``run_phases``: Worker.run_phases
        (thc's phases); ``handle(tensor, out, wire, count, average, ctx)``: a worker Handle;
        ``words``: the dtype the servers sum thc's phases in (worker.phase_words)."""
        self.io, self.counters, self.compressed_pushes = io, counters, compressed_pushes
        self.run_phases, self.handle, self.words = run_phases, handle, words

    def owner(self, tensor, p):
        """The member index (local rank) that sums, pushes and pulls partition ``p``."""
        return partition_owner(tensor.index, p, self.local_size)

    def phase_tensors(self, tensor):
        """thc under two levels (comm/phased.py ``host_first``): for each local rank, a pair of
        dense tensors holding the phase buffers of the partitions it owns, [(name, length)] for
        the worker to declare alike on every rank, placed (INIT) and pushed by that local rank
        of every host: one push per host a key, as the servers count, and lanes sized for the
        hosts."""
        size_for(tensor, self.size // self.local_size, self.words)
        named = []
        for rank in range(self.local_size):
            owned = [part for p, part in enumerate(tensor.partitions) if self.owner(tensor, p) == rank]
            for i, name in enumerate(owner_phase_names(tensor, rank)):
                length = sum(int(part.codec.phase_sizes[i]) for part in owned)
                if length:
                    self.pushed_by[name] = rank
                    named.append((name, length))
        return named

    def place(self, tensor):
        """The InitKey commands (commands.py) this rank sends the servers: those it owns. A
        compressed tensor of granularity 'entiremodel' is compressed by the binding over each
        rank's whole gradient, before any host sum: every rank pushes it, as in a flat job, and
        its declaration tells the servers to count one push per rank."""
        if tensor.name in self.pushed_by:  # thc's phase tensor: its local rank pushes it
            return [InitKey.of(tensor, part) for part in tensor.partitions] \
                if self.pushed_by[tensor.name] == self.local_rank else []
        if tensor.compressed and tensor.params.granularity == "entiremodel":
            self.per_rank.add(tensor.name)
            return [InitKey.of(tensor, part, pushers="rank") for part in tensor.partitions]
        return [InitKey.of(tensor, part) for part in self.owned(tensor)]

    def carries(self, tensor):
        """Whether the host level reduces ``tensor`` (else every rank pushes it, or, declared
        ``one_per_host``, only this one of the host's)."""
        return tensor.name not in self.per_rank and tensor.name not in self.pushed_by and tensor.pushed_by is None

    def owned(self, tensor):
        return [part for p, part in enumerate(tensor.partitions) if self.owner(tensor, p) == self.local_rank]

    def share(self, tensor, index):
        """The slices of ``tensor`` that local rank ``index`` sums: the partitions it owns."""
        return [slice(part.start, part.stop) for p, part in enumerate(tensor.partitions)
                if self.owner(tensor, p) == index]

    def divides(self, local):
        reducer = local.plan.partitions[0].reducer if local.plan.partitions else None
        return reducer is None or reducer.summed  # a majority vote is not averaged

    # ------------------------------------------------------------------ any thread

    def forward(self, local, rnd, handle, summed):
        """This rank's share of the host's sum is in its result buffer: push each of its
        partitions (compressed once, here), pull the job's sum into the same place, then SUMMED
        (``summed(local, rnd)``)."""
        tensor = local.plan
        owned = self.owned(tensor)
        if not owned:
            return summed(local, rnd)
        if phases(tensor) > 1:
            return self.forward_phases(local, rnd, handle, owned, summed)
        try:
            buf = self._wire_copy(local, owned)  # fp16 on the wire: push and pull a cast copy
            ctx, context = handle.ctx, encode_context(handle.ctx)
            inner = self.handle(InnerTensor(tensor.name), buf, buf, len(owned), False, ctx)
            inner.group = handle.group  # BPS_GC_ELASTIC: its replies are held with the user's group
        except Exception as e:
            return handle.fail(e)
        inner.then(lambda done: handle.fail(done.error) if done.error is not None
                   else self.pulled(local, rnd, handle, owned, summed))
        for part in owned:
            chunk = buf[part.start:part.stop]
            if part.codec is None:
                push = Push(inner, part, chunk, False, context, local.priority, tensor.wire_dtype,
                            chunk.view(np.uint8))
                self.counters.add(pushed_wire=chunk.nbytes)
                self.io.prefill(push)
                self.io.queue(SendPush(push))
            else:
                try:
                    self.compressed_pushes.submit(inner, part, chunk, ctx, context, local.priority,
                                                  tensor.wire_dtype)
                except RuntimeError as e:  # the interpreter is exiting and has shut the pool down
                    return inner.fail(e)

    def forward_phases(self, local, rnd, handle, owned, summed):
        """thc: the phases of this rank's partitions of the host's sum, with this local rank of
        every host (``phase_tensors``), decoded into its result buffer, then SUMMED."""
        tensor = local.plan
        try:
            buf = self._wire_copy(local, owned)
            reduction = PhasedReduction(tensor, buf, buf, handle.ctx, self.size // self.local_size, owned,
                                        self.words)
        except Exception as e:
            return handle.fail(e)
        self.run_phases(reduction, owner_phase_names(tensor, self.local_rank), local.priority, handle.ctx,
                        handle, lambda: self.pulled(local, rnd, handle, owned, summed))

    def _wire_copy(self, local, owned):
        """The buffer the owned partitions cross in: the result, or a cast copy (fp16)."""
        tensor = local.plan
        if tensor.wire_dtype == tensor.dtype:
            return local.result
        if local.wire is None:
            local.wire = np.empty(local.result.size, tensor.wire_dtype)
        for part in owned:
            local.wire[part.start:part.stop] = local.result[part.start:part.stop]
        return local.wire

    def pulled(self, local, rnd, handle, owned, summed):
        try:
            if local.wire is not None and local.plan.wire_dtype != local.plan.dtype:
                for part in owned:
                    local.result[part.start:part.stop] = local.wire[part.start:part.stop]
        except Exception as e:
            return handle.fail(e)
        summed(local, rnd)


def open_local(worker, host, port):
    """Before the join: the shared-memory endpoint this worker offers (or None), either for
    BPS_GC_LOCAL_REDUCE (one host) or for two levels; which one is decided by ``connect``."""
    cfg = worker.cfg
    if may_use(cfg) or cfg.local_reduce and shm.supported():
        return LocalReduce(worker.ctx, cfg, worker.auth, worker.rank, worker.size, host, port, worker.counters,
                           worker.pool.submit)
    return None


def connect(cfg, size, local, book, host, membership):
    """After the join: (local, host level) for this job: the one-host sums (BPS_GC_LOCAL_REDUCE,
    every worker on this host), or two levels (the address book's hierarchy is "host": ``local``
    divided by a HostShares, the host level, whose collaborators the worker attaches), or
    neither (``local`` is closed). ``membership``: the worker's (failures are reported to it)."""
    if local is None:
        if book.get("hierarchy") == "host":
            raise NodeFailure("BPS_GC_HIERARCHY=host needs shared memory (memfd), which this host "
                              "lacks; set BPS_GC_HIERARCHY=flat on every worker")
        return None, None
    if one_host(cfg, book, host):
        local.connect(book["workers"], membership)
        return local, None
    if book.get("hierarchy") == "host" and may_use(cfg):
        try:
            members = host_members(book, cfg, host)
        except NodeFailure as e:
            membership.report_failure(str(e))
            local.close()
            raise
        shares = HostShares(cfg, size)
        local.connect(members, membership, shares)
        return local, shares
    local.close()
    return None, None


__all__ = ["HostShares", "connect", "may_use", "open_local"]
