"""Workers on one host sum dense tensors among themselves in shared memory (BPS_GC_LOCAL_REDUCE).

BytePS reduces the devices of one machine before anything leaves it, and when the job is one
machine, nothing goes to a server at all. This is that single-machine path for worker
processes: when every worker of the job runs on one host, an uncompressed tensor's push_pull
never reaches a server (compressed tensors still go through the servers, as before).

Per tensor, each worker owns two buffers in its own memfd arena (wire/shm.py): a slot
holding its input, and a result of which it writes only its own slice
``[rank * step, (rank + 1) * step)``. A round of a tensor:
  1. the caller copies its input into its slot; the I/O thread tells every peer READY;
  2. once every worker is READY, this worker sums its slice over all slots, in rank order (so
     every run gives the same bits, whatever the timing), into its result; then SUMMED;
  3. once every worker has SUMMED, it copies each slice out of its owner's result.
Sums and copies of more than INLINE_BYTES run on the codec pool, smaller ones on the I/O
thread. One slot and one result per tensor suffice: a peer reads this worker's slot before its
SUMMED, and it is READY for the next round only after it copied this round's results out.

Notes (tensor id, round, READY or SUMMED) travel over one unix socket per worker, a ROUTER the
I/O thread polls, and every note made in one pass of the I/O loop goes to a peer in one
message. Each buffer is offered once, in a JSON message ahead of the tensor's first note.
BPS_GC_ELASTIC with two levels (host.py, elastic.py): a HELD note (id: the epoch, round: the
round group) tells the host's other ranks that this one holds every server reply of a group,
summed in that epoch; an owner hands its replies out (then SUMMED) only once every rank of the
host holds the group in the same epoch, so no rank copies out a result a REDO would replace,
and an averaged result divides by the members of the group's epoch (``averaged``).
A failure the scheduler reports fails every waiting push_pull (WorkerIO.fail_all); a peer that
said goodbye fails those waiting for it, naming it; a round waiting longer than
BPS_GC_STALL_TIMEOUT is logged with the ranks it waits for.
"""
import logging
import threading
import time
from typing import NamedTuple

import numpy as np
import zmq

from ...comm import NodeFailure
from ...comm.host_sum import add_in_order
from ...wire import shm
from ...wire.sockets import CONTROL_MAX_BYTES, DropLog, MalformedMessage, host_of, recv, send
from ...wire.wire import Header, Msg, decode_json, encode_json
from .peers import channel

log = logging.getLogger("bps_gc.worker")
INLINE_BYTES = 64 * 1024  # below this a sum or copy costs less than a trip through the codec pool
OFFER, NOTES = 1, 2  # message kinds (the header's key)
READY, SUMMED, HELD = 0, 1, 2
NOTE = np.dtype([("id", "<u8"), ("round", "<u4"), ("kind", "<u4")])


def endpoint(host, port):
    """The unix socket of the worker whose peer socket is host:port (abstract: nothing on disk)."""
    return f"ipc://@bps_gc/reduce/{host}:{port}"


def one_host(cfg, book, host):
    """Whether this job's workers reduce dense tensors in shared memory: asked for, possible
    here, and every worker on this host. Every worker decides alike from the address book."""
    workers = book["workers"]
    return (cfg.local_reduce and shm.supported() and not cfg.enable_async and len(workers) > 1
            and all(host_of(w["address"]) == host and w.get("local", "").startswith("ipc://@bps_gc/reduce/")
                    for w in workers))


class PeerBuffers(NamedTuple):
    """A peer's buffers of one tensor, mapped read-only: its input and its slices of the sum."""
    slot: np.ndarray
    result: np.ndarray


class LocalTensor:
    """One tensor's buffers and the notes seen for its rounds. Made by the caller's thread at the
    tensor's first reduce (``slot`` is written there); the rest is the I/O thread's."""

    __slots__ = ("name", "id", "nbytes", "dtype", "slot", "result", "offer", "offered", "offers", "peers",
                 "notes", "waiting", "since", "warned", "rounds", "plan", "shares", "priority", "wire")

    def __init__(self, name, nbytes=0, dtype=None, tid=None):
        self.name, self.nbytes, self.dtype = name, nbytes, dtype
        self.id = channel("reduce:" + name) if tid is None else tid
        self.slot = self.result = self.offer = None
        self.offered = False
        self.offers = {}  # rank -> the peer's offer, as it came
        self.peers = {}  # rank -> its PeerBuffers, mapped read-only once the offer is checked
        self.notes = {}  # (round, kind) -> ranks whose note arrived (-1: this worker's sum is under way)
        self.waiting = None  # this worker's round in flight: its commands.StartLocal
        self.since = 0.0
        self.warned = False
        self.rounds = 0  # the caller's: rounds started
        self.plan = None  # the tensor's TensorPlan (partitions, codecs)
        self.shares = None  # member rank -> the slices of the tensor it sums (see EqualShares.share)
        self.priority, self.wire = 0, None  # two levels (host.py): the push's priority, fp16 copy


class EqualShares:
    """What each member of one host's sums does (BPS_GC_LOCAL_REDUCE): the ``index``-th of
    ``members`` sums an equal cut of a tensor, says so once summed, and an averaged result is
    divided. Two levels give LocalReduce theirs instead (host.HostShares)."""

    def __init__(self, members):
        self.members = members

    def share(self, tensor, index):
        """The slices of ``tensor`` that the ``index``-th member sums: an equal cut."""
        n = tensor.size
        step = -(-n // self.members)
        return [slice(min(n, index * step), min(n, (index + 1) * step))]

    def forward(self, local, rnd, handle, summed):
        """This worker's slices are summed: tell the others (``summed(local, rnd)``)."""
        summed(local, rnd)

    def divides(self, local):
        """Whether an averaged push_pull divides the result by the number of workers."""
        return True


class LocalReduce:
    def __init__(self, ctx, cfg, auth, rank, size, host, port, counters, submit):
        """``submit(fn, *args)`` runs work on the codec pool; ``port``: the peer socket's."""
        self.cfg, self.rank, self.size, self.counters, self.submit = cfg, rank, size, counters, submit
        self.ctx, self.auth = ctx, auth
        self.router = auth.server(ctx.socket(zmq.ROUTER))
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_BYTES)
        self.endpoint = endpoint(host, port)
        self.router.bind(self.endpoint)
        self.arena = shm.Arena()
        self.peer_maps = shm.PeerMaps()
        self.lock = threading.Lock()  # the arena and by_name: reduces may start on several threads
        self.by_name = {}  # caller's side
        self.by_id = {}  # I/O thread's side: tensor id -> LocalTensor (a placeholder until started)
        self.links = {}  # rank -> DEALER
        self.outbox = {}  # rank -> notes to send at the end of this pass of the loop
        self.left = {}
        self.report_failure = None
        self.dropped = DropLog(log)
        self.next_scan = 0.0
        self.summed = None  # set by WorkerIO: queues after_sum(local, rnd) on the I/O thread
        self.members = list(range(size))  # the ranks that sum together (host.py: a host's)
        self.division = EqualShares(size)  # what each member sums (connect)
        # BPS_GC_ELASTIC (elastic.py): on_held(rank, group, epoch) hears a host-mate's HELD;
        # averaged(handle) is how many ranks the handle's result is averaged over
        self.on_held = self.averaged = None

    def connect(self, workers, membership, division=None):
        """``workers``: the address book's entries of the members; the membership keeps ``left``
        (ranks that said goodbye) and tells the scheduler of a round that can never complete.
        ``division``: what each member sums and does with its share (two levels: host.HostShares;
        None: equal cuts, EqualShares)."""
        self.left, self.report_failure = membership.left, membership.report_failure
        self.members = sorted(w["rank"] for w in workers)
        self.division = division if division is not None else EqualShares(len(self.members))
        for w in workers:
            if w["rank"] != self.rank:
                sock = self.auth.client(self.ctx.socket(zmq.DEALER))
                sock.setsockopt(zmq.IDENTITY, f"l{self.rank}".encode())
                sock.setsockopt(zmq.LINGER, 500)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.connect(w["local"])
                self.links[w["rank"]] = sock

    # ------------------------------------------------------------------ caller's thread

    def prepare(self, tensor, source):
        """(the tensor's buffers, made at its first reduce; the round): ``source`` is copied
        into the slot, which is free (see the module's note)."""
        with self.lock:
            local = self.by_name.get(tensor.name)
            if local is None:
                nbytes = tensor.size * tensor.dtype.itemsize
                local = LocalTensor(tensor.name, nbytes, tensor.dtype)
                offer, slot = self.arena.allocate(nbytes)
                result_offer, result = self.arena.allocate(nbytes)
                local.slot, local.result = slot.view(tensor.dtype), result.view(tensor.dtype)
                local.offer = {"id": local.id, "name": tensor.name, "slot": offer, "result": result_offer}
                local.plan = tensor
                local.shares = {r: self.division.share(tensor, i) for i, r in enumerate(self.members)}
                self.by_name[tensor.name] = local
        np.copyto(local.slot, source)
        self.counters.add(pushed_raw=0 if tensor.auxiliary else local.nbytes, shared_bytes=local.nbytes)
        local.rounds += 1
        return local, local.rounds - 1

    # ------------------------------------------------------------------ I/O thread

    def start(self, command):
        """This worker's input for the round of ``command`` (commands.StartLocal) is in its slot."""
        local, rnd = command.local, command.round
        early = self.by_id.get(local.id)
        if early is not local:
            if early is not None:  # notes and offers from peers that started first
                local.offers.update(early.offers)
                local.notes.update(early.notes)
            self.by_id[local.id] = local
        if not local.offered:
            local.offered = True
            for sock in self.links.values():
                send(sock, Header(Msg.PEER, self.rank, key=OFFER), encode_json(local.offer))
        local.waiting = command
        local.since, local.warned = time.monotonic(), False
        gone = sorted(r for r in self.links if r in self.left)
        if gone:
            return self.departed(local, gone[0])
        self.note(local, rnd, READY)

    def note(self, local, rnd, kind):
        """Record this worker's note, queue it for every peer, and move the round on."""
        local.notes.setdefault((rnd, kind), set()).add(self.rank)
        for rank in self.links:
            self.outbox.setdefault(rank, []).append((local.id, rnd, kind))
        self.advance(local)

    def advance(self, local):
        """Sum, or copy out, once every worker's note for that step is in."""
        if local.waiting is None:
            return
        rnd, handle = local.waiting.round, local.waiting.handle
        ready, summed = local.notes.get((rnd, READY), ()), local.notes.get((rnd, SUMMED), ())
        if len(summed) == len(self.members) and -1 not in summed:
            del local.notes[(rnd, READY)], local.notes[(rnd, SUMMED)]
            wire, average = local.waiting.wire, local.waiting.average
            local.waiting = None
            size = self.size if self.averaged is None else self.averaged(handle)
            self.run(local.nbytes, handle, self.copy_out, local, handle, wire, average, size)
        elif len(ready) == len(self.members) and self.rank not in summed and -1 not in summed:
            error = self.map_peers(local)
            if error is not None:
                return self.fail(local, error)
            local.notes.setdefault((rnd, SUMMED), set()).add(-1)
            self.run(local.nbytes // len(self.members), handle, self.sum_slice, local, rnd, handle)

    def run(self, nbytes, handle, fn, *args):
        if nbytes <= INLINE_BYTES:
            return fn(*args)
        try:
            self.submit(fn, *args)
        except RuntimeError as e:  # the interpreter is exiting and has shut the pool down
            handle.fail(e)

    def sum_slice(self, local, rnd, handle):
        """This worker's slices of the sum, over every slot in rank order (any thread)."""
        try:
            slots = [local.slot if r == self.rank else local.peers[r].slot for r in self.members]
            for part in local.shares[self.rank]:
                add_in_order([slot[part] for slot in slots], local.result[part])
        except Exception as e:
            return handle.fail(e)
        self.division.forward(local, rnd, handle, self.summed)  # two levels first push them

    def after_sum(self, local, rnd):
        """On the I/O thread: this worker's slice of round ``rnd`` is summed."""
        local.notes[(rnd, SUMMED)].discard(-1)
        self.note(local, rnd, SUMMED)

    def copy_out(self, local, handle, wire, average, size):
        """Every slice from its owner's result into the output, averaged over ``size`` ranks (any thread)."""
        try:
            size = wire.dtype.type(size)
            average = average and self.division.divides(local)
            for r in self.members:
                result = local.result if r == self.rank else local.peers[r].result
                for part in local.shares[r]:
                    if average:  # one pass; the same values as copying, then dividing
                        np.divide(result[part], size, out=wire[part])
                    else:
                        wire[part] = result[part]
            self.counters.add(pulled_raw=0 if handle.tensor.auxiliary else local.nbytes)
        except Exception as e:
            return handle.fail(e)
        handle.partition_done()

    def receive(self):
        """Take one message off the router (it is readable)."""
        try:
            msg = recv(self.router, router=True)
            sender = msg.header.sender
            if msg.header.type != Msg.PEER or msg.identity != f"l{sender}".encode() or sender not in self.links:
                raise MalformedMessage(f"{msg.header} from {msg.identity!r} is not a local reduce message")
            if msg.header.key == OFFER:
                offer = decode_json(msg.payload or b"{}")
                self.known(offer.get("id")).offers[sender] = offer
                return
            if msg.header.key != NOTES or len(msg.payload or b"") % NOTE.itemsize:
                raise MalformedMessage(f"{msg.header}: not a list of notes")
            notes = np.frombuffer(msg.payload, NOTE).tolist()
        except (MalformedMessage, TypeError) as e:
            return self.dropped("a local reduce message: %s", e)
        for tid, rnd, kind in notes:
            if kind == HELD:
                if self.on_held is not None:
                    self.on_held(sender, rnd, tid)
                continue
            local = self.known(tid)
            local.notes.setdefault((rnd, kind), set()).add(sender)
            self.advance(local)

    def known(self, tid):
        """The tensor with id ``tid``: a placeholder if this worker has not started it yet."""
        local = self.by_id.get(tid)
        if local is None:
            local = self.by_id[tid] = LocalTensor("?", tid=tid)
        return local

    def map_peers(self, local):
        """Map every peer's buffers not mapped yet; the error to fail the round with, if an
        offer is missing, names another tensor or other bytes (a peer passing another shape)."""
        for rank in self.links:
            if rank in local.peers:
                continue
            offer = local.offers.get(rank)
            try:
                if not isinstance(offer, dict) or offer.get("name") != local.name:
                    raise ValueError(f"worker {rank} offered no buffers for it")
                slot, result = offer["slot"], offer["result"]
                if not isinstance(slot, dict) or slot.get("bytes") != local.nbytes:
                    raise ValueError(f"worker {rank} reduces {slot.get('bytes') if isinstance(slot, dict) else '?'} "
                                     f"bytes, this worker {local.nbytes} (every worker must pass the "
                                     f"same shape and dtype)")
                local.peers[rank] = PeerBuffers(self.peer_maps.view(slot, local.nbytes).view(local.dtype),
                                                self.peer_maps.view(result, local.nbytes).view(local.dtype))
            except shm.ShmUnavailable as e:
                return NodeFailure(f"push_pull({local.name!r}): cannot map worker {rank}'s memory "
                                   f"({e}); set BPS_GC_LOCAL_REDUCE=0")
            except (KeyError, TypeError, ValueError) as e:
                return ValueError(f"push_pull({local.name!r}): {e}")
        return None

    def tell_held(self, group, epoch):
        """BPS_GC_ELASTIC: tell the host's other ranks this one holds round group ``group``'s
        replies, summed in ``epoch``."""
        for rank in self.links:
            self.outbox.setdefault(rank, []).append((epoch, group, HELD))

    def flush(self):
        """Send the notes made in this pass of the loop, one message per peer."""
        if self.outbox:
            for rank, notes in self.outbox.items():
                send(self.links[rank], Header(Msg.PEER, self.rank, key=NOTES), np.array(notes, NOTE))
            self.outbox = {}

    def check(self):
        """A tick: fail rounds waiting for a worker that left; log rounds stalled too long."""
        now = time.monotonic()
        if now < self.next_scan:
            return
        self.next_scan = now + min(0.25, self.cfg.stall_timeout / 4)
        for local in list(self.by_id.values()):
            if local.waiting is None:
                continue
            missing = self.missing(local)
            gone = sorted(r for r in missing if r in self.left)
            if gone:
                self.departed(local, gone[0])
            elif not local.warned and now - local.since > self.cfg.stall_timeout:
                local.warned = True
                log.warning("push_pull of %r (round %d) has waited %.0f s for worker(s) %s",
                            local.name, local.waiting.round, now - local.since, missing)

    def missing(self, local):
        rnd = local.waiting.round
        step = SUMMED if len(local.notes.get((rnd, READY), ())) == len(self.members) else READY
        return sorted(set(self.links) - local.notes.get((rnd, step), set()))

    def departed(self, local, rank):
        """``rank`` left while this worker needs it for ``local``: fail the push_pull and have the
        scheduler stop the job, as a server does for a round a departed worker never pushed."""
        reason = f"worker {rank} left the job: push_pull of {local.name!r} cannot complete"
        self.fail(local, NodeFailure(reason))
        self.report_failure(reason)

    def fail(self, local, error):
        if local.waiting is not None:
            local.waiting.handle.fail(error)
            local.waiting = None

    def fail_all(self, error):
        for local in self.by_id.values():
            self.fail(local, error)

    def close(self):
        for sock in self.links.values():
            sock.close(linger=500)
        self.router.close(linger=0)
        self.arena.close()


__all__ = ["LocalReduce", "endpoint", "one_host"]
