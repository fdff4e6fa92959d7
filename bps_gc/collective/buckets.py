"""The collective communicator's buckets (a part of ``Collective``): reductions fused like
DDP's (BPS_GC_BUCKET_BYTES of input), handed to the exchange thread when full or when any
handle is waited for (the caller is done adding for now: its last bucket goes out at once, not
after the buckets before it were delivered). There the bucket's compressed tensors send their
payloads in one all_gather and every rank runs the server's reduction (coded.py), its
two-phase ones run their phases (reductions.py), its dense ones start one all_reduce per dtype
on a buffer kept for the next step (fused_buffers.py); ``finish`` (a handle's wait) waits for
those and delivers the results. A bucket's error (a codec's, a failed peer's) is raised by
every wait on its handles.
"""
import dataclasses
import threading
import time
from typing import Any, NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist

from ..comm import communicator as api
from .fused_buffers import FusedBuffers
from .coded import PayloadsMissing, compress_parts, exchange_payloads, payload_bytes, reduce_parts


class Handle(api.Handle):
    def __init__(self, comm, result=None, bucket=None):
        """``comm``: what finishes ``bucket`` (the Buckets part) when waited for."""
        self.comm, self.result, self.bucket = comm, result, bucket

    def poll(self):
        bucket = self.bucket
        return bucket is None or (bucket.sent.is_set() and (bucket.error is not None or
                                                            all(w.is_completed() for w in bucket.works)))

    def wait(self, timeout=None):
        if self.bucket is not None:
            self.comm.finish(self.bucket)
        return self.result


@dataclasses.dataclass
class DenseEntry:
    """A dense reduction: ``wire`` (flat numpy array, or tensor of ``reduce_tensor``) is summed
    by the bucket's all_reduce of its dtype, then delivered into ``out``."""
    wire: Any
    out: Any
    average: bool


class Compressed:
    """One compressed reduction's payloads (or its codec's error), made on the exchange thread."""
    payloads = error = None

    def run(self, tensor, wire, ctx, counters):
        start = time.perf_counter()
        try:
            self.payloads = compress_parts(tensor.partitions, wire, ctx)
        except Exception as e:  # noqa: BLE001 -- the bucket's error, raised by its waits
            self.error = e
            return
        counters.compress_seconds += time.perf_counter() - start
        counters.pushed_wire += payload_bytes(self.payloads)


@dataclasses.dataclass
class CodedEntry:
    """A compressed reduction: ``wire`` (flat, this rank's copy; the result is decoded into
    it) of declared ``tensor``, delivered into ``out``. ``compressed``: its payloads, made on
    the exchange thread (None under two levels, whose owners compress the host's sums)."""
    tensor: Any
    wire: Any
    out: Any
    average: bool
    ctx: dict
    compressed: Optional[Compressed] = None


@dataclasses.dataclass
class PhasedEntry:
    """A two-phase reduction (comm/phased.py), its result written into ``wire``, then ``out``."""
    reduction: Any
    wire: Any
    out: Any
    average: bool


@dataclasses.dataclass
class GatheredEntry:
    """Device payloads of ``push_payloads``: every rank's land in ``result`` (rank order)."""
    payloads: list
    result: list
    name: str


class FusedBuffer(NamedTuple):
    """A bucket's all_reduce of one dtype (and device): ``tensor``, the ``entries`` fused into
    it in order, and ``array`` (numpy entries: the kept buffer under ``tensor``, else None)."""
    tensor: torch.Tensor
    entries: list
    array: Optional[np.ndarray] = None


class Bucket:
    """Reductions sent together: dense ones fused into one all_reduce per dtype (``entries``:
    [DenseEntry]); compressed ones' payloads in one all_gather (``coded``: [CodedEntry]);
    two-phase ones (PowerSGD) in one all_reduce per phase (``phased``: [PhasedEntry]), as
    torch's PowerSGD hook sums a whole bucket's matrices at once; device payloads
    (``gathered``: [GatheredEntry]) in one all_gather per device."""

    def __init__(self):
        self.entries, self.coded, self.phased, self.bytes, self.names = [], [], [], 0, []
        self.gathered = []
        self.works, self.buffers, self.flushed, self.done = [], [], False, False
        self.sent, self.error = threading.Event(), None  # set once the exchange thread issued it


class Buckets:
    """Reductions fused into buckets: ``add`` (into ``pending``, the bucket being filled),
    ``flush`` (to the exchange thread, which runs ``_send``), ``finish`` (a handle's wait) and
    ``deliver`` (a result into the caller's array); the dense and the one-level compressed
    kinds are its own (``add_dense``, ``add_coded``). The other kinds' exchanges are their
    parts' (``exchanges``)."""

    def __init__(self, shared, lifecycle, exchanger, bucket_bytes):
        """``shared``: shared.Shared; ``lifecycle``: its waits (lifecycle.py); ``exchanger``: the
        exchange thread; ``bucket_bytes``: a bucket goes out once it holds that much input."""
        self.shared, self.exchanger, self.bucket_bytes = shared, exchanger, bucket_bytes
        self.size = shared.size
        self.check_alive, self.wait, self.issue = lifecycle.check_alive, lifecycle.wait, lifecycle.issue
        self.pending = Bucket()
        self.fused_buffers = FusedBuffers()
        self.exchange_coded_on_hosts = self.exchange_phased = self.gather_payloads = self.deliver_tensors = None

    def exchanges(self, *, coded_on_hosts, phased, gathered, deliver_tensors):
        """The exchanges of the kinds other parts add to a bucket (those parts take the buckets,
        so they are made after them, and give these once), each a public method of its part:
        ``coded_on_hosts`` (TwoLevelReductions.exchange_coded_on_hosts: ``coded`` under two
        levels), ``phased`` (PhasesAndVotes.exchange_phased), ``gathered`` and
        ``deliver_tensors`` (DeviceTensors.gather_payloads, .deliver_tensors: device payloads,
        and device ``entries`` once summed)."""
        self.exchange_coded_on_hosts, self.exchange_phased = coded_on_hosts, phased
        self.gather_payloads, self.deliver_tensors = gathered, deliver_tensors

    def add_dense(self, name, wire, out, average):
        """A dense reduction into the pending bucket (summed by its all_reduce of ``wire``'s dtype)."""
        self.shared.counters.pushed_wire += wire.nbytes
        self.shared.counters.pulled_wire += wire.nbytes
        return self.add(Handle(self, out, self.pending), "entries", DenseEntry(wire, out, average), wire.nbytes, name)

    def add_coded(self, tensor, wire, out, average, ctx):
        """A one-level compressed reduction into the pending bucket: compressed now on the
        exchange thread (while backward goes on), exchanged with the bucket (``wire`` is our
        copy; the thread takes a tensor's steps in order, so error feedback sees each step in
        turn)."""
        compressed = Compressed()
        self.exchanger.submit(lambda: compressed.run(tensor, wire, ctx, self.shared.counters))
        return self.add(Handle(self, out, self.pending), "coded",
                        CodedEntry(tensor, wire, out, average, ctx, compressed), wire.nbytes, tensor.name)

    def add(self, handle, kind, entry, nbytes, name):
        """``entry`` into the pending bucket's list ``kind`` (entries, coded, phased or
        gathered); the bucket goes out once it holds ``bucket_bytes``. Returns ``handle``."""
        bucket = self.pending
        getattr(bucket, kind).append(entry)
        bucket.names.append(name)
        bucket.bytes += nbytes
        if bucket.bytes >= self.bucket_bytes:  # the same tensors reach it alike on every rank
            self.flush()
        return handle

    def flush(self):
        """Hand the pending bucket to the exchange thread (``_send``)."""
        bucket, self.pending = self.pending, Bucket()
        bucket.flushed = True
        if not bucket.names:
            bucket.sent.set()
            bucket.done = True
            return
        self.exchanger.submit(lambda: self._send(bucket))

    def _send(self, bucket):
        """On the exchange thread: the bucket's payloads' all_gather and phases (waited for),
        its dense all_reduce (started). Its error is the bucket's; after a peer failed, every
        later bucket fails with it at once."""
        try:
            self.check_alive()
            if self.shared.failure is not None:
                raise self.shared.failure
            self._exchange(bucket)
        except BaseException as e:  # noqa: BLE001 -- raised by the bucket's waits
            bucket.error = e
        finally:
            bucket.sent.set()

    def _exchange(self, bucket):
        if bucket.coded:
            (self.exchange_coded_on_hosts if self.shared.levels is not None else self._exchange_coded)(bucket.coded)
        if bucket.gathered:
            self.gather_payloads(bucket.gathered)
        if bucket.phased:
            self.exchange_phased(bucket.phased)
        by_dtype = {}  # numpy arrays by dtype; tensors (reduce_tensor) by dtype and device
        for entry in bucket.entries:
            wire = entry.wire
            # numpy 2 arrays have a .device too ("cpu"): only a tensor's device says it is one
            by_dtype.setdefault((wire.dtype, wire.device if isinstance(wire, torch.Tensor) else None), []).append(entry)
        for (dtype, device), entries in by_dtype.items():
            wires = [entry.wire for entry in entries]
            if device is None:  # into a kept buffer: a fresh one faults its pages in every step
                flat = self.fused_buffers.take(dtype, sum(wire.size for wire in wires))
                bucket.buffers.append(FusedBuffer(torch.from_numpy(np.concatenate(wires, out=flat)), entries, flat))
            else:
                bucket.buffers.append(FusedBuffer(torch.cat(wires), entries))
        bucket.works = [self.issue(dist.all_reduce(fused.tensor, async_op=True)) for fused in bucket.buffers]

    @staticmethod
    def _compress_coded(coded):
        """This rank's payloads of the bucket's compressed tensors (made by their jobs, which
        ran before the bucket's on the same thread), in order; (None, the error) when a codec
        raised: the rank still takes part in the exchange (all_gather.py)."""
        failures = [entry.compressed.error for entry in coded if entry.compressed.error is not None]
        if failures:
            return None, failures[0]
        return [p for entry in coded for p in entry.compressed.payloads], None

    def _exchange_coded(self, coded):
        """One all_gather for the bucket's payloads, then every partition's reduction."""
        mine, failure = self._compress_coded(coded)
        start = time.perf_counter()
        try:
            gathered = exchange_payloads(mine, lambda work, what: self.wait(
                self.issue(work), lambda: f"{what} of {listed(entry.tensor.name for entry in coded)}"),
                parts=sum(len(entry.tensor.partitions) for entry in coded))
        except PayloadsMissing:
            if failure is not None:  # this rank's own codec error says more
                raise failure from None
            raise
        counters = self.shared.counters
        counters.pulled_wire += payload_bytes(p for rank in gathered for p in rank) - payload_bytes(mine)
        counters.communicate_seconds += time.perf_counter() - start
        index = 0
        for entry in coded:
            parts = entry.tensor.partitions
            reduce_parts(parts, [rank[index:index + len(parts)] for rank in gathered], entry.wire, entry.ctx)
            index += len(parts)
            self.deliver(entry.wire, entry.out, entry.average and parts[0].reducer.summed)

    def finish(self, bucket):
        if bucket.done:
            return
        if self.pending.names:  # the caller waits: what it added since goes out now, not after this
            self.flush()
        start = time.perf_counter()
        while not bucket.sent.wait(0.05):  # the thread's waits watch the heartbeat too
            self.check_alive()
        if bucket.error is not None:
            raise bucket.error
        for work in bucket.works:
            self.wait(work, lambda: f"all_reduce of {listed(bucket.names)}")
        self.shared.counters.communicate_seconds += time.perf_counter() - start
        for fused in bucket.buffers:
            if fused.array is None:
                self.deliver_tensors(fused.tensor, fused.entries)
                continue
            offset = 0
            for entry in fused.entries:
                self.deliver(fused.array[offset:offset + entry.wire.size], entry.out, entry.average)
                offset += entry.wire.size
            self.fused_buffers.give(fused.array)
        bucket.done = True

    def deliver(self, total, out, average):
        """The reduced flat ``total`` into the caller's ``out`` (divided by the ranks first when
        averaging: in place, ``total`` is ours)."""
        dest = out.reshape(-1)
        if average and dest.dtype == total.dtype:  # one pass: the same bits as dividing, then copying
            np.divide(total, total.dtype.type(self.size), out=dest)
            return
        if average:
            total /= total.dtype.type(self.size)
        np.copyto(dest, total, casting="unsafe")


def listed(names, most=3):
    """The first ``most`` distinct names, quoted, and how many more: for an error's message."""
    names = list(dict.fromkeys(names))
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
