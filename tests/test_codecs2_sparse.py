"""threshold, adaptive_threshold, sign and signnorm against numpy; payload validation of every
issue-11 codec (malformed payloads raise ValueError, never crash)."""
import numpy as np
import pytest

from bps_gc.compress import build_chain
from bps_gc.compress.registry import COMPRESSORS
from bps_gc.compress.threshold import RECORDS

DTYPES = [np.float32, np.float16]


def sent(payload, dtype):
    return np.frombuffer(bytes(payload), RECORDS[np.dtype(dtype)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [0.0, 0.001, 0.3, 1.0, 5.0])
@pytest.mark.parametrize("n", [1, 2, 33, 5000])
def test_threshold_keeps_exactly_abs_at_least_v(dtype, v, n):
    x = np.random.default_rng(n).standard_normal(n).astype(dtype)
    x[: min(n, 3)] = np.array([v, -v, 0.0])[: min(n, 3)]  # ties at v are kept
    codec = build_chain({"compressor": "threshold", "threshold": v}, n, dtype)
    rec = sent(codec.compress(x), dtype)
    expected = np.flatnonzero(np.abs(x.astype(np.float32)) >= np.float32(v))
    assert np.array_equal(rec["i"], expected)
    assert np.array_equal(rec["v"], x[expected])
    y = codec.decompress(codec.compress(x))
    assert np.array_equal(y, np.where(np.abs(x.astype(np.float32)) >= np.float32(v), x, 0).astype(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_adaptive_threshold_keeps_half_the_max_and_nothing_for_zeros(dtype):
    x = np.random.default_rng(2).standard_normal(1000).astype(dtype)
    codec = build_chain({"compressor": "adaptive_threshold"}, 1000, dtype)
    rec = sent(codec.compress(x), dtype)
    assert np.array_equal(rec["i"], np.flatnonzero(np.abs(x) >= np.abs(x).max() / 2))
    assert codec.compress(np.zeros(1000, dtype)).size == 0


@pytest.mark.parametrize("name", ["threshold", "adaptive_threshold"])
def test_sparse_keeps_non_finite(name):
    x = np.full(50, 0.1, np.float32)
    x[[4, 9]] = [np.nan, -np.inf]
    codec = build_chain({"compressor": name, "threshold": 1.0} if name == "threshold" else
                        {"compressor": name}, 50, np.float32)
    y = codec.decompress(codec.compress(x))
    assert np.isnan(y[4]) and y[9] == -np.inf


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100])
def test_sign_and_signnorm(dtype, n):
    x = np.random.default_rng(n).standard_normal(n).astype(dtype)
    x[0] = 0
    sign = build_chain({"compressor": "sign"}, n, dtype)
    assert np.array_equal(sign.decompress(sign.compress(x)), np.where(x < 0, -1, 1).astype(dtype))
    norm = build_chain({"compressor": "signnorm"}, n, dtype)
    scale = np.float32(np.abs(x.astype(np.float64)).sum() / n)
    assert np.array_equal(norm.decompress(norm.compress(x)), np.where(x < 0, -scale, scale).astype(dtype))
    assert COMPRESSORS["sign"].reducers[0] == "majority"


def test_sign_shows_non_finite_through_its_scale():
    x = np.ones(40, np.float32)
    x[5] = np.nan
    codec = build_chain({"compressor": "sign"}, 40, np.float32)
    assert np.all(np.isnan(codec.decompress(codec.compress(x))))


VALID = [
    {"compressor": "terngrad"}, {"compressor": "qsgd", "levels": 5}, {"compressor": "qsgd"},
    {"compressor": "threshold", "threshold": 0.5}, {"compressor": "adaptive_threshold"},
    {"compressor": "sign"}, {"compressor": "signnorm"}, {"compressor": "dgc", "k": 0.1},
    {"compressor": "dgc", "k": 0.1, "fp16_values": True}, {"compressor": "powersgd", "rank": 2},
]


@pytest.mark.parametrize("params", VALID, ids=lambda p: "-".join(f"{v}" for v in p.values()))
@pytest.mark.parametrize("dtype", DTYPES)
def test_malformed_payloads_raise_value_error(params, dtype):
    n = 37
    codec = build_chain(dict(params, seed=3), n, dtype)
    x = np.random.default_rng(0).standard_normal(n).astype(dtype)
    good = codec.compress(x).copy()
    if params["compressor"] == "powersgd":
        good = np.concatenate([good, codec.compress_q(good)])
    codec.decompress(good)
    bad = [good[:-1], np.concatenate([good, np.zeros(1, np.uint8)]), np.zeros(0, np.uint8)]
    if params["compressor"] in ("threshold", "adaptive_threshold", "dgc"):
        rec = sent(good, np.float16 if params.get("fp16_values") or dtype == np.float16 else np.float32)
        assert rec.size >= 2
        oob, unsorted = rec.copy(), rec.copy()
        oob["i"][-1] = n
        unsorted["i"][[0, 1]] = unsorted["i"][[1, 0]]
        bad += [oob.view(np.uint8), unsorted.view(np.uint8), np.concatenate([good, good])]
        bad = [b for b in bad if b.size]  # no records is a valid (empty) message
    if params["compressor"] == "terngrad":
        bad.append(np.concatenate([good[:4], np.full(good.size - 4, 0xFF, np.uint8)]))  # code 3
        last = good.copy()
        last[-1] |= 0xC0  # a padding code (37 = 9*4 + 1)
        bad.append(last)
    if params["compressor"] == "qsgd":
        high = good.copy()
        high[4:] = 0xFF  # levels above Q (Q = 5 or 255 with 3 or 9 bits)
        bad.append(high)
    for payload in bad:
        with pytest.raises(ValueError):
            codec.decompress(payload)
        if params["compressor"] != "powersgd":
            with pytest.raises(ValueError):
                codec.decompress_add(payload, np.zeros(n, dtype))


@pytest.mark.parametrize("params", VALID, ids=lambda p: "-".join(f"{v}" for v in p.values()))
def test_random_bytes_never_crash(params):
    """Random bytes, real payloads and real payloads with two bytes overwritten: a ValueError or
    a well-formed decoding, never a crash; every real payload decodes, something is rejected."""
    n = 50
    sender = build_chain(dict(params, seed=3), n, np.float32)
    codec = build_chain(dict(params, seed=3), n, np.float32)
    rng = np.random.default_rng(1)
    real = accepted = rejected = 0
    for trial in range(300):
        kind = ("random", "real", "damaged")[trial % 3]
        if kind == "random":
            payload = rng.integers(0, 256, rng.integers(0, 600), dtype=np.uint8)
        else:
            payload = sender.compress(rng.standard_normal(n).astype(np.float32)).copy()
            if params["compressor"] == "powersgd":
                payload = np.concatenate([payload, sender.compress_q(payload)])
            if kind == "damaged" and payload.size:
                payload[rng.integers(0, payload.size, 2)] = rng.integers(0, 256, 2, dtype=np.uint8)
            real += kind == "real"
        try:
            y = codec.decompress(payload)
        except ValueError:
            assert kind != "real", f"trial {trial}: a payload {params['compressor']} made was rejected"
            rejected += 1
            continue
        accepted += 1
        assert y.shape == (n,) and y.dtype == np.float32
    assert accepted >= real == 100 and rejected > 0


@pytest.mark.parametrize("n", [1, 7, 4095, 4096, 4097, 1_000_003, 2**31 - 1, 2**32 - 1])
def test_randomk_fast_modulo_is_exact(n):
    from bps_gc.compress._native import lib, ptr
    from xorshift import XorShift128Plus
    state, idx = np.array([2020, 2020], np.uint64), np.empty(3000, np.uint32)
    lib.randomk_indices(ptr(state), n, idx.size, ptr(idx))
    rng = XorShift128Plus(2020)
    assert idx.tolist() == [rng.randint(0, n) for _ in range(idx.size)]


@pytest.mark.parametrize("params", [p for p in VALID if p["compressor"] not in ("dgc", "powersgd")],
                         ids=lambda p: "-".join(f"{v}" for v in p.values()))
def test_error_feedback_conserves_mass(params):
    n, steps = 500, 20
    rng = np.random.default_rng(2)
    codec = build_chain(dict(params, ef="vanilla", seed=5), n, np.float32)
    sent, inputs = np.zeros(n), np.zeros(n)
    for _ in range(steps):
        g = rng.standard_normal(n).astype(np.float32)
        inputs += g
        sent += codec.decompress(codec.compress(g, {"lr": 0.1}))
    assert np.allclose(sent + codec.error, inputs, atol=1e-3)
