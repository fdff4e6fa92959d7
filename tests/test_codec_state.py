"""Codec chain state (compress/stateful.py) through its byte encoding (compress/state_bytes.py):
N steps straight equal N/2 steps, save, encode, decode, load into a FRESH chain, N/2 more, byte
for byte; and every wrong state is refused, naming the problem, with nothing loaded. The oracle
is the straight run of an independent chain object."""
import itertools
import os

import numpy as np
import pytest

from bps_gc.compress import CompressionParams, ParamError, build_chain, make_reducer
from bps_gc.compress.entire_model import WholeVectorCodec
from bps_gc.compress.stateful import StateError
from bps_gc.compress.state_bytes import decode_state, encode_state
from conftest import DATA

N, STEPS = 300, 6
COMPRESSORS = [
    {"compressor": "onebit", "scaling": True}, {"compressor": "sign"}, {"compressor": "signnorm"},
    {"compressor": "topk", "k": 0.1}, {"compressor": "randomk", "k": 0.1},
    {"compressor": "dithering", "k": 4}, {"compressor": "dithering", "k": 3, "partition": "natural"},
    {"compressor": "terngrad"}, {"compressor": "qsgd", "levels": 7},
    {"compressor": "threshold", "threshold": 0.5}, {"compressor": "adaptive_threshold"},
    {"compressor": "dgc", "k": 0.05, "mu": 0.9}, {"compressor": "dgc", "k": 0.05},
    {"compressor": "dgc", "k": 0.05, "mu": 0.9, "momentum": "nesterov"},
    {"compressor": "powersgd", "rank": 2},
    {"compressor": "thc", "bits": 4}, {"compressor": "thc", "bits": 4, "rotate": True, "feedback": True},
    {"compressor": "identity"},
]


def valid(params):
    try:
        CompressionParams.from_dict(params)
        return True
    except ParamError:
        return False


CHAINS = [p for c, ef, mom in itertools.product(
    COMPRESSORS, [None, "vanilla"], [None, "nesterov", "plain"])
    for p in [{**c, **({"ef": ef} if ef else {}), **({"momentum": mom, "mu": 0.9} if mom else {})}]
    if valid(p) and not (mom and c["compressor"] == "dgc")]


def name(p):
    return ",".join(f"{k}={v}" for k, v in p.items())


def inputs(steps=STEPS, n=N, seed=3):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * np.exp(rng.uniform(-2, 1, n))).astype(np.float32)
            for _ in range(steps)]


def ctx(step):
    return {"lr": [0.1, 0.1, 0.05, 0.2, 0.2, 0.1][step % 6], "step": step, "epoch": step // 3}


def run(chain, xs, first, to_host=lambda a: np.asarray(a), from_host=lambda a: a):
    """Payloads (bytes) and decodes of steps first.. of ``chain``; PowerSGD runs its two phases
    with itself as the only worker."""
    out = []
    for i, x in enumerate(xs):
        step = first + i
        payload = chain.compress(from_host(x.copy()), ctx(step))
        if hasattr(chain, "compress_q"):
            q = chain.compress_q(payload)
            decoded = chain.finish(q, None, 1)
            payload = to_host(payload).tobytes() + to_host(q).tobytes()
        else:
            decoded = chain.decompress(payload)
            payload = to_host(payload).tobytes()
        out.append((payload, to_host(decoded).copy()))
    return out


def through_bytes(sd):
    return decode_state(encode_state(sd))


def assert_runs_equal(want, got):
    assert len(want) == len(got)
    for step, ((wp, wd), (gp, gd)) in enumerate(zip(want, got)):
        assert wp == gp, f"payload of step {step} differs"
        assert wd.tobytes() == gd.tobytes(), f"decoded step {step} differs"


def assert_states_equal(a, b):
    assert set(a) == set(b)
    for k in a:
        va, vb = a[k], b[k]
        if hasattr(va, "detach"):
            va, vb = va.cpu().numpy(), vb.cpu().numpy()
        assert np.asarray(va).tobytes() == np.asarray(vb).tobytes() and type(va) is type(vb), k


@pytest.mark.parametrize("params", CHAINS, ids=name)
def test_resume_equals_straight(params):
    xs = inputs()
    straight = build_chain(params, N, np.float32, key=11)
    want = run(straight, xs, 0)
    first = build_chain(params, N, np.float32, key=11)
    got = run(first, xs[:STEPS // 2], 0)
    fresh = build_chain(params, N, np.float32, key=11)
    fresh.load_state_dict(through_bytes(first.state_dict()))
    got += run(fresh, xs[STEPS // 2:], STEPS // 2)
    assert_runs_equal(want, got)
    assert_states_equal(straight.state_dict(), fresh.state_dict())


def test_thc_state_saved_before_its_seeding_change_loads():
    """A thc state from before issue 43 (its generator then seeded from the process id), written
    by 2ed851b's numpy and device chains after two steps, loads into a chain of another rank (the
    saved stream wins), and the third step's payload is the one that process sent."""
    import torch
    saved = np.load(os.path.join(DATA, "thc_state_before_issue43.npz"))
    x = (np.random.default_rng(0).standard_normal(64) * 1e-3).astype(np.float32)
    for kind, device in (("numpy", {}), ("device", {"device": "cpu"})):
        codec = build_chain({"compressor": "thc", "bits": 4}, 64, np.float32, key=3, rank=1, **device)
        codec.set_summands(2)
        codec.load_state_dict(decode_state(saved[f"{kind}_state"].tobytes()))
        hist = np.asarray(codec.compress(torch.from_numpy(x) if device else x, ctx(2))).view(np.float64) * 2
        assert np.asarray(codec.compress_q(hist.view(np.uint8))).tobytes() == saved[f"{kind}_payload"].tobytes(), kind


def test_resume_without_state_differs():
    """The check above can fail: a fresh chain without the state sends other bytes."""
    params = {"compressor": "topk", "k": 0.1, "ef": "vanilla", "momentum": "nesterov", "mu": 0.9}
    xs = inputs()
    want = run(build_chain(params, N, np.float32), xs, 0)
    got = run(build_chain(params, N, np.float32), xs[STEPS // 2:], STEPS // 2)
    assert got[0][0] != want[STEPS // 2][0]


@pytest.mark.parametrize("reducer,params", [
    ("recompress", {"compressor": "onebit", "scaling": True, "ef": "vanilla"}),
    ("recompress", {"compressor": "randomk", "k": 0.1, "ef": "vanilla"}),
    ("recompress", {"compressor": "dithering", "k": 4}),
    ("lossless", {"compressor": "topk", "k": 0.1}),
    ("majority", {"compressor": "sign"})], ids=lambda v: v if isinstance(v, str) else name(v))
def test_reducer_resume_equals_straight(reducer, params):
    workers = [build_chain(params, N, np.float32, key=5) for _ in range(2)]
    pushes = [[w.compress(x, ctx(s)).tobytes() for w, x in zip(workers, xs)]
              for s, xs in enumerate(zip(inputs(seed=1), inputs(seed=2)))]
    straight = make_reducer(reducer, CompressionParams.from_dict(params), N, np.float32, key=5)
    want = [straight.reduce(p, True, ctx(s)).tobytes() for s, p in enumerate(pushes)]
    first = make_reducer(reducer, CompressionParams.from_dict(params), N, np.float32, key=5)
    got = [first.reduce(p, True, ctx(s)).tobytes() for s, p in enumerate(pushes[:3])]
    fresh = make_reducer(reducer, CompressionParams.from_dict(params), N, np.float32, key=5)
    sd = through_bytes(first.state_dict())
    assert sd["identity.reducer"] == reducer
    fresh.load_state_dict(sd)
    got += [fresh.reduce(p, True, ctx(s + 3)).tobytes() for s, p in enumerate(pushes[3:])]
    assert got == want
    if params["compressor"] == "onebit":
        assert np.any(sd["chain.ef.error"])  # the server's residual is in the state
    other = make_reducer("lossless" if reducer != "lossless" else "recompress",
                         CompressionParams.from_dict(params), N, np.float32, key=5)
    with pytest.raises(StateError, match="'reducer' is '.*' in the state, '.*' here"):
        other.load_state_dict(sd)


def test_whole_model_codec_resumes():
    params = CompressionParams.from_dict({"compressor": "topk", "k": 0.1, "ef": "vanilla",
                                          "granularity": "entiremodel"})
    bounds = [(0, 128), (128, N)]

    def steps(codec, first, count):
        return [b"".join(p.tobytes() for p in codec.compress(x, ctx(first + i)))
                for i, x in enumerate(inputs()[first:first + count])]
    want = steps(WholeVectorCodec(params, N, np.float32, bounds, key=2), 0, STEPS)
    first = WholeVectorCodec(params, N, np.float32, bounds, key=2)
    got = steps(first, 0, 3)
    fresh = WholeVectorCodec(params, N, np.float32, bounds, key=2)
    fresh.load_state_dict(through_bytes(first.state_dict()))
    assert steps(fresh, 3, 3) == want[3:] and got == want[:3]


# ---- refusals: the setting or key is named, and nothing is loaded -----------------------------

BASE = {"compressor": "topk", "k": 0.1, "ef": "vanilla", "momentum": "nesterov", "mu": 0.9}


def used_chain(params=BASE, n=N, dtype=np.float32, role="worker"):
    chain = build_chain(params, n, dtype, role=role)
    for s, x in enumerate(inputs(3, n)):
        chain.compress(x.astype(dtype), ctx(s))
    return chain


@pytest.mark.parametrize("change,pattern", [
    (dict(params={**BASE, "k": 0.2}), r"'k' is 0\.1 in the state, 0\.2 here"),
    (dict(params={**BASE, "mu": 0.8}), r"'mu' is 0\.9 in the state, 0\.8 here"),
    (dict(params={**BASE, "compressor": "randomk"}), r"'codec\.name' is 'topk' in the state, 'randomk' here"),
    (dict(n=N + 1), rf"'codec\.n' is {N} in the state, {N + 1} here"),
    (dict(dtype=np.float64), r"'codec\.dtype' is 'float32' in the state, 'float64' here"),
    (dict(role="server"), r"'momentum\.name' is 'nesterov' in the state, absent here"),
    (dict(params={**BASE, "momentum": "plain"}), r"'momentum(\.name)?' is 'nesterov' in the state, 'plain' here"),
])
def test_other_settings_are_refused(change, pattern):
    sd = used_chain().state_dict()
    target = used_chain(**change)
    before = target.state_dict()
    with pytest.raises(StateError, match=pattern):
        target.load_state_dict(sd)
    assert_states_equal(before, target.state_dict())


def corrupt(sd, key, value):
    return {**{k: v for k, v in sd.items() if k != key}, **({} if value is None else {key: value})}


@pytest.mark.parametrize("key,value,pattern", [
    ("ef.error", None, r"lacks key 'ef\.error'"),
    ("momentum.momentum", np.zeros(N + 1, np.float32), r"'momentum\.momentum'.*shape \(300,\).*got an array of shape \(301,\)"),
    ("ef.error", np.zeros(N, np.float64), r"'ef\.error'.*dtype float32.*dtype float64"),
    ("ef.lr_prev", "fast", r"'ef\.lr_prev': expected float"),
    ("ef.lr_prev", np.zeros(2), r"'ef\.lr_prev': expected float"),
    ("ef.lr_prev", True, r"'ef\.lr_prev': expected float"),
    ("codec.rng_state", np.zeros(2, np.uint64), r"has key 'codec\.rng_state'"),
    ("identity.codec.params", "{not json", r"not the JSON"),
])
def test_bad_keys_are_named_and_nothing_is_loaded(key, value, pattern):
    sd = used_chain().state_dict()
    sd["momentum.momentum"] = sd["momentum.momentum"] + 1  # would change the chain if loaded
    target = build_chain(BASE, N, np.float32)
    before = target.state_dict()
    with pytest.raises(StateError, match=pattern):
        target.load_state_dict(corrupt(sd, key, value))
    assert_states_equal(before, target.state_dict())


def test_not_a_mapping():
    with pytest.raises(StateError, match="must be a mapping"):
        build_chain(BASE, N, np.float32).load_state_dict([1, 2])


def test_loaded_arrays_are_copied_into_the_native_buffers():
    """randomk's kernel holds the address of its generator words: loading writes into them."""
    params = {"compressor": "randomk", "k": 0.1}
    first = build_chain(params, N, np.float32)
    words = first.rng_state
    first.load_state_dict(used_chain(params).state_dict())
    assert first.rng_state is words and not np.array_equal(words, build_chain(params, N, np.float32).rng_state)


def test_a_plugins_numpy_generator_resumes():
    """A plugin codec that keeps a numpy Generator declares it like any state attribute."""
    from bps_gc.compress import Codec

    class Noisy(Codec):
        state_attrs = ("rng",)

        def __init__(self):
            super().__init__(CompressionParams.from_dict({"compressor": "topk", "k": 1}), 4, np.float32)
            self.rng = np.random.default_rng(5)

        def compress(self, x, ctx=None):
            return self.rng.integers(0, 256, 8, dtype=np.uint8)
    first = Noisy()
    first.compress(None)
    fresh = Noisy()
    fresh.load_state_dict(through_bytes(first.state_dict()))
    assert fresh.compress(None).tobytes() == first.compress(None).tobytes()
    with pytest.raises(StateError, match="'codec.rng': expected the JSON state of a PCG64"):
        fresh.load_state_dict({**first.state_dict(), "codec.rng": "{}"})


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
@pytest.mark.parametrize("params", [BASE, {"compressor": "onebit", "ef": "vanilla"},
                                    {"compressor": "randomk", "k": 0.1, "ef": "vanilla"}], ids=name)
def test_other_dtypes_resume(params, dtype):
    xs = [x.astype(dtype) for x in inputs()]
    want = run(build_chain(params, N, dtype, key=4), xs, 0)
    first = build_chain(params, N, dtype, key=4)
    got = run(first, xs[:3], 0)
    sd = through_bytes(first.state_dict())
    assert sd["ef.error"].dtype == dtype
    fresh = build_chain(params, N, dtype, key=4)
    fresh.load_state_dict(sd)
    assert_runs_equal(want, got + run(fresh, xs[3:], 3))


def test_state_group_checks_every_object_before_loading_any():
    from bps_gc.compress.stateful import StateGroup
    params = {"topk": BASE, "dgc": {"compressor": "dgc", "k": 0.05, "mu": 0.9}}
    group = StateGroup({name: used_chain(p) for name, p in params.items()})
    sd = through_bytes(group.state_dict())
    assert "topk/ef.error" in sd and "identity.dgc/codec.name" in sd
    fresh = StateGroup({name: build_chain(p, N, np.float32) for name, p in params.items()})
    before = fresh.state_dict()
    bad = {**sd, "dgc/codec.v": np.zeros(3, np.float32)}  # the second object's part is wrong
    with pytest.raises(StateError, match=r"'dgc/codec\.v'"):
        fresh.load_state_dict(bad)
    assert_states_equal(before, fresh.state_dict())  # topk's part was not loaded either
    with pytest.raises(StateError, match="holds 1 object.*'fc.weight'"):
        fresh.load_state_dict({**sd, "fc.weight/ef.error": np.zeros(1)})
    with pytest.raises(StateError, match="lacks 1 object.*'dgc'"):
        fresh.load_state_dict({k: v for k, v in sd.items() if "dgc/" not in k})
    fresh.load_state_dict(sd)
    assert_states_equal(group.state_dict(), fresh.state_dict())
    nested = StateGroup({"fc.weight": StateGroup({"0": build_chain(BASE, N, np.float32),
                                                  "1": build_chain(BASE, N, np.float32)})})
    saved = nested.state_dict()
    with pytest.raises(StateError, match="holds 1 object.*'fc.weight/2'"):
        nested.load_state_dict({k.replace("fc.weight/1/", "fc.weight/2/"): v for k, v in saved.items()})
    nested.load_state_dict(saved)
