"""identity (compress/identity.py): the payload is the elements' own bytes, decoded exactly; a
tensor of it is compressed below BYTEPS_MIN_COMPRESS_BYTES (it saves nothing there, and is chosen
for its reducer); reducer outer_sgd on its pushes is torch.optim.SGD's Nesterov step on the mean,
recomputed here in numpy, and its reply is the update's n elements (the dense pull's bytes)."""
import numpy as np
import pytest

from bps_gc.comm.placement import Placement, TensorPlan
from bps_gc.compress import CompressionParams, build_chain, make_reducer


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_the_payload_is_the_elements_and_decodes_exactly(dtype):
    x = np.random.default_rng(3).standard_normal(37).astype(dtype)
    codec = build_chain({"compressor": "identity"}, x.size, dtype, key=5)
    payload = codec.compress(x)
    assert payload.dtype == np.uint8 and payload.tobytes() == x.tobytes()
    unaligned = np.empty(payload.size + 1, np.uint8)[1:]  # as a received frame may be
    unaligned[:] = payload
    assert codec.decompress(unaligned).tobytes() == x.tobytes()
    acc = np.ones(x.size, dtype)
    codec.decompress_add(payload, acc)
    assert acc.tobytes() == (np.ones(x.size, dtype) + x).tobytes()
    with pytest.raises(ValueError, match="expected"):
        codec.decompress(payload[:-1])


def test_identity_is_compressed_below_the_min_compress_bytes():
    placement = Placement(2, partition_bytes=1024, min_compress_bytes=65_536)
    planned = {}
    for index, compressor in enumerate(("identity", "topk")):
        params = CompressionParams.from_dict({"compressor": compressor, **({"k": 0.5} if compressor == "topk" else {})})
        tensor = TensorPlan(compressor, index, params, "lossless")
        placement.plan(tensor, (16,), np.float32, lambda t, n, dtype, key: (None, None), balanced=True)
        planned[compressor] = tensor.compressed
    assert planned == {"identity": True, "topk": False}


def test_outer_sgd_on_identity_pushes_is_nesterov_sgd_on_the_mean():
    n, lr, mu = 11, 0.7, 0.9
    params = CompressionParams.from_dict({"compressor": "identity"})
    worker = build_chain(params, n, np.float32, key=1)
    reducer = make_reducer("outer_sgd", params, n, np.float32, key=1)
    rng = np.random.default_rng(0)
    momentum, glob = np.zeros(n, np.float32), np.zeros(n, np.float32)
    ctx = {"outer_lr": lr, "outer_momentum": mu, "outer_nesterov": True, "outer_workers": 3}
    for _ in range(3):
        pushes = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
        reply = reducer.reduce([worker.compress(p) for p in pushes], True, ctx)
        mean = (pushes[0] + pushes[1] + pushes[2]) / np.float32(3)
        momentum = np.float32(mu) * momentum + mean
        update = -(np.float32(lr) * (mean + np.float32(mu) * momentum))
        glob += update
        assert reply.nbytes == 4 * n
        np.testing.assert_allclose(reducer.decode(reply, np.empty(n, np.float32)), update, rtol=1e-6)
    np.testing.assert_allclose(reducer.global_copy, glob, rtol=1e-6)
