"""The server: owns the keys the workers assign to it and answers their push_pulls.

The I/O thread owns every socket and the per-key bookkeeping; engine threads (BYTEPS_SERVER_
ENGINE_THREAD, each key always on the same one) decode, sum, apply error feedback and
recompress, then hand the replies back through an inproc socket that wakes the I/O thread.
The codec library is passed in (the parameter server never imports it): anything with ``CompressionParams``,
``choose_reducer`` and ``make_reducer`` as in ``bps_gc.compress``. A FUSED push (several small
dense keys in one message, see ps/worker/push.py) is split into its keys; the rounds it completes are
answered together, one fused reply per worker.
"""
import logging
import queue
import threading

import numpy as np
import zmq

from ...wire import congestion, shm
from ...wire.sockets import Auth, DropLog, MalformedMessage, bind, bind_local, recv, send
from ...wire.wire import (COMPRESSED_BIT, FUSED_BIT, FUSED_COUNT, FUSED_ENTRY, MAX_FUSED, MAX_JSON, SHM_BIT, Header,
                         Msg, decode_json, encode_context, encode_json, pack_fused, unpack_fused)
from ...comm import NodeFailure
from ..membership.event_loop import EventLoop, queued
from ..membership.membership import Membership
from .key_state import STATE_MESSAGES, answer as answer_state
from .keys import KeyConflict, KeyState
from .records import Reply
from .rounds import ServerRounds, before_compute
from .watch import RoundWatch

log = logging.getLogger("bps_gc.server")
WAKE = "inproc://bps_gc-server-wake"


class Server:
    def __init__(self, cfg, codecs):
        self.cfg, self.codecs = cfg, codecs
        # the keys' reducers share their in-call buffers, kept across rounds (docs/runtime.md
        # "What a server's keys hold")
        self.scratch = codecs.Scratch(kept=True)
        self.ctx = zmq.Context()
        self.auth = Auth(self.ctx, cfg.auth_token, cfg.encrypt)
        self.router = self.auth.server(self.ctx.socket(zmq.ROUTER))
        self.router.setsockopt(zmq.LINGER, 1000)
        self.router.setsockopt(zmq.RCVHWM, 0)
        self.router.setsockopt(zmq.SNDHWM, 0)
        if cfg.elastic:  # a joining host reuses a departed one's identity (w<rank>)
            self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        congestion.watch(self.router, cfg.tcp_congestion)
        self.membership = Membership(self.ctx, cfg, self.auth, "server", rank=-1)
        # the largest legal frame: a compressed partition of fp16 (8 bytes/element at most), a
        # fused message of small dense pushes, or a JSON control message (headers are far smaller)
        largest = max(4 * cfg.partition_bytes + 64, MAX_JSON,
                      FUSED_COUNT.size + MAX_FUSED * FUSED_ENTRY.size + cfg.fusion_bytes) + 4096
        self.membership.port = bind(self.router, self.membership.host, cfg.port, largest, "server (BPS_GC_PORT)")
        if cfg.local_ipc:
            self.membership.local = bind_local(self.router, self.membership.host, self.membership.port)
        self.wake = self.ctx.socket(zmq.PULL)
        self.wake.bind(WAKE)
        self.replies = queue.SimpleQueue()
        self.keys = {}
        self.node_id = None
        self.workers = 0  # pushers of each key: worker processes, or hosts (BPS_GC_HIERARCHY=host)
        self.per_host = 1  # worker processes per pusher of a key (docs/local_ranks.md)
        self.local_size = 1  # worker processes per host
        self.ranks = 0  # worker processes
        self.engines = []
        self.dropped = DropLog(log)
        self.watch = RoundWatch(self)
        self.rounds = ServerRounds(self) if cfg.elastic else None  # BPS_GC_ELASTIC
        # shared memory with workers on this host (wire/shm.py), if they offer it
        self.arena = shm.Arena() if cfg.shm and shm.supported() else None
        self.peer_maps = shm.PeerMaps()

    # ------------------------------------------------------------------ lifecycle

    def run(self):
        """Serve until the scheduler says shut down (returns 0) or the job fails (returns 1)."""
        try:
            book = self.membership.join(self.cfg.join_timeout)
            self.node_id, self.ranks = book["you"], len(book["workers"])
            # two levels: one local rank of each host pushes a key (its host's sum), so the
            # pushes of a key are counted, and kept, per host
            self.local_size = int(book.get("local_size", 1))
            self.per_host = self.local_size if book.get("hierarchy") == "host" else 1
            self.workers = self.ranks // self.per_host
            log.info("server %d (node %d) serving %d workers on %s:%d", book["rank"], self.node_id,
                     self.workers, self.membership.host, self.membership.port)
            self.engines = [Engine(self.ctx, self.replies, self.codecs)
                            for _ in range(self.cfg.server_engine_threads)]
            return self.loop()
        except NodeFailure as e:
            log.error("%s; server exits", e)
            return 1
        finally:
            self.close()

    def close(self):
        for engine in self.engines:
            engine.stop()
        if self.arena is not None:
            self.arena.close()
        for sock in (self.router, self.wake):
            sock.close(linger=500)
        self.membership.close()
        self.auth.stop()
        self.ctx.term()

    def loop(self):
        loop = EventLoop(self.cfg.heartbeat_interval)
        loop.on_readable(self.wake, self.flush_replies)
        loop.on_readable(self.router, self.receive_some)
        loop.on_readable(self.membership.sock, self.scheduler_message)
        loop.on_tick(self.membership.tick)
        loop.on_tick(lambda: self.watch.tick(self.cfg.stall_timeout))
        loop.on_tick(self.shutdown_when_asked)
        return loop.run()

    def receive_some(self):
        for _ in range(64):  # bounded so heartbeats keep flowing under load
            self.receive()
            if not self.router.poll(0):
                break

    def scheduler_message(self):
        left = len(self.membership.left)
        self.membership.receive()
        if len(self.membership.left) != left:
            self.watch.departed()

    def shutdown_when_asked(self):
        if not self.membership.shutdown_requested:
            return None
        self.membership.send(Msg.GOODBYE)
        log.info("server %d: shutdown (dropped %d malformed messages)", self.node_id, self.dropped.count)
        return 1 if self.watch.failed else 0  # a round failed: the job did not end well

    # ------------------------------------------------------------------ requests

    def worker_rank(self, identity, header):
        try:
            text = identity.decode()
            rank = int(text[1:]) if text[:1] == "w" else -1
        except (UnicodeDecodeError, ValueError):
            rank = -1
        if not 0 <= rank < self.ranks or header.sender != rank:
            raise MalformedMessage(f"message from unknown peer {identity!r}")
        return rank

    def receive(self):
        context = {}

        def buffer_for(header):
            rank = self.worker_rank(context["identity"], header)
            if self.rounds is not None:
                self.rounds.admit(rank, header.type)
            if header.type != Msg.PUSH or header.flags & FUSED_BIT:
                return None
            state = self.keys.get(header.key)
            if state is None:
                raise MalformedMessage(f"push of undeclared key {header.key} from worker {rank}")
            return state.buffer_for(state.slot(rank), header)

        try:
            context["identity"] = self.router.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        try:
            msg = recv_rest(self.router, context["identity"], buffer_for)
            rank = self.worker_rank(msg.identity, msg.header)
            if msg.header.type == Msg.INIT:
                self.declare(rank, msg)
            elif msg.header.type == Msg.PUSH:
                self.push(rank, msg)
            elif msg.header.type == Msg.REDO and self.rounds is not None:
                self.rounds.redo(rank, msg.header)
            elif msg.header.type in STATE_MESSAGES:
                answer_state(self, rank, msg)
            else:
                raise MalformedMessage(f"unexpected {msg.header.type.name}")
        except MalformedMessage as e:
            self.dropped("a malformed message: %s", e)

    def error(self, identity, key, message):
        log.error("key %d: %s", key, message)
        send(self.router, Header(Msg.ERROR, self.node_id, key=key), encode_json({"message": message}),
             identity=identity)

    def declare(self, rank, msg):
        h = msg.header
        decl = decode_json(msg.payload or b"")
        if h.dtype is None:
            raise MalformedMessage("INIT without a dtype")
        # bounded before anything is allocated: a bogus INIT cannot make the server allocate more
        # than one partition (BYTEPS_PARTITION_BYTES), tokens or not
        limit = max(1, self.cfg.partition_bytes // np.dtype(h.dtype).itemsize)
        if not isinstance(decl.get("n"), int) or not 0 <= decl["n"] <= limit:
            raise MalformedMessage(f"INIT of key {h.key} with n={decl.get('n')!r} (at most {limit})")
        try:
            state = self.keys.get(h.key)
            if state is None:
                # two levels: one pusher per host, unless the key is pushed by every rank; a
                # key of one local rank's own ("host": an FSDP shard) one per host in either mode
                per_host = {"rank": 1, "host": self.local_size}.get(decl.get("pushers"), self.per_host)
                state = KeyState(h.key, decl, h.dtype, self.ranks // per_host, self.codecs,
                                 self.cfg.enable_async, per_host, self.scratch)
                # each key stays on one engine (its codec state is not shared); the least loaded
                # by bytes takes it (key % engines would follow the partition number)
                state.engine = min(self.engines, key=lambda e: e.load)
                state.engine.load += state.n * state.dtype.itemsize
                self.keys[h.key] = state
                if self.rounds is not None:
                    self.rounds.declared(state)
            state.check_declaration(decl, h.dtype, state.slot(rank))
        except (KeyConflict, ValueError, TypeError, KeyError) as e:
            return self.error(msg.identity, h.key, str(e))
        ack = self.share(state, state.slot(rank), decl.get("shm"))
        send(self.router, Header(Msg.INIT_ACK, self.node_id, key=h.key), ack and encode_json(ack),
             identity=msg.identity)

    def share(self, state, rank, offer):
        """Accept a worker's shared-memory slot for a key: the INIT_ACK's JSON then names the
        result buffers. None (the socket it is) when there is no offer or it cannot be used."""
        if offer is None or self.arena is None:
            return None
        try:
            slot = self.peer_maps.view(offer, state.n * state.dtype.itemsize)
            return {"shm": state.attach_shm(rank, slot, self.arena)}
        except shm.ShmUnavailable as e:
            log.info("key %d: worker %d's pushes stay on the socket: %s", state.key, rank, e)
        except OSError as e:  # the server's own arena could not grow
            log.warning("key %d: no shared memory for worker %d: %s", state.key, rank, e)
        return None

    def push(self, rank, msg):
        if msg.header.flags & FUSED_BIT:
            return self.push_fused(rank, msg)
        state = self.keys[msg.header.key]
        slot = state.slot(rank)
        if msg.payload is None:  # buffer_for checked the pushes that carry a payload frame
            state.check_push(slot, msg.header)
            if not msg.header.flags & SHM_BIT:
                raise MalformedMessage(f"push of key {msg.header.key} without a payload frame")
        if state.arrive(slot, msg.identity, msg.header):
            state.engine.submit([state.take_round()], self.node_id)
        else:
            self.watch.check(state)

    def push_fused(self, rank, msg):
        """Every entry is checked before any is applied, so a bad one drops the whole message."""
        h = msg.header
        shared = h.flags & SHM_BIT  # entries without bytes: each key's data is in its slot
        checked = []
        for key, rnd, data in unpack_fused(msg.payload):
            state = self.keys.get(key)
            if state is None or state.compressed:
                raise MalformedMessage(f"fused push of undeclared or compressed key {key} from worker {rank}")
            sub = Header(Msg.PUSH, h.sender, key=key, round=rnd, length=data.nbytes, ctx=h.ctx, dtype=h.dtype,
                         flags=SHM_BIT if shared else 0)  # ints: Flag's operators are slow
            slot = state.slot(rank)
            if shared:
                state.check_push(slot, sub)
            checked.append((state, sub, data, None if shared else state.buffer_for(slot, sub)))
        done = []
        for state, sub, data, buf in checked:
            if buf is not None:
                buf[:] = data
            if state.arrive(state.slot(rank), msg.identity, sub):
                job = state.take_round()
                if state.asynchronous:  # each key's store is updated by its own engine only
                    state.engine.submit([job], self.node_id)
                else:
                    done.append(job)
            else:
                self.watch.check(state)
        if done:
            done[0].state.engine.submit(done, self.node_id)

    def flush_replies(self):
        while self.wake.poll(0):
            self.wake.recv()
        for replies in queued(self.replies):
            for reply in replies:
                send(self.router, reply.header, reply.payload, identity=reply.identity)


def recv_rest(sock, identity, buffer_for):
    """The rest of a ROUTER message whose identity frame was already read."""
    if not sock.getsockopt(zmq.RCVMORE):
        raise MalformedMessage("message has no header frame")
    msg = recv(sock, router=False, buffer_for=buffer_for)
    msg.identity = identity
    return msg


class Engine:
    """A thread that completes rounds for the keys assigned to it."""

    def __init__(self, ctx, replies, codecs=None):
        self.codecs = codecs  # BPS_GC_ELASTIC: a redo puts a reducer's state back with it
        self.tasks = queue.SimpleQueue()
        self.load = 0  # bytes of the keys assigned to this engine
        self.replies = replies
        self.ctx = ctx
        self.thread = threading.Thread(target=self.run, name="bps_gc-engine", daemon=True)
        self.thread.start()

    def submit(self, jobs, node_id):
        """``jobs``: [records.TakenRound]; several (completed by one fused
        push, dense keys) are answered with one fused reply per worker."""
        self.tasks.put((jobs, node_id))

    def submit_call(self, call):
        """Run ``call()`` (it returns replies) after the rounds already submitted."""
        self.tasks.put(call)

    def stop(self):
        self.tasks.put(None)
        self.thread.join(timeout=5)

    def run(self):
        wake = self.ctx.socket(zmq.PUSH)
        wake.connect(WAKE)
        try:
            while True:
                task = self.tasks.get()
                if task is None:
                    return
                if callable(task):  # key_state.py's fetch or restore of a key's state
                    self.replies.put(task())
                    wake.send(b"", copy=True)
                    continue
                jobs, node_id = task
                replies = [r for job in jobs for r in self.complete(job, node_id, self.codecs)]
                self.replies.put(self.fuse(replies, node_id) if len(jobs) > 1 else replies)
                wake.send(b"", copy=True)
        finally:
            wake.close(linger=0)

    @staticmethod
    def fuse(replies, node_id):
        """Dense replies to one worker become one fused reply, those in shared memory another
        (errors stay on their own)."""
        out, fused = [], {}
        for reply in replies:
            header, payload = reply.header, reply.payload
            if header.type == Msg.PUSH_REPLY and header.flags in (0, SHM_BIT):
                entry = (header.key, header.round, b"" if payload is None else payload)
                fused.setdefault((reply.identity, header.flags), []).append(entry)
            else:
                out.append(reply)
        for (ident, flags), entries in fused.items():
            header = Header(Msg.PUSH_REPLY, node_id, dtype=None, flags=FUSED_BIT | flags)
            out.append(Reply(ident, header, pack_fused(entries)))
        return out

    @staticmethod
    def complete(job, node_id, codecs=None):
        """The replies to the pushers of ``job`` (records.TakenRound)."""
        state = job.state
        try:
            if codecs is not None and state.elastic:
                before_compute(state, job, codecs)
            result = state.compute(job.number, job.ranks)
        except KeyConflict as e:
            log.error("key %d round %d: %s", state.key, job.number, e)
            payload = encode_json({"message": str(e)})
            return [Reply(p.identity, Header(Msg.ERROR, node_id, key=state.key, round=p.round), payload)
                    for p in job.pushers]
        flags = COMPRESSED_BIT if state.compressed and not state.asynchronous else 0
        dtype = state.dtype
        context = encode_context({"epoch": job.epoch}) if job.epoch else None  # elastic: its members
        # a worker that pushed through shared memory reads the result there (results[rnd % 2])
        return [Reply(p.identity, Header(Msg.PUSH_REPLY, node_id, key=state.key, round=p.round, dtype=dtype,
                                         flags=SHM_BIT if p.shared else flags, context=context),
                      None if p.shared else result)
                for p in job.pushers]


__all__ = ["Server"]
