"""DGC (algorithms.md section 2) against an independent numpy re-computation."""
import math

import numpy as np
import pytest

from bps_gc.compress import build_chain
from bps_gc.compress.threshold import RECORDS


def sent(payload, value_dtype=np.float32):
    return np.frombuffer(bytes(payload), RECORDS[np.dtype(value_dtype)])


def plan(n, r, ratio=0.01):
    """The reference code's sampling plan, spelled out again."""
    pct, cpr = math.ceil(n * ratio), math.ceil(2 / r)
    if n <= cpr:
        stride, ns = 1, n
    else:
        stride = math.ceil(n / max(pct, cpr) / 32) * 32 + 1
        ns = n // stride
        while ns < max(pct, cpr):
            stride -= 8
            ns = n // stride
    return stride, ns, math.ceil(ns * r), math.ceil(n * r)


def select_oracle(v, r, start):
    """DGC's selection given the sampling start: sampled threshold, <= 10 adaptation rounds,
    the exact top-k (ties to the lower index) past 1.3x, at most num_selects kept."""
    n = v.size
    stride, ns, tks, nsel = plan(n, r)
    imp = np.abs(v)
    samples = imp if ns == n else imp[start::stride]
    thr = np.sort(samples)[::-1][tks - 1]
    idx = np.flatnonzero(imp >= thr)
    for _ in range(10):
        if idx.size > nsel:
            if idx.size > 1.3 * nsel:
                return np.sort(np.lexsort((np.arange(n), -imp))[:nsel]), True
            break
        if idx.size < 0.8 * nsel:
            thr = np.float32(thr * np.float32(0.8))
            idx = np.flatnonzero(imp >= thr)
        else:
            break
    return idx[:nsel], False


def test_sampling_plan_of_the_reference_code():
    from bps_gc.compress.dgc import sampling_plan
    assert sampling_plan(1_000_000, 0.001, 0.01) == (97, 10309, 11, 1000)
    for n, r in [(10, 0.5), (1000, 0.001), (12345, 0.01), (4_000_000, 0.001), (300, 0.25)]:
        assert sampling_plan(n, r, 0.01) == plan(n, r)


INPUTS = {
    "normal": lambda rng, n: rng.standard_normal(n),
    "heavy": lambda rng, n: rng.standard_cauchy(n),
    "ties": lambda rng, n: rng.integers(-3, 4, n).astype(float),
    "sparse": lambda rng, n: rng.standard_normal(n) * (rng.random(n) < 0.002),
}


@pytest.mark.parametrize("kind", INPUTS)
@pytest.mark.parametrize("n, k", [(100_000, 0.001), (20_000, 0.01), (3000, 0.1), (50, 0.5), (1, 0.001)])
def test_selection_matches_oracle_and_stays_within_bounds(kind, n, k):
    rng = np.random.default_rng(n)
    codec = build_chain({"compressor": "dgc", "k": k, "seed": 4}, n, np.float32)
    for _ in range(3):  # no momentum: v is the gradient plus what was not sent
        g = INPUTS[kind](rng, n).astype(np.float32)
        v = codec.v + g
        rec = sent(codec.compress(g))
        last = codec.last
        idx, fallback = select_oracle(v, k, last["start"])
        assert np.array_equal(rec["i"], idx) and last["fallback"] == fallback
        assert np.array_equal(rec["v"], v[idx])
        nsel = last["selects"]
        assert idx.size <= nsel
        if not fallback:  # the adaptation accepted a count within its bounds, or ran out of rounds
            assert last["count"] <= 1.3 * nsel
            assert last["count"] >= 0.8 * nsel or last["rounds"] == 10 or last["count"] == n
        remaining = v.copy()
        remaining[idx] = 0
        assert np.array_equal(codec.v, remaining)


def test_warmup_schedule_from_the_epoch():
    n, k = 100_000, 0.001
    codec = build_chain({"compressor": "dgc", "k": k, "warmup_epochs": 5}, n, np.float32)
    got = []
    for epoch in range(7):
        rec = sent(codec.compress(np.random.default_rng(epoch).standard_normal(n).astype(np.float32),
                                  {"epoch": epoch, "lr": 0.1, "step": epoch}))
        got.append(codec.last["density"])
        assert rec.size <= math.ceil(n * got[-1])
    expected = [k ** ((e + 1) / 5) for e in range(5)] + [k, k]
    assert np.allclose(got, expected, rtol=1e-12)
    assert [round(d * 100, 1) for d in got[:5]] == [25.1, 6.3, 1.6, 0.4, 0.1]


def test_warmup_densities_list_and_context_override():
    n = 10_000
    codec = build_chain({"compressor": "dgc", "k": 0.01, "warmup_densities": [0.5, 0.1]}, n, np.float32)
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    densities = []
    for ctx in [{"epoch": 0}, {"epoch": 1}, {"epoch": 2}, {"epoch": 0, "density": 0.02}]:
        codec.compress(x, ctx)
        densities.append(codec.last["density"])
    assert densities == [0.5, 0.1, 0.01, 0.02]


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("masking", [True, False])
def test_momentum_correction_and_factor_masking(nesterov, masking):
    n, mu = 5000, 0.9
    params = {"compressor": "dgc", "k": 0.01, "mu": mu, "momentum_masking": masking, "seed": 2}
    if nesterov:
        params["momentum"] = "nesterov"
    codec = build_chain(params, n, np.float32)
    assert type(codec).__name__ == "DGC"  # no momentum decorator around it
    rng = np.random.default_rng(3)
    u, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    m = np.float32(mu)
    for _ in range(4):
        g = rng.standard_normal(n).astype(np.float32)
        if nesterov:
            u = (u + g) * m
            v = v + u + g
        else:
            u = u * m + g
            v = v + u
        rec = sent(codec.compress(g))
        assert np.array_equal(rec["v"], v[rec["i"]])
        v[rec["i"]] = 0
        if masking:
            u[rec["i"]] = 0
            assert np.all(codec.u[rec["i"]] == 0)  # the momentum it sent is gone
        else:
            assert np.any(codec.u[rec["i"]] != 0)
        assert np.array_equal(codec.u, u) and np.array_equal(codec.v, v)


def test_fp16_values_and_float16_partitions():
    n = 3000
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    codec = build_chain({"compressor": "dgc", "k": 0.01, "fp16_values": True, "seed": 1}, n, np.float32)
    payload = codec.compress(x)
    rec = sent(payload, np.float16)
    assert payload.size == 6 * rec.size
    assert np.array_equal(rec["v"], x[rec["i"]].astype(np.float16))
    half = build_chain({"compressor": "dgc", "k": 0.01, "seed": 1}, n, np.float16)
    y = half.decompress(half.compress(x.astype(np.float16)))
    assert y.dtype == np.float16 and 0.8 * 30 <= np.count_nonzero(y) <= 30


def test_clipping_scales_the_gradient_to_the_norm_bound():
    n = 1000
    g = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    codec = build_chain({"compressor": "dgc", "k": 0.5, "clip_norm": 2.0, "seed": 1}, n, np.float32)
    rec = sent(codec.compress(g, {"workers": 4}))
    total = codec.v.copy()
    total[rec["i"]] += rec["v"]
    coef = (2.0 / math.sqrt(4)) / (np.linalg.norm(g.astype(np.float64)) + 1e-6)
    assert np.array_equal(total, g * np.float32(coef))


def test_non_finite_gradient_shows_and_keeps_state():
    n = 2000
    codec = build_chain({"compressor": "dgc", "k": 0.01, "mu": 0.9, "seed": 1}, n, np.float32)
    rng = np.random.default_rng(0)
    codec.compress(rng.standard_normal(n).astype(np.float32))
    u, v = codec.u.copy(), codec.v.copy()
    bad = rng.standard_normal(n).astype(np.float32)
    bad[[10, 20]] = [np.nan, np.inf]
    y = codec.decompress(codec.compress(bad))
    assert np.isnan(y[10]) and np.isinf(y[20])
    assert np.array_equal(codec.u, u) and np.array_equal(codec.v, v)
    y = codec.decompress(codec.compress(rng.standard_normal(n).astype(np.float32)))
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(codec.v))


def test_pushes_sum_exactly_with_decompress_add():
    n, workers = 4000, 4
    codecs = [build_chain({"compressor": "dgc", "k": 0.01, "seed": 1}, n, np.float32) for _ in range(workers)]
    rng = np.random.default_rng(5)
    payloads = [c.compress(rng.standard_normal(n).astype(np.float32)) for c in codecs]
    acc = np.zeros(n, np.float32)
    for c, p in zip(codecs, payloads):
        c.decompress_add(p, acc)
    expected = np.zeros(n, np.float32)
    for p in payloads:
        rec = sent(p)
        expected[rec["i"]] += rec["v"]
    assert np.array_equal(acc, expected)
