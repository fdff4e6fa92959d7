"""Device chains' state (compress/device, on CPU tensors; CUDA where present): resumed through
the byte encoding they equal the straight run byte for byte; a numpy chain's state resumes on
the device chain of the same settings and the other way round; a state whose generator kind
differs (torch's generator on the device, xorshift128+ in numpy) is refused, naming it."""
import numpy as np
import pytest

from bps_gc.compress import build_chain
from bps_gc.compress.device import HostBridge
from bps_gc.compress.stateful import StateError
from test_codec_state import CHAINS, N, STEPS, assert_runs_equal, inputs, name, run, through_bytes

torch = pytest.importorskip("torch")
CUDA_SKIP = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="no CUDA device: torch.cuda.is_available() is False here")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_SKIP)]
TORCH_RNG = {"dithering", "terngrad", "qsgd", "thc"}  # their device codecs draw from torch's generator


def on_device(device):
    return dict(to_host=lambda t: t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t),
                from_host=lambda a: torch.from_numpy(a).to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", CHAINS, ids=name)
def test_device_resume_equals_straight(params, device):
    io, xs = on_device(device), inputs()
    straight = build_chain(params, N, np.float32, key=11, device=device)
    want = run(straight, xs, 0, **io)
    first = build_chain(params, N, np.float32, key=11, device=device)
    got = run(first, xs[:STEPS // 2], 0, **io)
    sd = first.state_dict()
    for key, value in sd.items():  # device state stays on the device (the generator's: CPU)
        if isinstance(value, torch.Tensor) and not key.endswith("generator"):
            assert value.device.type == torch.device(device).type, key
    fresh = build_chain(params, N, np.float32, key=11, device=device)
    fresh.load_state_dict(through_bytes(sd))
    got += run(fresh, xs[STEPS // 2:], STEPS // 2, **io)
    assert_runs_equal(want, got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", CHAINS, ids=name)
def test_state_moves_between_numpy_and_device(params, device):
    """numpy's first half -> the device's second half decodes as numpy's straight run (and
    ends in the same state), and the other way round."""
    io, xs = on_device(device), inputs()
    host = build_chain(params, N, np.float32, key=11)
    dev = build_chain(params, N, np.float32, key=11, device=device)
    if params["compressor"] in TORCH_RNG:
        with pytest.raises(StateError, match=r"'codec\.rng' is 'xorshift128\+' in the state, "
                                             r"'torch.Generator\(\w+\)' here"):
            dev.load_state_dict(host.state_dict())
        return
    straight = build_chain(params, N, np.float32, key=11)
    want = run(straight, xs, 0)
    run(host, xs[:STEPS // 2], 0)
    dev.load_state_dict(through_bytes(host.state_dict()))
    got = run(dev, xs[STEPS // 2:], STEPS // 2, **io)
    # PowerSGD's device products and QR are torch's, not numpy's: equal to rounding only
    exact = params["compressor"] != "powersgd"
    for step, ((_, wd), (_, gd)) in enumerate(zip(want[STEPS // 2:], got)):
        np.testing.assert_allclose(gd, wd, rtol=0 if exact else 1e-4, atol=0 if exact else 1e-5,
                                   err_msg=f"step {step + STEPS // 2}")
    back = build_chain(params, N, np.float32, key=11)
    back.load_state_dict(through_bytes(dev.state_dict()))
    final = straight.state_dict()
    for key, value in back.state_dict().items():
        if isinstance(value, np.ndarray) and not exact:
            np.testing.assert_allclose(value, final[key], rtol=1e-3, atol=1e-4, err_msg=key)
        else:
            assert np.asarray(value).tobytes() == np.asarray(final[key]).tobytes(), key


@pytest.mark.parametrize("device", DEVICES)
def test_host_bridge_state_is_the_numpy_chains(device):
    params = {"compressor": "randomk", "k": 0.1, "ef": "vanilla"}
    host = build_chain(params, N, np.float32, key=3)
    run(host, inputs()[:2], 0)
    bridge = HostBridge(build_chain(params, N, np.float32, key=3), device)
    bridge.load_state_dict(host.state_dict())
    assert sorted(bridge.state_dict()) == sorted(host.state_dict())
    xs = inputs()[2:]
    assert_runs_equal(run(host, xs, 2), run(bridge, xs, 2, **on_device(device)))


def test_device_refusals_name_the_key():
    params = {"compressor": "dgc", "k": 0.05, "mu": 0.9}
    dev = build_chain(params, N, np.float32, device="cpu")
    sd = dev.state_dict()
    with pytest.raises(StateError, match=r"'codec\.u'.*shape \(300,\).*shape \(299,\)"):
        dev.load_state_dict({**sd, "codec.u": torch.zeros(N - 1)})
    with pytest.raises(StateError, match=r"'codec\.v'.*dtype float32.*dtype float64"):
        dev.load_state_dict({**sd, "codec.v": torch.zeros(N, dtype=torch.float64)})
    gen = build_chain({"compressor": "terngrad"}, N, np.float32, device="cpu")
    with pytest.raises(StateError, match=r"'codec\.generator': expected a generator state"):
        gen.load_state_dict({**gen.state_dict(), "codec.generator": torch.zeros(3, dtype=torch.uint8)})


def test_choco_state_moves_to_the_device_variant(monkeypatch):
    """A numpy CHOCO node's state resumes in bps_gc.torch's DeviceChocoGossip (CPU tensors,
    device codec chains): the models after the restart are the numpy straight run's."""
    monkeypatch.setenv("BPS_GC_DEVICE_CODECS", "torch")  # device chains on CPU tensors too
    from bps_gc.torch.choco import DeviceChocoGossip
    from test_algorithm_state import K, ROUNDS, SHAPES, gradient, make, models, rounds
    from mailbox import Mailbox, in_threads
    from bps_gc.algorithms.topology import ring
    params = {"compressor": "topk", "k": 0.25}
    arrays = models()
    want = rounds(make("choco", arrays, Mailbox(), params), arrays, 0, ROUNDS)
    arrays = models()
    nodes = make("choco", arrays, Mailbox(), params)
    rounds(nodes, arrays, 0, ROUNDS // 2)
    saved = [through_bytes(n.state_dict()) for n in nodes]
    tensors = [{n: torch.from_numpy(x.copy()) for n, x in a.items()} for a in arrays]
    box = Mailbox()
    fresh = [DeviceChocoGossip(tensors[r], ring(K), box.node(r, K), 0.4, params) for r in range(K)]
    for node, sd in zip(fresh, saved):
        node.load_state_dict(sd)
    for step in range(ROUNDS // 2, ROUNDS):
        for r in range(K):
            for name, x in tensors[r].items():
                x -= torch.from_numpy(np.float32(0.1) * gradient(r, step, name))
        in_threads([lambda n=n: n.step(0.1) for n in fresh])
    for r in range(K):
        for name in SHAPES:
            np.testing.assert_array_equal(tensors[r][name].numpy(), want[r][name], err_msg=f"{r} {name}")
