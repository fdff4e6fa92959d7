"""Device chains (bps_gc/compress/device) against the numpy chains, on CPU tensors (and CUDA
where this machine has it): the same payload bytes, decodes and state over several steps."""
import numpy as np
import pytest
import torch

from bps_gc.compress import CompressionParams, build_chain
from bps_gc.compress.device import DeviceCodec, HostBridge, host_array
from nan_bits import assert_equal_but_nan_bits

CUDA_SKIP = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="no CUDA device: torch.cuda.is_available() is False here")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_SKIP)]
TORCH = {np.float32: torch.float32, np.float16: torch.float16, np.float64: torch.float64}


def gradients(n, dtype, steps, seed=0):
    """Steps of gradient-like data: mixed magnitudes, exact zeros, -0.0 and ties."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(steps):
        x = (rng.standard_normal(n) * np.exp(rng.uniform(-4, 2, n))).astype(dtype)
        if n > 4:
            x[rng.integers(0, n, n // 5 + 1)] = 0
            x[rng.integers(0, n, n // 7 + 1)] = -0.0
            x[1:3] = x[0]  # a tie in magnitude
        out.append(x)
    return out


def run_side_by_side(params, n, dtype, device, steps=4, role="worker", key=7, records=False,
                     inputs=None, dev=None):
    """Compress the same steps with both chains; assert equal bytes (``records``: after sorting
    the numpy payload's records by index), decodes and cross-decodes. Returns both chains for
    state checks."""
    host = build_chain(params, n, dtype, key=key, role=role)
    dev = dev or build_chain(params, n, dtype, key=key, role=role, device=device)
    decoder = build_chain(CompressionParams.from_dict(params).to_dict() | {"ef": None, "momentum": None},
                          n, dtype, key=key, role="server", device=device)
    inputs = gradients(n, dtype, steps) if inputs is None else inputs
    for step, (x, lr) in enumerate(zip(inputs, [0.1, 0.1, 0.05, 0.2, 0.2, 0.0, 0.1])):
        ctx = {"lr": lr, "step": step, "epoch": 0}
        want = host.compress(x, ctx)
        got = dev.compress(torch.from_numpy(x.copy()).to(device), ctx)
        assert isinstance(got, torch.Tensor) and got.dtype == torch.uint8 and got.dim() == 1
        assert got.device.type == torch.device(device).type
        expected = sorted_records(want, dtype) if records else want.tobytes()
        assert_equal_but_nan_bits(host_array(got).tobytes(), expected, f"step {step}")
        decoded = dev.decompress(got)
        assert decoded.device.type == torch.device(device).type and decoded.dtype == TORCH[dtype]
        np.testing.assert_array_equal(decoded.cpu().numpy(), host.decompress(want))
        # a numpy payload decoded on the device, and a device payload by numpy
        np.testing.assert_array_equal(decoder.decompress(want).cpu().numpy(),
                                      host.decompress(host_array(got)))
    return host, dev


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, 33, 1000])
def test_bridge_matches_numpy_chain(device, n, monkeypatch):
    # a codec without a device implementation (dithering's, which draws on the device, is
    # taken out for this test): the numpy chain behind the bridge
    from bps_gc.compress.device import DEVICE_COMPRESSORS
    monkeypatch.delitem(DEVICE_COMPRESSORS, "dithering", raising=False)
    params = {"compressor": "dithering", "k": 2, "ef": "vanilla", "momentum": "nesterov", "mu": 0.9}
    chain = build_chain(params, n, np.float32, device=device)
    assert isinstance(chain, HostBridge)
    run_side_by_side(params, n, np.float32, device)


def test_device_errors_name_the_problem():
    chain = build_chain({"compressor": "dithering", "k": 2}, 10, np.float32, device="cpu")
    assert isinstance(chain, DeviceCodec)
    with pytest.raises(ValueError, match="10 elements of torch.float32, got 9"):
        chain.compress(torch.zeros(9))
    with pytest.raises(ValueError, match="got 10 of torch.float64"):
        chain.compress(torch.zeros(10, dtype=torch.float64))
    with pytest.raises(TypeError, match="torch.Tensor"):
        chain.compress(np.zeros(10, np.float32))
    with pytest.raises(TypeError, match="uint8"):
        chain.decompress(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="not a torch device"):
        build_chain({"compressor": "onebit"}, 10, np.float32, device="nowhere")
    with pytest.raises(ValueError, match="entiremodel"):
        build_chain({"compressor": "topk", "k": 2, "granularity": "entiremodel"}, 10,
                    np.float32, device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            build_chain({"compressor": "onebit"}, 10, np.float32, device="cuda")


def chains_of(codec_params):
    plain = dict(codec_params)
    return [plain, {**plain, "ef": "vanilla"}, {**plain, "ef": "vanilla", "momentum": "nesterov", "mu": 0.9}]


def assert_state_equal(host, dev):
    """The decorators' state (error, momentum) matches, layer by layer."""
    while host is not None:
        for name in ("error", "momentum"):
            if hasattr(host, name):
                np.testing.assert_array_equal(getattr(dev, name).cpu().numpy(), getattr(host, name))
        host, dev = getattr(host, "inner", None), getattr(dev, "inner", None)


ONEBIT_LIKE = [{"compressor": "onebit"}, {"compressor": "onebit", "scaling": True},
               {"compressor": "sign"}, {"compressor": "signnorm"}]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("n", [1, 17, 33, 1000])
@pytest.mark.parametrize("codec", ONEBIT_LIKE, ids=lambda c: c["compressor"] + "+s" * c.get("scaling", 0))
def test_onebit_family_matches_numpy(device, dtype, n, codec):
    if codec["compressor"] in ("sign", "signnorm") and dtype == np.float64:
        pytest.skip("sign and signnorm take float32 and float16 only (as numpy)")
    for params in chains_of(codec):
        host, dev = run_side_by_side(params, n, dtype, device)
        assert not isinstance(dev, HostBridge)
        assert_state_equal(host, dev)


def sorted_records(payload, dtype):
    """A records payload with its records in ascending index order (topk's "any order")."""
    from bps_gc.compress.sparse import RECORD
    rec = np.frombuffer(np.asarray(payload, np.uint8).tobytes(), RECORD[np.dtype(dtype).type])
    return rec[np.argsort(rec["i"], kind="stable")].tobytes()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("n,k", [(1, 1), (33, 3), (1000, 0.01), (1000, 200), (4097, 0.1)])
def test_topk_matches_numpy(device, dtype, n, k):
    for params in chains_of({"compressor": "topk", "k": k}):
        host, dev = run_side_by_side(params, n, dtype, device, records=True)
        assert not isinstance(dev, HostBridge)
        assert_state_equal(host, dev)


@pytest.mark.parametrize("device", DEVICES)
def test_topk_ties_go_to_the_lower_index(device):
    x = np.zeros(64, np.float32)
    x[[5, 9, 40, 41, 63]] = [2, -3, 3, -3, 3]  # four of |3|, one |2|: k=3 keeps 9, 40, 41
    chain = build_chain({"compressor": "topk", "k": 3}, 64, np.float32, device=device)
    payload = host_array(chain.compress(torch.from_numpy(x).to(device)))
    rec = np.frombuffer(payload.tobytes(), [("i", "<u4"), ("v", "<f4")])
    assert rec["i"].tolist() == [9, 40, 41] and rec["v"].tolist() == [-3, 3, -3]


THRESHOLDS = [{"compressor": "threshold", "threshold": 0.5}, {"compressor": "threshold", "threshold": 0.0},
              {"compressor": "threshold", "threshold": 1e30}, {"compressor": "adaptive_threshold"}]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("n", [1, 33, 1000])
@pytest.mark.parametrize("codec", THRESHOLDS, ids=lambda c: f"{c['compressor']}-{c.get('threshold', '')}")
def test_thresholds_match_numpy(device, dtype, n, codec):
    for params in chains_of(codec):
        host, dev = run_side_by_side(params, n, dtype, device)
        assert not isinstance(dev, HostBridge)
        assert_state_equal(host, dev)


DETERMINISTIC = ONEBIT_LIKE + [{"compressor": "topk", "k": 0.1}] + THRESHOLDS


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", DETERMINISTIC, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_nonfinite_steps_match_numpy(device, codec):
    # inf, then NaN, then finite again: error feedback and momentum skip the bad steps alike
    xs = gradients(100, np.float32, 5, seed=3)
    xs[1][7], xs[2][50] = np.inf, np.nan
    for params in chains_of(codec):
        host, dev = run_side_by_side(params, 100, np.float32, device, inputs=xs,
                                     records=codec["compressor"] == "topk")
        assert_state_equal(host, dev)


@pytest.mark.parametrize("device", DEVICES)
def test_server_role_and_accumulation_match_numpy(device):
    # servers never apply momentum; decompress_add and residual update like the numpy codec
    for codec in DETERMINISTIC:
        params = {**codec, "ef": "vanilla", "momentum": "nesterov", "mu": 0.9}
        host, dev = run_side_by_side(params, 200, np.float32, device, role="server",
                                     records=codec["compressor"] == "topk")
        assert not hasattr(dev, "momentum") and hasattr(dev, "error")
        acc_host = gradients(200, np.float32, 1, seed=9)[0]
        acc_dev = torch.from_numpy(acc_host.copy()).to(device)
        for x in gradients(200, np.float32, 2, seed=5):
            payload = host.inner.compress(x)
            host.decompress_add(payload, acc_host)
            dev.decompress_add(payload, acc_dev)
            np.testing.assert_array_equal(acc_dev.cpu().numpy(), acc_host)
            host.residual(payload, acc_host)
            dev.residual(torch.from_numpy(payload).to(device), acc_dev)
            np.testing.assert_array_equal(acc_dev.cpu().numpy(), acc_host)


@pytest.mark.parametrize("device", DEVICES)
def test_plugin_codec_runs_behind_the_bridge(device):
    import plugin_step_codec  # noqa: F401  (registers test_step_mask, a step-dependent codec)
    params = {"compressor": "test_step_mask", "ef": "vanilla", "momentum": "nesterov", "mu": 0.9}
    host, dev = run_side_by_side(params, 50, np.float32, device, steps=6)
    assert isinstance(dev, HostBridge) and dev.reducers == host_reducers(params)


def host_reducers(params):
    from bps_gc.compress.registry import COMPRESSORS
    return COMPRESSORS[params["compressor"]].reducers


@pytest.mark.parametrize("device", DEVICES)
def test_device_decorators_wrap_the_bridge(device):
    # error feedback and momentum on the device around a numpy codec behind the bridge
    from bps_gc.compress.device import DEVICE_ERROR_FEEDBACKS, DEVICE_MOMENTUMS
    p = CompressionParams.from_dict({"compressor": "topk", "k": 7, "ef": "vanilla",
                                     "momentum": "nesterov", "mu": 0.8})
    bare = build_chain({"compressor": "topk", "k": 7}, 300, np.float32, key=7)
    dev = DEVICE_MOMENTUMS["nesterov"](DEVICE_ERROR_FEEDBACKS["vanilla"](HostBridge(bare, device), p), p)
    host, dev = run_side_by_side(p.to_dict(), 300, np.float32, device, dev=dev, steps=6)
    assert_state_equal(host, dev)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_onebit_scale_within_one_ulp_on_wide_ranges(dtype):
    # the device sums |x| in float64 in another order than the C kernel's eight lanes: the float32
    # mean may differ only by float64 rounding, i.e. by at most one float32 ulp (onebit.py)
    worst = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(1, 3000))
        x = (rng.standard_normal(n) * np.exp(rng.uniform(-60, 60, n))).astype(dtype)
        params = {"compressor": "onebit", "scaling": True}
        want = build_chain(params, n, dtype).compress(x)[-4:].view(np.int32)[0]
        got = host_array(build_chain(params, n, dtype, device="cpu").compress(torch.from_numpy(x)))
        worst = max(worst, abs(int(got[-4:].view(np.int32)[0]) - int(want)))
    assert worst <= 1


def test_wrong_device_is_named():
    chain = build_chain({"compressor": "onebit"}, 10, np.float32, device="cpu")
    with pytest.raises(ValueError, match="input is on meta, expected cpu"):
        chain.compress(torch.zeros(10, device="meta"))
    with pytest.raises(ValueError, match="payload of 3 bytes, expected 8"):
        chain.decompress(b"abc")
    topk = build_chain({"compressor": "topk", "k": 2}, 10, np.float32, device="cpu")
    with pytest.raises(ValueError, match="index out of range"):
        topk.decompress(np.array([(10, 1.0)], [("i", "<u4"), ("v", "<f4")]).view(np.uint8))
    thr = build_chain({"compressor": "threshold", "threshold": 1}, 10, np.float32, device="cpu")
    with pytest.raises(ValueError, match="increase strictly"):
        thr.decompress(np.array([(3, 1.0), (3, 2.0)], [("i", "<u4"), ("v", "<f4")]).view(np.uint8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["gradient", "mostly zeros", "all equal", "few distinct"])
def test_topk_sampled_and_full_selection_match_numpy(device, kind):
    # the sampled key keeps the candidates (gradient), or falls back to the whole array: a
    # zero sampled key (mostly zeros) or far too many candidates (ties everywhere)
    n, k = 5000, 40
    rng = np.random.default_rng(4)
    x = {"gradient": rng.standard_normal(n), "mostly zeros": np.where(rng.random(n) < 0.005, 1.0, 0.0),
         "all equal": np.full(n, -0.5), "few distinct": rng.integers(-3, 4, n) * 0.25}[kind]
    x = x.astype(np.float32)
    host = build_chain({"compressor": "topk", "k": k}, n, np.float32)
    dev = build_chain({"compressor": "topk", "k": k}, n, np.float32, device=device)
    got = host_array(dev.compress(torch.from_numpy(x).to(device)))
    assert got.tobytes() == sorted_records(host.compress(x), np.float32)


def test_benchmark_rows_run():
    import sys
    sys.path.insert(0, __file__.rsplit("/tests/", 1)[0] + "/scripts")
    import bench_device_codecs
    rows = bench_device_codecs.device_rows("cpu", ["2K"], repeats=1, only=["onebit", "topk 1%", "dgc"])
    assert [(r["codec"], r["path"]) for r in rows][:3] == [("onebit scaling", "device"),
                                                           ("EF + onebit", "device"),
                                                           ("topk 1%", "device")]
    assert all(r["compress_gbps"] > 0 and r["host_decompress_gbps"] > 0 for r in rows)
    assert rows[0]["compression_ratio"] == 8000 / (-(-2000 // 32) * 4 + 4)


def test_device_without_torch_says_so():
    import subprocess
    import sys
    code = ("import sys; sys.modules['torch'] = None\n"
            "import numpy as np, bps_gc.compress as c\n"
            "c.build_chain({'compressor': 'onebit'}, 8, np.float32).compress(np.ones(8, np.float32))\n"
            "try:\n"
            "    c.build_chain({'compressor': 'onebit'}, 8, np.float32, device='cpu')\n"
            "except ImportError as e:\n"
            "    print(e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "build_chain with a device) needs torch" in result.stdout


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", [{"compressor": "topk", "k": 9}, {"compressor": "terngrad"},
                                   {"compressor": "qsgd", "levels": 4}, {"compressor": "onebit", "scaling": True}])
def test_payload_forms_decode_alike(device, codec):
    # a payload as received from the network (read-only bytes view), as bytes, a tensor, or a
    # tensor cut from a gathered buffer at an odd byte (its float32 header unaligned)
    import warnings
    x = gradients(300, np.float32, 1)[0]
    chain = build_chain(codec, 300, np.float32, device=device)
    payload = chain.compress(torch.from_numpy(x).to(device))
    raw = host_array(payload).tobytes()
    want = chain.decompress(payload).cpu().numpy()
    odd = torch.cat([torch.zeros(1, dtype=torch.uint8, device=payload.device), payload])[1:]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for form in (raw, np.frombuffer(raw, np.uint8), bytearray(raw), payload.cpu(), odd):
            np.testing.assert_array_equal(chain.decompress(form).cpu().numpy(), want)


def test_nan_bits_are_the_only_difference_allowed():
    one, gpu_nan, numpy_nan = (np.array(v, np.uint32).tobytes() for v in (0x3F800000, 0x7FFFFFFF, 0x7FC00000))
    header = np.array([5, 7], np.uint32).tobytes()
    assert_equal_but_nan_bits(header + gpu_nan + one, header + numpy_nan + one)
    with pytest.raises(AssertionError, match="byte 8"):
        assert_equal_but_nan_bits(header + gpu_nan + one, header + one + one)
    with pytest.raises(AssertionError, match="byte 0"):  # a differing integer field stays a difference
        assert_equal_but_nan_bits(np.array([6, 7], np.uint32).tobytes() + one, header + one)
    half_gpu, half_numpy = np.array([0x7FFF], np.uint16).tobytes(), np.array([0x7E00], np.uint16).tobytes()
    assert_equal_but_nan_bits(header + half_gpu, header + half_numpy)
