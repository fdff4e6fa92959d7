"""A parameter server's keys share their reducers' in-call buffers (Server.scratch: a sum, a
decoded push, per engine thread, the largest key's size, kept across rounds): the replies are
the bytes of keys keeping their own, round after round (the servers' error feedback included),
and between rounds the keys hold their state and error feedback's second buffer, where each
kept its sum and decoded push too. In-process KeyStates, as the server's engine runs them."""
import numpy as np
import pytest

from bps_gc import compress
from bps_gc.ps.server.keys import KeyState
from bps_gc.wire.wire import COMPRESSED_BIT, Header, Msg
from held_bytes import held_bytes

SIZES = (700, 96, 333)
CODECS = [{"compressor": "onebit", "scaling": True, "ef": "vanilla"},
          {"compressor": "dithering", "k": 4, "seed": 5}]


def server_keys(params, scratch):
    """One KeyState per size (2 pushers), declared by both workers, as the server makes them."""
    keys = []
    for key, n in enumerate(SIZES):
        decl = {"name": f"w{key}", "n": n, "params": params, "reducer": "recompress"}
        state = KeyState(key, decl, np.float32, 2, compress, False, scratch=scratch)
        for rank in range(2):
            state.check_declaration(decl, np.float32, rank)
            state.declared.add(rank)
        keys.append(state)
    return keys


def one_round(state, payloads, number, lr):
    """Both workers' compressed pushes of round ``number``: the reply's bytes."""
    for rank, payload in enumerate(payloads):
        header = Header.unpack(Header(Msg.PUSH, rank, key=state.key, length=payload.nbytes, dtype=np.dtype(np.float32),
                                      flags=COMPRESSED_BIT, round=number, ctx={"lr": lr}).pack())
        np.frombuffer(state.buffer_for(rank, header), np.uint8)[:] = payload
        done = state.arrive(rank, None, header)
    assert done
    job = state.take_round()
    return bytes(state.compute(job.number, job.ranks))


@pytest.mark.parametrize("params", CODECS, ids=lambda p: p["compressor"])
def test_keys_sharing_the_servers_scratch_reply_the_same_bytes_and_hold_less(params):
    rng = np.random.default_rng(4)
    scratch = compress.Scratch(kept=True)
    own, shared = server_keys(params, None), server_keys(params, scratch)
    workers = [[compress.build_chain(params, n, np.float32, key=key, rank=rank) for rank in range(2)]
               for key, n in enumerate(SIZES)]
    for number, lr in enumerate((0.1, 0.1, 0.05)):
        for key, n in enumerate(SIZES):
            payloads = [w.compress(rng.standard_normal(n).astype(np.float32), {"lr": lr}) for w in workers[key]]
            assert one_round(own[key], payloads, number, lr) == one_round(shared[key], payloads, number, lr)
    for a, b in zip(own, shared):
        sa, sb = a.reducer.state_dict(), b.reducer.state_dict()
        assert sa.keys() == sb.keys() and all(np.array_equal(sa[k], sb[k]) for k in sa)
    ef = "ef" in params
    # held: each key's residual and its g (error feedback), plus the shared sum and decoded push;
    # each key's own sum and decoded push before (or a generator's 16 bytes, no residual)
    per_key = 4 * sum(SIZES) * (2 if ef else 0)
    reducers = [[state.reducer for state in keys] for keys in (own, shared)]
    assert held_bytes(reducers[1]) - held_bytes([scratch]) <= per_key + 64 * len(SIZES)
    assert held_bytes([scratch]) <= 2 * 4 * max(SIZES)
    assert held_bytes(reducers[0]) >= per_key + 4 * sum(SIZES)  # each key's sum at least
