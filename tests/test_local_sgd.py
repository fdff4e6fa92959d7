"""bps_gc.torch.LocalSGD on a local cluster (bpslaunch --local, 2 workers, 1 server): H=1 is
synchronous SGD (bit for bit where float32 is exact, to rounding otherwise), the models follow a
numpy re-computation of spec §4, H=4 puts 4x fewer bytes on the wire, post-local SGD switches at
its epoch, BatchNorm statistics stay local."""
import inspect
import json
import os
import sys

import numpy as np
import pytest

import bps_gc.core
from cluster import run_local
from conftest import ROOT

pytest.importorskip("torch")
WORKERS = 2
EXACT = {"lr": 1 / 64, "momentum": 0.5}             # powers of two: exact on the 1/16 grid
MLP = {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}
CONFIGS = [
    {"name": "sync-exact", "algorithm": "sync", "model": "exact", "optimizer": EXACT, "steps": 8},
    {"name": "h1-exact", "algorithm": "local", "model": "exact", "optimizer": EXACT, "steps": 8,
     "local_steps": 1, "steps_per_epoch": 4},
    {"name": "sync-mlp", "algorithm": "sync", "model": "mlp", "optimizer": MLP, "steps": 8},
    {"name": "h1-mlp", "algorithm": "local", "model": "mlp", "optimizer": MLP, "steps": 8,
     "local_steps": 1, "steps_per_epoch": 4},
    {"name": "h4-mlp", "algorithm": "local", "model": "mlp", "optimizer": MLP, "steps": 8,
     "local_steps": 4, "steps_per_epoch": 4},
    {"name": "post-bn", "algorithm": "local", "model": "bn", "optimizer": MLP, "steps": 12,
     "local_steps": 4, "local_from_epoch": 2, "steps_per_epoch": 3},
]
# the compressed differences are averaged exactly (the 'lossless' reducer): runtimes with reducers
REDUCERS = "reducer" in inspect.signature(bps_gc.core.declare).parameters
COMPRESSED = [
    {"name": "h2-sign", "algorithm": "local", "model": "mlp", "optimizer": MLP, "steps": 8, "local_steps": 2,
     "steps_per_epoch": 4, "compression_params": {"compressor": "sign"}},
    {"name": "h2-signnorm-ef", "algorithm": "local", "model": "mlp", "optimizer": MLP, "steps": 8,
     "local_steps": 2, "steps_per_epoch": 4,
     "compression_params": {"compressor": "onebit", "scaling": True, "ef": "vanilla"}},
] if REDUCERS else []
CONFIGS += COMPRESSED


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("localsgd")
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"configs": CONFIGS}))
    result = run_local([sys.executable, os.path.join(ROOT, "tests", "local_sgd_job.py"), str(spec), str(tmp)],
                       workers=WORKERS, servers=1, timeout=240, env={"BYTEPS_MIN_COMPRESS_BYTES": "0"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return [dict(np.load(tmp / f"local{r}.npz")) for r in range(WORKERS)]


def series(run, cfg, what, step):
    return {k.split("/", 3)[3]: v for k, v in run.items() if k.startswith(f"{cfg}/{step}/{what}/")}


def params_at(runs, cfg, step, rank=0):
    return {k.split(".", 1)[1]: v for k, v in series(runs[rank], cfg, "param", step).items()}


def test_h1_without_compression_is_synchronous_sgd_bit_for_bit(runs):
    for step in range(8):
        for r in range(WORKERS):
            grads = series(runs[r], "h1-exact", "grad", step)
            assert all(np.array_equal(g, np.round(g)) for g in grads.values())  # the premise: exact
            local, sync = params_at(runs, "h1-exact", step, r), params_at(runs, "sync-exact", step, r)
            for n in sync:
                assert np.array_equal(local[n], sync[n]), f"step {step} rank {r} {n}"


def test_h1_is_synchronous_sgd_to_rounding(runs):
    for step in range(8):
        local, sync = params_at(runs, "h1-mlp", step), params_at(runs, "sync-mlp", step)
        for n in sync:
            assert np.allclose(local[n], sync[n], rtol=1e-5, atol=1e-6), f"step {step} {n}"


def sgd_oracle(x, grad, buf, lr, momentum, nesterov, weight_decay):
    """torch.optim.SGD's update in numpy (the buffer starts as the first d)."""
    d = grad + np.float32(weight_decay) * x
    buf = d.copy() if buf is None else np.float32(momentum) * buf + d
    d = d + np.float32(momentum) * buf if nesterov else buf
    return x - np.float32(lr) * d, buf


def signs(x):
    """onebit's decoded signs: -1 below zero, +1 otherwise."""
    return np.where(x < 0, np.float32(-1), np.float32(1))


def mean_abs(x):
    return np.float32(np.abs(x).sum(dtype=np.float64) / x.size)


class Averaging:
    """mean over the workers of what each sends for its delta (spec §4), per tensor."""

    def __init__(self, params, names):
        self.kind = (params or {}).get("compressor")
        self.error = {n: [0, 0] for n in names}

    def __call__(self, name, deltas):
        if self.kind is None:  # the server sums in float32, each worker divides
            return sum(deltas) / np.float32(WORKERS)
        if self.kind == "sign":  # mean(sign) * mean(scale)
            scale = sum(mean_abs(d) for d in deltas) / np.float32(WORKERS)
            return sum(signs(d) for d in deltas) / np.float32(WORKERS) * scale
        sent = []  # sign+norm with error feedback: p = delta + e; C(p); e = p - C(p)
        for r, d in enumerate(deltas):
            p = d + self.error[name][r]
            c = mean_abs(p) * signs(p)
            self.error[name][r] = p - c
            sent.append(c)
        return sum(sent) / np.float32(WORKERS)


@pytest.mark.parametrize("cfg", ["h4-mlp", "post-bn"] + [c["name"] for c in COMPRESSED])
def test_models_follow_spec_4(runs, cfg):
    spec = next(c for c in CONFIGS if c["name"] == cfg)
    names = sorted(series(runs[0], cfg, "grad", 0))
    x_sync = {n: runs[0][f"{cfg}/init/param/{n}"] for n in names}
    x = [dict(x_sync) for _ in range(WORKERS)]
    bufs = [{n: None for n in names} for _ in range(WORKERS)]
    average = Averaging(spec.get("compression_params"), names)
    for step in range(spec["steps"]):
        epoch = step // spec["steps_per_epoch"]
        sync = epoch < spec.get("local_from_epoch", 0) or step % spec["local_steps"] == 0
        for r in range(WORKERS):
            assert bool(runs[r][f"{cfg}/{step}/synchronizes"]) == sync, (cfg, step)
            for n in names:
                x[r][n], bufs[r][n] = sgd_oracle(x[r][n], runs[r][f"{cfg}/{step}/grad/{n}"], bufs[r][n],
                                                 **spec["optimizer"])
        if sync:
            for n in names:
                x_sync[n] = x_sync[n] - average(n, [x_sync[n] - x[r][n] for r in range(WORKERS)])
                for r in range(WORKERS):
                    x[r][n] = x_sync[n].copy()
        for r in range(WORKERS):
            for n in names:
                got = runs[r][f"{cfg}/{step}/param/{n}"]
                assert np.allclose(got, x[r][n], rtol=1e-5, atol=1e-6), f"{cfg} step {step} rank {r} {n}"


def test_h4_puts_four_times_fewer_bytes_on_the_wire(runs):
    for r in range(WORKERS):
        per_step = {c: [int(runs[r][f"{c}/{s}/bytes"]) for s in range(8)] for c in ("h1-mlp", "h4-mlp")}
        assert all(b > 0 for b in per_step["h1-mlp"])
        assert [b > 0 for b in per_step["h4-mlp"]] == [s % 4 == 0 for s in range(8)]
        assert sum(per_step["h1-mlp"]) == 4 * sum(per_step["h4-mlp"])


@pytest.mark.parametrize("cfg", [c["name"] for c in COMPRESSED])
def test_compressed_differences_push_a_bit_per_element(runs, cfg):
    dense = int(runs[0]["h1-mlp/0/pushed"])
    for r in range(WORKERS):
        pushed = [int(runs[r][f"{cfg}/{s}/pushed"]) for s in range(8)]
        assert [p > 0 for p in pushed] == [s % 2 == 0 for s in range(8)]
        assert max(pushed) < dense / 8, (pushed, dense)  # signs (+ a scale per tensor) vs float32


def test_post_local_sgd_switches_at_its_epoch_and_keeps_batchnorm_local(runs):
    # 3 steps per epoch, switch at epoch 2 (step 6), then every 4th step: 0-5 and 8
    want = [s < 6 or s % 4 == 0 for s in range(12)]
    for r in range(WORKERS):
        assert [bool(runs[r][f"post-bn/{s}/bytes"] > 0) for s in range(12)] == want
    for s in range(12):
        p0, p1 = params_at(runs, "post-bn", s, 0), params_at(runs, "post-bn", s, 1)
        same = all(np.array_equal(p0[n], p1[n]) for n in p0)
        assert same == want[s], f"step {s}: parameters {'equal' if same else 'differ'} across ranks"
        b0, b1 = series(runs[0], "post-bn", "buffer", s), series(runs[1], "post-bn", "buffer", s)
        # each rank's data has its own mean: its running statistics are its own, never averaged
        assert np.abs(b0["1.running_mean"] - b1["1.running_mean"]).max() > 0.05, s
        assert int(b0["1.num_batches_tracked"]) == s + 1
