"""The message header every bps_gc frame sequence starts with.

A message is [header, payload...]: the header is a fixed 44-byte little-endian struct, the
payload frames are raw bytes (tensor data, compressed payloads, or UTF-8 JSON for control
messages). Nothing is ever unpickled or evaluated.
"""
import enum
import json
import struct

import numpy as np

MAGIC = b"BPSG"
VERSION = 1
# magic, version, type, dtype, flags, sender, key, round, payload length, learning rate
HEADER = struct.Struct("<4sBBBBiQQQd")
MAX_JSON = 1 << 20


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
    # key-value (worker <-> server)
    INIT = 20          # JSON {name, n, params}
    INIT_ACK = 21
    PUSH = 22          # payload: tensor bytes or compressed payload; lr in the header
    PUSH_REPLY = 23    # payload: the round's result
    ERROR = 30         # JSON {message}
    # worker <-> worker (roles/peers.py)
    PEER = 40          # key: the message's channel; round: its sequence number on that channel


class Flag(enum.IntFlag):
    NONE = 0
    COMPRESSED = 1     # payload is a codec payload, not raw elements


DTYPES = {0: np.dtype(np.float32), 1: np.dtype(np.float64), 2: np.dtype(np.float16),
          255: None}  # 255: no tensor
DTYPE_CODES = {v: k for k, v in DTYPES.items()}


class MalformedMessage(ValueError):
    """A frame sequence that is not a valid bps_gc message; it is logged and dropped."""


class Header:
    __slots__ = ("type", "dtype", "flags", "sender", "key", "round", "length", "lr")

    def __init__(self, type, sender=0, key=0, round=0, length=0, lr=0.0, dtype=None,
                 flags=Flag.NONE):
        self.type, self.sender, self.key, self.round = type, sender, key, round
        self.length, self.lr, self.dtype, self.flags = length, lr, dtype, flags

    def pack(self):
        return HEADER.pack(MAGIC, VERSION, int(self.type), DTYPE_CODES[self.dtype],
                           int(self.flags), self.sender, self.key, self.round, self.length,
                           self.lr)

    @classmethod
    def unpack(cls, data):
        if len(data) != HEADER.size:
            raise MalformedMessage(f"header of {len(data)} bytes, expected {HEADER.size}")
        magic, version, mtype, dcode, flags, sender, key, rnd, length, lr = HEADER.unpack(data)
        if magic != MAGIC:
            raise MalformedMessage(f"bad magic {magic!r}")
        if version != VERSION:
            raise MalformedMessage(f"protocol version {version}, this node speaks {VERSION}")
        try:
            mtype = Msg(mtype)
        except ValueError:
            raise MalformedMessage(f"unknown message type {mtype}") from None
        if dcode not in DTYPES:
            raise MalformedMessage(f"unknown dtype code {dcode}")
        if flags & ~int(Flag.COMPRESSED):
            raise MalformedMessage(f"unknown flags {flags:#x}")
        if not lr == lr or lr in (float("inf"), float("-inf")):
            raise MalformedMessage("learning rate is not finite")
        return cls(mtype, sender, key, rnd, length, lr, DTYPES[dcode], Flag(flags))

    def __repr__(self):
        return (f"Header({self.type.name}, sender={self.sender}, key={self.key}, "
                f"round={self.round}, length={self.length})")


def encode_json(obj):
    return json.dumps(obj, separators=(",", ":")).encode()


def decode_json(data):
    if len(data) > MAX_JSON:
        raise MalformedMessage(f"JSON payload of {len(data)} bytes is too large")
    try:
        obj = json.loads(bytes(data).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MalformedMessage(f"bad JSON payload: {e}") from None
    if not isinstance(obj, dict):
        raise MalformedMessage("JSON payload must be an object")
    return obj
