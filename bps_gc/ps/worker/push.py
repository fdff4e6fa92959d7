"""The worker I/O thread's sending side (a part of ``WorkerIO``): ``Push``, one partition of
one push_pull, waits in a priority heap and is sent while the bytes in flight stay under a
window, so high-priority tensors overtake queued ones.

Fusion: dense pushes of at most FUSABLE_BYTES that are queued together (one priority window)
go to their server as one FUSED message of up to BPS_GC_FUSION_BYTES (0: off), as Horovod's
fusion buffer and DDP's buckets do. A fusable push waits at most FUSION_CYCLE for the others
posted with it; the server answers their rounds with fused replies. Each
key keeps its own round, so workers need not fuse alike.

Shared memory (shm.py): a dense push to a server on this host that is not fused with
small ones goes as a bare SHM header once its data is in the key's shared slot; the headers
that leave together go to each server as one message (fused entries without bytes).
"""
import heapq
import itertools
import time
from typing import NamedTuple

from ...wire.sockets import send
from ...wire.wire import MAX_FUSED, Flag, Header, Msg, pack_fused

FUSABLE_BYTES = 64 * 1024  # larger pushes are sent alone, zero-copy
FUSION_CYCLE = 0.001  # seconds a fusable push may wait for others to fill its message (Horovod's cycle)


def fusable(push, fusion_bytes):
    """A dense push small enough to share a FUSED message (the rest go alone, zero-copy)."""
    return not push.compressed and push.dest is not None and push.nbytes <= FUSABLE_BYTES \
        and push.nbytes < fusion_bytes


def fusion_buckets(pushes, fusion_bytes):
    """The FUSED messages of fusable ``pushes`` (in send order): one per server, dtype and step
    context, each of at most ``fusion_bytes``; a bucket that would overflow is closed first.
    Returns the buckets in the order they are sent (scripts/scale_on_paper.py counts them)."""
    buckets, closed = {}, []  # (server, dtype, context) -> [pushes, their bytes]
    for push in pushes:
        bucket = buckets.setdefault((push.part.server, push.dtype, push.context), [[], 0])
        if bucket[1] + push.nbytes > fusion_bytes:
            closed.append(bucket[0])
            bucket[:] = [[], 0]
        bucket[0].append(push)
        bucket[1] += push.nbytes
    return closed + [pushes for pushes, _ in buckets.values()]


class Queued(NamedTuple):
    """A push in the heap: the highest priority first, then the first posted (``seq``)."""
    neg_priority: int
    seq: int
    push: "Push"


class Push:
    """One partition of one push_pull, from queueing to reply."""

    __slots__ = ("handle", "part", "round", "payload", "compressed", "context", "priority", "dtype",
                 "dest", "sent_at", "shared", "nbytes")

    def __init__(self, handle, part, payload, compressed, context, priority, dtype, dest):
        """``context``: the encoded step context section (wire.encode_context)."""
        self.handle, self.part, self.payload, self.compressed = handle, part, payload, compressed
        self.context, self.priority, self.dtype, self.dest = context, priority, dtype, dest
        self.round = part.round
        self.sent_at = None
        self.shared = False  # its data is in its key's shared slot
        self.nbytes = memoryview(payload).nbytes  # read many times by the window and fusion


class PushSending:
    """The pushes' way out, on the I/O thread: ``enqueue`` (a posted push into the priority
    heap), ``send_ready`` (every tick: send while the window allows, fused, alone or through
    shared memory), ``poll_timeout`` (how long the loop may sleep with fusable pushes queued);
    ``prefill`` on the pushing thread. Records what it sent in ``flight`` (inflight.py)."""

    def __init__(self, links, shm, counters, rank, window, fusion_bytes, flight):
        """``links``: a DEALER socket per server; ``shm``: shm.SharedSlots; ``counters``: the
        worker's (comm.metrics.Counters); ``window``: bytes in flight before pushes wait;
        ``fusion_bytes``: a FUSED message's most (0: no fusion); ``flight``: inflight.InFlight."""
        self.links, self.shm, self.counters, self.rank = links, shm, counters, rank
        self.window, self.fusion_bytes, self.flight = window, fusion_bytes, flight
        self.inflight, self.failed_keys = flight.inflight, flight.failed_keys  # dicts, changed in place
        self.fusable_bytes = 0  # queued in the heap
        self.fusion_due = None  # when queued fusable pushes go even if their message is not full
        self.heap, self.seq = [], itertools.count()

    def enqueue(self, push):
        """A posted push into the heap (on the I/O thread); a fusable one starts the fusion
        cycle if none runs."""
        heapq.heappush(self.heap, Queued(-push.priority, next(self.seq), push))
        if self.fusable(push):
            self.fusable_bytes += push.nbytes
            if self.fusion_due is None:
                self.fusion_due = time.perf_counter() + FUSION_CYCLE

    def poll_timeout(self, idle_ms):
        """Milliseconds to wait for sockets: until queued fusable pushes are due, if they are
        not yet (once due, only a full window holds them, and replies wake the poll)."""
        if self.fusion_due is not None:
            left = self.fusion_due - time.perf_counter()
            if left > 0:
                return max(1, min(idle_ms, int(left * 1000 + 1)))
        return idle_ms

    def fusable(self, push):
        return fusable(push, self.fusion_bytes)

    def send_ready(self):
        shared = {}  # (server, dtype, context) -> pushes whose data is in shared memory
        while self.heap and (self.flight.inflight_bytes < self.window or not self.inflight):
            if self.fusable(self.heap[0].push):
                if self.fusable_bytes < self.fusion_bytes and time.perf_counter() < self.fusion_due:
                    break  # let the pushes posted with it join its message
                self.send_fused()
                continue
            push = heapq.heappop(self.heap).push
            if self.refused(push):
                continue
            self.sent(push)
            if self.shm.take(push):
                shared.setdefault((push.part.server, push.dtype, push.context), []).append(push)
            else:
                self.send_alone(push)
        for batch in shared.values():
            self.send_shared(batch)

    def refused(self, push):
        if push.part.key in self.failed_keys:
            push.handle.fail(ValueError(self.failed_keys[push.part.key]))
            return True
        return False

    def sent(self, push):
        push.sent_at = time.perf_counter()
        self.inflight[push.part.key] = push
        self.flight.inflight_bytes += push.nbytes

    def send_fused(self):
        """Send every queued fusable push (the priority window), in priority order, one
        message per server, dtype and step context, each of at most fusion_bytes."""
        queued = sorted(item for item in self.heap if self.fusable(item.push))
        self.heap = [item for item in self.heap if not self.fusable(item.push)]
        heapq.heapify(self.heap)
        self.fusable_bytes = 0
        self.fusion_due = None
        pushes = [item.push for item in queued if not self.refused(item.push)]
        for push in pushes:
            self.sent(push)
        for bucket in fusion_buckets(pushes, self.fusion_bytes):
            self.send_bucket(bucket)

    def fail_all(self, error):
        """Fail every push still queued here (the I/O thread failed: none will be sent)."""
        for item in self.heap:
            item.push.handle.fail(error)
        self.heap.clear()

    def prefill(self, push):
        """On the pushing thread: a push that will go alone is copied into its shared slot now."""
        if not self.fusable(push):
            self.shm.prefill(push)

    def send_shared(self, batch):
        """Pushes whose data is in shared memory, to one server: bare headers, as one message
        (fused entries without bytes) of at most MAX_FUSED."""
        for start in range(0, len(batch), MAX_FUSED):
            chunk = batch[start:start + MAX_FUSED]
            push = chunk[0]
            self.counters.add(messages=1, shared_bytes=sum(p.nbytes for p in chunk))
            if len(chunk) == 1:
                header = Header(Msg.PUSH, self.rank, key=push.part.key, round=push.round, dtype=push.dtype,
                                flags=Flag.SHM, context=push.context)
                send(self.links[push.part.server], header)
                continue
            header = Header(Msg.PUSH, self.rank, dtype=push.dtype, flags=Flag.FUSED | Flag.SHM,
                            context=push.context)
            send(self.links[push.part.server], header, pack_fused([(p.part.key, p.round, b"") for p in chunk]))

    def send_alone(self, push):
        """One partition in one message, with its payload."""
        self.counters.add(messages=1)
        header = Header(Msg.PUSH, self.rank, key=push.part.key, round=push.round, dtype=push.dtype,
                        flags=Flag.COMPRESSED if push.compressed else Flag.NONE, context=push.context)
        send(self.links[push.part.server], header, push.payload)

    def send_bucket(self, bucket):
        if not bucket:
            return
        push = bucket[0]
        if len(bucket) == 1:
            return self.send_alone(push)
        self.counters.add(messages=1)
        header = Header(Msg.PUSH, self.rank, dtype=push.dtype, flags=Flag.FUSED, context=push.context)
        send(self.links[push.part.server], header,
             pack_fused([(p.part.key, p.round, p.payload) for p in bucket]))
