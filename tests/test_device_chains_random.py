"""The random codecs' device chains (randomk, dithering, terngrad, qsgd, dgc, powersgd) against
the numpy chains, on CPU tensors (and CUDA where this machine has one).

Oracles: the numpy chain's bytes and decodes where the device chain is deterministic (randomk,
dgc, dithering with integer levels); a pure-Python xorshift128+ for randomk's indices; for the
device-drawn codecs, each element's two possible decoded values and their probabilities,
recomputed here with numpy from the codec's definition (docs/codecs.md), which bound the mean
of many decodes.
"""
import numpy as np
import pytest
import torch

from bps_gc.compress import build_chain
from bps_gc.compress.device import DEVICE_ERROR_FEEDBACKS, HostBridge, host_array
from nan_bits import assert_equal_but_nan_bits

CUDA_SKIP = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="no CUDA device: torch.cuda.is_available() is False here")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_SKIP)]
MASK64 = (1 << 64) - 1
SEED = 0x5DEECE66D12345  # an explicit seed, so the oracle needs nothing from the package


def chains(params, n, dtype, device, shape=None):
    """(numpy chain, device chain) for the same key; the device one must not be the bridge."""
    host = build_chain(params, n, dtype, key=11, shape=shape)
    dev = build_chain(params, n, dtype, key=11, shape=shape, device=device)
    assert not isinstance(dev, HostBridge), f"{params['compressor']} ran behind the host bridge"
    return host, dev


def decoding_paths(dev):
    """``dev`` once per decoding path: dithering decodes with the numpy kernel (on the host) by
    default and with its parallel parse on the device where ``parallel_decode`` is set: both run."""
    if not hasattr(dev, "parallel_decode"):
        yield dev
        return
    for parallel in (False, True):
        dev.parallel_decode = parallel
        yield dev


def on(device, x):
    return torch.from_numpy(np.array(x)).to(device)


def assert_cross_decodes(host, dev, device_payload, host_payload):
    """Each chain decodes the other's payload to the values the other decodes it to."""
    np.testing.assert_array_equal(dev.decompress(device_payload).cpu().numpy(),
                                  host.decompress(host_array(device_payload)))
    np.testing.assert_array_equal(dev.decompress(torch.from_numpy(host_payload)).cpu().numpy(),
                                  host.decompress(host_payload))


# ---------------------------------------------------------------- randomk

def xorshift_indices(seed, n, k, steps):
    """randomk's indices for each step: xorshift128+ with a = b = seed, next() % n."""
    s0 = s1 = seed
    out = []
    for _ in range(steps):
        drawn = []
        for _ in range(k):
            t, u = s0, s1
            s0 = u
            t ^= (t << 23) & MASK64
            t ^= t >> 17
            t ^= u ^ (u >> 26)
            s1 = t
            drawn.append(((t + u) & MASK64) % n)
        out.append(drawn)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("ef,seed", [(None, SEED), ("vanilla", SEED), (None, None)])
def test_randomk_bytes_and_indices_match_numpy_and_server(device, dtype, ef, seed):
    # seed None: derived from the key by both chains (the pure-Python oracle needs a seed)
    n, steps = 5000, 3
    params = {"compressor": "randomk", "k": 0.01, "seed": seed, "ef": ef}
    host, dev = chains(params, n, dtype, device)
    server = build_chain(params, n, dtype, key=11, role="server")  # recompress draws these too
    k = 50  # int(0.01 * 5024): n rounded up to 32
    expected = xorshift_indices(SEED, n, k, steps)
    index_type = np.uint64 if dtype == np.float64 else np.uint32
    record = np.dtype([("i", index_type), ("v", dtype)])
    rng = np.random.default_rng(1)
    for step in range(steps):
        x = rng.standard_normal(n).astype(dtype)
        ctx = {"lr": 0.1, "step": step, "epoch": 0}
        want = host.compress(x, ctx)
        got = dev.compress(on(device, x), ctx)
        assert got.device.type == device and host_array(got).tobytes() == want.tobytes()
        indices = np.frombuffer(host_array(got).tobytes(), record)["i"]
        assert len(indices) == k and (seed is None or indices.tolist() == expected[step])
        server_payload = server.compress(np.zeros(n, dtype), ctx)
        assert np.array_equal(np.frombuffer(server_payload.tobytes(), record)["i"], indices)
        assert_cross_decodes(host, dev, got, want)
        acc_host, acc_dev = x.copy(), on(device, x)
        host.decompress_add(want, acc_host)
        dev.decompress_add(got, acc_dev)
        np.testing.assert_array_equal(acc_dev.cpu().numpy(), acc_host)
        host.residual(want, acc_host)
        dev.residual(got, acc_dev)
        np.testing.assert_array_equal(acc_dev.cpu().numpy(), acc_host)


@pytest.mark.parametrize("device", DEVICES)
def test_randomk_rejects_bad_payloads(device):
    _, dev = chains({"compressor": "randomk", "k": 4}, 100, np.float32, device)
    with pytest.raises(ValueError, match="whole number"):
        dev.decompress(torch.zeros(12, dtype=torch.uint8, device=device))
    bad = np.array([(100, 1.0)], np.dtype([("i", "<u4"), ("v", "<f4")])).view(np.uint8)
    with pytest.raises(ValueError, match="out of range"):
        dev.decompress(torch.from_numpy(bad).to(device))


# ---------------------------------------------------------------- the device-drawn codecs

def two_points(params, x):
    """(low, high, p): each element decodes to high with probability p, else to low (numpy,
    from the definitions in docs/codecs.md; float64)."""
    name, a, sign = params["compressor"], np.abs(x.astype(np.float64)), np.where(np.signbit(x), -1.0, 1.0)
    if name == "terngrad":
        s = a.max()
        return 0 * a, sign * s, a / s
    if name == "qsgd":
        q = params.get("levels", 255)
        norm = np.sqrt((a * a).sum())
        lev = a * q / norm
        return sign * np.floor(lev) * norm / q, sign * (np.floor(lev) + 1) * norm / q, lev - np.floor(lev)
    s = params["k"]
    scale = np.sqrt((a * a).sum()) if params.get("normalize") == "l2" else a.max()
    if params.get("partition") == "natural":
        top = 2.0 ** (s - 1)
        u = a / scale * top
        low = np.where(u < 1, 0, 2.0 ** np.floor(np.log2(np.maximum(u, 1))))
        high = np.where(u < 1, 1, 2 * low)
    else:
        top = s
        u = a / scale * top
        low, high = np.floor(u), np.floor(u) + 1
    return sign * low * scale / top, sign * high * scale / top, (u - low) / (high - low)


RANDOM = [{"compressor": "terngrad"}, {"compressor": "qsgd", "levels": 3},
          {"compressor": "qsgd"}, {"compressor": "dithering", "k": 2},
          {"compressor": "dithering", "k": 3, "partition": "natural"},
          {"compressor": "dithering", "k": 5, "normalize": "l2"}]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", RANDOM, ids=lambda p: "-".join(str(v) for v in p.values()))
def test_random_codecs_unbiased_and_on_the_two_points(device, params):
    n, draws = 300, 1000
    x = (np.random.default_rng(2).standard_normal(n) * np.exp(np.linspace(-3, 1, n))).astype(np.float32)
    x[::17] = 0
    host, dev = chains(params, n, np.float32, device)
    low, high, p = two_points(params, x)
    tol = 1e-5 * np.abs(high - low) + 1e-30  # float32 rounding of the decoded levels
    total = np.zeros(n)
    for _ in range(draws):
        payload = dev.compress(on(device, x))
        decoded = host.decompress(host_array(payload)).astype(np.float64)  # the numpy decoder
        assert np.all((np.abs(decoded - low) <= tol) | (np.abs(decoded - high) <= tol))
        total += decoded
    mean = total / draws
    sd = np.abs(high - low) * np.sqrt(p * (1 - p) / draws)
    assert np.all(np.abs(mean - x) <= 5.5 * sd + 2 * tol), np.max(np.abs(mean - x) / (sd + tol))
    # and all together: the sum of the element biases within 5 of its standard deviations
    assert abs((mean - x).sum()) <= 5 * np.sqrt((sd ** 2).sum()) + tol.sum()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("params", RANDOM, ids=lambda p: "-".join(str(v) for v in p.values()))
def test_random_codecs_cross_decode(device, dtype, params):
    n = 1001
    x = np.random.default_rng(3).standard_normal(n).astype(dtype)
    host, dev = chains(params, n, dtype, device)
    got, want = dev.compress(on(device, x)), host.compress(x)
    if params["compressor"] != "dithering":  # a fixed size; dithering's depends on the draws
        assert got.numel() == want.size
    x[5] = np.inf
    bad = dev.compress(on(device, x))
    for dev in decoding_paths(dev):
        assert_cross_decodes(host, dev, got, want)
        # non-finite input: a NaN scale, decoded as NaN (as numpy)
        np.testing.assert_array_equal(dev.decompress(bad).cpu().numpy(),
                                      host.decompress(host.compress(x)))


@pytest.mark.parametrize("device", DEVICES)
def test_quantizers_reject_malformed_codes(device):
    _, tern = chains({"compressor": "terngrad"}, 8, np.float32, device)
    payload = torch.zeros(6, dtype=torch.uint8, device=device)
    payload[4] = 3  # code 3 is not a TernGrad code
    with pytest.raises(ValueError, match="malformed"):
        tern.decompress(payload)
    _, qsgd = chains({"compressor": "qsgd", "levels": 2}, 8, np.float32, device)  # 3-bit codes
    payload = torch.zeros(7, dtype=torch.uint8, device=device)
    payload[4] = 6  # level 3 > Q
    with pytest.raises(ValueError, match="malformed"):
        qsgd.decompress(payload)
    with pytest.raises(ValueError, match="expected 7"):
        qsgd.decompress(payload[:6])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("params", [{"compressor": "dithering", "k": 4},
                                    {"compressor": "dithering", "k": 300},
                                    {"compressor": "dithering", "k": 4, "partition": "natural"}],
                         ids=["linear", "linear-300", "natural"])
def test_dithering_bytes_equal_where_nothing_is_random(device, dtype, params):
    # every |x| / max * levels an integer (natural: a power of two): no element is rounded at
    # random, so the bit stream (long gaps and levels past 255 included) must be numpy's
    n, rng = 6000, np.random.default_rng(4)
    top = params["k"] if params.get("partition") != "natural" else 2 ** (params["k"] - 1)
    if params.get("partition") == "natural":
        levels = 2.0 ** rng.integers(-1, params["k"], n) * (rng.random(n) < 0.05)
        levels[levels == 0.5] = 0
    else:
        levels = rng.integers(0, top + 1, n) * (rng.random(n) < 0.05)
    levels[3] = top
    levels[100:5100] = 0  # a gap of 5000: a gap code past 255 (and past 12 bits)
    levels[5200] = 1 if params.get("partition") == "natural" else top
    # exact in every dtype, so |x| / max * top rounds back to the level (natural: exactly)
    x = (levels * np.where(rng.random(n) < 0.5, -1, 1) * 0.125).astype(dtype)
    host, dev = chains(params, n, dtype, device)
    want, got = host.compress(x), dev.compress(on(device, x))
    assert host_array(got).tobytes() == want.tobytes()
    for dev in decoding_paths(dev):
        assert_cross_decodes(host, dev, got, want)
    zeros = dev.compress(on(device, np.zeros(n, dtype)))
    assert host_array(zeros).tobytes() == host.compress(np.zeros(n, dtype)).tobytes()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dithering_device_decoder_accepts_and_rejects_what_numpy_does(device, dtype):
    # corrupted payloads (flipped bits, cut short, random bytes): the device decoder raises
    # exactly where the numpy kernel does, and decodes the rest to the same values
    n, rng = 200, np.random.default_rng(8)
    params = {"compressor": "dithering", "k": 6, "partition": "natural"}
    host, dev = chains(params, n, dtype, device)
    dev.parallel_decode = True  # the numpy kernel decodes by default
    outcomes = set()
    for case in range(120):
        payload = host.compress((rng.standard_normal(n) * (rng.random(n) < 0.3)).astype(dtype)).copy()
        if case % 3 == 0:
            payload[rng.integers(0, payload.size - 4)] ^= np.uint8(1 << rng.integers(0, 8))
        elif case % 3 == 1:
            payload = payload[: rng.integers(0, payload.size)]
        else:
            payload = rng.integers(0, 256, payload.size).astype(np.uint8)
        try:
            want = host.decompress(payload)
        except ValueError:
            want = None
        if want is None:
            with pytest.raises(ValueError, match="dithering"):
                dev.decompress(torch.from_numpy(payload).to(device))
        else:
            got = dev.decompress(torch.from_numpy(payload).to(device)).cpu().numpy()
            np.testing.assert_array_equal(got, want)
        outcomes.add(want is None)
    assert outcomes == {True, False}


# ---------------------------------------------------------------- DGC

DGC = [{"compressor": "dgc", "k": 0.01, "mu": 0.9},
       {"compressor": "dgc", "k": 0.01, "mu": 0.9, "momentum": "nesterov", "fp16_values": True},
       {"compressor": "dgc", "k": 0.002, "warmup_epochs": 3},
       {"compressor": "dgc", "k": 0.05, "mu": 0.5, "sample_ratio": 1.0, "momentum_masking": False}]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("params", DGC, ids=["plain", "nesterov-fp16", "warmup", "full-sample"])
def test_dgc_bytes_and_state_match_numpy_step_by_step(device, dtype, params):
    n, rng = 20000, np.random.default_rng(5)
    host, dev = chains(params, n, dtype, device)
    contexts = [{"lr": 0.1, "step": s, "epoch": s // 2} for s in range(6)]
    contexts.append({"lr": 0.1, "step": 6, "epoch": 3, "density": 0.03})
    for step, ctx in enumerate(contexts):
        x = (rng.standard_normal(n) * np.exp(rng.uniform(-3, 1, n))).astype(dtype)
        if step == 4:
            x[[7, 900]] = [np.nan, -np.inf]  # sent as such, the state kept
        want, got = host.compress(x, ctx), dev.compress(on(device, x), ctx)
        assert_equal_but_nan_bits(host_array(got).tobytes(), want.tobytes(), f"step {step}")
        assert dev.last == host.last
        np.testing.assert_array_equal(dev.v.cpu().numpy(), host.v)
        if host.u is not None:
            np.testing.assert_array_equal(dev.u.cpu().numpy(), host.u)
        assert_cross_decodes(host, dev, got, want)
    with pytest.raises(ValueError, match="increase strictly"):
        size = 6 if dev.value_dtype == torch.float16 else 8  # two records swapped
        dev.decompress(torch.from_numpy(np.concatenate([want[size:2 * size], want[:size]])).to(device))


@pytest.mark.parametrize("device", DEVICES)
def test_dgc_clipping_close_to_numpy(device):
    # the clipping norm is summed in another order on the device: the coefficient may differ
    # in its last bit, so the state is compared to a float32 rounding, the selection exactly
    params = {"compressor": "dgc", "k": 0.01, "mu": 0.9, "clip_norm": 1.0}
    n, rng = 5000, np.random.default_rng(6)
    host, dev = chains(params, n, np.float32, device)
    for step in range(3):
        x = rng.standard_normal(n).astype(np.float32)
        want = host.compress(x, {"lr": 0.1, "step": step, "epoch": 0, "workers": 4})
        got = dev.compress(on(device, x), {"lr": 0.1, "step": step, "epoch": 0, "workers": 4})
        rec = np.dtype([("i", "<u4"), ("v", "<f4")])
        a, b = np.frombuffer(want.tobytes(), rec), np.frombuffer(host_array(got).tobytes(), rec)
        assert np.array_equal(a["i"], b["i"])
        np.testing.assert_allclose(b["v"], a["v"], rtol=1e-6)
        np.testing.assert_allclose(dev.v.cpu().numpy(), host.v, rtol=1e-6, atol=1e-12)


# ---------------------------------------------------------------- PowerSGD

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rank,shape", [(1, (60, 50)), (2, None), (4, (30, 100))])
def test_powersgd_two_workers_follow_numpy(device, rank, shape):
    # two workers' phases summed by hand, as comm/phased.py drives them; float32 products in
    # another order: equal to a float32 rounding over the steps, with the same start Q exactly
    n, params, rng = 3000, {"compressor": "powersgd", "rank": rank}, np.random.default_rng(7)
    pairs = [chains(params, n, np.float32, device, shape) for _ in range(2)]
    hosts, devs = [h for h, _ in pairs], [d for _, d in pairs]
    np.testing.assert_array_equal(devs[0].q.cpu().numpy(), hosts[0].q)
    assert devs[0].phase_sizes == hosts[0].phase_sizes
    for step in range(4):
        xs = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
        if step == 2:
            xs[1][9] = np.nan
        p_dev = sum(d.compress(on(device, x)).view(torch.float32) for d, x in zip(devs, xs))
        q_dev = sum(d.compress_q(p_dev).view(torch.float32) for d in devs)
        q_before = devs[0].q.clone()
        outs_dev = [d.finish(q_dev, None, 2).cpu().numpy() for d in devs]
        if step >= 2:
            # the NaN shows in its step's result and leaves no error and the old warm start
            # behind; the next step is finite again (the numpy chain keeps the NaN Q instead,
            # so from here on only the device chain is checked)
            finite = all(np.isfinite(o).all() for o in outs_dev)
            assert finite == (step == 3)
            if step == 2:
                assert not devs[0].error.any() and torch.equal(devs[0].q, q_before)
            continue
        p_host = sum(h.compress(x).view(np.float32) for h, x in zip(hosts, xs))
        np.testing.assert_allclose(p_dev.cpu().numpy(), p_host, atol=1e-5 * np.abs(p_host).max())
        q_host = sum(h.compress_q(p_host).view(np.float32) for h in hosts)
        outs_host = [h.finish(q_host, None, 2) for h in hosts]
        for h, d, oh, od in zip(hosts, devs, outs_host, outs_dev):
            big = np.abs(oh).max()
            np.testing.assert_allclose(od, oh, atol=1e-5 * big)
            np.testing.assert_allclose(d.error.cpu().numpy(), h.error, atol=1e-5 * big)
            np.testing.assert_allclose(d.q.cpu().numpy(), h.q, atol=1e-5 * np.abs(h.q).max())
    # the decoding of (P^, Q) back to back
    payload = np.concatenate([hosts[0].p_hat.reshape(-1), hosts[0].q.reshape(-1)]).view(np.uint8)
    want = hosts[0].decompress(payload)
    np.testing.assert_allclose(devs[0].decompress(torch.from_numpy(payload).to(device)).cpu().numpy(),
                               want, atol=1e-6 * np.abs(want).max())


# ---------------------------------------------------------------- what the chains declare

@pytest.mark.parametrize("name", ["randomk", "dithering", "terngrad", "qsgd", "dgc", "powersgd", "thc"])
def test_device_classes_declare_what_numpy_codecs_do(name):
    # servers pick reducers and build_chain decorators from these: they must agree
    from bps_gc.compress.device import DEVICE_COMPRESSORS
    from bps_gc.compress.registry import COMPRESSORS
    dev, host = DEVICE_COMPRESSORS[name], COMPRESSORS[name]
    for attr in ("reducers", "owns_momentum", "takes_shape"):
        assert getattr(dev, attr, None) == getattr(host, attr, None), attr


@pytest.mark.parametrize("params", [{"compressor": "terngrad"}, {"compressor": "qsgd"},
                                    {"compressor": "dgc", "k": 0.01},
                                    {"compressor": "powersgd"}])
def test_device_chains_refuse_float64_as_numpy(params):
    with pytest.raises(TypeError, match="float32 or float16"):
        build_chain(params, 100, np.float64)
    with pytest.raises(TypeError, match="float32 or float16"):
        build_chain(params, 100, np.float64, device="cpu")
