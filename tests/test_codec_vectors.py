"""Our codecs against bytes produced by BytePS's own C++ codecs, and codecs.md's examples."""
import json
import os

import numpy as np
import pytest

from bps_gc.compress import build_chain
from xorshift import XorShift128Plus, native_outputs
from bps_gc.compress.sparse import RECORD
from conftest import DATA

VECTORS = os.path.join(DATA, "byteps")
MANIFEST = json.load(open(os.path.join(VECTORS, "manifest.json")))
CASES = MANIFEST["cases"]


def load(name, dtype):
    return np.fromfile(os.path.join(VECTORS, name), dtype)


def record_set(payload):
    rec = np.frombuffer(bytes(payload), RECORD[np.float32])
    return {(int(i), v.tobytes()) for i, v in zip(rec["i"], rec["v"])}


def plain_case(case):
    """The case without error feedback (same input, same codec parameters)."""
    params = {k: v for k, v in case["params"].items() if k not in ("ef", "note")}
    for other in CASES:
        if other["n"] == case["n"] and other["params"] == params:
            return other
    return None


@pytest.mark.parametrize("case", CASES, ids=[f"{c['n']}-{c['name']}" for c in CASES])
def test_compress_matches_byteps(case):
    params = {k: v for k, v in case["params"].items() if k != "note"}
    x = load(case["input"], np.float32)
    assert x.size == case["n"]
    expected = load(case["compressed"], np.uint8)
    got = build_chain(params, x.size, np.float32).compress(x, {"lr": 0.1})
    if params["compressor"] == "topk":  # BytePS emits heap order; the set is the contract
        assert got.size == expected.size
        assert record_set(got) == record_set(expected)
    else:
        assert got.tobytes() == expected.tobytes()


@pytest.mark.parametrize("case", CASES, ids=[f"{c['n']}-{c['name']}" for c in CASES])
def test_decompress_matches_byteps(case):
    params = {k: v for k, v in case["params"].items() if k != "note"}
    codec = build_chain(params, case["n"], np.float32)
    got = codec.decompress(load(case["compressed"], np.uint8))
    if "ef" in params:
        # BytePS's EF .decomp files hold its scratch buffer, not a decoding (its in-place
        # decompress bug); the decoding of an EF payload is the plain codec's decoding.
        reference = plain_case(case)
        if reference is None:
            pytest.skip("no plain case of the same size in the lean vector set")
        expected = load(reference["decompressed"], np.float32)
        # first step, zero error: BytePS's EF payload is its plain payload (the later steps,
        # with the error no longer zero: tests/test_byteps_steps.py)
        ef_payload, plain_payload = load(case["compressed"], np.uint8), load(reference["compressed"], np.uint8)
        if params["compressor"] == "topk":
            assert record_set(ef_payload) == record_set(plain_payload)
        else:
            assert ef_payload.tobytes() == plain_payload.tobytes()
    else:
        expected = load(case["decompressed"], np.float32)
    assert got.tobytes() == expected.tobytes()


def test_onebit_example_from_spec():
    x = np.array([0.5, -1, 0, -0.0, 2, -3] + [1] * 26 + [-1] * 3, np.float32)
    codec = build_chain({"compressor": "onebit", "scaling": True}, 35, np.float32)
    payload = codec.compress(x)
    assert payload.tobytes().hex() == "00000044" "000000e0" "1dd4813f"
    scale = np.float32(np.abs(x.astype(np.float64)).sum() / 35)
    assert np.array_equal(codec.decompress(payload), np.where(x < 0, -scale, scale))


def test_dithering_example_from_spec():
    x = np.array([0.1, -0.4, 0, 0.3, -0.2, 0.05, 0, 0.4], np.float32)
    codec = build_chain({"compressor": "dithering", "k": 2, "partition": "linear",
                         "normalize": "max", "seed": 2020}, 8, np.float32)
    payload = codec.compress(x)
    assert payload.tobytes().hex() == "423d21ba" "00000000" "21000000" "cdcccc3e"
    assert np.array_equal(codec.decompress(payload),
                          np.array([0.2, -0.4, 0, 0.4, -0.2, 0.2, 0, 0.4], np.float32))


def test_rng_examples_from_spec():
    rng = XorShift128Plus(2020)
    assert [rng.next() for _ in range(3)] == [0x3F20200E4, 0x3F2020018, 0x1F90003F27E4E30]
    rng = XorShift128Plus(2020)
    assert [rng.randint(0, 10**6) for _ in range(5)] == [119460, 119256, 146992, 189780, 90903]


@pytest.mark.parametrize("seed", [1, 2020, 2**64 - 1])
def test_native_rng_equals_python_rng(seed):
    rng = XorShift128Plus(seed)
    assert [int(v) for v in native_outputs(seed, 1000)] == [rng.next() for _ in range(1000)]


def test_randomk_indices_follow_the_rng():
    n, k = 1000, 7
    x = np.arange(n, dtype=np.float32)
    payload = build_chain({"compressor": "randomk", "k": k, "seed": 2020}, n, np.float32).compress(x)
    rng = XorShift128Plus(2020)
    rec = np.frombuffer(payload.tobytes(), RECORD[np.float32])
    assert rec["i"].tolist() == [rng.randint(0, n) for _ in range(k)]
    assert np.array_equal(rec["v"], x[rec["i"]])
