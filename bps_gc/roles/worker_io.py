"""The worker's I/O thread: the only thread touching its sockets.

Other threads post commands (declare a key, push a partition, barrier, goodbye) and wake it
through a pipe. Pushes wait in a priority heap and are sent while the bytes in flight stay
under a window, so high-priority tensors overtake queued ones; dense replies are received
straight into the caller's output buffer.

Fusion: dense pushes of at most FUSABLE_BYTES that are queued together (one priority window)
go to their server as one FUSED message of up to BPS_GC_FUSION_BYTES (0: off), as Horovod's
fusion buffer and DDP's buckets do. A fusable push waits at most FUSION_CYCLE for the others
posted with it; the server answers their rounds with fused replies. Each
key keeps its own round, so workers need not fuse alike.

Shared memory (worker_shm.py): a dense push to a server on this host that is not fused with
small ones goes as a bare SHM header once its data is in the key's shared slot; the headers
that leave together go to each server as one message (fused entries without bytes).
"""
import collections
import heapq
import itertools
import logging
import queue
import threading
import time

import zmq

from ..transport import congestion
from ..transport.sockets import DropLog, MalformedMessage, peer_endpoint, recv, send
from ..transport.wire import (COMPRESSED_BIT, FUSED_BIT, MAX_FUSED, SHM_BIT, Flag, Header, Msg, decode_json,
                              encode_json, pack_fused, unpack_fused)
from . import NodeFailure
from .event_loop import EventLoop
from .worker_shm import SharedSlots

log = logging.getLogger("bps_gc.worker")
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


class WorkerIO:
    def __init__(self, ctx, cfg, auth, membership, servers, rank, window, counters, local_reduce=None):
        """``local_reduce``: the workers' shared-memory sums (worker_local.py), if this job has them."""
        self.cfg, self.membership, self.rank, self.window = cfg, membership, rank, window
        self.counters = counters
        self.fusion_bytes = cfg.fusion_bytes
        self.fusable_bytes = 0  # queued in the heap
        self.fusion_due = None  # when queued fusable pushes go even if their message is not full
        self.links, self.local = [], []
        for server in servers:
            sock = auth.client(ctx.socket(zmq.DEALER))
            sock.setsockopt(zmq.IDENTITY, f"w{rank}".encode())
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            # a server on this host: over a unix socket (half the kernel work of TCP loopback)
            endpoint = peer_endpoint(server, membership.host)
            local = endpoint.startswith("ipc://")
            if not local:  # a unix socket has no congestion control
                congestion.watch(sock, cfg.tcp_congestion)
            sock.connect(endpoint)
            self.links.append(sock)
            self.local.append(local)
        self.shm = SharedSlots(cfg, self.local)
        self.servers = servers
        self.commands = queue.SimpleQueue()
        self.loop = EventLoop(cfg.heartbeat_interval)
        self.loop.wakeable(lambda: True if self.run_commands() else None)
        for sock in self.links:
            self.loop.on_readable(sock, lambda sock=sock: self.receive_some(sock))
        self.loop.on_readable(membership.sock, self.scheduler_message)
        self.local_reduce = local_reduce
        if local_reduce is not None:
            local_reduce.summed = lambda local, rnd: self.queue("local_summed", local, rnd)
            self.loop.on_readable(local_reduce.router, self.receive_local)
        self.loop.on_tick(membership.tick)
        self.loop.on_tick(self.send_ready)
        if local_reduce is not None:  # after every handler of the pass: its notes go out together
            self.loop.on_tick(local_reduce.flush)
            self.loop.on_tick(local_reduce.check)
        self.loop.poll_timeout = self.poll_timeout
        self.heap, self.seq = [], itertools.count()
        self.inflight = {}  # key -> Push awaiting its reply
        self.inflight_bytes = 0
        self.failed_keys = {}  # key -> the server's error for its declaration
        self.failure = None
        self.dropped = DropLog(log)
        self.barriers_wanted = 0
        self.barrier_waiters = collections.deque()  # (barrier number, its Event), oldest first
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, name="bps_gc-io", daemon=True)

    # ------------------------------------------------------------------ any thread

    def post(self, *command):
        if self.failure is not None:
            raise self.failure
        self.queue(*command)

    def queue(self, *command):
        """``post`` without the failure check (the codec pool's completions: fail_all has
        failed their push_pulls already)."""
        self.commands.put(command)
        self.loop.wake()

    # ------------------------------------------------------------------ I/O thread

    def run(self):
        try:
            self.loop.run(on_failure=self.fail_all)
        except Exception as e:  # a bug here must not leave callers waiting forever
            log.exception("worker I/O thread crashed")
            self.fail_all(NodeFailure(f"worker {self.rank}: I/O thread crashed: {e!r}"))
        finally:
            self.done.set()

    def receive_local(self):
        for _ in range(256):  # bounded, as receive_some
            self.local_reduce.receive()
            if not self.local_reduce.router.poll(0):
                break

    def receive_some(self, sock):
        for _ in range(256):  # bounded so heartbeats and other links keep flowing
            self.receive(sock)
            if not sock.poll(0):
                break

    def scheduler_message(self):
        self.membership.receive()
        self.check_barrier()

    def run_commands(self):
        """Apply queued commands; True when the thread should stop."""
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return False
            kind = command[0]
            if kind == "push":
                push = command[1]
                heapq.heappush(self.heap, (-push.priority, next(self.seq), push))
                if self.fusable(push):
                    self.fusable_bytes += push.nbytes
                    if self.fusion_due is None:
                        self.fusion_due = time.perf_counter() + FUSION_CYCLE
            elif kind == "local":
                self.local_reduce.start(*command[1:])
            elif kind == "local_summed":
                self.local_reduce.after_sum(*command[1:])
            elif kind == "init":
                _, key, server, dtype, decl = command
                decl = self.shm.offer(key, server, dtype, decl)
                send(self.links[server], Header(Msg.INIT, self.rank, key=key, dtype=dtype), encode_json(decl))
            elif kind == "barrier":
                self.barriers_wanted += 1
                self.barrier_waiters.append((self.barriers_wanted, command[1]))
                self.membership.send(Msg.BARRIER, key=0)
            elif kind == "goodbye":
                self.goodbye(command[1])
                return True

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
        while self.heap and (self.inflight_bytes < self.window or not self.inflight):
            if self.fusable(self.heap[0][2]):
                if self.fusable_bytes < self.fusion_bytes and time.perf_counter() < self.fusion_due:
                    break  # let the pushes posted with it join its message
                self.send_fused()
                continue
            _, _, push = heapq.heappop(self.heap)
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
        self.inflight_bytes += push.nbytes

    def send_fused(self):
        """Send every queued fusable push (the priority window), in priority order, one
        message per server, dtype and step context, each of at most fusion_bytes."""
        queued = sorted(item for item in self.heap if self.fusable(item[2]))
        self.heap = [item for item in self.heap if not self.fusable(item[2])]
        heapq.heapify(self.heap)
        self.fusable_bytes = 0
        self.fusion_due = None
        pushes = [push for _, _, push in queued if not self.refused(push)]
        for push in pushes:
            self.sent(push)
        for bucket in fusion_buckets(pushes, self.fusion_bytes):
            self.send_bucket(bucket)

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

    def receive(self, sock):
        def buffer_for(header):
            push = self.inflight.get(header.key)
            if header.type != Msg.PUSH_REPLY or push is None or header.flags & FUSED_BIT:
                return None
            if header.round != push.round:
                raise MalformedMessage(f"reply for key {header.key} round {header.round}, expected {push.round}")
            if header.flags or push.dest is None:
                return None  # compressed: decoded by the pool; fused: split below
            if header.length != push.dest.nbytes:
                raise MalformedMessage(f"reply for key {header.key} of {header.length} bytes, expected {push.dest.nbytes}")
            return push.dest

        seen = {}

        def checked_buffer_for(header):
            if not header.flags & FUSED_BIT:
                seen["key"] = header.key
            return buffer_for(header)

        try:
            msg = recv(sock, router=False, buffer_for=checked_buffer_for)
        except MalformedMessage as e:
            push = self.inflight.pop(seen.get("key"), None)
            if push is None:
                self.dropped("a malformed reply: %s", e)
                return
            # the reply this push waits for is unusable: fail it rather than wait forever
            self.inflight_bytes -= push.nbytes
            push.handle.fail(ValueError(f"invalid reply from server {push.part.server} for "
                                        f"{push.handle.tensor.name!r}: {e}"))
            return
        h = msg.header
        if h.type == Msg.ERROR:
            info = decode_json(msg.payload or b"{}")
            message = info.get("message", "server error")
            self.failed_keys.setdefault(h.key, message)
            push = self.inflight.pop(h.key, None)
            if push is not None:
                self.inflight_bytes -= push.nbytes
                # a round the job can never finish (a worker left) vs. this worker's mistake
                push.handle.fail(NodeFailure(message) if info.get("job_failed") else ValueError(message))
            return
        if h.type == Msg.INIT_ACK:
            if msg.payload:
                self.shm.accept(h.key, msg.payload)
            return
        if h.type == Msg.PUSH_REPLY and h.flags & FUSED_BIT:
            return self.receive_fused(msg.payload, h.flags & SHM_BIT)
        push = self.inflight.pop(h.key, None)
        if push is None or h.type != Msg.PUSH_REPLY:
            self.dropped("an unexpected %s for key %d", h.type.name, h.key)
            return
        self.inflight_bytes -= push.nbytes
        payload = msg.payload
        if h.flags & SHM_BIT:
            if not push.shared or h.round != push.round:
                push.handle.fail(ValueError(f"invalid reply from server {push.part.server} for "
                                            f"{push.handle.tensor.name!r}: shared memory it was not pushed through"))
                return
            payload = self.shm.result(push)
        push.part.round += 1
        push.handle.partition_replied(push, payload, bool(h.flags & COMPRESSED_BIT),
                                      time.perf_counter() - push.sent_at)

    def receive_fused(self, payload, shared):
        """``shared``: the entries carry no bytes; each result is in its key's shared buffer."""
        try:
            entries = unpack_fused(payload)
        except MalformedMessage as e:
            log.warning("dropped a malformed fused reply: %s", e)
            return
        now = time.perf_counter()
        for key, rnd, data in entries:
            push = self.inflight.get(key)
            if push is None or push.dest is None or rnd != push.round or push.shared != bool(shared) or \
                    data.nbytes != (0 if shared else push.dest.nbytes):
                log.warning("dropped an unexpected fused reply entry for key %d round %d", key, rnd)
                continue
            del self.inflight[key]
            self.inflight_bytes -= push.nbytes
            # the codec pool copies the entry out (a view into the message, or shared memory)
            result = self.shm.result(push) if shared else data
            push.part.round += 1
            push.handle.partition_replied(push, result, False, now - push.sent_at)

    def check_barrier(self):
        # each barrier has its own event, set only once the scheduler has completed it: one
        # shared event, cleared by the caller, was set again by any scheduler message that came
        # before the new barrier was counted, and that barrier returned at once
        done = self.membership.barriers_done.get(0, 0)
        while self.barrier_waiters and self.barrier_waiters[0][0] <= done:
            self.barrier_waiters.popleft()[1].set()

    def goodbye(self, timeout):
        self.membership.send(Msg.GOODBYE)
        deadline = time.monotonic() + timeout
        while not self.membership.said_goodbye and time.monotonic() < deadline:
            if self.membership.sock.poll(100):
                try:
                    self.membership.receive()
                except NodeFailure as e:
                    log.warning("during shutdown: %s", e)
                    return

    def fail_all(self, error):
        self.failure = error
        log.error("%s", error)
        for push in self.inflight.values():
            push.handle.fail(error)
        for _, _, push in self.heap:
            push.handle.fail(error)
        self.inflight.clear()
        self.heap.clear()
        if self.local_reduce is not None:
            self.local_reduce.fail_all(error)
        for _, event in self.barrier_waiters:  # their callers raise self.failure
            event.set()
        self.barrier_waiters.clear()
        # pushes posted but not yet taken off the queue
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "push":
                command[1].handle.fail(error)
            elif command[0] == "local":
                command[3].fail(error)
            elif command[0] == "barrier":
                command[1].set()

    def close(self):
        for sock in self.links:
            sock.close(linger=500)
        self.loop.close()
        self.shm.close()
        if self.local_reduce is not None:
            self.local_reduce.close()
