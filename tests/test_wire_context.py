"""The step context section and fused payloads of the wire format: round trips, and every
malformed variant is a MalformedMessage (what a server logs and drops)."""
import struct
import threading

import numpy as np
import pytest

from bps_gc.comm.metrics import Counters
from bps_gc.wire.wire import (HEADER, MAX_CONTEXT_ENTRIES, Flag, Header, MalformedMessage, Msg,
                              encode_context, pack_fused, unpack_fused)


def push_header(ctx):
    return Header(Msg.PUSH, 1, key=7, round=3, length=8, ctx=ctx, dtype=np.dtype(np.float32)).pack()


def test_context_round_trips_with_every_value_type():
    ctx = {"lr": 0.125, "step": 2**40, "epoch": -1, "density": 1e-3, "warmup": True}
    h = Header.unpack(push_header(ctx))
    assert h.ctx == ctx and type(h.ctx["warmup"]) is bool and type(h.ctx["step"]) is int
    assert (h.type, h.sender, h.key, h.round, h.length) == (Msg.PUSH, 1, 7, 3, 8)
    assert Header.unpack(push_header(None)).ctx == {}
    assert len(push_header({"lr": 0.1, "step": 1, "epoch": 0})) == HEADER.size + 1 + 3 * 10 + len("lr" "step" "epoch")  # 42 bytes of context


def test_repeated_contexts_encode_as_the_first_time():
    """encode_context remembers the last context: a repeat gives the same bytes, and a value of
    another type or a bad value right after a good one is still encoded (or refused) afresh."""
    def section(value):  # the expected bytes, written out by hand
        return bytes([1, 4]) + b"flag" + (struct.pack("<cd", b"f", value) if type(value) is float
                                          else struct.pack("<cq", b"b" if type(value) is bool else b"i", int(value)))
    for value in (True, True, 1, 1, 1.0, 1.0, np.float32(1.0), False, 0, 0.0):
        assert encode_context({"flag": value}) == section(float(value) if isinstance(value, np.floating) else value)
    encode_context({"flag": 0.5})
    for bad in (float("nan"), np.array([0.5, 0.5]), [0.5]):
        with pytest.raises(ValueError, match="'flag': value must be a finite number"):
            encode_context({"flag": bad})
    assert encode_context({"flag": 0.5}) == section(0.5)


@pytest.mark.parametrize("ctx, message", [
    ({"LR": 0.1}, "'LR': names are lower-case"),
    ({"x" * 33: 1}, "at most 32 characters"),
    ({"lr": float("nan")}, "'lr': value must be a finite number"),
    ({"lr": float("inf")}, "'lr': value must be a finite number"),
    ({"lr": "0.1"}, "'lr': value must be a finite number or a boolean"),
    ({"step": 2**64}, "'step': 18446744073709551616 does not fit in 64 bits"),
    ({f"k{i}": i for i in range(MAX_CONTEXT_ENTRIES + 1)}, "at most 16"),
])
def test_a_bad_context_is_refused_before_sending(ctx, message):
    with pytest.raises(ValueError, match=message):
        encode_context(ctx)


def entry(name, kind, raw):
    return bytes([len(name)]) + name + kind + raw


@pytest.mark.parametrize("section", [
    b"\x01" + entry(b"lr", b"f", struct.pack("<d", float("nan"))),
    b"\x01" + entry(b"lr", b"f", struct.pack("<d", float("-inf"))),
    b"\x01" + entry(b"lr", b"x", bytes(8)),                         # unknown type
    b"\x01" + entry(b"ok", b"b", struct.pack("<q", 2)),             # bool that is not 0/1
    b"\x01" + entry(b"Lr", b"i", bytes(8)),                         # bad name
    b"\x01" + entry(b"\xff\xfe", b"i", bytes(8)),                   # not ASCII
    b"\x02" + entry(b"lr", b"i", bytes(8)) * 2,                     # repeated key
    b"\x01" + entry(b"lr", b"i", bytes(4)),                         # truncated value
    b"\x02" + entry(b"lr", b"i", bytes(8)),                         # count larger than entries
    b"\x01" + entry(b"lr", b"i", bytes(8)) + b"z",                  # trailing byte
    bytes([MAX_CONTEXT_ENTRIES + 1]) + entry(b"a", b"i", bytes(8)) * (MAX_CONTEXT_ENTRIES + 1),
])
def test_a_malformed_context_section_is_a_malformed_message(section):
    fixed = HEADER.pack(b"BPSG", 2, int(Msg.PUSH), 0, 0, 1, 7, 3, 8, len(section))
    with pytest.raises(MalformedMessage):
        Header.unpack(fixed + section)


def test_context_length_must_match_the_frame():
    data = push_header({"lr": 0.1})
    with pytest.raises(MalformedMessage, match="context section"):
        Header.unpack(data + b"\x00")
    with pytest.raises(MalformedMessage):
        Header.unpack(data[:-1])
    with pytest.raises(MalformedMessage, match="version 1"):
        Header.unpack(b"BPSG\x01" + data[5:])


def test_fused_payload_round_trips_and_rejects_lies():
    a, b = np.arange(5, dtype=np.float32), np.arange(3, dtype=np.float16)
    entries = unpack_fused(pack_fused([(1, 4, a), (1 << 16, 0, b)]))
    assert [(k, r) for k, r, _ in entries] == [(1, 4), (1 << 16, 0)]
    assert bytes(entries[0][2]) == a.tobytes() and bytes(entries[1][2]) == b.tobytes()
    good = pack_fused([(1, 0, a), (2, 0, a)])
    for bad in (good[:-1], good + b"x", pack_fused([(1, 0, a), (1, 0, a)]), b"\x00\x00\x00\x00",
                b"\xff\xff\xff\xff" + good[4:], good[:10]):
        with pytest.raises(MalformedMessage):
            unpack_fused(bad)
    with pytest.raises(MalformedMessage):  # compressed and fused at once
        Header.unpack(Header(Msg.PUSH, flags=Flag.COMPRESSED | Flag.FUSED).pack())


def test_counters_lose_no_update_from_several_threads():
    counters = Counters()

    def bump():
        for _ in range(20_000):
            counters.add(pushed_raw=1, compress_seconds=0.5, messages=1)

    threads = [threading.Thread(target=bump) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    m = counters.take()
    assert (m.pushed_raw, m.compress_seconds, m.messages) == (160_000, 80_000.0, 160_000)
    assert counters.take().pushed_raw == 0
