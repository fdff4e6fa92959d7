"""DGC follows its config's momentum, plain or nesterov (issue 34): the codec's momentum
correction, the post-pull momentum of tensors the codec never sees, and the plain momentum
decorator, each against a numpy re-computation in float32, step by step; and the example's
settings map each config's ``memory.nesterov`` to its form."""
import os
import sys

import numpy as np
import pytest

from bps_gc.algorithms.momentum import MomentumPlan
from bps_gc.compress import build_chain
from bps_gc.compress.sparse import RECORD
from conftest import ROOT

MU = np.float32(0.9)
N, STEPS = 257, 6


def gradients(seed=3):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(N).astype(np.float32) for _ in range(STEPS)]


def numpy_dgc_sent(form, grads):
    """What DGC sends each step when it keeps every element and never masks: v is sent and
    zeroed, so the payload is this step's correction; float32, the codec's order of roundings."""
    u, out = np.zeros(N, np.float32), []
    for g in grads:
        if form == "plain":  # u = mu*u + g; v += u
            u = u * MU + g
            out.append(u.copy())
        else:  # u = mu*(u + g); v += u + g
            u = (u + g) * MU
            out.append(np.float32(0) + u + g)
    return out


@pytest.mark.parametrize("form", ["plain", "nesterov"])
def test_dgc_momentum_correction_follows_the_form(form):
    # density 1 with every element sampled keeps all of v: the payload is v itself
    codec = build_chain({"compressor": "dgc", "k": 0.5, "mu": float(MU), "momentum": form,
                         "momentum_masking": False, "sample_ratio": 1.0}, N, np.float32)
    want = numpy_dgc_sent(form, gradients())
    for step, (g, expected) in enumerate(zip(gradients(), want)):
        payload = codec.compress(g, {"lr": 0.1, "step": step, "epoch": 0, "density": 1.0})
        got = codec.decompress(payload)
        assert got.tobytes() == expected.tobytes(), f"{form}: step {step} differs"
    other = "nesterov" if form == "plain" else "plain"
    assert not np.array_equal(numpy_dgc_sent(other, gradients())[1], want[1])  # the forms differ


@pytest.mark.parametrize("nesterov", [False, True])
def test_post_pull_momentum_of_uncompressed_tensors_follows_the_form(nesterov):
    """1-D tensors under DGC (and tensors too small to compress) get the optimizer's momentum
    after the pull, in the config's form; DGC's weight decay is added first (wd_rule "dgc")."""
    plan = MomentumPlan({"compressor": "dgc", "k": 0.01, "momentum": "nesterov" if nesterov else "plain"},
                        float(MU), 1e-2)
    step = plan.adapter((N,), np.float32, compressed=False)
    x = np.linspace(-1, 1, N, dtype=np.float32)
    m = np.zeros(N, np.float32)
    for g in gradients(7):
        got = step(g.copy(), x)
        d = g + x * np.float32(1e-2)
        if nesterov:  # m = mu*(m + d); g = d + m
            m = (m + d) * MU
            want = d + m
        else:  # m = mu*m + d; g = m
            m = m * MU + d
            want = m.copy()
        assert got.tobytes() == want.tobytes()


def cuda_missing():
    try:
        import torch
    except ImportError:
        return True
    return not torch.cuda.is_available()


@pytest.mark.parametrize("device", [None, "cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    cuda_missing(), reason="no CUDA device: torch.cuda.is_available() is False here"))],
    ids=["numpy", "device-cpu", "device-cuda"])
def test_plain_momentum_decorator_before_another_codec(device):
    """The ``plain`` decorator (numpy, and the device chain's) before topk."""
    if device:
        pytest.importorskip("torch")
        from bps_gc.compress.device.feedback import DevicePlainMomentum
    n = 64
    codec = build_chain({"compressor": "topk", "k": n // 2, "momentum": "plain", "mu": float(MU)}, n,
                        np.float32, device=device)
    assert not device or isinstance(codec, DevicePlainMomentum)  # not bridged to the host
    m = np.zeros(n, np.float32)
    rng = np.random.default_rng(5)
    for _ in range(4):
        g = rng.standard_normal(n).astype(np.float32)
        m = m * MU + g
        if device:
            import torch
            payload = codec.compress(torch.from_numpy(g.copy()).to(device)).cpu().numpy()
        else:
            payload = codec.compress(g)
        rec = np.frombuffer(payload.tobytes(), RECORD[np.float32])
        top = np.argsort(-np.abs(m), kind="stable")[: n // 2]
        assert sorted(rec["i"].tolist()) == sorted(top.tolist())
        assert rec["v"].tobytes() == m[rec["i"]].tobytes()


def test_the_example_maps_each_config_to_its_momentum_form():
    sys.path.insert(0, os.path.join(ROOT, "example", "pytorch", "dgc"))
    try:
        from dgc_config import Config
        from dgc_settings import dgc_params
    finally:
        sys.path.pop(0)
    for nesterov, form in ((False, "plain"), (True, "nesterov")):
        comp = Config(compress_ratio=0.001, sample_ratio=0.01, warmup_epochs=0, warmup_coeff=None,
                      fp16_values=False, int32_indices=True,
                      memory=Config(momentum=0.9, nesterov=nesterov, momentum_masking=True,
                                    gradient_clipping=None))
        c = Config(train=Config(compression=comp, optimizer=Config(momentum=0.9, weight_decay=0.0),
                                optimize_bn_separately=False))
        notes = []
        assert dgc_params(c, notes)["momentum"] == form
        assert not any("nesterov" in note for note in notes)
