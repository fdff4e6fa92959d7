"""Issue 10: a non-finite gradient shows up in that round's result (AMP's loss scaler must see
it), while error feedback and momentum drop that step's state, so later rounds stay finite."""
import numpy as np
import pytest

from bps_gc.compress import build_chain

CODECS = [
    {"compressor": "onebit", "scaling": True}, {"compressor": "onebit"},
    {"compressor": "topk", "k": 0.05}, {"compressor": "randomk", "k": 0.05, "seed": 2},
    {"compressor": "dithering", "k": 2, "seed": 2},
    {"compressor": "terngrad"}, {"compressor": "qsgd"}, {"compressor": "threshold", "threshold": 0.5},
    {"compressor": "adaptive_threshold"}, {"compressor": "sign"}, {"compressor": "signnorm"},
]
NEW_ONLY_32_16 = ("terngrad", "qsgd", "threshold", "adaptive_threshold", "sign", "signnorm")


def chains(params, dtype):
    for extra in ({"ef": "vanilla"}, {"ef": "vanilla", "momentum": "nesterov", "mu": 0.9},
                  {"momentum": "nesterov", "mu": 0.9}):
        yield extra, build_chain(dict(params, **extra), 200, dtype, key=5)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("params", CODECS, ids=lambda p: "-".join(str(v) for v in p.values()))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_step_shows_and_later_rounds_stay_finite(params, dtype, bad):
    if dtype == np.float64 and params["compressor"] in NEW_ONLY_32_16:
        pytest.skip("float32 and float16 only")
    rng = np.random.default_rng(0)
    for extra, codec in chains(params, dtype):
        good = [rng.standard_normal(200).astype(dtype) for _ in range(4)]
        codec.compress(good[0], {"lr": 0.1})
        error = getattr(codec, "error", getattr(getattr(codec, "inner", None), "error", None))
        before = None if error is None else error.copy()
        momentum = getattr(codec, "momentum", None)
        momentum_before = None if momentum is None else momentum.copy()
        x = good[1].copy()
        x[17] = bad
        y = codec.decompress(codec.compress(x, {"lr": 0.1}))
        assert not np.all(np.isfinite(y)), (extra, "the round must show the non-finite gradient")
        ef = codec if "ef" in extra and "momentum" not in extra else getattr(codec, "inner", None)
        if "ef" in extra:
            assert np.array_equal(ef.error, before), "error feedback kept the state of the last good step"
        if "momentum" in extra:
            assert np.array_equal(codec.momentum, momentum_before)
        for g in good[2:]:
            y = codec.decompress(codec.compress(g, {"lr": 0.1}))
            assert np.all(np.isfinite(y)), extra
        if "ef" in extra:
            assert np.all(np.isfinite(ef.error))


def test_skipped_step_leaves_ef_exactly_as_if_it_never_happened():
    rng = np.random.default_rng(1)
    gs = [rng.standard_normal(300).astype(np.float32) for _ in range(3)]
    a = build_chain({"compressor": "topk", "k": 10, "ef": "vanilla"}, 300, np.float32)
    b = build_chain({"compressor": "topk", "k": 10, "ef": "vanilla"}, 300, np.float32)
    a.compress(gs[0], {"lr": 0.1})
    b.compress(gs[0], {"lr": 0.1})
    bad = gs[1].copy()
    bad[3] = np.nan
    a.compress(bad, {"lr": 0.05})  # neither the state nor the lr of this step is kept
    assert a.compress(gs[2], {"lr": 0.1}).tobytes() == b.compress(gs[2], {"lr": 0.1}).tobytes()
    assert np.array_equal(a.error, b.error)


def test_float16_overflow_of_the_residual_is_a_non_finite_step():
    codec = build_chain({"compressor": "topk", "k": 1, "ef": "vanilla"}, 4, np.float16)
    x = np.array([60000, 50000, 1, 1], np.float16)
    codec.compress(x, 0.1)  # keeps 60000, holds 50000 back
    held = codec.error.copy()
    y = codec.decompress(codec.compress(x, 0.1))  # 50000 + 50000 overflows float16
    assert not np.all(np.isfinite(y)) and np.array_equal(codec.error, held)



def test_powersgd_warm_start_survives_a_non_finite_step():
    # one worker runs its two phases on its own sums; after a NaN step the next warm start must
    # be the last good Q (a NaN Q would make every later step NaN)
    rng = np.random.default_rng(2)
    gs = [rng.standard_normal(192).astype(np.float32) for _ in range(3)]
    codec = build_chain({"compressor": "powersgd", "rank": 2}, 192, np.float32, key=3, shape=(16, 12))

    def step(g):
        return codec.finish(codec.compress_q(codec.compress(g, {"lr": 0.1})), workers=1)

    step(gs[0])
    good_q = codec.q.copy()
    bad = gs[1].copy()
    bad[5] = np.nan
    assert not np.all(np.isfinite(step(bad)))
    assert np.array_equal(codec.q, good_q)
    assert np.all(np.isfinite(step(gs[2])))
