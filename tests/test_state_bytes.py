"""The byte encoding of state dicts (compress/state_bytes.py): exact round trips, and every
truncated, corrupt or hostile input refused with a StateError (never another exception)."""
import json
import math

import numpy as np
import pytest

from bps_gc.compress.stateful import StateError
from bps_gc.compress.state_bytes import MAGIC, decode_state, encode_state


def example():
    return {"identity.codec.name": "topk", "identity.codec.n": 5, "ef.lr_prev": 0.1,
            "nan": math.nan, "big": 2**63 + 5,
            "ef.error": np.array([1.5, -0.0, np.inf, 3, 4], np.float32),
            "codec.rng_state": np.array([2**64 - 1, 7], np.uint64),
            "matrix": np.arange(6, dtype=np.float16).reshape(2, 3),
            "empty": np.zeros((0, 4), np.float64), "scalar_array": np.array(7, np.int32)}


def split(data):
    """(header dict, body bytes) of an encoding, by the documented layout."""
    size = int.from_bytes(data[8:12], "little")
    return json.loads(data[12:12 + size]), data[12 + size:]


def join(header, body):
    head = json.dumps(header).encode()
    return MAGIC + len(head).to_bytes(4, "little") + head + body


def test_round_trip_is_exact():
    sd = example()
    back = decode_state(encode_state(sd))
    assert set(back) == set(sd)
    for key, value in sd.items():
        if isinstance(value, np.ndarray):
            assert back[key].dtype == value.dtype and back[key].shape == value.shape
            assert back[key].tobytes() == value.tobytes() and back[key].flags.writeable
        elif isinstance(value, float) and math.isnan(value):
            assert math.isnan(back[key])
        else:
            assert back[key] == value and type(back[key]) is type(value)
    # independent check of the layout: the body is the arrays' bytes in the header's order
    header, body = split(encode_state(sd))
    assert body == b"".join(sd[k].tobytes() for k, *_ in header["arrays"])


def test_big_endian_arrays_are_written_little_endian():
    back = decode_state(encode_state({"a": np.array([1.0, 2.0], ">f8")}))
    assert back["a"].dtype == np.dtype("<f8") and back["a"].tolist() == [1.0, 2.0]


def test_torch_tensors_encode_from_the_host():
    torch = pytest.importorskip("torch")
    back = decode_state(encode_state({"t": torch.arange(4, dtype=torch.float32)}))
    assert back["t"].tolist() == [0, 1, 2, 3] and back["t"].dtype == np.float32


@pytest.mark.parametrize("bad", [{"x": None}, {"x": True}, {"x": [1, 2]}, {3: 1},
                                 {"x": np.array(["a"])}, {"x": np.zeros(2, np.complex64)}])
def test_unencodable_values_are_refused(bad):
    with pytest.raises(StateError):
        encode_state(bad)


def test_every_truncation_is_refused():
    data = encode_state(example())
    for end in range(len(data)):
        with pytest.raises(StateError):
            decode_state(data[:end])
    with pytest.raises(StateError, match="bytes after the last array"):
        decode_state(data + b"\0")


def test_every_single_byte_corruption_fails_cleanly():
    """A flipped byte anywhere: a StateError, or a state dict (a flip inside an array's
    values is undetectable by design); never another exception."""
    data = bytearray(encode_state(example()))
    for i in range(len(data)):
        for flip in (0x41,):  # a low and a high bit: digits become other digits or letters
            data[i] ^= flip
            try:
                out = decode_state(bytes(data))
            except StateError:
                pass
            else:
                assert isinstance(out, dict)
            data[i] ^= flip


@pytest.mark.parametrize("edit,pattern", [
    (lambda h: h["arrays"][0].__setitem__(1, "<c8"), "dtype '<c8'"),
    (lambda h: h["arrays"][0].__setitem__(1, ">f4"), "dtype '>f4'"),
    (lambda h: h["arrays"][0].__setitem__(1, "|O"), "dtype '|O'"),
    (lambda h: h["arrays"][0].__setitem__(3, h["arrays"][0][3] + 4), "has 24 bytes, expected 20"),
    (lambda h: h["arrays"][0].__setitem__(2, [-5]), "shape"),
    (lambda h: h["arrays"][0].__setitem__(2, [2**40]), "expected"),
    (lambda h: h["arrays"][0].__setitem__(3, -1), "-1 bytes"),
    (lambda h: h["arrays"][0].__setitem__(2, "5"), "malformed"),
    (lambda h: h["arrays"].append(["ef.error", "<f4", [0], 0]), "appears twice"),
    (lambda h: h["arrays"].append(["identity.codec.n", "<f4", [0], 0]), "appears twice"),
    (lambda h: h["scalars"].__setitem__("x", None), "scalar 'x' is a NoneType"),
    (lambda h: h["scalars"].__setitem__("x", True), "scalar 'x' is a bool"),
    (lambda h: h.__setitem__("more", 1), "exactly 'scalars' and 'arrays'"),
])
def test_bad_headers_are_named(edit, pattern):
    header, body = split(encode_state(example()))
    edit(header)
    with pytest.raises(StateError, match=pattern):
        decode_state(join(header, body))


def test_bad_frames_are_named():
    data = encode_state(example())
    with pytest.raises(StateError, match="no BPSGCST1 mark"):
        decode_state(b"PK\x03\x04" + data)
    with pytest.raises(StateError, match="header of 4294967295 bytes"):
        decode_state(MAGIC + b"\xff\xff\xff\xff" + data[12:])
    with pytest.raises(StateError, match="not JSON"):
        decode_state(MAGIC + (3).to_bytes(4, "little") + b"\xff{]")
