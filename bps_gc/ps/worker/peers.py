"""Worker-to-worker messages with no server in the path (``Worker.send`` / ``Worker.recv``).

Each worker process binds one ROUTER socket (its address travels in REGISTER, so the
scheduler's address book lists it) and connects one DEALER to each peer it sends to, on
first use. Messages are ordinary bps_gc frames (type PEER; key: a 64-bit hash of the channel
name; round: the sequence number on that (sender, channel)), under the job's token. One TCP
connection per ordered pair keeps the messages of each (peer, name) in order.

No thread of its own: ``send`` and ``recv`` run on the caller's thread under one lock, and
``recv`` drains the socket into per-(peer, channel) queues while it waits. The wait is bounded
by the cluster's health: a peer the scheduler declares dead (heartbeats) or that said goodbye
ends it with a NodeFailure naming the peer.
"""
import collections
import hashlib
import threading
import time

import numpy as np
import zmq

from ...comm import NodeFailure
from ...wire import congestion
from ...wire.sockets import DropLog, MalformedMessage, bind, recv, send
from ...wire.wire import HEADER, Header, Msg

POLL_SECONDS = 0.05  # how often a waiting recv looks at the cluster's health


def channel(name):
    """The 64-bit wire key of a channel name (every worker derives the same)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"peer channel name must be a non-empty string, got {name!r}")
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


class Peers:
    def __init__(self, ctx, cfg, auth, rank, size, host, log):
        self.ctx, self.cfg, self.auth, self.rank, self.size = ctx, cfg, auth, rank, size
        self.dropped = DropLog(log)
        self.lock = threading.Lock()
        self.queues = collections.defaultdict(collections.deque)  # (rank, key) -> payloads
        self.sent = collections.Counter()  # (rank, key) -> next sequence number to send
        self.expected = collections.Counter()  # (rank, key) -> next sequence number to receive
        self.links = {}  # rank -> DEALER
        self.addresses = {}
        self.health = lambda: None  # set by connect: the failure to raise, else None
        self.left = {}  # set by connect: worker rank -> its goodbye (filled by the membership)
        self.router = None
        self.port = 0
        if ctx is not None:
            self.router = auth.server(ctx.socket(zmq.ROUTER))
            self.router.setsockopt(zmq.LINGER, 0)
            congestion.watch(self.router, cfg.tcp_congestion)
            self.port = bind(self.router, host, 0, HEADER.size + cfg.peer_max_bytes, "worker peer socket")

    def connect(self, workers, health, left):
        """``workers``: the address book's worker entries (by rank); ``health()``: the
        NodeFailure that ends every wait (or None); ``left``: ranks that said goodbye."""
        self.addresses = {w["rank"]: w["address"] for w in workers}
        self.health, self.left = health, left

    # ------------------------------------------------------------------ public

    def send(self, rank, name, payload):
        """Queue ``payload`` (bytes-like or a numpy array) for worker ``rank`` on channel ``name``."""
        self.check_rank(rank, "send")
        key = channel(name)
        data = np.ascontiguousarray(payload).view(np.uint8).reshape(-1) \
            if isinstance(payload, np.ndarray) else np.frombuffer(memoryview(payload).cast("B"), np.uint8)
        if data.nbytes > self.cfg.peer_max_bytes:
            raise ValueError(f"send to worker {rank} on {name!r}: {data.nbytes} bytes exceed "
                             f"BPS_GC_PEER_MAX_BYTES={self.cfg.peer_max_bytes}")
        failure = self.health()
        if failure is not None:
            raise failure
        with self.lock:
            seq = self.sent[(rank, key)]
            self.sent[(rank, key)] += 1
            if rank == self.rank:
                self.queues[(rank, key)].append(data.copy())
                self.expected[(rank, key)] += 1
                return
            header = Header(Msg.PEER, self.rank, key=key, round=seq)
            send(self.link(rank), header, data if data.nbytes else None)

    def recv(self, rank, name, timeout=None):
        """The next message from worker ``rank`` on channel ``name``, as a uint8 array."""
        self.check_rank(rank, "recv")
        key = channel(name)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self.lock:
                self.drain(0)
                queue = self.queues.get((rank, key))
                if queue:
                    return queue.popleft()
                failure = self.health() or self.gone(rank, name)
                if failure is not None:
                    raise failure
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"recv from worker {rank} on {name!r}: nothing after {timeout} s")
                self.drain(POLL_SECONDS)

    def close(self):
        for sock in self.links.values():
            sock.close(linger=500)
        if self.router is not None:
            self.router.close(linger=0)
        self.links.clear()

    def renew(self, rank, address):
        """Another process now holds worker ``rank`` (a host joining an elastic job): a link to
        its address, and sequence numbers from 0 both ways, as that process counts them. Else a
        join after one cancelled once the donor had sent (the same channel: the epoch is numbered
        again) reaches the new process numbered on from the old one's, and is dropped."""
        with self.lock:
            self.addresses[rank] = address
            old = self.links.pop(rank, None)
            if old is not None:
                old.close(linger=0)
            for counts in (self.sent, self.expected, self.queues):
                for where in [w for w in counts if w[0] == rank]:
                    del counts[where]

    # ------------------------------------------------------------------ internals

    def check_rank(self, rank, what):
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.size:
            raise ValueError(f"{what}: worker rank {rank!r} outside [0, {self.size})")

    def gone(self, rank, name):
        """A NodeFailure when ``rank`` can never send again (set by the membership)."""
        if rank in self.left:
            return NodeFailure(f"worker {rank} left the job: recv on {name!r} from it cannot complete")
        return None

    def link(self, rank):
        sock = self.links.get(rank)
        if sock is None:
            if rank not in self.addresses:
                raise NodeFailure(f"worker {rank} has no peer address in the address book")
            sock = self.auth.client(self.ctx.socket(zmq.DEALER))
            sock.setsockopt(zmq.IDENTITY, f"p{self.rank}".encode())
            sock.setsockopt(zmq.LINGER, 500)
            congestion.watch(sock, self.cfg.tcp_congestion)
            sock.connect(f"tcp://{self.addresses[rank]}")
            self.links[rank] = sock
        return sock

    def drain(self, wait):
        """Move every message waiting on the socket into its queue (waits up to ``wait`` s)."""
        if self.router is None or not self.router.poll(int(wait * 1000)):
            return
        while self.router.poll(0):
            try:
                msg = recv(self.router, router=True)
                self.accept(msg)
            except MalformedMessage as e:
                self.dropped("a peer message: %s", e)

    def accept(self, msg):
        h = msg.header
        if h.type != Msg.PEER or msg.identity != f"p{h.sender}".encode() or not 0 <= h.sender < self.size:
            raise MalformedMessage(f"{h} from {msg.identity!r} is not a peer message")
        where = (h.sender, h.key)
        if h.round != self.expected[where]:
            raise MalformedMessage(f"peer message {h.round} from worker {h.sender}, expected {self.expected[where]}")
        self.expected[where] += 1
        payload = msg.payload if msg.payload is not None else b""
        self.queues[where].append(np.frombuffer(payload, np.uint8).copy() if payload else np.empty(0, np.uint8))
