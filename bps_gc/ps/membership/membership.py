"""A node's link to the scheduler: join, address book, heartbeats, barriers, goodbye.

Owned by the node's I/O thread, which polls ``sock`` and calls ``handle`` for what arrives and
``tick`` at least every heartbeat interval. Failures (a dead peer, a silent scheduler) come back
as NodeFailure exceptions naming the node.
"""
import logging
import socket
import time

import numpy as np
import zmq

from ...comm import NodeFailure
from ...wire.sockets import CONTROL_MAX_BYTES, Auth, DropLog, MalformedMessage, recv, send
from ...wire.waiting import WaitLines
from ...wire.wire import SERVER_SUMS, Header, Msg, decode_json, encode_json

log = logging.getLogger("bps_gc.membership")
# a joining node waits this long past BPS_GC_JOIN_TIMEOUT for the scheduler's verdict on it
JOIN_VERDICT_GRACE = 2.0  # seconds


def advertised_host(cfg):
    """The address peers reach this node at: DMLC_NODE_HOST, else the interface's, else the
    local address routing towards the scheduler."""
    if cfg.node_host:
        return cfg.node_host
    if cfg.interface:
        import fcntl
        import struct
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", cfg.interface[:15].encode()))
            except OSError as e:
                raise NodeFailure(f"DMLC_INTERFACE={cfg.interface}: no IPv4 address ({e})") from None
            return socket.inet_ntoa(packed[20:24])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((cfg.root_uri, cfg.root_port))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class JobEnded(Exception):
    """The scheduler ended the job before it assembled, for a reason that is no failure (its
    only worker trains alone): the node exits 0, printing the reason."""


def abort_job(cfg, role, rank, reason):
    """This node cannot start (e.g. a plugin module is missing here): tell the scheduler, which
    stops every node at once naming ``reason``, instead of letting them wait out the join
    timeout for this one. Returns a NodeFailure to raise."""
    tell_scheduler(cfg, role, rank, min(cfg.join_timeout, 3.0), error=reason)  # the refusal confirms delivery
    return NodeFailure(f"this {role} could not start: {reason}")


def tell_scheduler(cfg, role, rank, wait, stop=None, **news):
    """Register with ``news`` added (the scheduler reads them instead of a join) and wait up to
    ``wait`` seconds for its answer, which confirms delivery; ``stop`` (an Event) ends the
    wait early. Returns the type of the scheduler's answer (a Msg), None without one."""
    ctx = zmq.Context()
    auth = Auth(ctx, cfg.auth_token, cfg.encrypt)
    link = Membership(ctx, cfg, auth, role, rank)
    deadline = time.monotonic() + wait
    try:
        link.send(Msg.REGISTER, obj=dict(link.registration(), **news))
        while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            if link.sock.poll(200):
                try:
                    return recv(link.sock, router=False).header.type
                except MalformedMessage:
                    return None
        return None
    finally:
        link.close()
        auth.stop()
        ctx.term()


def describe(info):
    where = f" at {info['address']}" if info.get("address") else ""
    who = "the cluster" if info.get("role") == "cluster" else f"{info.get('role')} {info.get('rank')} (node {info.get('id')}{where})"
    return f"{who} failed: {info.get('reason', 'unknown reason')}"


def phase_words(servers):
    """The words thc's phases are summed in (comm/phased.py ``carrier``): int64, all 64 bits
    (wrapping), when every server's address-book entry says it adds them; else float64, whose
    53 exact bits an older server adds."""
    return np.dtype(np.int64 if all("int64" in (s.get("sums") or ()) for s in servers) else np.float64)


class Membership:
    def __init__(self, ctx, cfg, auth, role, rank, port=0):
        self.cfg, self.role, self.rank = cfg, role, rank
        self.host = advertised_host(cfg)
        self.port = port
        self.local = None
        self.sock = auth.client(ctx.socket(zmq.DEALER))
        self.sock.setsockopt(zmq.LINGER, 500)
        self.sock.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_BYTES)
        self.sock.connect(f"tcp://{cfg.root_uri}:{cfg.root_port}")
        self.node_id = None
        self.book = None
        self.last_ack = self.last_beat = time.monotonic()
        self.shutdown_requested = False
        self.barriers_done = {}
        self.said_goodbye = False
        self.registered = False  # join(): heard from the scheduler
        self.left = {}  # worker rank -> {role, rank, id}: workers that said goodbye before us
        self.dropped = DropLog(log)
        # BPS_GC_ELASTIC: the role's on_epoch(type, info) takes EPOCH_PREPARE and EPOCH_COMMIT
        self.on_epoch = None

    def send(self, mtype, key=0, obj=None):
        send(self.sock, Header(mtype, self.node_id or 0, key=key), None if obj is None else encode_json(obj))

    def registration(self):
        info = {"role": self.role, "rank": self.rank, "host": self.host, "port": self.port,
                "worker_id": self.cfg.worker_id, "local_rank": self.cfg.local_rank,
                "agree": self.cfg.agreement()}
        if self.role == "worker":  # the scheduler learns each host's local ranks from its workers
            # join_timeout: how long a rank joining a running elastic job waits for its host-mates
            info.update(local_size=self.cfg.local_size, hierarchy=self.cfg.hierarchy,
                        join_timeout=self.cfg.join_timeout)
        if self.role == "server":  # workers push int64 words only if every server says it adds them
            info["sums"] = list(SERVER_SUMS)
        if self.local:
            info["local"] = self.local  # the same-host endpoint (sockets.bind_local)
        return info

    def join(self, timeout):
        """Register and wait for the address book (blocking; used before the I/O loop runs)."""
        self.send(Msg.REGISTER, obj=self.registration())
        # the scheduler enforces the same timeout and then tells every registered node what is
        # missing: wait a little past it for that verdict before blaming the scheduler
        deadline = time.monotonic() + timeout + JOIN_VERDICT_GRACE
        lines = WaitLines(self.awaited, timeout)
        while True:
            lines.tick()
            left = deadline - time.monotonic()
            if left <= 0:
                raise NodeFailure(f"could not join the cluster: no answer from the scheduler at "
                                  f"{self.cfg.root_uri}:{self.cfg.root_port} within {timeout:.0f} s")
            if not self.sock.poll(int(min(left, 1.0) * 1000)):
                continue
            try:
                msg = recv(self.sock, router=False)
            except MalformedMessage as e:
                self.dropped("a malformed message from the scheduler: %s", e)
                continue
            self.registered = True  # the scheduler acknowledges a registration (HEARTBEAT_ACK)
            if msg.header.type == Msg.SHUTDOWN and msg.payload:  # the job ends before it assembled
                raise JobEnded(decode_json(msg.payload).get("reason", "the scheduler ended the job"))
            if msg.header.type == Msg.ADDRESS_BOOK:
                self.book = decode_json(msg.payload)
                self.node_id = self.book["you"]
                self.last_ack = time.monotonic()
                return self.book
            self.handle(msg)

    def awaited(self):
        """What join() is waiting for, for its WaitLines."""
        where = f"the scheduler at {self.cfg.root_uri}:{self.cfg.root_port}"
        if not self.registered:
            return f"waiting for {where}"
        return f"joined {where}; waiting for the other nodes (the scheduler's lines name them)"

    def handle(self, msg):
        """Process a scheduler message; raises NodeFailure when the job must stop."""
        h = msg.header
        self.last_ack = time.monotonic()
        if h.type == Msg.NODE_FAILED:
            raise NodeFailure(describe(decode_json(msg.payload or b"{}")))
        if h.type == Msg.ERROR:
            raise NodeFailure(f"the scheduler refused this {self.role}: "
                              f"{decode_json(msg.payload or b'{}').get('message')}")
        if h.type == Msg.SHUTDOWN:
            self.shutdown_requested = True
        elif h.type == Msg.BARRIER_DONE:
            self.barriers_done[h.key] = self.barriers_done.get(h.key, 0) + 1
        elif h.type == Msg.GOODBYE:
            self.said_goodbye = True
        elif h.type in (Msg.EPOCH_PREPARE, Msg.EPOCH_COMMIT, Msg.EPOCH_GO) and self.on_epoch is not None:
            self.on_epoch(h.type, decode_json(msg.payload or b"{}"))
        elif h.type == Msg.NODE_LEFT:
            info = decode_json(msg.payload or b"{}")
            self.left[info.get("rank")] = info
        elif h.type != Msg.HEARTBEAT_ACK:
            self.dropped("an unexpected %s from the scheduler", h.type.name)

    def receive(self):
        """Take one message off the socket (it is readable) and handle it."""
        try:
            msg = recv(self.sock, router=False)
        except MalformedMessage as e:
            self.dropped("a malformed message from the scheduler: %s", e)
            return
        self.handle(msg)

    def tick(self):
        now = time.monotonic()
        if now - self.last_beat >= self.cfg.heartbeat_interval:
            self.send(Msg.HEARTBEAT)
            self.last_beat = now
        if not self.said_goodbye and now - self.last_ack > self.cfg.heartbeat_timeout:
            raise NodeFailure(f"scheduler (node 0 at {self.cfg.root_uri}:{self.cfg.root_port}) failed: "
                              f"no answer for {self.cfg.heartbeat_timeout:g} s")

    def report_failure(self, reason):
        """Tell the scheduler this node saw the job fail (it stops every node, naming ``reason``)."""
        self.send(Msg.NODE_FAILED, obj={"reason": reason})

    def close(self):
        self.sock.close(linger=500)
