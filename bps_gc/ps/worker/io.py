"""The worker's I/O thread: the only thread touching its sockets.

Other threads post commands (declare a key, push a partition, barrier, goodbye) and wake it
through a pipe. Its parts send the pushes (``sending``, push.py: the priority window, fusion,
shared memory) and take the servers' replies (``replies``, replies.py); what both touch, the
pushes awaiting their replies, is one ``inflight.InFlight`` (``flight``).
"""
import collections
import logging
import queue
import threading
import time
from typing import NamedTuple

import zmq

from ...comm import NodeFailure
from ...wire import congestion
from ...wire.sockets import DropLog, peer_endpoint, send
from ...wire.wire import Header, Msg, encode_json
from ..membership.event_loop import EventLoop, queued
from .codec_state import StateRequests
from .commands import Barrier, Goodbye, InitKey, LocalSummed, SendPush, SendState, StartLocal
from .elastic import CloseGroup
from .inflight import InFlight
from .push import PushSending
from .replies import Replies
from .shm import SharedSlots

log = logging.getLogger("bps_gc.worker")


class BarrierWait(NamedTuple):
    """A barrier this worker joined: its ``number`` (1, 2, ... in joining order) and the Event
    its caller waits on."""
    number: int
    done: threading.Event


class WorkerIO:
    """Any thread: ``post``/``queue`` a command (commands.py), ``prefill`` a push's shared slot; ``failure``
    (set once the thread failed), ``done`` (set once it ended), ``close``. The I/O thread
    (``thread``) runs the event loop over the servers' sockets, the scheduler's and the local
    sums' router."""

    def __init__(self, ctx, cfg, auth, membership, servers, rank, window, counters, local_reduce=None):
        """``local_reduce``: the workers' shared-memory sums (local.py), if this job has them."""
        self.cfg, self.membership, self.rank = cfg, membership, rank
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
        self.dropped = DropLog(log)
        self.flight = InFlight()
        self.sending = PushSending(self.links, self.shm, counters, rank, window, cfg.fusion_bytes, self.flight)
        self.state_requests = StateRequests(self.links, rank)  # checkpoints: a key's server state
        self.replies = Replies(self.shm, self.flight, self.dropped, self.state_requests)
        self.prefill = self.sending.prefill  # on the pushing thread: bound, a call costs no more
        self.commands = queue.SimpleQueue()
        self.loop = EventLoop(cfg.heartbeat_interval)
        self.loop.wakeable(lambda: True if self.run_commands() else None)
        for sock in self.links:
            self.loop.on_readable(sock, lambda sock=sock: self.receive_some(sock))
        self.loop.on_readable(membership.sock, self.scheduler_message)
        self.local_reduce = local_reduce
        if local_reduce is not None:
            local_reduce.summed = lambda local, rnd: self.queue(LocalSummed(local, rnd))
            self.loop.on_readable(local_reduce.router, self.receive_local)
        self.loop.on_tick(membership.tick)
        self.loop.on_tick(self.sending.send_ready)
        if local_reduce is not None:  # after every handler of the pass: its notes go out together
            self.loop.on_tick(local_reduce.flush)
            self.loop.on_tick(local_reduce.check)
        self.loop.poll_timeout = self.sending.poll_timeout
        self.failure = None
        self.barriers_wanted = 0
        self.inits_posted, self.inits_lock = 0, threading.Lock()  # post_declaration's (wait_declared)
        self.barrier_waiters = collections.deque()  # BarrierWait, oldest first
        self.handlers = {SendPush: lambda c: self.sending.enqueue(c.push),
                         StartLocal: lambda c: self.local_reduce.start(c),
                         LocalSummed: lambda c: self.local_reduce.after_sum(c.local, c.round),
                         InitKey: self.init_key,
                         SendState: lambda c: self.state_requests.send(c.request),
                         Barrier: self.join_barrier,
                         Goodbye: lambda c: self.goodbye(c.timeout)}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, name="bps_gc-io", daemon=True)

    def elastic(self, rounds):
        """BPS_GC_ELASTIC: replies are held by round group (elastic.ElasticRounds)."""
        self.replies.elastic = rounds
        self.handlers[CloseGroup] = rounds.closing

    # ------------------------------------------------------------------ any thread

    def post(self, command):
        """Hand ``command`` (one of commands.py's) to the I/O thread; raises its failure if it failed."""
        if self.failure is not None:
            raise self.failure
        self.queue(command)

    def post_declaration(self, init):
        """``post`` an InitKey of the worker's own declarations, counted for ``wait_declared``."""
        with self.inits_lock:  # any thread may declare
            self.inits_posted += 1
        self.post(init)

    def wait_declared(self, check_alive):
        """Until the servers answered every declaration posted so far (accepted or refused). A
        barrier waits for it: a server reads each worker's socket on its own, so without it a
        host-mate could ask for a key's state before the owner's INIT reached the server."""
        while self.replies.init_acks + len(self.flight.failed_keys) < self.inits_posted:
            check_alive()
            time.sleep(0.002)

    def failure_within(self, seconds, poll):
        """The job's failure once the I/O thread has it, waited for up to ``seconds``; None if
        none came."""
        deadline = time.monotonic() + seconds
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(poll)
        return self.failure

    def queue(self, command):
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
            self.replies.receive(sock)
            if not sock.poll(0):
                break

    def scheduler_message(self):
        self.membership.receive()
        self.check_barrier()

    def run_commands(self):
        """Apply queued commands; True when the thread should stop."""
        for command in queued(self.commands):
            self.handlers[type(command)](command)
            if type(command) is Goodbye:
                return True
        return False

    def init_key(self, command):
        declaration = self.shm.offer(command.key, command.server, command.dtype, command.declaration)
        send(self.links[command.server], Header(Msg.INIT, self.rank, key=command.key, dtype=command.dtype),
             encode_json(declaration))

    def join_barrier(self, command):
        self.barriers_wanted += 1
        self.barrier_waiters.append(BarrierWait(self.barriers_wanted, command.done))
        self.membership.send(Msg.BARRIER, key=0)

    def check_barrier(self):
        # each barrier has its own event, set only once the scheduler has completed it: one
        # shared event, cleared by the caller, was set again by any scheduler message that came
        # before the new barrier was counted, and that barrier returned at once
        done = self.membership.barriers_done.get(0, 0)
        while self.barrier_waiters and self.barrier_waiters[0].number <= done:
            self.barrier_waiters.popleft().done.set()

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
        self.flight.fail_all(error)
        self.sending.fail_all(error)
        if self.local_reduce is not None:
            self.local_reduce.fail_all(error)
        for waiter in self.barrier_waiters:  # their callers raise self.failure
            waiter.done.set()
        self.barrier_waiters.clear()
        # commands posted but not yet taken off the queue
        for command in queued(self.commands):
            match command:
                case SendPush(push=push):
                    push.handle.fail(error)
                case StartLocal(handle=handle):
                    handle.fail(error)
                case Barrier(done=done):
                    done.set()

    def close(self):
        for sock in self.links:
            sock.close(linger=500)
        self.loop.close()
        self.shm.close()
        if self.local_reduce is not None:
            self.local_reduce.close()
