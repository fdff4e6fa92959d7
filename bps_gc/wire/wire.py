"""The message header every bps_gc frame sequence starts with.

A message is [header, payload...]: the header frame is a fixed 38-byte little-endian struct
followed by the step context section (``context_len`` bytes, empty on control messages); the
payload frames are raw bytes (tensor data, compressed payloads, or UTF-8 JSON for control
messages). Nothing is ever unpickled or evaluated.

Step context section (``bps_gc.compress.context``): one byte with the entry count, then per
entry one byte name length, the ASCII name, one type byte (``f`` float64, ``i`` int64, ``b``
bool) and 8 value bytes, little-endian. At most 16 entries, names ``[a-z][a-z0-9_]{0,31}``,
unique, floats finite: anything else is a MalformedMessage.
"""
import enum
import json
import math
import re
import struct

import numpy as np

from .bfloat16 import BFLOAT16
from .half import HALF_SUMS

MAGIC = b"BPSG"
VERSION = 2  # 2: the step context section replaced the fixed learning-rate field
# magic, version, type, dtype, flags, sender, key, round, payload length, context length
HEADER = struct.Struct("<4sBBBBiQQQH")
MAX_JSON = 1 << 20
MAX_CONTEXT_ENTRIES = 16
CONTEXT_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}\Z")
CONTEXT_VALUE = struct.Struct("<cq")  # an int64 or bool; floats use "<cd"
CONTEXT_FLOAT = struct.Struct("<cd")


class Msg(enum.IntEnum):
    # membership (node <-> scheduler)
    REGISTER = 1       # JSON {role, host, port, rank}
    ADDRESS_BOOK = 2   # JSON {you, servers: [...], workers: [...]}
    BARRIER = 3        # key: group
    BARRIER_DONE = 4
    HEARTBEAT = 5
    HEARTBEAT_ACK = 6
    NODE_FAILED = 7    # JSON {id, role, rank, address, reason}
    GOODBYE = 8
    SHUTDOWN = 9
    NODE_LEFT = 10     # JSON {role, rank, id}: a worker said goodbye while others still run
    # BPS_GC_ELASTIC (docs/elastic.md): a worker host died
    EPOCH_PREPARE = 11  # JSON {epoch, left, members}: servers fence the dead; workers stop releasing rounds
    EPOCH_REPORT = 12   # JSON {epoch, released}: a worker's last released round group
    EPOCH_COMMIT = 13   # JSON {epoch, left, members, from_group}: the new epoch, from that group on
    # a worker host joins (ps/scheduler/joins.py): the joiner asks, once its declarations are accepted;
    JOIN_READY = 14     # a joining worker -> scheduler, no payload
    EPOCH_AT = 15       # JSON {epoch}: a worker waits at the join's first round group (the joiner: has the parameters)
    EPOCH_GO = 16       # JSON {epoch, joined, members, from_group}: servers count the joiner (they echo it
                        # back), then workers go on with it
    # key-value (worker <-> server)
    INIT = 20          # JSON {name, n, params}
    INIT_ACK = 21
    PUSH = 22          # payload: tensor bytes or compressed payload; step context in the header
    PUSH_REPLY = 23    # payload: the round's result
    # a key's server-side codec state (checkpoints: ps/worker/codec_state.py, ps/server/key_state.py)
    STATE_GET = 24     # no payload: the key's state, in STATE_REPLY
    STATE_PUT = 25     # payload: the key's state (compress/state_bytes.py), before its first round
    STATE_REPLY = 26   # payload: the state (after STATE_GET), empty (after STATE_PUT)
    STATE_ERROR = 27   # JSON {message}: the request was refused
    REDO = 28          # no payload: sum round ``round`` of ``key`` again over the new epoch's members
    ERROR = 30         # JSON {message}
    # worker <-> worker (ps/worker/peers.py)
    PEER = 40          # key: the message's channel; round: its sequence number on that channel


class Flag(enum.IntFlag):
    NONE = 0
    COMPRESSED = 1     # payload is a codec payload, not raw elements
    FUSED = 2          # payload holds several keys' dense pushes or replies (pack_fused)
    SHM = 4            # no payload: the data is in shared memory set up at INIT (wire/shm.py)


FUSED_BIT = int(Flag.FUSED)  # for the hot paths: received headers carry flags as a plain int
SHM_BIT = int(Flag.SHM)
# FUSED | SHM: several keys' shared-memory pushes or replies, fused entries without bytes
VALID_FLAGS = frozenset({0, int(Flag.COMPRESSED), FUSED_BIT, SHM_BIT, FUSED_BIT | SHM_BIT})
COMPRESSED_BIT = int(Flag.COMPRESSED)
MSG_BY_CODE = {int(m): m for m in Msg}  # a dict lookup: Msg(code) is slow on the hot path

# 3: int64, summed wrapping modulo 2^64 (thc's words on the parameter server); 4: bfloat16
# (bfloat16.py); float16 and bfloat16 summed in float32 and rounded once (half.py). thc's int64
# words and FSDP's float16 and bfloat16 shards are pushed only when every server's registration
# lists "int64", or HALF_SUMS (those half sums, averaged on request), in ``sums`` (SERVER_SUMS)
DTYPES = {0: np.dtype(np.float32), 1: np.dtype(np.float64), 2: np.dtype(np.float16),
          3: np.dtype(np.int64), 4: BFLOAT16, 255: None}  # 255: no tensor
SERVER_SUMS = ("float32", "float64", "float16", "int64", "bfloat16", HALF_SUMS)  # what a server adds
DTYPE_CODES = {v: k for k, v in DTYPES.items()}


class MalformedMessage(ValueError):
    """A frame sequence that is not a valid bps_gc message; it is logged and dropped."""


_last_encoded = ((), b"")  # every push_pull of a step has the same context: encode it once


def encode_context(ctx):
    """The step context section for a mapping of names to finite numbers or booleans; a bad
    entry is a ValueError naming it (the caller's mistake, found before anything is sent)."""
    global _last_encoded
    if not ctx:
        return b""
    try:  # the types are part of the key: True == 1 == 1.0 encode differently
        key = tuple((name, type(value), value) for name, value in ctx.items())
        hash(key)  # an array value raises here, not in the comparison
        last_key, last_section = _last_encoded  # one read: another thread may replace it
        if key == last_key:
            return last_section
    except TypeError:  # an unhashable value: encoded below, which names it
        key = None
    section = _encode_context(ctx)
    if key is not None:
        _last_encoded = (key, section)
    return section


def _encode_context(ctx):
    if len(ctx) > MAX_CONTEXT_ENTRIES:
        raise ValueError(f"step context has {len(ctx)} entries; at most {MAX_CONTEXT_ENTRIES}")
    parts = [bytes([len(ctx)])]
    for name, value in ctx.items():
        if not isinstance(name, str) or not CONTEXT_NAME.match(name):
            raise ValueError(f"step context key {name!r}: names are lower-case ASCII "
                             "[a-z][a-z0-9_]*, at most 32 characters")
        parts.append(bytes([len(name)]) + name.encode())
        if isinstance(value, (bool, np.bool_)):
            parts.append(CONTEXT_VALUE.pack(b"b", int(value)))
        elif isinstance(value, (int, np.integer)):
            if not -2**63 <= int(value) < 2**63:
                raise ValueError(f"step context key {name!r}: {value} does not fit in 64 bits")
            parts.append(CONTEXT_VALUE.pack(b"i", int(value)))
        elif isinstance(value, (float, np.floating)) and math.isfinite(value):
            parts.append(CONTEXT_FLOAT.pack(b"f", float(value)))
        else:
            raise ValueError(f"step context key {name!r}: value must be a finite number or a "
                             f"boolean, got {value!r}")
    return b"".join(parts)


_last_context = (b"", {})  # every push of a step carries the same section: decode it once


def decode_context(data):
    """The step context mapping of a received section (a fresh dict); MalformedMessage if it is
    not valid."""
    global _last_context
    if not data:
        return {}
    data = bytes(data)
    section, ctx = _last_context
    if data == section:
        return dict(ctx)
    ctx = _decode_context(data)
    _last_context = (data, ctx)
    return dict(ctx)


def _decode_context(data):
    count, pos, ctx = data[0], 1, {}
    if count > MAX_CONTEXT_ENTRIES:
        raise MalformedMessage(f"step context with {count} entries (at most {MAX_CONTEXT_ENTRIES})")
    for _ in range(count):
        if pos >= len(data):
            raise MalformedMessage("step context section is truncated")
        size = data[pos]
        end = pos + 1 + size
        if end + 9 > len(data):
            raise MalformedMessage("step context section is truncated")
        try:
            name = data[pos + 1:end].decode("ascii")
        except UnicodeDecodeError:
            raise MalformedMessage("step context key is not ASCII") from None
        if not CONTEXT_NAME.match(name) or name in ctx:
            raise MalformedMessage(f"step context key {name!r} is invalid or repeated")
        kind = data[end:end + 1]
        if kind == b"f":
            value = CONTEXT_FLOAT.unpack_from(data, end)[1]
            if not math.isfinite(value):
                raise MalformedMessage(f"step context {name!r} is not finite")
        elif kind in (b"i", b"b"):
            value = CONTEXT_VALUE.unpack_from(data, end)[1]
            if kind == b"b":
                if value not in (0, 1):
                    raise MalformedMessage(f"step context {name!r} is not a boolean")
                value = bool(value)
        else:
            raise MalformedMessage(f"step context {name!r} has unknown type {kind!r}")
        ctx[name] = value
        pos = end + 9
    if pos != len(data):
        raise MalformedMessage(f"step context section has {len(data) - pos} trailing bytes")
    return ctx


class Header:
    """``ctx``: the step context (a dict) of a PUSH; ``context`` may carry its section already
    encoded (one encoding for every partition of a push_pull)."""

    __slots__ = ("type", "dtype", "flags", "sender", "key", "round", "length", "ctx", "context")

    def __init__(self, type, sender=0, key=0, round=0, length=0, ctx=None, dtype=None,
                 flags=Flag.NONE, context=None):
        self.type, self.sender, self.key, self.round = type, sender, key, round
        self.length, self.ctx, self.dtype, self.flags = length, ctx, dtype, flags
        self.context = context

    def pack(self):
        section = self.context if self.context is not None else encode_context(self.ctx)
        return HEADER.pack(MAGIC, VERSION, int(self.type), DTYPE_CODES[self.dtype],
                           int(self.flags), self.sender, self.key, self.round, self.length,
                           len(section)) + section

    @classmethod
    def unpack(cls, data):
        if len(data) < HEADER.size:
            raise MalformedMessage(f"header of {len(data)} bytes, expected at least {HEADER.size}")
        magic, version, mtype, dcode, flags, sender, key, rnd, length, ctx_len = \
            HEADER.unpack_from(data)
        if magic != MAGIC:
            raise MalformedMessage(f"bad magic {magic!r}")
        if version != VERSION:
            raise MalformedMessage(f"protocol version {version}, this node speaks {VERSION}")
        msg_type = MSG_BY_CODE.get(mtype)
        if msg_type is None:
            raise MalformedMessage(f"unknown message type {mtype}")
        if dcode not in DTYPES:
            raise MalformedMessage(f"unknown dtype code {dcode}")
        if flags not in VALID_FLAGS:
            raise MalformedMessage(f"unknown flags {flags:#x}")
        if len(data) != HEADER.size + ctx_len:
            raise MalformedMessage(f"header frame of {len(data)} bytes, its context section "
                                   f"says {HEADER.size + ctx_len}")
        ctx = decode_context(memoryview(data)[HEADER.size:]) if ctx_len else {}
        return cls(msg_type, sender, key, rnd, length, ctx, DTYPES[dcode], flags)  # flags: a plain int

    def __repr__(self):
        return (f"Header({self.type.name}, sender={self.sender}, key={self.key}, "
                f"round={self.round}, length={self.length})")


FUSED_COUNT = struct.Struct("<I")
FUSED_ENTRY = struct.Struct("<QQQ")  # key, round, length
MAX_FUSED = 4096


def pack_fused(entries):
    """One payload for several dense pushes or replies: a uint32 count, then (uint64 key,
    uint64 round, uint64 length) per entry, then the entries' bytes in that order."""
    index = [FUSED_COUNT.pack(len(entries))]
    index += [FUSED_ENTRY.pack(key, rnd, memoryview(data).nbytes) for key, rnd, data in entries]
    return b"".join(index + [memoryview(data).cast("B") for _, _, data in entries])


def unpack_fused(payload):
    """[(key, round, memoryview)] of a fused payload; MalformedMessage if it is not valid."""
    if payload is None:
        raise MalformedMessage("fused message without a payload")
    view = memoryview(payload).cast("B")
    if view.nbytes < FUSED_COUNT.size:
        raise MalformedMessage("fused payload without its entry count")
    (count,) = FUSED_COUNT.unpack_from(view)
    if not 0 < count <= MAX_FUSED:
        raise MalformedMessage(f"fused payload with {count} entries (1 to {MAX_FUSED})")
    pos = FUSED_COUNT.size + count * FUSED_ENTRY.size
    if view.nbytes < pos:
        raise MalformedMessage("fused payload index is truncated")
    entries, keys = [], set()
    for i in range(count):
        key, rnd, length = FUSED_ENTRY.unpack_from(view, FUSED_COUNT.size + i * FUSED_ENTRY.size)
        if key in keys or pos + length > view.nbytes:
            raise MalformedMessage(f"fused payload: key {key} repeated or its {length} bytes missing")
        keys.add(key)
        entries.append((key, rnd, view[pos:pos + length]))
        pos += length
    if pos != view.nbytes:
        raise MalformedMessage(f"fused payload has {view.nbytes - pos} trailing bytes")
    return entries


def encode_json(obj):
    return json.dumps(obj, separators=(",", ":")).encode()


def json_object(data, what, error):
    """``data`` (bytes) read as a JSON object; else ``error`` naming ``what`` and the fault."""
    try:
        obj = json.loads(bytes(data).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{what}: not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise error(f"{what}: not a JSON object")
    return obj


def decode_json(data):
    if len(data) > MAX_JSON:
        raise MalformedMessage(f"JSON payload of {len(data)} bytes is too large")
    return json_object(data, "JSON payload", MalformedMessage)
