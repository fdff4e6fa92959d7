"""bps_gc.torch on a local cluster: parameters after every step equal a numpy re-computation of
the update (worker chain, server decode-sum-EF-recode, post-pull adapters, torch's SGD)."""
import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from bps_gc.algorithms.momentum import MomentumPlan
from cluster import run_local
from conftest import LAUNCH_PYTHONPATH, ROOT
from reference import PushPullModel
from test_half_wire import round_half, widen_half

MIN_COMPRESS, PARTITION = 256, 256
CODECS = {"onebit": {"compressor": "onebit", "scaling": True}, "topk": {"compressor": "topk", "k": 0.25},
          "randomk": {"compressor": "randomk", "k": 0.25}, "dithering": {"compressor": "dithering", "k": 3}}
OPTIMIZER = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}


def configs():
    out = []
    for codec, params in CODECS.items():
        out.append({"name": f"{codec}", "compression_params": params, "optimizer": OPTIMIZER})
        out.append({"name": f"{codec}-ef", "compression_params": dict(params, ef="vanilla"), "optimizer": OPTIMIZER})
        out.append({"name": f"{codec}-ef-mom", "optimizer": OPTIMIZER,
                    "compression_params": dict(params, ef="vanilla", momentum="nesterov")})
    out.append({"name": "dense", "compression_params": {}, "optimizer": OPTIMIZER})
    out.append({"name": "fp16-topk", "compression_params": dict(CODECS["topk"], ef="vanilla"), "fp16": True,
                "optimizer": {"lr": 0.05}})
    return out


def sgd(param, grad, state, lr, momentum=0, weight_decay=0, **_):
    d = grad + np.float32(weight_decay) * param if weight_decay else grad
    if momentum:
        state["buf"] = d.copy() if "buf" not in state else np.float32(momentum) * state["buf"] + d
        d = state["buf"]
    return param - np.float32(lr) * d


def replay(results, spec, workers, min_compress=MIN_COMPRESS):
    index = 0
    for cfg in spec["configs"]:
        prefix = cfg["name"]
        names = sorted(k.split("/", 2)[2] for k in results[0] if k.startswith(f"{prefix}/init/"))
        params = {n: results[0][f"{prefix}/init/{n}"] for n in names}
        cp = dict(cfg["compression_params"])
        opt = dict(cfg["optimizer"])
        plan = MomentumPlan(cp, opt.get("momentum"), opt.get("weight_decay")) if cp.get("momentum") else None
        if plan:
            opt["momentum"] = 0
            if plan.moves_weight_decay:
                opt["weight_decay"] = 0
            cp = plan.tensor_params()
        if cfg.get("fp16"):
            cp["fp16"] = True
        models = {n: PushPullModel(cp, params[n].shape, np.float32, index + i, workers, PARTITION, min_compress)
                  for i, n in enumerate(names)}
        adapters = {n: plan.adapter(params[n].shape, np.float32, models[n].compressed) for n in names} if plan else {}
        state = {n: {} for n in names}
        index += len(names)
        for step in range(spec["steps"]):
            for n in names:
                grads = [results[r][f"{prefix}/{step}/grad/{n}"] for r in range(workers)]
                g = models[n].step(grads, opt["lr"])
                if n in adapters:
                    adapters[n](g, params[n])
                params[n] = sgd(params[n], g, state[n], **opt)
                for r in range(workers):
                    got = results[r][f"{prefix}/{step}/param/{n}"]
                    assert np.allclose(got, params[n], rtol=1e-5, atol=1e-6), \
                        f"{prefix} step {step} {n} rank {r}: max diff {np.abs(got - params[n]).max()}"
                params[n] = results[0][f"{prefix}/{step}/param/{n}"]  # follow the run, check each step


@pytest.mark.parametrize("workers", [1, 2])
def test_every_codec_matches_the_update_rule(workers, tmp_path):
    spec = {"steps": 4, "configs": configs()}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {"BYTEPS_MIN_COMPRESS_BYTES": str(MIN_COMPRESS), "BYTEPS_PARTITION_BYTES": str(PARTITION),
           "BYTEPS_FORCE_DISTRIBUTED": "1"}
    result = run_local([sys.executable, os.path.join(ROOT, "tests", "torch_job.py"), str(tmp_path / "spec.json"),
                        str(tmp_path)], workers=workers, servers=workers, env=env, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    results = [dict(np.load(tmp_path / f"torch{r}.npz")) for r in range(workers)]
    replay(results, spec, workers)


def test_single_process_keeps_the_moved_momentum(tmp_path):
    # one worker process, not distributed: nothing is compressed, so the momentum that moved out
    # of the optimizer must come back as NAG after the (local) pull for every tensor
    spec = {"steps": 3, "configs": [c for c in configs() if c["name"] == "onebit-ef-mom"]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env.update(DMLC_ROLE="worker", DMLC_NUM_WORKER="1", DMLC_NUM_SERVER="1", DMLC_WORKER_ID="0",
               DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT="9", PYTHONPATH=LAUNCH_PYTHONPATH)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "torch_job.py"),
                             str(tmp_path / "spec.json"), str(tmp_path)], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    replay([dict(np.load(tmp_path / "torch0.npz"))], spec, 1, min_compress=float("inf"))


# the errors (ERRORS, before and after init()) and the two broadcast scenarios share one launch
# (2 workers, 1 server), one after the other: broadcast from a non-zero root with the plain API,
# then a fresh model and optimizer where only the root has stepped
SCRIPT = textwrap.dedent("""
    torch.manual_seed(r)                        # different weights on each rank
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()   # one local step creates momentum buffers
    opt.step()
    root = {k: v.clone() for k, v in model.state_dict().items()}
    bufs = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    bps.broadcast_parameters(model.state_dict(), root_rank=1)
    bps.broadcast_optimizer_state(opt, root_rank=1)
    out = {k: v.numpy() for k, v in model.state_dict().items()}
    out.update({f"buf{i}": opt.state[p]["momentum_buffer"].numpy() for i, p in enumerate(model.parameters())})
    out.update({f"own.{k}": v.numpy() for k, v in root.items()})
    out.update({f"ownbuf{i}": b.numpy() for i, b in enumerate(bufs)})
    np.savez(f"{OUT}/b{r}.npz", **out)
    # the value-returning and async forms
    t = torch.full((5,), float(r + 1))
    s = bps.push_pull(t, average=False, name="t")
    h = bps.push_pull_async(torch.full((5,), float(r + 1)), average=True, name="u")
    while not bps.poll(h):
        pass
    u = bps.synchronize(h)
    assert t.tolist() == [float(r + 1)] * 5 and s.tolist() == [3.0] * 5 and u.tolist() == [1.5] * 5
    # bfloat16 every worker pushes (no host sums it): averaged by the servers (mean_of_bfloat16)
    g = torch.Generator().manual_seed(7 + r)
    bf = (torch.randn(500, generator=g) * 10.0 ** torch.randint(-6, 3, (500,), generator=g)).to(torch.bfloat16)
    mean = bps.push_pull(bf, average=True, name="bf16")
    torch.manual_seed(5)  # and DistributedOptimizer on a bfloat16 model: gradients 1 and 1.5 averaged
    net = torch.nn.Linear(3, 2).to(torch.bfloat16)
    step = bps.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.5), named_parameters=net.named_parameters())
    net(torch.full((1, 3), float(r + 1), dtype=torch.bfloat16)).sum().backward()
    step.step()
    assert net.bias.grad.tolist() == [1.0] * 2 and net.weight.grad.tolist() == [[1.5] * 3] * 2
    np.savez(f"{OUT}/bf{r}.npz", given=bf.view(torch.int16).numpy(), mean=mean.view(torch.int16).numpy(),
             weight=net.weight.detach().float().numpy())
    print("TORCH-OK", r)
""")


@pytest.fixture(scope="module")
def broadcasts(tmp_path_factory):
    """ERRORS (it calls init()), SCRIPT then LAZY in one launch: (the folder, the result, its seconds)."""
    out = tmp_path_factory.mktemp("broadcasts")
    code = (f"OUT = {str(out)!r}\nimport numpy as np, torch, bps_gc.torch as bps\n" + ERRORS + "r = bps.rank()\n"
            + SCRIPT + LAZY + "bps.shutdown()\n")
    started = time.monotonic()
    result = run_local([sys.executable, "-c", code], workers=2, servers=1, timeout=120)
    return out, result, time.monotonic() - started


def test_broadcast_from_a_non_zero_root_and_the_plain_api(broadcasts):
    tmp_path, result, _ = broadcasts
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("TORCH-OK") == 2
    b0, b1 = np.load(tmp_path / "b0.npz"), np.load(tmp_path / "b1.npz")
    for key in ("weight", "bias", "buf0", "buf1"):
        assert np.array_equal(b0[key], b1[key])
    assert np.array_equal(b0["weight"], b1["own.weight"]) and np.array_equal(b0["buf0"], b1["ownbuf0"])
    assert not np.array_equal(b0["own.weight"], b1["own.weight"])
    given = [np.load(tmp_path / f"bf{r}.npz") for r in (0, 1)]
    want = mean_of_bfloat16([g["given"] for g in given])
    assert all(g["mean"].view(np.uint16).tobytes() == want.tobytes() for g in given)
    assert np.array_equal(given[0]["weight"], given[1]["weight"])


def mean_of_bfloat16(pushes):
    """The servers' mean of bfloat16 pushes (their bits, in rank order): the float32 sum in rank
    order divided by their count in float32, rounded once to nearest, ties to even (test_half_wire's
    rounding); the bits as uint16."""
    widened = [widen_half(bits, "bfloat16") for bits in pushes]
    total = widened[0]
    for value in widened[1:]:
        total = total + value
    return round_half(total / np.float32(len(pushes)), "bfloat16")


# run first in the broadcasts launch (2 workers: the distributed path, which the errors are about);
# it calls init() and leaves the shutdown() to the launch's end
ERRORS = textwrap.dedent("""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    def expect(fn, cls, text):
        try:
            fn()
        except cls as e:
            assert text in str(e), str(e)
            print("OK:", text)
        else:
            raise SystemExit(f"no {cls.__name__} for {text}")
    expect(lambda: bps.DistributedOptimizer(opt), RuntimeError, "call bps_gc.torch.init() first")
    bps.init()
    expect(lambda: bps.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
           compression_params={"compressor": "zip"}), ValueError, "'compressor': unknown compressor 'zip'")
    expect(lambda: bps.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
           compression_params={"compressor": "onebit", "momentum": "nesterov"}), ValueError,
           "needs momentum in the optimizer")
    expect(lambda: bps.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
           compression_params={"compressor": "topk", "k": 0.1, "reducer": "majority"}), ValueError,
           "compressor 'topk' does not support reducer 'majority'")
    expect(lambda: bps.DistributedOptimizer(model), TypeError, "wraps a torch.optim.Optimizer")
    expect(lambda: bps.push_pull(torch.ones(3, dtype=torch.int64), name="i"), TypeError, "torch.int64 is not supported")
    half = torch.nn.Linear(4, 3).to(torch.bfloat16)  # the momentum moved after the pull runs in numpy
    expect(lambda: bps.DistributedOptimizer(torch.optim.SGD(half.parameters(), lr=0.1, momentum=0.9),
           named_parameters=half.named_parameters(), compression_params={"compressor": "onebit", "momentum": "nesterov"}),
           TypeError, "DistributedOptimizer: 'bias' is torch.bfloat16, which numpy (the momentum moved after the pull")
""")


def test_errors_are_clear(broadcasts):
    _, result, _ = broadcasts
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stdout.count("OK:") == 2 * 7  # each of the 2 workers


LAZY = textwrap.dedent("""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if r == 0:  # only the root has stepped: only it has momentum buffers
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    bps.broadcast_optimizer_state(opt, root_rank=0)
    bufs = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    np.savez(f"{OUT}/lazy{r}.npz", *[b.numpy() for b in bufs])
    print("LAZY-OK", r, flush=True)
""")


def test_broadcast_optimizer_state_when_only_the_root_has_state(broadcasts):
    tmp_path, result, seconds = broadcasts
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("LAZY-OK") == 2 and seconds < 60
    root, other = (np.load(tmp_path / f"lazy{r}.npz") for r in (0, 1))
    assert root.files == other.files and len(root.files) == 2
    for name in root.files:
        assert np.any(root[name] != 0) and np.array_equal(root[name], other[name])
