"""thc's C kernels (kernels/thc.c, and thc_avx512.c where the CPU has it) on a partition long
enough for every path: whole 65,536-element blocks of jumped xorshift128+ streams (8 or 16), the tail
in blocks of halving streams, the last elements one by one, an odd length, codes clamped past
a scale clipped at 2^32, and summed words of both carriers with an even and an odd number of
lanes to a word. The oracle is numpy: floor(u + r) with r from tests/xorshift.py's Python
generator (the stream carried from one step to the next), the lanes unpacked with integer
shifts, and the decoding formula s (2 Q / M - N)."""
import numpy as np
import pytest

from bps_gc.compress import CompressionParams, build_chain
from bps_gc.compress import thc
from bps_gc.compress._native import lib
from xorshift import XorShift128Plus, mixed_state, worker_seed

N = 2 * 65536 + 3 * 128 + 16 * 8 + 77  # two blocks, halving ones, and 77 left over (odd)
SEED, KEY, RANK = 11, 5, 1


def lanes(words, width, k, count):
    """numpy's unpacking: lane j of word w at bit width * j."""
    shifts = np.arange(k, dtype=np.uint64) * np.uint64(width)
    return ((words.astype(np.uint64)[:, None] >> shifts) & np.uint64((1 << width) - 1)).reshape(-1)[:count]


@pytest.fixture(scope="module")
def x():
    x = np.clip(np.random.default_rng(4).standard_normal(N) * 1e-3, -5e-3, 5e-3).astype(np.float32)
    x[N // 3] = -6e-3  # the peak of step 0: scale 2^-7, every code within it
    return x


def test_long_partition_draws_the_oracles_codes_step_after_step(x):
    params = CompressionParams.from_dict({"compressor": "thc", "bits": 4, "seed": SEED})
    codec = build_chain(params, N, np.float32, key=KEY, rank=RANK)
    codec.set_summands(2)
    gen = XorShift128Plus(1)
    gen.a, gen.b = (int(w) for w in mixed_state(worker_seed(SEED, KEY, RANK)))
    for step, given in enumerate((x, np.where(np.arange(N) % 1000 == 7, np.float32(1e10), x))):
        hist = codec.compress(given, {"step": step}).view(thc.CARRIER) * 2  # two pushes of this bin
        words = codec.compress_q(hist.view(np.uint8)).view(thc.CARRIER)[thc.HEADER:]
        exponent = codec.agreed[0]
        assert exponent == (-7 if step == 0 else 32)  # step 1: 1e10 > 2^32, clipped, so codes clamp
        draws = np.array([gen.next() for _ in range((N + 1) // 2)], np.uint64)
        r = np.stack([draws >> np.uint64(32), draws & np.uint64(0xFFFFFFFF)], 1).reshape(-1)[:N] / 2.0**32
        u = (given.astype(np.float64) * 2.0**-exponent + 1) * 15 / 2
        expected = np.clip(np.floor(u + r), 0, 15)
        np.testing.assert_array_equal(lanes(words, 5, 10, N), expected)
        assert step == 0 or (expected[7::1000] == 15).all()
    assert tuple(int(w) for w in codec.rng_state) == (gen.a, gen.b)  # the stream goes on from here


@pytest.mark.parametrize("carrier", [np.float64, np.int64])
@pytest.mark.parametrize("workers", [2, 8])  # 5-bit lanes (10 or 12 to a word), 7-bit (7 or 9)
def test_long_sums_decode_by_the_formula(x, carrier, workers):
    params = CompressionParams.from_dict({"compressor": "thc", "bits": 4, "feedback": True})
    codec = build_chain(params, N, np.float32, key=KEY)
    codec.set_summands(workers, carrier)
    hist = codec.compress(x, {}).view(carrier) * workers
    words = codec.compress_q(hist.view(np.uint8)).view(carrier)
    summed = words * workers  # every push the same: lanes hold N q, in range by construction
    width = thc.lane_bits(4, workers)
    k = thc.lanes_per_word(width, thc.word_bits(carrier))
    total = lanes(summed[thc.HEADER:].view(np.uint64) if carrier == np.int64 else summed[thc.HEADER:],
                  width, k, N).astype(np.float64)
    assert (total % workers == 0).all() and total.max() <= 15 * workers
    out = codec.finish(summed.view(np.uint8), np.full(N, 7.0, np.float32), workers)
    exponent = codec.agreed[0]
    assert out.tobytes() == (2.0**exponent * (2.0 * total / 15 - workers)).astype(np.float32).tobytes()


@pytest.mark.parametrize("carrier", [np.float64, np.int64])  # 6-bit lanes, 8 or 10 to a word
def test_outputs_streamed_past_the_cache_decode_by_the_formula(x, carrier):
    """An output larger than the last level cache is streamed from its first 64-byte line on,
    the elements before that line one by one; the size is lowered here so any machine streams
    this one. At every start within a line: the formula's floats, nothing written outside."""
    params = CompressionParams.from_dict({"compressor": "thc", "bits": 4})
    codecs = [build_chain(params, N, np.float32, key=KEY, rank=rank) for rank in range(3)]
    for codec in codecs:
        codec.set_summands(3, carrier)
    hist = sum(c.compress(x, {}).view(carrier) for c in codecs)
    summed = sum(c.compress_q(hist.view(np.uint8)).view(carrier) for c in codecs)
    k = thc.lanes_per_word(6, thc.word_bits(carrier))
    total = lanes(summed[thc.HEADER:].view(np.uint64) if carrier == np.int64 else summed[thc.HEADER:], 6, k, N)
    assert len(set(total.tolist())) > 20  # sums of three draws: the table's entries, not a few
    expected = (2.0**codecs[0].agreed[0] * (2.0 * total.astype(np.float64) / 15 - 3)).astype(np.float32)
    before = lib.thc_stream_above(4096)
    try:
        for offset in (0, 1, 2, 3, 4, 13):  # out at 4 * offset bytes into a line (numpy's: 16)
            buf = np.full(N + 32, 7.0, np.float32)
            start = (-(buf.ctypes.data // 4)) % 16 + offset
            codecs[0].finish(summed.view(np.uint8), buf[start:start + N], 3)
            assert buf[start:start + N].tobytes() == expected.tobytes(), offset
            assert (buf[:start] == 7.0).all() and (buf[start + N:] == 7.0).all()
    finally:
        lib.thc_stream_above(before)


def test_a_bad_float64_word_anywhere_is_refused_before_anything_is_written(x):
    """The words are checked 32 at a time from a 64-byte line on: a bad one in the words
    before that line, inside a block of 32 or in the tail is refused with ``out`` untouched;
    -0.0 (an integer) fails the block's quick test and passes word by word."""
    params = CompressionParams.from_dict({"compressor": "thc", "bits": 4, "feedback": True})
    codec = build_chain(params, N, np.float32, key=KEY)
    codec.set_summands(2)
    hist = codec.compress(x, {}).view(thc.CARRIER) * 2
    summed = codec.compress_q(hist.view(np.uint8)).view(thc.CARRIER) * 2
    out = np.full(N, 7.0, np.float32)
    for at in (0, 1, 100, 5_000, summed.size - thc.HEADER - 1):
        for bad in (0.5, -1.0, 2.0**53, np.nan, np.inf, 2.0**51 + 0.5, 1e-300):
            broken = summed.copy()
            broken[thc.HEADER + at] = bad
            with pytest.raises(ValueError, match="a lane overflowed"):
                codec.finish(broken.view(np.uint8), out, 2)
    assert (out == 7.0).all()
    signed = summed.copy()
    signed[thc.HEADER + 5_000] = -0.0
    total = lanes(signed[thc.HEADER:], 5, 10, N).astype(np.float64)
    expected = (2.0**codec.agreed[0] * (2.0 * total / 15 - 2)).astype(np.float32)
    assert codec.finish(signed.view(np.uint8), out, 2).tobytes() == expected.tobytes()
