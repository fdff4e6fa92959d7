"""thc (compress/thc.py): summable b-bit codes. Each check has an independent numpy oracle:
lane widths and packing against integer arithmetic, the decoded sum against numpy's integer
sum of the codes, the stochastic decoded mean against its stated bound, the error feedback's
residual against half a quantization step, the rotation against its inverse; and the refusals
(a lane overflow, a push with another scale or bit width) leave the output untouched."""
import math

import numpy as np
import pytest

from bps_gc.compress import CompressionParams, ParamError, build_chain
from bps_gc.compress import thc
from xorshift import XorShift128Plus, mixed_state, worker_seed

CTX = {"lr": 0.1, "step": 3, "epoch": 0}


def chains(n, workers, key=7, **options):
    """One chain per worker, each with its rank (its own rounding draws)."""
    params = CompressionParams.from_dict({"compressor": "thc", **options})
    out = [build_chain(params, n, np.float32, key=key, rank=rank) for rank in range(workers)]
    for c in out:
        c.set_summands(workers)
    return out


def phases(codecs, inputs, ctx=CTX):
    """Both phases summed as the transports do (float64 adds), and every worker's finish."""
    hist = np.sum([c.compress(x, ctx).view(thc.CARRIER) for c, x in zip(codecs, inputs)], axis=0)
    payloads = [c.compress_q(hist.view(np.uint8)).view(thc.CARRIER) for c in codecs]
    summed = np.sum(payloads, axis=0)
    return payloads, summed, [c.finish(summed.view(np.uint8), None, len(codecs)) for c in codecs]


def pack(codes, width):
    """The oracle's packing (docs/codecs.md): code j of a word at bit width * j, floor(53 / width)
    codes a float64 word, written here with Python integers."""
    k = 53 // width
    codes = [int(c) for c in codes] + [0] * (-len(codes) % k)
    return np.array([float(sum(c << (width * j) for j, c in enumerate(codes[i:i + k])))
                     for i in range(0, len(codes), k)])


def unpack(words, width, count):
    k, mask = 53 // width, (1 << width) - 1
    return np.array([(int(w) >> (width * j)) & mask for w in words for j in range(k)][:count], np.int64)


def nearest(x, exponent, levels):
    """Codes rounded to the nearest, ties up (the C kernel's floor(u + 1/2))."""
    return np.clip(np.floor((x.astype(np.float64) / 2.0**exponent + 1) * levels / 2 + 0.5), 0, levels).astype(np.int64)


def inputs(n, workers, scale=1e-3, seed=0):
    return [np.random.default_rng([seed, w]).standard_normal(n).astype(np.float32) * scale for w in range(workers)]


def test_lane_widths_and_refusal_past_float64s_exact_integers():
    assert [thc.lane_bits(4, n) for n in (1, 2, 3, 8, 9, 1024)] == [4, 5, 6, 7, 8, 14]
    assert thc.lanes_per_word(5) == 10 and thc.lanes_per_word(7) == 7 and thc.lanes_per_word(17) == 3
    with pytest.raises(ValueError, match="need 54-bit lanes"):
        thc.lane_bits(8, 2**45 + 1)
    with pytest.raises(ValueError, match="bits must be one of"):
        thc.lane_bits(3, 2)


def test_each_push_is_its_codes_packed_as_stated():
    """One worker's phase-2 payload: the header, then its nearest-rounded codes packed by the
    oracle's own packing, word for word."""
    for n, bits, workers in ((1001, 4, 5), (7, 2, 1), (300, 8, 3)):
        xs = inputs(n, workers, seed=n)
        payloads, _, _ = phases(chains(n, workers, bits=bits, feedback=True), xs)
        exponent = max(math.ceil(math.log2(np.abs(x).max())) for x in xs)
        width = thc.lane_bits(bits, workers)
        for x, payload in zip(xs, payloads):
            assert payload[:thc.HEADER].tolist() == [bits, exponent, 1]
            assert payload[thc.HEADER:].tobytes() == pack(nearest(x, exponent, 2**bits - 1), width).tobytes()


def test_codes_that_would_overflow_their_lane_are_refused():
    codecs = chains(300, 2)
    payloads, summed, _ = phases(codecs, inputs(300, 2))
    out = np.full(300, 7.0, np.float32)
    broken = summed.copy()
    broken[thc.HEADER + 3] = 2.0**53  # a word past float64's exact integers
    with pytest.raises(ValueError, match="a lane overflowed"):
        codecs[0].finish(broken.view(np.uint8), out, 2)
    broken[thc.HEADER + 3] = 0.5  # not a sum of whole words
    with pytest.raises(ValueError, match="a lane overflowed"):
        codecs[0].finish(broken.view(np.uint8), out, 2)
    assert (out == 7.0).all()
    # a push more than the lanes were sized for: phase 1 counts it, and refuses
    codecs = chains(300, 2)
    extra = chains(300, 2)[0]
    hist = sum(c.compress(x, CTX).view(thc.CARRIER) for c, x in zip(codecs + [extra], inputs(300, 3)))
    with pytest.raises(ValueError, match="counted 3 pushes, but the lanes are sized for 2"):
        codecs[0].compress_q(hist.view(np.uint8))


def test_int64_words_refuse_a_push_their_lanes_were_not_sized_for():
    """int64 words carry no integer check (every bit pattern is a sum modulo 2^64), so the
    headers' push count is what refuses a third push into lanes sized for two, in either
    phase, before anything is written."""
    def sized(n):
        codecs = chains(300, n, bits=4, feedback=True)
        for c in codecs:
            c.set_summands(2, np.int64)
        return codecs
    codecs, extra = sized(2), sized(1)[0]
    xs = inputs(300, 3)
    hist = sum(c.compress(x, CTX).view(np.int64) for c, x in zip(codecs + [extra], xs))
    with pytest.raises(ValueError, match="counted 3 pushes, but the lanes are sized for 2"):
        codecs[0].compress_q(hist.view(np.uint8))
    hist = sum(c.compress(x, CTX).view(np.int64) for c, x in zip(codecs, xs))
    extra.compress(xs[2], CTX)
    payloads = [c.compress_q(hist.view(np.uint8)).view(np.int64) for c in codecs + [extra]]
    out = np.full(300, 7.0, np.float32)
    with pytest.raises(ValueError, match="the sum holds 3 pushes, its lanes hold 2"):
        codecs[0].finish(np.sum(payloads, axis=0).view(np.uint8), out, 2)
    assert (out == 7.0).all()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_decoded_sum_is_numpys_integer_sum_of_the_codes(bits):
    """Nearest rounding (``feedback``): every code is recomputed here from the agreed scale,
    summed as integers, and decoded by the stated formula s (2 Q / M - N)."""
    workers, n = 3, 1000
    xs = inputs(n, workers)
    _, summed, outs = phases(chains(n, workers, bits=bits, feedback=True), xs)
    exponent = max(math.ceil(math.log2(np.abs(x).max())) for x in xs)
    levels = 2**bits - 1
    total = np.sum([nearest(x, exponent, levels) for x in xs], axis=0)
    np.testing.assert_array_equal(unpack(summed[thc.HEADER:], thc.lane_bits(bits, workers), n), total)
    expected = (2.0**exponent * (2.0 * total / levels - workers)).astype(np.float32)
    for out in outs:
        assert out.tobytes() == expected.tobytes()
    # each element within N half-steps of the true sum
    assert np.abs(outs[0] - np.sum(xs, axis=0)).max() <= workers * 2.0**exponent / levels * 1.0001


@pytest.mark.parametrize("bits, workers", [(4, 3), (8, 256), (2, 2)])
def test_int64_words_add_64_bit_lanes_exactly(bits, workers):
    """torch.distributed's words (``set_summands(N, int64)``): floor(64 / w) lanes to a word,
    summed by numpy's int64 addition as gloo and NCCL sum them (wrapping modulo 2^64): the lanes
    read back unsigned are numpy's integer sums of the recomputed codes, the decoded values
    are the float64 words' bit for bit, and 8-bit codes of 256 summands fill bit 63."""
    n = 700
    xs = inputs(n, workers, seed=bits)
    words = chains(n, workers, bits=bits, feedback=True)
    for c in words:
        c.set_summands(workers, np.int64)
    hist = np.sum([c.compress(x, CTX).view(np.int64) for c, x in zip(words, xs)], axis=0)
    summed = np.sum([c.compress_q(hist.view(np.uint8)).view(np.int64) for c in words], axis=0)
    width = thc.lane_bits(bits, workers)
    k = 64 // width
    assert words[0].phase_sizes == (math.ceil(thc.HIST / (64 // thc.count_bits(workers))), thc.HEADER + math.ceil(n / k))
    exponent = max(math.ceil(math.log2(np.abs(x).max())) for x in xs)
    total = np.sum([nearest(x, exponent, 2**bits - 1) for x in xs], axis=0)
    mask = (1 << width) - 1
    lanes = [(int(w) >> (width * j)) & mask for w in summed[thc.HEADER:].view(np.uint64) for j in range(k)][:n]
    np.testing.assert_array_equal(np.array(lanes, np.int64), total)
    floats = [o for o in phases(chains(n, workers, bits=bits, feedback=True), xs)[2]]
    out = words[0].finish(summed.view(np.uint8), None, workers)
    assert out.tobytes() == floats[0].tobytes()
    if (bits, workers) == (8, 256):
        assert (summed[thc.HEADER:] < 0).any()  # the top lane reaches the sign bit


@pytest.mark.parametrize("rotate", [False, True])
def test_stochastic_rounding_is_unbiased_within_six_sigma(rotate):
    """Each code is floor(u + U[0,1)): E = u, variance <= 1/4 code steps of 2 s / M, so a
    decoded sum of N pushes has per-element variance <= N (s / M)^2 (also after the orthonormal
    rotation). Over T rounds the mean error is within 6 sqrt(N / T) s / M of zero everywhere."""
    workers, n, rounds, bits = 2, 500, 400, 4
    xs = inputs(n, workers, seed=3)
    codecs = chains(n, workers, bits=bits, rotate=rotate)
    total, scales = np.zeros(n), []
    for t in range(rounds):
        _, _, outs = phases(codecs, xs, dict(CTX, step=t))
        total += outs[0]
        scales.append(2.0 ** codecs[0].agreed[0])
    sigma = math.sqrt(workers / rounds) * max(scales) / (2**bits - 1)
    err = np.abs(total / rounds - np.sum(xs, axis=0, dtype=np.float64))
    assert err.max() < 6 * sigma, (err.max(), sigma)
    assert err.max() > 0.05 * sigma  # it is random, not exact


def rounded_codes(codec, x, ctx, workers=2):
    """One worker's codes of ``x`` (its phase-2 payload unpacked), the histogram its alone."""
    hist = codec.compress(x, ctx)
    summed = np.asarray(hist).view(thc.CARRIER) * workers  # as if every worker pushed that bin
    return unpack(np.asarray(codec.compress_q(summed.view(np.uint8))).view(thc.CARRIER)[thc.HEADER:],
                  codec.width, codec.codes)


def test_rounding_draws_follow_seed_key_and_rank_alone():
    """Runs repeat: fresh chains of one (seed, key, rank) give the same codes at every step (no
    process id or OS entropy); another rank or key draws apart. The codes are numpy's
    floor(u + r), r from xorshift128+ seeded by the rank's seed (tests/xorshift.py, high 32
    bits first), and the torch chain's r is torch's generator under that seed."""
    torch = pytest.importorskip("torch")
    n, params = 600, CompressionParams.from_dict({"compressor": "thc", "bits": 4, "seed": 11})
    x = inputs(n, 1, seed=1)[0]

    def codes(rank=1, key=5, steps=3, **device):
        codec = build_chain(params, n, np.float32, key=key, rank=rank, **device)
        codec.set_summands(2)
        given = torch.from_numpy(x) if device else x
        return [rounded_codes(codec, given, dict(CTX, step=t)) for t in range(steps)], codec

    runs, codec = codes()
    assert all((a == b).all() for a, b in zip(runs, codes()[0]))  # a second launch
    assert (runs[0] != runs[1]).any()  # the stream goes on across steps
    for other in (codes(rank=0)[0], codes(key=6)[0]):
        assert np.mean(other[0] != runs[0]) > 0.2
    u = (x.astype(np.float64) * 2.0 ** -codec.agreed[0] + 1) * 15 / 2
    gen = XorShift128Plus(1)
    gen.a, gen.b = (int(w) for w in mixed_state(worker_seed(11, 5, 1)))
    r = np.array([[w >> 32, w & 0xFFFFFFFF] for w in (gen.next() for _ in range(n // 2))]).reshape(-1) / 2.0**32
    np.testing.assert_array_equal(runs[0], np.clip(np.floor(u + r), 0, 15))
    on_torch, dev = codes(steps=1, device="cpu")
    generator = torch.Generator().manual_seed(worker_seed(11, 5, 1) & 2**63 - 1)
    r = torch.rand(n, dtype=torch.float64, generator=generator).numpy()
    np.testing.assert_array_equal(on_torch[0], np.clip(np.floor(u + r), 0, 15))
    assert (on_torch[0] == codes(steps=1, device="cpu")[0][0]).all()
    assert (codes(rank=0, steps=1, device="cpu")[0][0] != on_torch[0]).any()


def test_error_feedback_residual_stays_within_half_a_step():
    """One worker, nearest rounding: each step's error is at most s / M per element, and the
    decoded values summed over the steps differ from the inputs' sum only by the last error."""
    codecs = chains(800, 1, bits=2, feedback=True)
    decoded, given = np.zeros(800), np.zeros(800)
    for t in range(20):
        x = inputs(800, 1, seed=t)[0]
        _, _, outs = phases(codecs, [x], dict(CTX, step=t))
        decoded += outs[0]
        given += x
        step = 2.0 ** codecs[0].agreed[0] / 3
        assert np.abs(codecs[0].error).max() <= step * 1.0001
    np.testing.assert_allclose(given - decoded, codecs[0].error, atol=1e-6)


def test_rotation_is_inverted_and_agrees_on_every_worker():
    a, b = chains(5000, 2, rotate=True)
    x = inputs(5000, 1)[0]
    a.compress(x, CTX)
    b.compress(x, CTX)
    np.testing.assert_array_equal(a.signs, b.signs)  # the same seed: key and step
    np.testing.assert_allclose(a._rotate(a.y, inverse=True)[:5000], x, atol=1e-9)
    # the C kernel does numpy's float32 operations in numpy's order (thc.rotated: the device's)
    padded = np.zeros(a.codes, np.float32)
    padded[:5000] = x
    assert a.y.tobytes() == thc.rotated(padded, a.signs, a.block).tobytes()
    assert a._rotate(a.y, True).tobytes() == thc.rotated(a.y, a.signs, a.block, inverse=True).tobytes()
    assert a.block == 4096 and a.codes == 8192
    a.compress(x, dict(CTX, step=4))
    assert not np.array_equal(a.signs, b.signs)  # a new rotation each step
    np.testing.assert_allclose(np.linalg.norm(a.y), np.linalg.norm(x), rtol=1e-5)


def test_a_push_with_another_scale_or_bit_width_is_refused_and_nothing_written():
    workers, n = 2, 300
    codecs = chains(n, workers, bits=4)
    payloads, summed, _ = phases(codecs, inputs(n, workers))
    out = np.full(n, 7.0, np.float32)
    other = payloads[1].copy()
    other[1] -= 1  # this push quantized against half the scale
    with pytest.raises(ValueError, match="a push with another scale"):
        codecs[0].finish((payloads[0] + other).view(np.uint8), out, workers)
    other = payloads[1].copy()
    other[0] = 2  # a 2-bit push of the same length
    with pytest.raises(ValueError, match="a push with another bit width"):
        codecs[0].finish((payloads[0] + other).view(np.uint8), out, workers)
    two_bit = chains(n, workers, bits=2)
    phases(two_bit, inputs(n, workers))
    with pytest.raises(ValueError, match="a summed code buffer of"):
        two_bit[0].finish(summed.view(np.uint8), out, workers)
    with pytest.raises(ValueError, match="holds 3 pushes"):
        codecs[0].finish((summed + payloads[0]).view(np.uint8), out, workers)
    assert (out == 7.0).all()


def test_non_finite_push_gives_nan_everywhere():
    xs = inputs(100, 2)
    xs[1][5] = np.inf
    _, _, outs = phases(chains(100, 2), xs)
    assert np.isnan(outs[0]).all()


def test_parameters():
    with pytest.raises(ParamError, match="must be one of 2, 4, 8"):
        CompressionParams.from_dict({"compressor": "thc", "bits": 3})
    with pytest.raises(ParamError, match="thc has its own error feedback"):
        CompressionParams.from_dict({"compressor": "thc", "ef": "vanilla"})
    with pytest.raises(ParamError, match="2-bit rotated codes with 'feedback' diverge"):
        CompressionParams.from_dict({"compressor": "thc", "bits": 2, "rotate": True, "feedback": True})
    with pytest.raises(ParamError, match="thc keeps the momentum"):
        CompressionParams.from_dict({"compressor": "thc", "momentum": "nesterov", "mu": 0.9})
    codec = chains(10_000, 8, bits=4)[0]
    # 8 pushes: histogram counts in 4-bit lanes, 13 to a word; codes in 7-bit lanes, 7 to a word
    assert codec.phase_sizes == (math.ceil(thc.HIST / 13), thc.HEADER + math.ceil(10_000 / 7))


@pytest.mark.parametrize("pushes", [1, 2, 3, 8, 1000, 8192])
def test_histogram_counts_add_in_their_lanes(pushes):
    """Each push's histogram is one 1 in its exponent's bin, packed in lanes of bit_length(N)
    bits; the float64 sum of N such pushes unpacks to numpy's counts per bin."""
    rng = np.random.default_rng(pushes)
    bins = rng.integers(0, thc.HIST, pushes)
    total = np.sum([thc.histogram_words(int(b), pushes) for b in bins], axis=0)
    width = thc.count_bits(pushes)
    assert total.size == math.ceil(thc.HIST / (53 // width))
    np.testing.assert_array_equal(thc.unpack_counts(total, width, thc.HIST), np.bincount(bins, minlength=thc.HIST))
    summands, exponent, nonfinite = thc.agreed_scale(total, pushes)
    top = int(bins[bins < thc.HIST - 1].max()) if (bins < thc.HIST - 1).any() else 0
    assert (summands, exponent, nonfinite) == (pushes, top + thc.E_MIN, bool((bins == thc.HIST - 1).any()))


def test_four_bit_rotated_feedback_stays_bounded_where_two_bit_grows():
    """Why 2-bit rotated codes with feedback are refused: on 12,288 N(0, 1e-3) values a step
    (three 4,096-blocks), the residual of the 2-bit rounding grows past 20x the input's norm
    within 60 steps, while 4-bit's stays below it (numpy's recomputation of the codec's
    nearest rounding, its rotation and its error feedback)."""
    n, rng = 3 * 4096, np.random.default_rng(0)
    grads = (rng.standard_normal((60, n)) * 1e-3).astype(np.float32)
    for bits, bounded in ((4, True), (2, False)):
        levels, error, worst = 2**bits - 1, np.zeros(n, np.float32), 0.0
        for step, g in enumerate(grads):
            x = g + error
            signs = thc.rotation_signs(7, {"step": step}, 4096)
            y = thc.rotated(x, signs, 4096)
            exponent = math.ceil(math.log2(float(np.abs(y).max())))
            q = np.clip(np.floor((y.astype(np.float64) / 2.0**exponent + 1) * levels / 2 + 0.5), 0, levels)
            own = (2.0**exponent * (2 * q / levels - 1)).astype(np.float32)
            error = x - thc.rotated(own, signs, 4096, inverse=True)
            worst = max(worst, float(np.linalg.norm(error) / np.linalg.norm(g)))
        assert (worst < 1) == bounded and (bounded or worst > 20), (bits, worst)


def test_a_histogram_of_another_size_or_an_overflowed_word_is_refused():
    words = thc.histogram_words(5, 2)
    with pytest.raises(ValueError, match="must be 7 words"):
        thc.agreed_scale(np.concatenate([words, words]), 2)
    with pytest.raises(ValueError, match="not an integer in"):
        thc.agreed_scale(words + 0.5, 2)
    with pytest.raises(ValueError, match="counts no push"):
        thc.agreed_scale(np.zeros_like(words), 2)


def test_device_chain_on_cpu_torch_matches_numpys_payloads():
    """The torch chain (compress/device/thc.py, here on the CPU): the same histogram, header and
    lanes as numpy's with nearest rounding (rotation included), and it decodes numpy's sums."""
    torch = pytest.importorskip("torch")
    params = CompressionParams.from_dict({"compressor": "thc", "bits": 4, "rotate": True, "feedback": True})
    xs = inputs(3000, 2, seed=5)
    host = [build_chain(params, 3000, np.float32, key=9) for _ in range(2)]
    dev = [build_chain(params, 3000, np.float32, key=9, device="cpu") for _ in range(2)]
    for c in host + dev:
        c.set_summands(2)
    hist_h = [c.compress(x, CTX) for c, x in zip(host, xs)]
    hist_d = [c.compress(torch.from_numpy(x), CTX).numpy() for c, x in zip(dev, xs)]
    assert all(h.tobytes() == d.tobytes() for h, d in zip(hist_h, hist_d))
    hist = (hist_h[0].view(np.float64) + hist_h[1].view(np.float64)).view(np.uint8)
    q_h = [c.compress_q(hist).view(np.float64) for c in host]
    q_d = [c.compress_q(torch.from_numpy(hist.copy())).view(torch.float64).numpy() for c in dev]
    for h, d in zip(q_h, q_d):  # the Hadamard sums' order may move a code at a rounding tie
        assert (h[:thc.HEADER] == d[:thc.HEADER]).all() and np.mean(h == d) > 0.99
    summed = (q_h[0] + q_h[1]).view(np.uint8)
    np.testing.assert_allclose(dev[0].finish(torch.from_numpy(summed.copy()), None, 2).numpy(),
                               host[0].finish(summed, None, 2), atol=1e-7)
    np.testing.assert_allclose(dev[0].error.numpy(), host[0].error, atol=1e-6)


def test_device_chain_on_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    params = CompressionParams.from_dict({"compressor": "thc", "bits": 4, "rotate": True})
    codec = build_chain(params, 5000, np.float32, key=1, device="cuda")
    codec.set_summands(1)
    x = torch.randn(5000, device="cuda") * 1e-3
    hist = codec.compress(x, CTX)
    out = codec.finish(codec.compress_q(hist), None, 1)
    # each rotated code errs by under one code step 2 s / M; the rotation keeps the 2-norm
    step = 2 * 2.0 ** codec.host.agreed[0] / 15
    assert float((out - x).norm()) <= step * codec.codes ** 0.5


def test_parameter_server_words_are_int64_only_when_every_server_adds_them():
    """A worker sums thc's phases in int64 words when every server's address-book entry lists
    int64 among its sums; one server without the list (an older one) keeps float64 for all."""
    from bps_gc.ps.membership.membership import phase_words
    from bps_gc.wire.wire import SERVER_SUMS
    new = {"id": 1, "sums": list(SERVER_SUMS)}
    assert phase_words([new, dict(new, id=2)]) == np.int64
    assert phase_words([new, {"id": 2}]) == np.float64
    assert phase_words([{"id": 1, "sums": ["float32", "float64"]}]) == np.float64
