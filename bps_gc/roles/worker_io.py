"""The worker's I/O thread: the only thread touching its sockets.

Other threads post commands (declare a key, push a partition, barrier, goodbye) and wake it
through a pipe. Pushes wait in a priority heap and are sent while the bytes in flight stay
under a window, so high-priority tensors overtake queued ones; dense replies are received
straight into the caller's output buffer.
"""
import heapq
import itertools
import logging
import queue
import threading
import time

import zmq

from ..transport.sockets import DropLog, MalformedMessage, recv, send
from ..transport.wire import Header, Msg, decode_json, encode_json
from . import NodeFailure
from .event_loop import EventLoop

log = logging.getLogger("bps_gc.worker")


class Push:
    """One partition of one push_pull, from queueing to reply."""

    __slots__ = ("handle", "part", "round", "payload", "compressed", "lr", "priority", "dtype",
                 "dest", "sent_at")

    def __init__(self, handle, part, payload, compressed, lr, priority, dtype, dest):
        self.handle, self.part, self.payload, self.compressed = handle, part, payload, compressed
        self.lr, self.priority, self.dtype, self.dest = lr, priority, dtype, dest
        self.round = part.round
        self.sent_at = None

    @property
    def nbytes(self):
        return memoryview(self.payload).nbytes


class WorkerIO:
    def __init__(self, ctx, cfg, auth, membership, servers, rank, window):
        self.cfg, self.membership, self.rank, self.window = cfg, membership, rank, window
        self.links = []
        for server in servers:
            sock = auth.client(ctx.socket(zmq.DEALER))
            sock.setsockopt(zmq.IDENTITY, f"w{rank}".encode())
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.connect(f"tcp://{server['address']}")
            self.links.append(sock)
        self.servers = servers
        self.commands = queue.SimpleQueue()
        self.loop = EventLoop(cfg.heartbeat_interval)
        self.loop.wakeable(lambda: True if self.run_commands() else None)
        for sock in self.links:
            self.loop.on_readable(sock, lambda sock=sock: self.receive_some(sock))
        self.loop.on_readable(membership.sock, self.scheduler_message)
        self.loop.on_tick(membership.tick)
        self.loop.on_tick(self.send_ready)
        self.heap, self.seq = [], itertools.count()
        self.inflight = {}  # key -> Push awaiting its reply
        self.inflight_bytes = 0
        self.failed_keys = {}  # key -> the server's error for its declaration
        self.failure = None
        self.dropped = DropLog(log)
        self.barriers_wanted = 0
        self.barrier_event = threading.Event()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, name="bps_gc-io", daemon=True)

    # ------------------------------------------------------------------ any thread

    def post(self, *command):
        if self.failure is not None:
            raise self.failure
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
            elif kind == "init":
                _, key, server, dtype, decl = command
                send(self.links[server], Header(Msg.INIT, self.rank, key=key, dtype=dtype), encode_json(decl))
            elif kind == "barrier":
                self.barriers_wanted += 1
                self.membership.send(Msg.BARRIER, key=0)
            elif kind == "goodbye":
                self.goodbye(command[1])
                return True

    def send_ready(self):
        while self.heap and (self.inflight_bytes < self.window or not self.inflight):
            _, _, push = heapq.heappop(self.heap)
            key = push.part.key
            if key in self.failed_keys:
                push.handle.fail(ValueError(self.failed_keys[key]))
                continue
            flags = 1 if push.compressed else 0
            header = Header(Msg.PUSH, self.rank, key=key, round=push.round, lr=push.lr,
                            dtype=push.dtype, flags=flags)
            push.sent_at = time.perf_counter()
            send(self.links[push.part.server], header, push.payload)
            self.inflight[key] = push
            self.inflight_bytes += push.nbytes

    def receive(self, sock):
        def buffer_for(header):
            push = self.inflight.get(header.key)
            if header.type != Msg.PUSH_REPLY or push is None:
                return None
            if header.round != push.round:
                raise MalformedMessage(f"reply for key {header.key} round {header.round}, expected {push.round}")
            if header.flags or push.dest is None:
                return None  # compressed: decoded by the pool
            if header.length != push.dest.nbytes:
                raise MalformedMessage(f"reply for key {header.key} of {header.length} bytes, expected {push.dest.nbytes}")
            return push.dest

        seen = {}

        def checked_buffer_for(header):
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
            return
        push = self.inflight.pop(h.key, None)
        if push is None or h.type != Msg.PUSH_REPLY:
            self.dropped("an unexpected %s for key %d", h.type.name, h.key)
            return
        self.inflight_bytes -= push.nbytes
        push.part.round += 1
        push.handle.partition_replied(push, msg.payload, bool(h.flags), time.perf_counter() - push.sent_at)

    def check_barrier(self):
        done = self.membership.barriers_done.get(0, 0)
        if self.barriers_wanted and done >= self.barriers_wanted:
            self.barrier_event.set()

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
        self.barrier_event.set()
        # pushes posted but not yet taken off the queue
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "push":
                command[1].handle.fail(error)

    def close(self):
        for sock in self.links:
            sock.close(linger=500)
        self.loop.close()
