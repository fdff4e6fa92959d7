"""A state dict (compress/stateful.py) as bytes, for files and the network: no pickle.

Layout (docs/checkpoint.md):

    b"BPSGCST1"                         8 bytes, magic and format version
    header length H                     uint32, little-endian
    header                              H bytes of UTF-8 JSON:
        {"scalars": {key: int | float | str, ...},
         "arrays": [[key, dtype, shape, nbytes], ...]}
    the arrays' bytes                   back to back, in the header's order, nothing after

``dtype`` is numpy's explicit little-endian string (``"<f4"``, ``"|u1"``, ...) from a short
list; the decoder checks every length against the header and the header against the buffer
before it makes any array, so a truncated or corrupt input is a StateError, never a crash or a
silently short state. torch tensors are written from their host copy; decoding gives numpy
arrays, which ``load_state_dict`` copies onto a device chain's device.
"""
import json
import math

import numpy as np

from .stateful import StateError, as_numpy

MAGIC = b"BPSGCST1"
MAX_HEADER = 64 << 20  # a header past this is corrupt (it lists names and shapes only)
MAX_DIMS = 32
DTYPES = {np.dtype(t).str for t in (np.float16, np.float32, np.float64, np.int8, np.int16,
                                    np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                                    np.uint64, np.bool_)}


def encode_state(sd):
    """The bytes of state dict ``sd`` (str keys; numpy arrays or torch tensors, ints, floats,
    strs)."""
    scalars, arrays, blobs = {}, [], []
    for key, value in sd.items():
        if not isinstance(key, str):
            raise StateError(f"state keys must be str, got {key!r}")
        array = as_numpy(value)
        if array is not None:
            dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
            if dtype.str not in DTYPES:
                raise StateError(f"state key {key!r}: cannot encode dtype {array.dtype}")
            blob = array.astype(dtype, copy=False).tobytes()  # C order whatever the strides
            arrays.append([key, dtype.str, list(array.shape), len(blob)])
            blobs.append(blob)
        elif isinstance(value, (int, float, str)) and not isinstance(value, bool):
            scalars[key] = value
        elif isinstance(value, (np.integer, np.floating)):
            scalars[key] = value.item()
        else:
            raise StateError(f"state key {key!r}: cannot encode a {type(value).__name__} "
                             "(arrays, tensors, int, float, str)")
    header = json.dumps({"scalars": scalars, "arrays": arrays}, separators=(",", ":")).encode()
    return b"".join([MAGIC, len(header).to_bytes(4, "little"), header] + blobs)


def decode_state(data):
    """The state dict in ``data`` (bytes-like); a StateError says what is wrong with it."""
    buf = memoryview(data).cast("B")
    fixed = len(MAGIC) + 4
    if len(buf) < fixed or bytes(buf[:len(MAGIC)]) != MAGIC:
        raise StateError("not a bps_gc state (no BPSGCST1 mark at its start): "
                         f"{len(buf)} bytes")
    size = int.from_bytes(buf[len(MAGIC):fixed], "little")
    if size > min(MAX_HEADER, len(buf) - fixed):
        raise StateError(f"bps_gc state: header of {size} bytes, but {len(buf) - fixed} "
                         "follow (truncated or corrupt)")
    try:
        header = json.loads(bytes(buf[fixed:fixed + size]).decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise StateError(f"bps_gc state: header is not JSON ({e})") from None
    if not (isinstance(header, dict) and set(header) == {"scalars", "arrays"}
            and isinstance(header["scalars"], dict) and isinstance(header["arrays"], list)):
        raise StateError("bps_gc state: header must hold exactly 'scalars' and 'arrays'")
    out = {}
    for key, value in header["scalars"].items():
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise StateError(f"bps_gc state: scalar {key!r} is a {type(value).__name__}")
        out[key] = value
    offset = fixed + size
    for entry in header["arrays"]:
        key, dtype, shape, nbytes = _entry(entry)
        if key in out:
            raise StateError(f"bps_gc state: key {key!r} appears twice")
        if nbytes != math.prod(shape) * dtype.itemsize:
            raise StateError(f"bps_gc state: array {key!r} of shape {tuple(shape)} and dtype "
                             f"{dtype} has {nbytes} bytes, expected {math.prod(shape) * dtype.itemsize}")
        if nbytes > len(buf) - offset:
            raise StateError(f"bps_gc state: array {key!r} needs {nbytes} bytes, "
                             f"{len(buf) - offset} are left (truncated)")
        out[key] = np.frombuffer(buf, dtype, math.prod(shape), offset).reshape(tuple(shape)).copy()
        offset += nbytes
    if offset != len(buf):
        raise StateError(f"bps_gc state: {len(buf) - offset} bytes after the last array")
    return out


def _entry(entry):
    """(key, dtype, shape, nbytes) of an array entry of the header, checked."""
    if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
            and isinstance(entry[1], str) and isinstance(entry[2], list)
            and isinstance(entry[3], int) and not isinstance(entry[3], bool)):
        raise StateError(f"bps_gc state: malformed array entry {str(entry)[:80]}")
    key, dtype, shape, nbytes = entry
    if dtype not in DTYPES:
        raise StateError(f"bps_gc state: array {key!r} has dtype {dtype!r}, not one of "
                         f"{', '.join(sorted(DTYPES))}")
    if len(shape) > MAX_DIMS or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                        for d in shape):
        raise StateError(f"bps_gc state: array {key!r} has shape {str(shape)[:80]}")
    if nbytes < 0:
        raise StateError(f"bps_gc state: array {key!r} has {nbytes} bytes")
    return key, np.dtype(dtype), shape, nbytes
