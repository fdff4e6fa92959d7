"""A key's server-side codec state, fetched and restored by workers (checkpoints, issue 33).

STATE_GET asks for a key's state (its reducer's: the recompress chain's error feedback and
momentum, a random codec's generator words); STATE_PUT restores it before the key's first
round. Both run on the key's engine thread, queued behind the rounds already taken, so a
fetched state is the one after the last completed round and a restore is in place before the
round the restoring worker's own next push completes (that push follows the STATE_PUT on the
same socket). The state travels as ``codecs.encode_state`` bytes: never pickle. Which worker
restores which key, and why the server count may change: docs/checkpoint.md.
"""
import logging

from ...wire.sockets import send
from ...wire.wire import Header, Msg, encode_json
from .records import Reply

log = logging.getLogger("bps_gc.server")
STATE_MESSAGES = (Msg.STATE_GET, Msg.STATE_PUT)


def answer(server, rank, msg):
    """Handle a STATE_GET or STATE_PUT of worker ``rank`` (the server's I/O thread)."""
    h, identity, codecs = msg.header, msg.identity, server.codecs
    state = server.keys.get(h.key)

    def refuse(message):
        log.error("key %d: %s", h.key, message)
        return [Reply(identity, Header(Msg.STATE_ERROR, server.node_id, key=h.key),
                      encode_json({"message": message}))]

    def refuse_now(message):
        for r in refuse(message):
            send(server.router, r.header, r.payload, identity=r.identity)

    def reply(payload):
        return [Reply(identity, Header(Msg.STATE_REPLY, server.node_id, key=h.key), payload)]

    if state is None or state.slot(rank) not in state.declared:
        return refuse_now(f"worker {rank} asked for the state of key {h.key}, "
                          "which it did not declare to this server")
    if state.asynchronous:
        return refuse_now("BYTEPS_ENABLE_ASYNC keeps a running sum on the servers, which a "
                          "checkpoint does not hold")
    if h.type == Msg.STATE_GET:
        def fetch():
            return reply(codecs.encode_state(state.reducer.state_dict() if state.reducer else {}))
        return state.engine.submit_call(fetch)
    if state.round != 0:
        return refuse_now(
            f"key {h.key} ({state.decl.get('name')!r}) is at round {state.round}: its state is "
            "restored before its first round only (load the state before the first push_pull)")
    data = bytes(msg.payload or b"")

    def restore():
        try:
            sd = codecs.decode_state(data)
            if state.reducer is None:
                if any(not k.startswith("identity.") for k in sd):
                    raise codecs.StateError("an uncompressed key keeps no state")
            else:
                state.reducer.load_state_dict(sd)
        except codecs.StateError as e:
            return refuse(f"the state of key {h.key} ({state.decl.get('name')!r}) was refused: {e}")
        return reply(b"")
    return state.engine.submit_call(restore)
