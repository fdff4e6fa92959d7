"""``Collective``: the communicator (roles/communicator.py) on torch.distributed.

Reductions are fused into buckets like DDP's (BPS_GC_BUCKET_BYTES, 25 MB of input): a bucket
goes out when full or when a handle waiting on it is waited for. Going out hands it to the
exchange thread (exchange_thread.py), so reduce() returns at once: a gradient hook never holds
backward for an exchange. There its dense tensors are summed by one all_reduce (per dtype), its
two-phase tensors' phases by one all_reduce each, and its compressed tensors, cut into the
parameter server's partitions (same keys, so the same codec seeds) and compressed there, send
their payloads in one all_gather, and every rank runs the server's reduction (exchange.py); the
handles' wait() delivers the results. Every rank issues the same collectives in the same order
because every rank declares, reduces and waits in the same order (the contract of the
interface), the thread takes buckets in the order they were flushed, and the collectives the
caller issues itself wait until the thread is idle (``drain``). A bucket's error (a codec's, a
failed peer's) is raised by every wait on its handles.

Every wait polls the heartbeat (liveness.py): a dead rank raises NodeFailure within the
heartbeat bound, and one that shut down (departure.py) as soon as this rank waits on anything it
never issued; so every collective and message is counted. ``all_reduce`` is the plain-sum phase PowerSGD's P and Q steps call.
"""
import logging
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from ..roles import NodeFailure
from ..roles import communicator as api
from ..roles.phased import PhasedReduction, phases
from ..roles.worker_handle import Metrics
from ..roles.worker_tensors import Placement, check_dtype, declare_tensor, resolve_reduce_call
from .departure import Ending, await_end, departure, described
from .device_tensors import DeviceTensors
from .exchange import PayloadsMissing, all_gather_bytes
from .exchange_thread import ExchangeThread
from .liveness import Heartbeat
from .messages import Messages
from .rendezvous import backend_from_env, connect
from .two_level import TwoLevels

log = logging.getLogger("bps_gc.collective")


class Handle(api.Handle):
    def __init__(self, comm, result=None, bucket=None):
        self.comm, self.result, self.bucket = comm, result, bucket

    def poll(self):
        bucket = self.bucket
        return bucket is None or (bucket.sent.is_set() and (bucket.error is not None or
                                                            all(w.is_completed() for w in bucket.works)))

    def wait(self, timeout=None):
        if self.bucket is not None:
            self.comm.finish(self.bucket)
        return self.result


class Bucket:
    """Reductions sent together: dense ones fused into one all_reduce per dtype ``entries``:
    [(flat wire array, out, average)]; compressed ones' payloads in one all_gather ``coded``:
    [(tensor, wire, out, average, lr, payloads)]; two-phase ones (PowerSGD) in one all_reduce
    per phase ``phased``: [(PhasedReduction, first phase buffer, wire, out, average)], as
    torch's PowerSGD hook sums a whole bucket's matrices at once. ``gathered``: [(payload
    tensors, the list every rank's payloads land in, name)] of ``push_payloads`` (device chains),
    one all_gather per device."""

    def __init__(self):
        self.entries, self.coded, self.phased, self.bytes, self.names = [], [], [], 0, []
        self.gathered = []
        self.works, self.buffers, self.flushed, self.done = [], [], False, False
        self.sent, self.error = threading.Event(), None  # set once the exchange thread issued it


class Compressed:
    """One compressed reduction's payloads (or its codec's error), made on the exchange thread."""
    payloads = error = None

    def run(self, tensor, wire, ctx, counters):
        start = time.perf_counter()
        try:
            self.payloads = [part.codec.compress(wire[part.start:part.stop], ctx) for part in tensor.partitions]
        except Exception as e:  # noqa: BLE001 -- the bucket's error, raised by its waits
            self.error = e
            return
        counters.compress_seconds += time.perf_counter() - start
        counters.pushed_wire += sum(p.nbytes for p in self.payloads)


class Collective(TwoLevels, Messages, DeviceTensors, api.Communicator):
    def __init__(self, cfg, codecs, local_rank=None, local_size=None):
        self.cfg, self.codecs = cfg, codecs
        self.rank, self.size = cfg.rank, cfg.size
        self.local_rank = cfg.local_rank if local_rank is None else local_rank
        self.local_size = cfg.local_size if local_size is None else local_size
        self.tensors = {}
        self.placement = Placement(1, cfg.partition_bytes, cfg.min_compress_bytes)
        self.bucket_bytes = cfg.bucket_bytes
        self.pending = Bucket()
        self.counters = Metrics()
        self.heartbeat = None
        self.closed = False
        self.hosts_store = False
        self.issued = 0  # collectives, and messages per peer: what a rank that left compares
        self.sent, self.received = [0] * self.size, [0] * self.size
        self.awaiting = None  # the message this rank last told the store it waits for
        self.failure = None
        self.abandoned = None  # the uncaught exception the script ends on, if any
        self.exchanger = ExchangeThread(f"bps_gc-collective-exchange-{self.rank}")

    # ------------------------------------------------------------------ lifecycle

    def start(self):
        backend = backend_from_env()
        store, self.hosts_store = connect(self.cfg, backend)
        where = f"{self.cfg.root_uri}:{self.cfg.root_port}"
        self.heartbeat = Heartbeat(store, self.rank, self.size, self.cfg.heartbeat_interval,
                                   self.cfg.heartbeat_timeout, where).start()
        self.join_levels()
        self.barrier()
        log.info("rank %d/%d joined over torch.distributed (%s, %s)", self.rank, self.size, backend,
                 "two levels" if self.levels else "one level")
        return self

    def shutdown(self, timeout=10.0):
        """Publish what this rank did, wait for the others to end (departure.py); a last
        barrier and the group's teardown only when all ended at the same point."""
        if self.closed:
            return
        failed = self.failure is not None or (self.heartbeat is not None and self.heartbeat.failure is not None)
        if not failed:
            try:
                self.flush()
                self.drain()  # every collective issued before the count is published
            except (NodeFailure, RuntimeError):  # a peer failed while the last bucket went out
                failed = True
        self.exchanger.stop()  # after a failure it may still wait on the dead peer: a daemon
        self.closed = True
        clean = not failed
        if self.heartbeat is not None and self.heartbeat.store is not None and self.size > 1:
            mine = Ending(self.issued, tuple(self.sent), tuple(self.received), failed, self.abandoned)
            self.heartbeat.announce(mine)
            clean = await_end(self.heartbeat, mine, self.hosts_store, self.cfg.join_timeout)
            self.heartbeat.leave()
        if self.levels is not None:
            self.levels.close()
        if clean and dist.is_initialized():
            try:
                dist.barrier()  # nobody tears down its pairs while a peer still sends
                dist.destroy_process_group()
            except RuntimeError as e:
                log.warning("rank %d: the process group's teardown failed: %s", self.rank, e)

    def abandon(self, reason):
        self.abandoned = reason

    def check_alive(self):
        if self.closed:
            raise RuntimeError("bps_gc: the collective communicator was shut down")
        if self.heartbeat is not None and self.heartbeat.failure is not None:
            self.failure = self.heartbeat.failure
            raise self.failure

    def drain(self):
        """Wait until the exchange thread issued every flushed bucket (before this thread issues
        a collective itself: the order every rank issues them in), watching the heartbeat; a
        failure the thread met is raised here too."""
        while not self.exchanger.wait_idle(0.05):
            self.check_alive()
        if self.failure is not None:
            raise self.failure

    def wait(self, work, what, message=None):
        """Wait for a torch.distributed work item, watching the heartbeat and the ranks that
        shut down meanwhile. ``what`` names it in an error: a string, or a function making one
        (only called then). Gloo's send/recv works (``message``: ("recv" | "send", peer, n))
        only complete inside a blocking wait(): a dead or departed peer then shows as gloo's
        socket error, which the heartbeat names."""
        spins = 0
        if message is not None and self.heartbeat is not None:
            self._check_departures(what, message)
            if message != self.awaiting:  # a message's two works: one note in the store
                self.heartbeat.waiting_for(*message)
                self.awaiting = message
        while message is None and not work.is_completed():
            self._check_departures(what)
            self.check_alive()
            spins += 1
            time.sleep(0 if spins < 100 else 0.001)
        try:
            work.wait()
        except RuntimeError as e:  # a peer's socket closed: let the heartbeat name who (its
            # thread may run late on a busy host: twice its bound)
            deadline = time.monotonic() + 2 * (self.cfg.heartbeat_timeout + self.cfg.heartbeat_interval)
            while time.monotonic() < deadline:
                self._check_departures(what, message)
                self.check_alive()
                time.sleep(self.cfg.heartbeat_interval / 4)
            self.failure = NodeFailure(f"bps_gc: {described(what)} failed on rank {self.rank}: {e}")
            raise self.failure from None

    def _check_departures(self, what, message=None):
        if self.heartbeat is None or not self.heartbeat.ended:  # the usual case, on every spin
            return
        failure = departure(self.heartbeat.ended, self.rank, self.issued, what, message)
        if failure:
            self.failure = failure
            raise failure

    def _issue(self, work):
        """Count a collective as it is issued (every rank issues them in the same order)."""
        self.issued += 1
        return work

    # ------------------------------------------------------------------ tensors

    def declare(self, name, shape=None, dtype=None, reducer=None, **compression):
        self.check_alive()
        tensor, shape, dtype = declare_tensor(self.tensors, self.codecs, name, shape, dtype, reducer,
                                              compression)
        if shape is not None:
            self._place(tensor, shape, dtype)
        return tensor.declaration()

    def declaration(self, name):
        tensor = self.tensors.get(name)
        return None if tensor is None else tensor.declaration()

    def _place(self, tensor, shape, dtype):
        check_dtype(tensor, dtype)
        self.placement.plan(tensor, shape, dtype, self._build_codec, balanced=True)

    def _build_codec(self, tensor, n, dtype, key):
        """(worker chain, reducer): every rank runs the reducer the server would have run."""
        return (self.codecs.build_chain(tensor.params, n, dtype, key=key, role="worker",
                                        shape=tensor.shape),
                self.codecs.make_reducer(tensor.reducer, tensor.params, n, dtype, key))

    def reduce(self, array, name, average=True, priority=0, ctx=None, out=None, lr=None):
        """Sum (or average) over all ranks into ``out`` (default: ``array``, in place)."""
        self.check_alive()
        ctx = dict(self.codecs.step_context(ctx))  # a copy: the caller may reuse its dict
        if lr is not None:
            ctx["lr"] = float(lr)
        tensor, array, out, place = resolve_reduce_call(self.tensors, name, array, out)
        if place:
            self._place(tensor, array.shape, array.dtype)
        # dense: the bucket's concatenation is the one copy, made when the bucket goes out (like
        # the parameter server's push, the caller leaves the array alone until wait());
        # compressed: a copy the reduction then overwrites with the result
        # two levels sum a host in the tensor's dtype, then cast the host's sum for the wire (as
        # the parameter server's do); PowerSGD's phases start from each rank's own wire copy
        carried = tensor.dtype if self.levels is not None and phases(tensor) == 1 else tensor.wire_dtype
        wire = np.ascontiguousarray(array).reshape(-1).astype(carried, copy=tensor.compressed)
        self.counters.pushed_raw += wire.nbytes
        self.counters.pulled_raw += wire.nbytes
        if phases(tensor) == 1 and self.levels is not None:  # two levels, dense or not (two_level.py)
            return self._add(Handle(self, out, self.pending), "coded", (tensor, wire, out, average, ctx, None),
                             wire.nbytes, tensor.name)
        if not tensor.compressed:
            return self._reduce_dense(tensor.name, wire, out, average)
        if phases(tensor) > 1:
            return self._reduce_in_phases(tensor, wire, out, average, ctx)
        if tensor.reducer != "majority":
            return self._queue_payloads(tensor, wire, out, average, ctx)
        start = time.perf_counter()
        self._reduce_signs(tensor, wire, ctx)
        self.counters.communicate_seconds += time.perf_counter() - start
        self._deliver(wire, out, False)  # a vote: never averaged
        return Handle(self, out)

    def push_pull(self, array, name, average=True, priority=0, ctx=None, out=None, lr=None):
        return self.reduce(array, name, average=average, priority=priority, ctx=ctx, out=out, lr=lr)

    def _queue_payloads(self, tensor, wire, out, average, ctx):
        """Compressed now on the exchange thread (while backward goes on), exchanged with the
        bucket (``wire`` is our copy; the thread takes a tensor's steps in order, so error
        feedback sees each step in turn)."""
        compressed = Compressed()
        self.exchanger.submit(lambda: compressed.run(tensor, wire, ctx, self.counters))
        return self._add(Handle(self, out, self.pending), "coded", (tensor, wire, out, average, ctx, compressed),
                         wire.nbytes, tensor.name)

    @staticmethod
    def _compress_coded(coded):
        """This rank's payloads of the bucket's compressed tensors (made by their jobs, which
        ran before the bucket's on the same thread), in order; (None, the error) when a codec
        raised: the rank still takes part in the exchange (exchange.py)."""
        failures = [entry[5].error for entry in coded if entry[5].error is not None]
        if failures:
            return None, failures[0]
        return [p for entry in coded for p in entry[5].payloads], None

    def _reduce_coded(self, coded):
        """Compress, one all_gather for the bucket's payloads, then every partition's reduction."""
        mine, failure = self._compress_coded(coded)
        start = time.perf_counter()
        try:
            gathered = all_gather_bytes(mine, lambda work, what: self.wait(
                self._issue(work), lambda: f"{what} of {_listed(entry[0].name for entry in coded)}"),
                parts=sum(len(entry[0].partitions) for entry in coded))
        except PayloadsMissing:
            if failure is not None:  # this rank's own codec error says more
                raise failure from None
            raise
        self.counters.pulled_wire += sum(p.nbytes for rank in gathered for p in rank) - sum(p.nbytes for p in mine)
        self.counters.communicate_seconds += time.perf_counter() - start
        index = 0
        for tensor, wire, out, average, ctx, _ in coded:
            for part in tensor.partitions:
                reply = part.reducer.reduce([rank[index] for rank in gathered], True, ctx)
                part.reducer.decode(reply, wire[part.start:part.stop], ctx)
                index += 1
            self._deliver(wire, out, average and tensor.partitions[0].reducer.summed)

    def _reduce_in_phases(self, tensor, wire, out, average, ctx):
        """Two phases (roles/phased.py), both with the bucket on the exchange thread (a tensor's
        steps in order there, so error feedback sees each step in turn)."""
        reduction = PhasedReduction(tensor, wire, wire, ctx, self.size)
        return self._add(Handle(self, out, self.pending), "phased", (reduction, None, wire, out, average),
                         wire.nbytes, tensor.name)

    def _reduce_phased(self, phased):
        """Both phases of every two-phase reduction in the bucket: one all_reduce each."""
        start = time.perf_counter()
        firsts = [entry[0].first() for entry in phased]
        self.counters.compress_seconds += time.perf_counter() - start
        p_sums = self._sum_phase(firsts)
        q_sums = self._sum_phase([entry[0].second(p_sum) for entry, p_sum in zip(phased, p_sums)])
        for (reduction, _, wire, out, average), q_sum in zip(phased, q_sums):
            reduction.finish(q_sum)
            self._deliver(wire, out, average)

    def _sum_phase(self, buffers):
        """The buffers summed over ranks by one all_reduce of their concatenation; the sums,
        in order."""
        start = time.perf_counter()
        fused = np.concatenate(buffers)
        self._sum(fused)
        self.counters.communicate_seconds += time.perf_counter() - start
        self.counters.pushed_wire += fused.nbytes
        self.counters.pulled_wire += fused.nbytes
        return np.split(fused, np.cumsum([b.size for b in buffers])[:-1])

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
        self.counters.pushed_wire += votes.numel() // 8 + 1
        self.counters.pulled_wire += votes.numel() // 8 + 1
        self.wait(self._issue(dist.all_reduce(votes, async_op=True)), f"all_reduce of {tensor.name!r}'s signs")
        tally = votes.numpy()
        wire[...] = np.nan if tally[-1] else np.where(tally[:-1] < 0, -1, 1)

    def _reduce_dense(self, name, wire, out, average):
        self.counters.pushed_wire += wire.nbytes
        self.counters.pulled_wire += wire.nbytes
        return self._add(Handle(self, out, self.pending), "entries", (wire, out, average), wire.nbytes, name)

    def _add(self, handle, kind, entry, nbytes, name):
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
            if self.failure is not None:
                raise self.failure
            self._exchange(bucket)
        except BaseException as e:  # noqa: BLE001 -- raised by the bucket's waits
            bucket.error = e
        finally:
            bucket.sent.set()

    def _exchange(self, bucket):
        if bucket.coded:
            (self.reduce_coded_on_hosts if self.levels is not None else self._reduce_coded)(bucket.coded)
        if bucket.gathered:
            self._gather_payloads(bucket.gathered)
        if bucket.phased:
            self._reduce_phased(bucket.phased)
        by_dtype = {}  # numpy arrays by dtype; tensors (reduce_tensor) by dtype and device
        for entry in bucket.entries:
            wire = entry[0]
            by_dtype.setdefault((wire.dtype, getattr(wire, "device", None)), []).append(entry)
        for (_, device), entries in by_dtype.items():
            wires = [w for w, _, _ in entries]
            fused = torch.from_numpy(np.concatenate(wires)) if device is None else torch.cat(wires)
            bucket.buffers.append((fused, entries))
        bucket.works = [self._issue(dist.all_reduce(fused, async_op=True)) for fused, _ in bucket.buffers]

    def finish(self, bucket):
        if bucket.done:
            return
        if bucket is self.pending:
            self.flush()
        start = time.perf_counter()
        while not bucket.sent.wait(0.05):  # the thread's waits watch the heartbeat too
            self.check_alive()
        if bucket.error is not None:
            raise bucket.error
        for work in bucket.works:
            self.wait(work, lambda: f"all_reduce of {_listed(bucket.names)}")
        self.counters.communicate_seconds += time.perf_counter() - start
        for fused, entries in bucket.buffers:
            if isinstance(entries[0][0], torch.Tensor):
                self._deliver_tensors(fused, entries)
                continue
            flat, offset = fused.numpy(), 0
            for wire, out, average in entries:
                self._deliver(flat[offset:offset + wire.size], out, average)
                offset += wire.size
        bucket.done = True

    def _deliver(self, total, out, average):
        """The reduced flat ``total`` into the caller's ``out`` (divided by the ranks first when
        averaging: in place, ``total`` is ours)."""
        if average:
            total /= total.dtype.type(self.size)
        np.copyto(out.reshape(-1), total, casting="unsafe")

    def all_reduce(self, array, average=False):
        """A plain in-place sum over ranks now (PowerSGD's P and Q phases, local SGD's model
        difference); no codec, no bucket."""
        self.check_alive()
        self.drain()
        return self._sum(array, average)

    def _sum(self, array, average=False):
        """``all_reduce`` on the thread that runs it (the exchange thread for a bucket's phases)."""
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if self.levels is not None:
            self.levels.all_reduce(tensor.numpy())
        else:
            self.wait(self._issue(dist.all_reduce(tensor, async_op=True)), "all_reduce")
        if average:
            tensor /= self.size
        if not np.shares_memory(tensor.numpy(), array):
            np.copyto(array, tensor.numpy())
        return array

    # ------------------------------------------------------------------ collectives

    def barrier(self):
        self.check_alive()
        self.flush()
        self.drain()
        self.wait(self._issue(dist.barrier(async_op=True)), "barrier")

    def broadcast(self, array, root_rank, name):
        if not 0 <= root_rank < self.size:
            raise ValueError(f"broadcast: root_rank {root_rank} outside [0, {self.size})")
        self.check_alive()
        self.drain()
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        self.wait(self._issue(dist.broadcast(tensor, root_rank, async_op=True)), f"broadcast of {name!r}")
        if not np.shares_memory(tensor.numpy(), array):
            np.copyto(array, tensor.numpy())
        return array

    def send(self, rank, name, payload):
        self.drain()
        return Messages.send(self, rank, name, payload)

    def recv(self, rank, name, timeout=None):
        self.drain()
        return Messages.recv(self, rank, name, timeout)

    def metrics(self):
        current, self.counters = self.counters, Metrics()
        return current

    step_metrics = metrics  # the parameter-server worker's name, which core.metrics() calls


def _listed(names, most=3):
    names = list(dict.fromkeys(names))
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
