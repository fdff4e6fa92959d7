"""The collective communicator's buckets (a part of ``Collective``): reductions fused like
DDP's (BPS_GC_BUCKET_BYTES of input), handed to the exchange thread when full or when any
handle is waited for (the caller is done adding for now: its last bucket goes out at once, not
after the buckets before it were delivered). There the bucket's compressed tensors are one job of
the compressed exchange's driver (exchange/driver.py, run inline on the exchange thread: their
payloads in one all_gather, every rank running the server's reduction), its two-phase ones run
their phases (reductions.py), its dense ones start one all_reduce per dtype on a buffer kept for
the next step (fused_buffers.py), or in their own memory when they are views back to back in
one flat buffer, each reduced in place (flat_views.py: DDP's bucket views), except that a large
dense array (ALONE_BYTES) reduced in place and not such a view gets its own all_reduce in its
own memory, as Horovod and DDP leave large tensors unfused: no copy, and gloo's AVG divides it
(not the caller's thread); from its second reduction on it goes out as it is added, in a bucket
of its own; ``finish`` (a handle's wait)
waits for those and delivers the results. A bucket's error (a codec's, a failed peer's) is
raised by every wait on its handles.
"""
import dataclasses
import functools
import threading
import time
from typing import Any, NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist

from ..comm import communicator as api
from .exchange.driver import Driver, Inline
from .exchange.jobs import ArraySegment, GatheredSegment, Job
from .flat_views import in_larger_buffer, in_place_region, same_memory
from .fused_buffers import FusedBuffers

# a dense numpy array of at least this many wire bytes, reduced in place on every rank, is
# all_reduced alone in its own memory: fused, it would be copied into a kept buffer and back.
# Below it, gloo's cost per all_reduce outweighs the copy (1 MB: about as much gloo CPU time added
# as copying saved, on 2 ranks on the 2-core box); into another output it stays fused (a copy
# either way, and the fused one measured cheaper).
ALONE_BYTES = 4 << 20


class Handle(api.Handle):
    def __init__(self, comm, result=None, bucket=None):
        """``comm``: what finishes ``bucket`` (the Buckets part) when waited for."""
        self.comm, self.result, self.bucket = comm, result, bucket

    def poll(self):
        bucket = self.bucket
        return bucket is None or (bucket.sent.is_set() and (bucket.error is not None or
                                                            all(w.is_completed() for w in bucket.works)))

    def wait(self, timeout=None):
        if self.bucket is not None and not self.bucket.done:  # (finish's own test, a call fewer a handle)
            self.comm.finish(self.bucket)
        return self.result


@dataclasses.dataclass
class DenseEntry:
    """A dense reduction: ``wire`` (flat numpy array, or tensor of ``reduce_tensor``) is summed
    by the bucket's all_reduce of its dtype, then delivered into ``out`` (``in_place``: ``wire``
    is known to be ``out``'s memory, flat_views then checks only where it lies)."""
    wire: Any
    out: Any
    average: bool
    name: str = ""
    in_place: bool = False


@dataclasses.dataclass
class CodedEntry:
    """A reduction under two levels (dense or compressed: two_level_reductions.py): ``wire``
    (flat, in the tensor's dtype) of declared ``tensor``, delivered into ``out``."""
    tensor: Any
    wire: Any
    out: Any
    average: bool
    ctx: dict


@dataclasses.dataclass
class PhasedEntry:
    """A two-phase reduction (comm/phased.py), its result written into ``wire``, then ``out``."""
    reduction: Any
    wire: Any
    out: Any
    average: bool


class FusedBuffer(NamedTuple):
    """A bucket's all_reduce of one dtype (and device), or of one large array alone:
    ``tensor``, the ``entries`` fused into it in order, ``array`` (numpy entries: the array
    under ``tensor``, else None), ``kept`` (``array`` is a kept buffer, given back once
    delivered; not when it is the output's own memory), ``averaged`` (gloo's AVG divides
    it by the ranks, as it leaves the sum: the same bits as dividing after) and ``in_place``
    (``array`` is the entries' own memory, back to back: flat_views.py)."""
    tensor: torch.Tensor
    entries: list
    array: Optional[np.ndarray] = None
    kept: bool = False
    averaged: bool = False
    in_place: bool = False


class Bucket:
    """Reductions sent together: dense ones fused into one all_reduce per dtype (``entries``:
    [DenseEntry]); compressed ones' payloads in one all_gather (``coded``: [jobs.ArraySegment];
    under two levels ``on_hosts``: [CodedEntry], dense ones too);
    two-phase ones (PowerSGD) in one all_reduce per phase (``phased``: [PhasedEntry]), as
    torch's PowerSGD hook sums a whole bucket's matrices at once; device payloads
    (``gathered``: [jobs.GatheredSegment]) in one all_gather per device."""

    def __init__(self):
        self.entries, self.coded, self.on_hosts, self.phased, self.bytes, self.names = [], [], [], [], 0, []
        self.agreed_alone = []  # names first agreed alone in this bucket (Buckets.going_alone)
        self.gathered = []
        self.works, self.buffers, self.flushed, self.done = [], [], False, False
        self.sent, self.error = threading.Event(), None  # set once the exchange thread issued it

    def abandon(self, error):
        """Ended by ``error`` (job_thread.JobThread: sending it could not be called): its waits raise it."""
        if self.error is None:
            self.error = error
        self.sent.set()


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
        # the compressed exchange's stages, run on the exchange thread itself (its jobs in order)
        self.driver = Driver(self.count, Inline, Inline, Inline)
        self.fused_buffers = FusedBuffers()
        self.gloo_averages = True  # until gloo refuses ReduceOp.AVG (torch before it had it)
        self.alone = {}  # name -> its large array is all_reduced alone (agreed at its first use)
        # the names agreed alone, as the caller's thread knows them: added when it finishes the
        # bucket that agreed (a point every rank reaches in the same order, unlike the exchange
        # thread's progress), so every rank sends a name's next reduction the same way
        self.going_alone = set()
        self.exchange_coded_on_hosts = self.exchange_phased = self.deliver_tensors = None

    def exchanges(self, *, coded_on_hosts, phased, deliver_tensors):
        """The exchanges of the kinds other parts add to a bucket (those parts take the buckets,
        so they are made after them, and give these once), each a public method of its part:
        ``coded_on_hosts`` (TwoLevelReductions.exchange_coded_on_hosts: ``on_hosts``),
        ``phased`` (PhasesAndVotes.exchange_phased) and ``deliver_tensors``
        (DeviceTensors.deliver_tensors: device ``entries`` once summed)."""
        self.exchange_coded_on_hosts, self.exchange_phased = coded_on_hosts, phased
        self.deliver_tensors = deliver_tensors

    def add_dense(self, name, wire, out, average, in_place=False):
        """A dense reduction into the pending bucket (summed by its all_reduce of ``wire``'s dtype);
        a large array the ranks agreed goes alone, in a bucket of its own, out at once: it is
        not copied, so it neither waits for the pending bucket to fill nor fills it (a bucket
        closed early by it would add an all_reduce of the few small arrays left in it)."""
        counters = self.shared.counters
        counters.pushed_wire += wire.nbytes
        counters.pulled_wire += wire.nbytes
        entry = DenseEntry(wire, out, average, name, in_place)
        if name in self.going_alone:
            bucket = Bucket()
            bucket.entries.append(entry)
            bucket.names.append(name)
            bucket.flushed = True
            self.exchanger.submit(self._send, bucket)
            return Handle(self, out, bucket)
        return self.add(Handle(self, out, self.pending), "entries", entry, wire.nbytes, name)

    def add_coded(self, tensor, wire, out, average, ctx):
        """A one-level compressed reduction into the pending bucket: compressed now on the
        exchange thread (while backward goes on), exchanged with the bucket (``wire`` is our
        copy, the result decoded into it; the thread takes a tensor's steps in order, so error
        feedback sees each step in turn)."""
        segment = ArraySegment(tensor.partitions, ctx, wire, out=out, average=average, into=self.deliver,
                               name=tensor.name)
        self.exchanger.submit(self.driver.compress, segment)
        return self.add(Handle(self, out, self.pending), "coded", segment, wire.nbytes, tensor.name)

    def add_on_hosts(self, tensor, wire, out, average, ctx):
        """A reduction under two levels into the pending bucket (two_level_reductions.py)."""
        return self.add(Handle(self, out, self.pending), "on_hosts", CodedEntry(tensor, wire, out, average, ctx),
                        wire.nbytes, tensor.name)

    def count(self, **amounts):
        """Add to this step's counters (the driver's bytes and seconds)."""
        counters = self.shared.counters
        for name, amount in amounts.items():
            setattr(counters, name, getattr(counters, name) + amount)

    def add(self, handle, kind, entry, nbytes, name):
        """``entry`` into the pending bucket's list ``kind`` (entries, coded, on_hosts, phased or
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
        self.exchanger.submit(self._send, bucket)

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
        if bucket.coded:  # one all_gather for the bucket's payloads, then every partition's reduction
            names = [segment.name for segment in bucket.coded]
            self.driver.run(Job(bucket.coded, functools.partial(self._wait_named, names)))
        if bucket.on_hosts:
            self.exchange_coded_on_hosts(bucket.on_hosts)
        by_device = {}  # device payloads: one job (one all_gather) per device, in the order they appear
        for segment in bucket.gathered:
            by_device.setdefault(segment.payloads[0].device, []).append(segment)
        for device, segments in by_device.items():
            names = [segment.name for segment in segments]
            self.driver.run(Job(segments, functools.partial(self._wait_named, names), device=device))
        if bucket.phased:
            self.exchange_phased(bucket.phased)
        # numpy 2 arrays have a .device too ("cpu"): only a tensor's device says it is one
        large = [e for e in bucket.entries if not isinstance(e.wire, torch.Tensor) and e.wire.nbytes >= ALONE_BYTES]
        bucket.agreed_alone = self._agree_alone(large)
        by_dtype = {}  # numpy arrays by dtype; tensors (reduce_tensor) by dtype and device
        for entry in bucket.entries:
            wire = entry.wire
            on_device = isinstance(wire, torch.Tensor)
            if not on_device and self.alone.get(entry.name):  # it goes out while the next is prepared
                self._start(bucket, self._alone(entry))
                continue
            by_dtype.setdefault((wire.dtype, wire.device if on_device else None), []).append(entry)
        for (dtype, device), entries in by_dtype.items():
            wires = [entry.wire for entry in entries]
            region = in_place_region(entries) if device is None else None
            if region is not None:  # views back to back in one buffer (flat_views.py): no copy, and
                # gloo's AVG divides it where all average (only the sum crosses ranks: any layout agrees)
                self._start(bucket, FusedBuffer(torch.from_numpy(region), entries, region, in_place=True,
                                                averaged=all(entry.average for entry in entries)))
            elif device is None:  # into a kept buffer: a fresh one faults its pages in every step
                flat = self.fused_buffers.take(dtype, sum(wire.size for wire in wires))
                self._start(bucket, FusedBuffer(torch.from_numpy(np.concatenate(wires, out=flat)), entries, flat, True))
            else:
                self._start(bucket, FusedBuffer(torch.cat(wires), entries))

    def _agree_alone(self, large):
        """Whether each large array first seen goes alone: where every rank reduces it in place
        (the MIN of each rank's answer, one small all_reduce on the step that first reduces it;
        returns the names that go alone);
        every rank fuses the same arrays, so issues the same all_reduces, whatever it is called
        with later (alone into another output: copied there; fused in place: as any other)."""
        new = [entry for entry in large if entry.name not in self.alone]
        if not new:
            return []
        # a view into a larger buffer (a gradient laid out as a bucket view) is fused in place instead
        flags = torch.tensor([same_memory(entry.out.reshape(-1), entry.wire) and not in_larger_buffer(entry.wire)
                              for entry in new], dtype=torch.int32)
        self.wait(self.issue(dist.all_reduce(flags, op=dist.ReduceOp.MIN, async_op=True)),
                  lambda: f"all_reduce choosing how {listed([entry.name for entry in new])} go out")
        for entry, flag in zip(new, flags.tolist()):
            self.alone[entry.name] = bool(flag)
        return [entry.name for entry, flag in zip(new, flags.tolist()) if flag]

    def _alone(self, entry):
        """A large array's own buffer: its output's memory when that holds the wire's dtype
        (the input copied in unless it is the output: a reduction in place copies nothing),
        else a kept buffer."""
        wire, out = entry.wire, entry.out.reshape(-1)
        if out.dtype == wire.dtype:  # the average too is done there, by gloo's thread
            if not entry.in_place and not same_memory(out, wire):
                np.copyto(out, wire)
            return FusedBuffer(torch.from_numpy(out), [entry], out, averaged=entry.average)
        flat = self.fused_buffers.take(wire.dtype, wire.size)
        np.copyto(flat, wire)
        return FusedBuffer(torch.from_numpy(flat), [entry], flat, True)

    def _start(self, bucket, fused):
        """Start ``fused``'s all_reduce (the bucket's collectives go in the order started)."""
        work = None
        if fused.averaged and self.gloo_averages:
            try:
                work = dist.all_reduce(fused.tensor, op=dist.ReduceOp.AVG, async_op=True)
            except (RuntimeError, ValueError):  # an older torch's gloo refuses AVG before sending
                self.gloo_averages = False
        if work is None:
            fused = fused._replace(averaged=False)  # divided when delivered
            work = dist.all_reduce(fused.tensor, async_op=True)
        bucket.buffers.append(fused)
        bucket.works.append(self.issue(work))

    def _wait_named(self, names, work, what):
        """Wait for a bucket's collective, a failure naming the bucket's tensors."""
        self.wait(self.issue(work), lambda: f"{what} of {listed(names)}")

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
        self.going_alone.update(bucket.agreed_alone)
        waited = time.perf_counter() - start
        # each buffer delivered once its all_reduce is done, while the later ones still run (and
        # its memory may still be in the cache); taken off the bucket, so never delivered twice
        while bucket.buffers:
            start = time.perf_counter()
            self.wait(bucket.works[0], lambda: f"all_reduce of {listed(bucket.names)}")
            waited += time.perf_counter() - start
            fused = bucket.buffers.pop(0)
            bucket.works.pop(0)
            self._deliver_fused(fused)
        self.shared.counters.communicate_seconds += waited
        bucket.done = True

    def _deliver_fused(self, fused):
        if fused.array is None:
            self.deliver_tensors(fused.tensor, fused.entries)
            return
        averages = [entry.average and not fused.averaged for entry in fused.entries]
        if fused.in_place and not any(averages):  # the outputs are the array: already the result
            return
        if fused.in_place and all(averages):  # gloo took no AVG: one divide over them all
            np.divide(fused.array, fused.array.dtype.type(self.size), out=fused.array)
            return
        offset = 0
        for entry in fused.entries:
            self.deliver(fused.array[offset:offset + entry.wire.size], entry.out, entry.average and not fused.averaged)
            offset += entry.wire.size
        if fused.kept:
            self.fused_buffers.give(fused.array)

    def deliver(self, total, out, average):
        """The reduced flat ``total`` into the caller's ``out`` (divided by the ranks first when
        averaging: in place, ``total`` is ours)."""
        dest = out.reshape(-1)
        if average and dest.dtype == total.dtype:  # one pass: the same bits as dividing, then copying
            np.divide(total, total.dtype.type(self.size), out=dest)
            return
        if average:
            total /= total.dtype.type(self.size)
        if not same_memory(dest, total):  # a large array reduced in its output is there already
            np.copyto(dest, total, casting="unsafe")


def listed(names, most=3):
    """The first ``most`` distinct names, quoted, and how many more: for an error's message."""
    names = list(dict.fromkeys(names))
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
