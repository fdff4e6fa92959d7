"""Device chains (bps_gc/compress/device) against the numpy chains, on CPU tensors (and CUDA
where this machine has it): the same payload bytes, decodes and state over several steps."""
import numpy as np
import pytest
import torch

from bps_gc.compress import CompressionParams, build_chain
from bps_gc.compress.device import DeviceCodec, HostBridge, host_array

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


def run_side_by_side(params, n, dtype, device, steps=4, role="worker", key=7):
    """Compress the same steps with both chains; assert equal bytes, decodes and cross-decodes.
    Returns both chains for state checks."""
    host = build_chain(params, n, dtype, key=key, role=role)
    dev = build_chain(params, n, dtype, key=key, role=role, device=device)
    decoder = build_chain(CompressionParams.from_dict(params).to_dict() | {"ef": None, "momentum": None},
                          n, dtype, key=key, role="server", device=device)
    for step, (x, lr) in enumerate(zip(gradients(n, dtype, steps), [0.1, 0.1, 0.05, 0.2, 0.2])):
        ctx = {"lr": lr, "step": step, "epoch": 0}
        want = host.compress(x, ctx)
        got = dev.compress(torch.from_numpy(x.copy()).to(device), ctx)
        assert isinstance(got, torch.Tensor) and got.dtype == torch.uint8 and got.dim() == 1
        assert got.device.type == torch.device(device).type
        assert host_array(got).tobytes() == want.tobytes(), f"step {step}: payloads differ"
        decoded = dev.decompress(got)
        assert decoded.device.type == torch.device(device).type and decoded.dtype == TORCH[dtype]
        np.testing.assert_array_equal(decoded.cpu().numpy(), host.decompress(want))
        # a numpy payload decoded on the device, and a device payload by numpy
        np.testing.assert_array_equal(decoder.decompress(want).cpu().numpy(),
                                      host.decompress(host_array(got)))
    return host, dev


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, 33, 1000])
def test_bridge_matches_numpy_chain(device, n):
    # a codec without a device implementation: the numpy chain behind the bridge
    from bps_gc.compress.device import DEVICE_COMPRESSORS
    params = {"compressor": "dithering", "k": 2, "ef": "vanilla", "momentum": "nesterov", "mu": 0.9}
    if "dithering" not in DEVICE_COMPRESSORS:
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
