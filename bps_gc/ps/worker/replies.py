"""The worker I/O thread's receiving side (a part of ``WorkerIO``): the servers' replies to
pushes (dense replies straight into the caller's output buffer, fused ones split into their
keys, shared-memory ones read from the key's slot) and their errors.
"""
import logging
import time

from ...comm import NodeFailure
from ...wire.sockets import MalformedMessage, recv
from ...wire.wire import COMPRESSED_BIT, FUSED_BIT, SHM_BIT, Msg, decode_json, unpack_fused

log = logging.getLogger("bps_gc.worker")


class Replies:
    """The servers' answers, on the I/O thread: ``receive`` (one message from a server's
    socket) hands each reply to its push's handle and takes it off ``flight`` (inflight.py);
    an error for a key fails its push and is kept for the key's later pushes."""

    def __init__(self, shm, flight, dropped, state_requests):
        """``shm``: shm.SharedSlots; ``flight``: inflight.InFlight; ``dropped``: where an
        unexpected message is logged (sockets.DropLog); ``state_requests``: the checkpoint
        requests awaiting their STATE_REPLY (codec_state.StateRequests)."""
        self.shm, self.flight, self.dropped, self.state_requests = shm, flight, dropped, state_requests
        self.inflight, self.failed_keys = flight.inflight, flight.failed_keys  # dicts, changed in place
        self.elastic = None  # BPS_GC_ELASTIC: elastic.ElasticRounds, which holds the replies
        self.init_acks = 0  # declarations the servers accepted (a joining host waits for them)

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
            self.flight.inflight_bytes -= push.nbytes
            push.handle.fail(ValueError(f"invalid reply from server {push.part.server} for "
                                        f"{push.handle.tensor.name!r}: {e}"))
            return
        h = msg.header
        if h.type in (Msg.STATE_REPLY, Msg.STATE_ERROR):
            return self.state_requests.reply(h, msg.payload)
        if h.type == Msg.ERROR:
            info = decode_json(msg.payload or b"{}")
            message = info.get("message", "server error")
            self.failed_keys.setdefault(h.key, message)
            push = self.inflight.pop(h.key, None)
            if push is not None:
                self.flight.inflight_bytes -= push.nbytes
                # a round the job can never finish (a worker left) vs. this worker's mistake
                push.handle.fail(NodeFailure(message) if info.get("job_failed") else ValueError(message))
            return
        if h.type == Msg.INIT_ACK:
            self.init_acks += 1
            if msg.payload:
                self.shm.accept(h.key, msg.payload)
            return
        if h.type == Msg.PUSH_REPLY and h.flags & FUSED_BIT:
            return self.receive_fused(msg.payload, h.flags & SHM_BIT)
        if self.elastic is not None and h.type == Msg.PUSH_REPLY and h.key not in self.inflight \
                and self.elastic.redone(h, msg.payload):
            return
        push = self.inflight.pop(h.key, None)
        if push is None or h.type != Msg.PUSH_REPLY:
            self.dropped("an unexpected %s for key %d", h.type.name, h.key)
            return
        self.flight.inflight_bytes -= push.nbytes
        payload = msg.payload
        if h.flags & SHM_BIT:
            if not push.shared or h.round != push.round:
                push.handle.fail(ValueError(f"invalid reply from server {push.part.server} for "
                                            f"{push.handle.tensor.name!r}: shared memory it was not pushed through"))
                return
            payload = self.shm.result(push)
        push.part.round += 1
        if self.elastic is not None:
            return self.elastic.replied(push, payload, bool(h.flags & COMPRESSED_BIT),
                                        time.perf_counter() - push.sent_at, h.ctx.get("epoch", 0))
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
            self.flight.inflight_bytes -= push.nbytes
            # the codec pool copies the entry out (a view into the message, or shared memory)
            result = self.shm.result(push) if shared else data
            push.part.round += 1
            push.handle.partition_replied(push, result, False, now - push.sent_at)
