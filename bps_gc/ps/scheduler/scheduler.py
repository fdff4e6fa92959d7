"""The scheduler: membership, address book, barriers, heartbeats, failures, shutdown.

Node ids: 0 is the scheduler, 1..S the servers (by registration order), then one per worker
process in global-rank order. A node that misses heartbeats for ``heartbeat_timeout`` seconds
is declared dead: every other node is told (NODE_FAILED) and the scheduler exits non-zero.
A registration that cannot be part of the job (a duplicate worker rank, settings that disagree
with the scheduler's, a node that could not start) stops the whole job at once; the scheduler
then stays up for REFUSE_SECONDS to tell late registrants why, so nobody waits out the join
timeout (it exits at once when every node the job declares was told). A worker that says
goodbye while other workers still run is announced (NODE_LEFT), so servers fail the rounds that
still need it at once instead of waiting for it. A worker that trains alone
(ps/worker/lone_worker.py) ends the job: every node exits 0, told why. Until the cluster is
complete the scheduler prints who joined and who has not (assembly.py).
"""
import collections
import logging
import time

import zmq

from ...wire.sockets import CONTROL_MAX_BYTES, Auth, DropLog, MalformedMessage, bind, recv, send
from ...wire.waiting import WaitLines
from ...wire.wire import Header, Msg, decode_json, encode_json
from ..membership.event_loop import EventLoop
from . import registration
from .assembly import assembling, lone_worker_notice
from .epochs import Epochs
from .hosts import WorkerHosts
from .joins import Joins

log = logging.getLogger("bps_gc.scheduler")
SCHEDULER_ID = 0
REFUSE_SECONDS = 3.0


class Member:
    __slots__ = ("identity", "role", "rank", "host", "port", "local", "sums", "node_id", "last_seen", "gone",
                 "joining")

    def __init__(self, identity, role, rank, host, port, local=None, sums=None):
        self.identity, self.role, self.rank, self.host, self.port = identity, role, rank, host, port
        self.local = local  # its same-host endpoint, if it has one
        self.sums = sums  # a server's: the dtypes it adds (an older server's: None, float only)
        self.node_id, self.last_seen, self.gone = None, time.monotonic(), False
        self.joining = False  # BPS_GC_ELASTIC: a worker host joining the running job (joins.py)

    def describe(self):
        info = {"id": self.node_id, "role": self.role, "rank": self.rank,
                "address": f"{self.host}:{self.port}" if self.port else self.host}
        if self.local:
            info["local"] = self.local
        if self.sums is not None:
            info["sums"] = self.sums
        return info


class Scheduler:
    def __init__(self, config):
        self.cfg = config
        # DMLC_NUM_WORKER counts worker hosts; their local ranks are learned at join (ps/scheduler/hosts.py)
        self.hosts = WorkerHosts(config.num_worker)
        self.expected = {"server": config.num_server, "worker": None}
        self.join_timeout = config.join_timeout
        self.members = {}  # identity -> Member
        self.barrier_waiting = collections.Counter()  # worker identity -> its barriers not yet done
        self.ctx = zmq.Context()
        self.auth = Auth(self.ctx, config.auth_token, config.encrypt)
        self.sock = self.auth.server(self.ctx.socket(zmq.ROUTER))
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            bind(self.sock, config.root_uri, config.root_port, CONTROL_MAX_BYTES,
                 "scheduler (DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT)")
        except Exception:
            self.close()
            raise
        self.ready = False
        self.dropped = DropLog(log)
        self.refusal = None  # why the job was stopped at registration
        self.stop_at = None  # when the scheduler exits after such a refusal
        self.told = set()  # identities told of that refusal
        self.told_local_sizes = set()  # BYTEPS_LOCAL_SIZE of the workers told
        self.ended = None  # why the job ended before it assembled, with status 0 (a lone worker)
        self.told_servers = set()  # identities of the servers told so
        self.epochs = Epochs(self) if config.elastic else None  # BPS_GC_ELASTIC: membership epochs
        self.joins = Joins(self, self.epochs) if config.elastic else None  # and hosts joining

    # ------------------------------------------------------------------ main loop

    def run(self):
        """Serve until every node said goodbye (returns 0) or a node failed (returns 1)."""
        self.started = time.monotonic()
        self.waiting = WaitLines(lambda: assembling(self.cfg, self.members.values(), self.hosts), self.join_timeout)
        loop = EventLoop(self.cfg.heartbeat_interval)
        loop.on_readable(self.sock, self.receive)
        loop.on_tick(self.check_time)
        loop.poll_timeout = self.until_deadline
        try:
            return loop.run()
        finally:
            loop.close()
            self.close()

    def receive(self):
        try:
            msg = recv(self.sock, router=True)
        except MalformedMessage as e:
            self.dropped("a malformed message: %s", e)
            return None
        return self.handle(msg)

    def check_time(self):
        """Deadlines: the refusal window, the join timeout, every member's heartbeat."""
        now = time.monotonic()
        if self.stop_at is not None:
            return (0 if self.ended else 1) if now >= self.stop_at else None
        if not self.ready:
            self.waiting.tick()
        if not self.ready and now - self.started > self.join_timeout:
            # before any worker joined, its local size is unknown: this node's BYTEPS_LOCAL_SIZE
            # (usually unset: 1) stands in for it
            expected = dict(self.expected, worker=self.expected["worker"] or self.hosts.num_hosts * self.cfg.local_size)
            missing = {r: n - self.count(r) for r, n in expected.items()}
            return self.fail(None, f"the cluster did not assemble within {self.join_timeout:.0f} s "
                                   f"(still missing: {missing})")
        if self.joins is not None:
            self.joins.overdue(now)  # a joining host's rank that never registers (joins.py)
        dead = self.dead_member(now)
        if dead is not None:
            reason = f"no heartbeat for {self.cfg.heartbeat_timeout:g} s"
            if dead.joining:
                self.joins.left(dead, reason)
                return self.end_if_done(dead)
            if self.epochs is not None and dead.role == "worker":
                if self.joins.step == "go":  # the servers count the joiner: the join ends first
                    return None
                if self.joins.joiners:
                    self.joins.cancel(f"worker {dead.rank} left while it joined")
                return self.epochs.worker_died(dead, reason)
            return self.fail(dead, reason)
        return None

    def until_deadline(self, idle_ms):
        """How long the loop may poll: no later than the next heartbeat deadline. The nodes'
        heartbeats tend to arrive together, once an interval, so a deadline checked only when
        a message comes would notice a silent node up to an interval after its timeout."""
        seen = [m.last_seen for m in self.members.values() if not m.gone] if self.ready else []
        if not seen:
            return idle_ms
        wait = (min(seen) + self.cfg.heartbeat_timeout - time.monotonic()) * 1000
        return min(idle_ms, int(wait) + 1) if wait > 0 else idle_ms  # past it: check_time acted already

    def close(self):
        self.sock.close(linger=1000)
        self.auth.stop()
        self.ctx.term()

    def count(self, role):
        return sum(1 for m in self.members.values() if m.role == role)

    def dead_member(self, now):
        if not self.ready:
            return None
        for m in self.members.values():
            if not m.gone and now - m.last_seen > self.cfg.heartbeat_timeout:
                return m
        return None

    # ------------------------------------------------------------------ messages

    def handle(self, msg):
        h = msg.header
        member = self.members.get(msg.identity)
        if member:
            member.last_seen = time.monotonic()
        if h.type == Msg.REGISTER:
            return self.register(msg)
        if member is None:
            self.dropped("%s from an unregistered peer", h.type.name)
            return None
        if h.type == Msg.HEARTBEAT:
            self.reply(member, Msg.HEARTBEAT_ACK)
        elif h.type == Msg.BARRIER:
            return self.barrier(member)
        elif h.type == Msg.GOODBYE:
            return self.goodbye(member)
        elif h.type in (Msg.EPOCH_REPORT, Msg.JOIN_READY, Msg.EPOCH_AT, Msg.EPOCH_GO) and self.epochs is not None:
            try:
                info = decode_json(msg.payload or b"{}")
                if h.type == Msg.EPOCH_REPORT:
                    self.epochs.report(member, info)
                elif h.type == Msg.JOIN_READY:
                    self.joins.ready(member)
                else:
                    self.joins.arrived(member, info)
            except (MalformedMessage, KeyError, TypeError, ValueError) as e:
                self.dropped("a bad membership message: %s", e)
        elif h.type == Msg.NODE_FAILED:  # a node saw a peer die (e.g. a server's socket error)
            info = decode_json(msg.payload or b"{}")
            return self.fail(None, f"node {member.node_id} reported: {info.get('reason', '?')}")
        else:
            self.dropped("an unexpected %s from node %s", h.type.name, member.node_id)
        return None

    def reply(self, member, mtype, key=0, obj=None):
        payload = None if obj is None else encode_json(obj)
        send(self.sock, Header(mtype, SCHEDULER_ID, key=key), payload, identity=member.identity)

    def register(self, msg):
        try:
            reg = registration.parse(msg.payload)
        except (MalformedMessage, KeyError, TypeError, ValueError) as e:
            self.dropped("a bad registration: %s", e)
            return None
        info, role, rank, host, port, local, sums = reg
        who = reg.who
        if self.refusal:
            self.note_told(msg.identity, info)
            if self.everyone_told():
                self.stop_at = time.monotonic()
            return self.refuse(msg.identity, self.refusal)
        if msg.identity in self.members:
            return None  # a retried registration
        if self.ready and self.joins is not None:  # BPS_GC_ELASTIC: a host may join (joins.py)
            return self.joins.register(msg.identity, info, role, rank, host, port, local, who)
        if self.ready:  # a late or hostile registration must not stop a running job
            return self.refuse(msg.identity, "the cluster is already complete")
        notice = self.ended or lone_worker_notice(info, who)
        if notice:
            return self.end_job(msg.identity, role, notice)
        fatal = registration.fatal(reg, self.cfg.agreement(), self.members.values())
        if fatal:
            return self.stop_job(msg.identity, info, fatal)
        problem = None
        if role not in self.expected:
            problem = f"unknown role {role!r}"
        elif role == "worker":
            fatal, problem = self.hosts.check(info, rank)
            if fatal:
                return self.stop_job(msg.identity, info, fatal)
            self.expected["worker"] = self.hosts.expected_workers()
        if problem is None and role in self.expected and self.count(role) >= self.expected[role]:
            problem = f"more {role}s than the job declares ({self.expected[role]})"
        if problem:
            log.error("refused %s from %s: %s", role, host, problem)
            return self.refuse(msg.identity, problem)
        self.members[msg.identity] = Member(msg.identity, role, rank, host, port, local, sums)
        log.info("%s %s joined from %s:%s", role, rank, host, port)
        self.reply(self.members[msg.identity], Msg.HEARTBEAT_ACK)  # it now waits for the others, not for us
        if all(self.count(r) == n for r, n in self.expected.items()):
            self.publish_address_book()
        return None

    def stop_job(self, identity, info, fatal):
        """Nothing can fix this job: stop every node now, naming the cause."""
        self.refusal = fatal
        self.told = {m.identity for m in self.members.values() if not m.gone}
        self.note_told(identity, info)
        self.refuse(identity, fatal)
        self.fail(None, fatal)
        self.stop_at = time.monotonic() + (0.0 if self.everyone_told() else REFUSE_SECONDS)
        return None

    def note_told(self, identity, info):
        self.told.add(identity)
        if info.get("role") == "worker":
            size = info.get("local_size", 1)
            self.told_local_sizes.add(size if isinstance(size, int) and size >= 1 else None)

    def everyone_told(self):
        """Whether every node the job declares was told of the refusal, so that none can come
        late. The workers' count needs their local size (from a worker that joined or was told);
        hosts that disagree on it leave the count unknown."""
        sizes = self.told_local_sizes | ({self.hosts.local_size} if self.hosts.local_size else set())
        if len(sizes) != 1 or None in sizes:
            return False
        return len(self.told) >= self.hosts.num_hosts * sizes.pop() + self.expected["server"]

    def end_job(self, identity, role, notice):
        """The job's only worker trains alone: every node started for it exits 0 now, told why;
        the scheduler too, once every server was told (else after REFUSE_SECONDS more)."""
        if self.ended is None:
            self.ended = notice
            log.warning("%s; the scheduler exits", notice)
            for m in self.members.values():
                self.reply(m, Msg.SHUTDOWN, obj={"reason": notice})
            self.told_servers = {m.identity for m in self.members.values() if m.role == "server"}
        send(self.sock, Header(Msg.SHUTDOWN, SCHEDULER_ID), encode_json({"reason": notice}), identity=identity)
        if role == "server":
            self.told_servers.add(identity)
        told_all = len(self.told_servers) >= self.expected["server"]
        self.stop_at = time.monotonic() + (0.0 if told_all else REFUSE_SECONDS)
        return None

    def refuse(self, identity, problem):
        send(self.sock, Header(Msg.ERROR, SCHEDULER_ID), encode_json({"message": problem}), identity=identity)
        return None

    def publish_address_book(self):
        servers = [m for m in self.members.values() if m.role == "server"]
        workers = sorted((m for m in self.members.values() if m.role == "worker"), key=lambda m: m.rank)
        for i, m in enumerate(servers):
            m.node_id, m.rank = 1 + i, i
        for m in workers:
            m.node_id = 1 + len(servers) + m.rank
        book = {"servers": [m.describe() for m in servers], "workers": [m.describe() for m in workers],
                **self.hosts.book(self.cfg, workers)}
        for m in self.members.values():
            m.last_seen = time.monotonic()
            self.reply(m, Msg.ADDRESS_BOOK, obj=dict(book, you=m.node_id, rank=m.rank))
        self.ready = True
        log.info("cluster complete: %d servers, %d workers (%d hosts, hierarchy %s)", len(servers),
                 len(workers), self.hosts.num_hosts, book["hierarchy"])

    def barrier(self, member):
        """A barrier of every worker process; one that a departed worker can never join fails."""
        # counted per worker, so that a worker's next barrier is never merged into this one
        self.barrier_waiting[member.identity] += 1
        left = self.departed_worker()
        if left is not None:
            return self.fail(None, f"worker {left.rank} (node {left.node_id}) left the job; "
                                   f"the barrier can never complete")
        if len(self.barrier_waiting) == self.expected["worker"] - len(self.epochs.dead if self.epochs else ()):
            for identity in self.barrier_waiting:
                self.reply(self.members[identity], Msg.BARRIER_DONE, key=0)
            # one barrier done for each worker; a Counter's `-=` drops those now at zero
            self.barrier_waiting -= collections.Counter(self.barrier_waiting.keys())
        return None

    def departed_worker(self):
        dead = self.epochs.dead if self.epochs else ()  # an elastic job went on without them
        return next((m for m in self.members.values() if m.role == "worker" and m.gone
                     and m.rank not in dead), None)

    def goodbye(self, member):
        self.reply(member, Msg.GOODBYE)
        if member.joining:  # refused by a server, or stopped before it was admitted
            self.joins.left(member, "it said goodbye")
            return self.end_if_done(member)
        member.gone = True
        if member.role == "worker" and self.joins is not None:
            self.joins.ending(member)  # a member's goodbye: the job ends, no host may join now
        running = [m for m in self.members.values() if m.role == "worker" and not m.gone]
        if member.role == "worker" and running:
            if self.barrier_waiting:
                return self.fail(None, f"worker {member.rank} (node {member.node_id}) left the job "
                                       f"while the others wait in a barrier")
            # servers fail rounds that still need its push; peers fail receives from it
            for m in self.members.values():
                if not m.gone:
                    self.reply(m, Msg.NODE_LEFT, obj=member.describe())
        return self.end_if_done(member)

    def end_if_done(self, member):
        """After ``member`` left: the last worker gone shuts the servers down; the last node, the scheduler."""
        if member.role == "worker" and all(m.gone for m in self.members.values() if m.role == "worker"):
            for m in self.members.values():
                if m.role == "server" and not m.gone:
                    self.reply(m, Msg.SHUTDOWN)
        if all(m.gone for m in self.members.values()) and self.ready:
            log.info("every node said goodbye; scheduler exits")
            return 0
        return None

    def fail(self, dead, reason):
        """Tell every live node that ``dead`` failed, then stop with status 1."""
        info = dead.describe() if dead else {"id": None, "role": "cluster", "rank": None, "address": ""}
        info["reason"] = reason
        if dead:
            dead.gone = True
            log.error("%s %s (node %s, %s) failed: %s", info["role"], info["rank"], info["id"],
                      info["address"], reason)
        else:
            log.error("the cluster failed: %s", reason)
        for m in self.members.values():
            if not m.gone:
                self.reply(m, Msg.NODE_FAILED, obj=info)
        return 1

