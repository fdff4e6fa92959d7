"""TernGrad and QSGD against an independent numpy re-computation (xorshift128+ seeded through
splitmix64, two 32-bit draws per output), their statistics, and their formats."""
import math

import numpy as np
import pytest

from bps_gc.compress import build_chain

M64 = (1 << 64) - 1


def splitmix_state(seed):
    words, z = [], seed
    for _ in range(2):
        z = (z + 0x9E3779B97F4A7C15) & M64
        w = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        w = ((w ^ (w >> 27)) * 0x94D049BB133111EB) & M64
        words.append((w ^ (w >> 31)) or 1)
    return words


def uniform_bits(state, n):
    """n 32-bit draws: the high then the low half of each xorshift128+ output."""
    out = []
    while len(out) < n:
        t, s = state
        t ^= (t << 23) & M64
        t ^= t >> 17
        t ^= s ^ (s >> 26)
        state[:] = [s, t]
        r = (t + s) & M64
        out += [r >> 32, r & 0xFFFFFFFF]
    return np.array(out[:n], np.float64)


def terngrad_oracle(x, seed, clip=False):
    x = x.astype(np.float32)
    peak = np.abs(x).max()
    bound = np.float32(np.inf)
    if clip:
        bound = np.float32(2.5 * x.astype(np.float64).std())
    scale = np.float32(min(peak, bound))
    a = np.minimum(np.abs(x), bound)
    with np.errstate(invalid="ignore"):  # 0 / 0 when everything is clipped to 0
        keep = uniform_bits(splitmix_state(seed), x.size) < (a / scale).astype(np.float64) * 2.0**32
    t = np.where(keep, np.sign(x), 0).astype(np.float32)
    return scale * t


def qsgd_oracle(x, seed, levels, biased=False):
    x = x.astype(np.float32)
    norm = math.sqrt((x.astype(np.float64) ** 2).sum())
    mult = np.float32(levels / norm)
    l = np.abs(x) * mult
    f = np.floor(l)
    keep = uniform_bits(splitmix_state(seed), x.size) < (l - f).astype(np.float64) * 2.0**32
    level = np.minimum(f + keep, levels).astype(np.float32)
    tau = 1 + min(x.size / levels**2, math.sqrt(x.size) / levels) if biased else 1
    scale = np.float32(float(np.float32(norm)) / (levels * tau))
    return np.where(x < 0, -1, 1).astype(np.float32) * (level * scale)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 1000])
@pytest.mark.parametrize("clip", [False, True])
def test_terngrad_matches_oracle(n, clip):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    codec = build_chain({"compressor": "terngrad", "clip": clip, "seed": 5}, n, np.float32)
    payload = codec.compress(x)
    assert payload.size == 4 + -(-n // 4)
    assert np.array_equal(codec.decompress(payload), terngrad_oracle(x, 5, clip))


@pytest.mark.parametrize("levels, biased", [(1, False), (3, False), (255, False), (255, True),
                                            (1000, False)])
def test_qsgd_matches_oracle(levels, biased):
    n = 777
    x = (np.random.default_rng(levels).standard_normal(n) ** 3).astype(np.float32)
    codec = build_chain({"compressor": "qsgd", "levels": levels, "biased": biased, "seed": 9},
                        n, np.float32)
    payload = codec.compress(x)
    bits = levels.bit_length() + 1
    assert payload.size == 4 + -(-n * bits // 8)
    assert np.array_equal(codec.decompress(payload), qsgd_oracle(x, 9, levels, biased))


def draws(params, x, trials):
    codec = build_chain(params, x.size, np.float32)
    return np.stack([codec.decompress(codec.compress(x)) for _ in range(trials)]).astype(np.float64)


@pytest.mark.parametrize("params", [{"compressor": "terngrad", "seed": 3},
                                    {"compressor": "qsgd", "levels": 4, "seed": 3},
                                    {"compressor": "qsgd", "levels": 255, "seed": 4}])
def test_unbiased_within_four_standard_errors(params):
    x = (np.random.default_rng(0).standard_normal(64) * np.linspace(0.01, 1, 64)).astype(np.float32)
    x[7] = 0
    y = draws(params, x, 2000)
    mean, se = y.mean(0), y.std(0, ddof=1) / math.sqrt(2000)
    random = se > 0
    assert np.all(np.abs(mean - x)[random] <= 4 * se[random])
    # elements that never vary are exact (a zero, or the max for TernGrad)
    assert np.allclose(mean[~random], x[~random], rtol=1e-6, atol=0)


@pytest.mark.parametrize("levels, n", [(2, 100), (16, 64), (255, 1000)])
def test_qsgd_meets_its_variance_bound(levels, n):
    x = np.random.default_rng(levels).standard_normal(n).astype(np.float32)
    y = draws({"compressor": "qsgd", "levels": levels, "seed": 1}, x, 2000)
    err = ((y - x) ** 2).sum(1).mean()
    bound = min(n / levels**2, math.sqrt(n) / levels) * (x.astype(np.float64) ** 2).sum()
    assert err <= bound


def test_biased_qsgd_divides_by_tau():
    n, levels = 400, 4
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    plain = build_chain({"compressor": "qsgd", "levels": levels, "seed": 2}, n, np.float32)
    biased = build_chain({"compressor": "qsgd", "levels": levels, "biased": True, "seed": 2}, n, np.float32)
    a, b = plain.decompress(plain.compress(x)), biased.decompress(biased.compress(x))
    tau = 1 + min(n / levels**2, math.sqrt(n) / levels)
    assert np.allclose(b, a / tau, rtol=1e-6)


@pytest.mark.parametrize("name", ["terngrad", "qsgd"])
def test_small_seeds_draw_differently(name):
    # BytePS seeds xorshift128+ with a = b = seed: seeds 1 and 2 then start alike; ours are mixed
    x = np.full(64, 0.5, np.float32)
    x[0] = 1
    first = [build_chain({"compressor": name, "seed": s}, 64, np.float32).compress(x).tobytes()
             for s in (1, 2, 3)]
    assert len(set(first)) == 3


@pytest.mark.parametrize("params", [{"compressor": "terngrad"}, {"compressor": "qsgd"},
                                    {"compressor": "terngrad", "clip": True}])
@pytest.mark.parametrize("n", [1, 2, 9])
def test_float16_and_tiny(params, n):
    x = np.linspace(-1, 1, n).astype(np.float16) if n > 1 else np.array([-0.75], np.float16)
    c16 = build_chain(dict(params, seed=4), n, np.float16)
    c32 = build_chain(dict(params, seed=4), n, np.float32)
    p16, p32 = c16.compress(x), c32.compress(x.astype(np.float32))
    assert p16.tobytes() == p32.tobytes()  # float16 is quantized in float32 (exact)
    y = c16.decompress(p16)
    assert y.dtype == np.float16 and np.array_equal(y, c32.decompress(p32).astype(np.float16))


@pytest.mark.parametrize("name", ["terngrad", "qsgd"])
def test_zeros_and_non_finite(name):
    codec = build_chain({"compressor": name, "seed": 1}, 10, np.float32)
    assert np.array_equal(codec.decompress(codec.compress(np.zeros(10, np.float32))), np.zeros(10))
    x = np.ones(10, np.float32)
    x[3] = np.inf
    assert np.all(np.isnan(codec.decompress(codec.compress(x))))


def test_qsgd_partition_of_subnormals():
    x = np.array([1e-42, -3e-42, 0, 2e-42], np.float32)
    codec = build_chain({"compressor": "qsgd", "levels": 255, "seed": 1}, 4, np.float32)
    y = np.stack([codec.decompress(codec.compress(x)) for _ in range(200)])
    assert np.all(np.isfinite(y)) and np.all(np.sign(y) * np.sign(x) >= 0)
