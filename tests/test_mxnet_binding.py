"""bps_gc.mxnet on a local cluster of real processes: after every DistributedTrainer step the
parameters equal a numpy re-computation to float32 rounding (each rank's autograd gradient ->
1/(batch*size) -> worker codec chain -> the server's rank-ordered sum, its chain -> post-pull
momentum / weight decay adapters -> MXNet's sgd rule), for every codec with and without error feedback and
momentum, and fp16; broadcasts from a non-zero root; a BytePS gluon script runs unchanged; the
errors are clear."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cluster import TESTS, run_local
from conftest import LAUNCH_PYTHONPATH, ROOT, skip_unless_installed
from reference import PushPullModel

skip_unless_installed("mxnet")  # the launched jobs import it

JOB = os.path.join(TESTS, "mxnet_job.py")
PARTITION_BYTES, MIN_COMPRESS_BYTES = 1024, 256  # dense0_weight (1280 B): 2 partitions; biases raw
ENV = {"BYTEPS_PARTITION_BYTES": str(PARTITION_BYTES), "BYTEPS_MIN_COMPRESS_BYTES": str(MIN_COMPRESS_BYTES),
       "OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1"}
CODECS = {
    "onebit": {"compressor": "onebit", "scaling": True},
    "topk": {"compressor": "topk", "k": 0.1},
    "randomk": {"compressor": "randomk", "k": 0.1},
    "dithering": {"compressor": "dithering", "k": 2},
}
CONFIGS = [{}] + [dict(p, **({"ef": "vanilla"} if ef else {}), **({"momentum": "nesterov"} if mom else {}))
                  for p in CODECS.values() for ef in (False, True) for mom in (False, True)] + [
    {"fp16": True},
    {"compressor": "topk", "k": 0.1, "ef": "vanilla", "fp16": True},
    {"compressor": "onebit", "scaling": True, "ef": "vanilla", "momentum": "nesterov", "fp16": True},
]
SPEC = {"configs": CONFIGS, "optimizer": {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01},
        "lrs": [0.1, 0.1, 0.05, 0.05], "batch": 8}


def label(config):
    return "+".join(f"{k}={v}" for k, v in config.items()) or "dense"


def run_train(tmp_path, workers, servers):
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(SPEC))
    env = dict(ENV, **({"BYTEPS_FORCE_DISTRIBUTED": "1"} if workers == 1 else {}))
    result = run_local([sys.executable, JOB, "train", str(spec_path), str(tmp_path)], workers, servers,
                       env, timeout=150)
    assert result.returncode == 0, \
        f"job failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return ([dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(workers)],
            [json.loads((tmp_path / f"meta{r}.json").read_text()) for r in range(workers)])


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    return run_train(tmp_path_factory.mktemp("mx1"), workers=1, servers=1)


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    return run_train(tmp_path_factory.mktemp("mx2"), workers=2, servers=2)


# ---------------------------------------------------------------- the numpy re-computation

def expected_params(config, results, meta, workers):
    """{(step, name): parameters after that step}, replaying every rank's saved gradients."""
    j = CONFIGS.index(config)
    opt = SPEC["optimizer"]
    mu, wd = opt["momentum"], opt["wd"]
    moves_momentum = bool(config.get("momentum"))
    moves_wd = moves_momentum and config.get("compressor") == "onebit"
    codec = dict(config, **({"mu": mu} if moves_momentum else {}))
    names, indices = meta["names"], meta["index"]
    x = {n: results[0][f"{j}/init/{n}"].copy() for n in names}
    models = {n: PushPullModel(codec, x[n].shape, np.float32, index, workers, PARTITION_BYTES,
                               MIN_COMPRESS_BYTES, average=False) for n, index in zip(names, indices)}
    if config.get("compressor"):  # the set-up covers compressed, uncompressed and 2-partition tensors
        assert {m.compressed for m in models.values()} == {True, False}
        assert max(len(m.parts) for m in models.values()) == (1 if config.get("fp16") else 2)
    nag, wd_mom, opt_mom = ({n: np.zeros_like(x[n]) for n in names} for _ in range(3))
    scale = np.float32(1.0 / (SPEC["batch"] * workers))
    out = {}
    for step, lr in enumerate(SPEC["lrs"]):
        for n in names:
            g = models[n].step([results[r][f"{j}/grad/{step}/{n}"] * scale for r in range(workers)], lr)
            if moves_momentum and not models[n].compressed:  # NAG for what the codec chain did not see
                nag[n] = np.float32(mu) * (nag[n] + g)
                g = g + nag[n]
            if moves_wd:  # onebit: weight decay after the pull, with momentum when compressed
                c = np.float32(wd) * x[n]
                if models[n].compressed:
                    wd_mom[n] = np.float32(mu) * (wd_mom[n] + c)
                    g = g + wd_mom[n]
                g = g + c
            # MXNet's sgd (rescale_grad 1): mom = mu*mom - lr*(g + wd*x); x += mom
            opt_wd = 0.0 if moves_wd else wd
            opt_mu = 0.0 if moves_momentum else mu
            if opt_mu:
                opt_mom[n] = np.float32(opt_mu) * opt_mom[n] - np.float32(lr) * (g + np.float32(opt_wd) * x[n])
                x[n] = x[n] + opt_mom[n]
            else:
                x[n] = (np.float32(1) - np.float32(lr * opt_wd)) * x[n] - np.float32(lr) * g
            out[(step, n)] = x[n].copy()
    return out


# Not byte-exact, on purpose: MXNet's sgd kernels apply lr, wd, rescale_grad and momentum in
# their own float32 expression order, so a parameter can differ from numpy's re-computation in
# its last bits (1 ulp per step measured here, for the dense configuration too: at most 9e-8
# after 4 steps on parameters of magnitude < 1). The bound is a few float32 ulps at magnitude 1,
# far below anything a wrong codec, reducer or adapter would produce.
ROUNDING = 4e-7


def check_to_rounding(results, metas, workers):
    failures = []
    for j, config in enumerate(CONFIGS):
        meta = metas[0]["configs"][j]
        # declaration order: per trainer, parameter_i then gradient_i (4 parameters per net)
        assert meta["index"] == [8 * j + 2 * i + 1 for i in range(4)], meta
        assert all(m["configs"][j]["index"] == meta["index"] for m in metas)
        expected = expected_params(config, results, meta, workers)
        for (step, name), want in expected.items():
            for rank in range(workers):
                got = results[rank][f"{j}/param/{step}/{name}"]
                if not np.abs(got.astype(np.float64) - want).max() <= ROUNDING:
                    failures.append(f"{label(config)} rank {rank} step {step} {name}: "
                                    f"max diff {np.abs(got - want).max():.3g}")
        # the updates did something, and compressed configs differ from the dense one
        last = meta["names"][-1]
        assert not np.allclose(results[0][f"{j}/param/3/{last}"], results[0][f"{j}/init/{last}"])
    assert not failures, "\n".join(failures[:20])


def test_every_codec_to_float32_rounding_on_one_worker(one_worker):
    results, metas = one_worker
    check_to_rounding(results, metas, workers=1)


def test_every_codec_to_float32_rounding_on_two_workers(two_workers):
    results, metas = two_workers
    check_to_rounding(results, metas, workers=2)
    # compressed and uncompressed configurations really differ
    dense, onebit = (results[0][f"{j}/param/3/{metas[0]['configs'][j]['names'][-1]}"] for j in (0, 1))
    assert not np.allclose(onebit, dense)


def test_bytes_on_the_wire(two_workers):
    _, metas = two_workers
    ratios = {label(c): metas[0]["configs"][j]["metrics"]["ratio"] for j, c in enumerate(CONFIGS)}
    for name, ratio in ratios.items():
        print(f"bytes-on-wire ratio, 2 workers, {name}: {ratio:.2f}")
    m = metas[0]["configs"][CONFIGS.index(dict(CODECS["onebit"], ef="vanilla"))]["metrics"]
    print(f"onebit+scaling+ef, rank 0: pushed {m['pushed_raw']} B ({m['pushed_wire']} on the wire), "
          f"pulled {m['pulled_raw']} B ({m['pulled_wire']}), ratio {m['ratio']:.2f}")
    assert ratios["dense"] == pytest.approx(1.0)
    assert ratios[label({"fp16": True})] == pytest.approx(1.0)  # pushed_raw counts the wire dtype
    assert all(ratios[label(c)] > 1.5 for c in CONFIGS if c.get("compressor") in ("onebit", "topk", "randomk"))


def test_broadcast_from_root_one(two_workers):
    results, _ = two_workers
    for kind in ("bcast", "tbcast"):
        names = sorted(k.split("/", 2)[2] for k in results[1] if k.startswith(f"{kind}/before/"))
        assert names
        for name in names:
            root = results[1][f"{kind}/before/{name}"]
            if "weight" in name:  # each rank started elsewhere (biases start at zero)
                assert not np.array_equal(results[0][f"{kind}/before/{name}"], root)
            for rank in (0, 1):
                np.testing.assert_array_equal(results[rank][f"{kind}/after/{name}"], root, err_msg=f"{kind} {name}")
    for rank in (0, 1):
        np.testing.assert_array_equal(results[rank]["bcast/dict/a"], np.arange(3) * 2.0)
        np.testing.assert_array_equal(results[rank]["bcast/dict/b"], np.full(5, 2.0))


def test_byteps_push_pull_in_place(two_workers):
    results, _ = two_workers
    for rank in (0, 1):
        np.testing.assert_allclose(results[rank]["pp/avg"], np.arange(6) * 1.5)
        np.testing.assert_allclose(results[rank]["pp/sum"], np.arange(6) * 3.0)
        np.testing.assert_allclose(results[rank]["pp/onebit"], np.full(1000, 1.5))


BYTEPS_SCRIPT = '''
import sys
import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd
import bps_gc.mxnet as bps

bps.init()
ctx = mx.cpu(bps.local_rank())
mx.random.seed(42)
net = gluon.nn.HybridSequential()
with net.name_scope():
    net.add(gluon.nn.Conv2D(8, kernel_size=3, activation="relu"))
    net.add(gluon.nn.MaxPool2D(pool_size=2))
    net.add(gluon.nn.Flatten())
    net.add(gluon.nn.Dense(64, activation="relu"))
    net.add(gluon.nn.Dense(10))
net.initialize(mx.init.Xavier(magnitude=2.24), ctx=ctx)
net.hybridize()
params = net.collect_params()
bps.broadcast_parameters(params, root_rank=0)
optimizer_params = {"momentum": 0.9, "learning_rate": 0.01 * bps.size(), "wd": 1e-4}
compression_params = {"compressor": "onebit", "ef": "vanilla", "momentum": "nesterov", "scaling": True}
trainer = bps.DistributedTrainer(params, "sgd", optimizer_params, compression_params=compression_params)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
metric = mx.metric.Accuracy()
rng = np.random.RandomState(bps.rank())
batch_size = 16
for epoch in range(2):
    metric.reset()
    for i in range(4):
        data = nd.array(rng.rand(batch_size, 1, 12, 12), ctx=ctx)
        label = nd.array(rng.randint(0, 10, batch_size), ctx=ctx)
        with autograd.record():
            output = net(data)
            loss = loss_fn(output, label)
        loss.backward()
        trainer.step(batch_size)
        metric.update([label], [output])
    name, acc = metric.get()
    print("[Epoch %d] rank %d training: %s=%f" % (epoch, bps.rank(), name, acc))
np.savez(sys.argv[1] + "/params%d.npz" % bps.rank(), **{k: v.data().asnumpy() for k, v in params.items()})
'''


def test_byteps_gluon_script_runs_unchanged(tmp_path):
    script = tmp_path / "train_gluon_byteps.py"
    script.write_text(BYTEPS_SCRIPT)
    original = BYTEPS_SCRIPT.replace("import bps_gc.mxnet as bps", "import byteps.mxnet as bps")
    assert original.count("bps_gc") == 0  # the only change to a BytePS script is the import
    result = run_local([sys.executable, str(script), str(tmp_path)], workers=2, servers=1,
                       env={"OMP_NUM_THREADS": "1", "BYTEPS_MIN_COMPRESS_BYTES": "4096"}, timeout=120)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert "[Epoch 1] rank 1 training" in result.stdout + result.stderr
    ranks = [dict(np.load(tmp_path / f"params{r}.npz")) for r in (0, 1)]
    for name in ranks[0]:  # every worker applied the same updates
        np.testing.assert_array_equal(ranks[0][name], ranks[1][name], err_msg=name)


def test_clear_errors_and_zero_copy(tmp_path):
    out = tmp_path / "errors.json"
    env = dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH, OMP_NUM_THREADS="1",
               DMLC_ROLE="worker", DMLC_NUM_WORKER="1", DMLC_NUM_SERVER="1", DMLC_WORKER_ID="0",
               DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT="9")
    env.pop("BYTEPS_FORCE_DISTRIBUTED", None)
    result = subprocess.run([sys.executable, JOB, "errors", str(out)], env=env, capture_output=True,
                            text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-5000:]
    errors = json.loads(out.read_text())

    def expect(case, kind, *words):
        assert errors[case] is not None, f"{case}: no error"
        name, message = errors[case]
        assert name == kind, (case, name, message)
        for word in words:
            assert word in message, (case, message)

    for case in ("trainer before init", "push_pull before init", "broadcast before init", "rank before init"):
        expect(case, "RuntimeError", "init()")
    expect("bad compressor", "ParamError", "'compressor'", "zip", "onebit")
    expect("bad k", "ParamError", "'k'")
    expect("unknown key", "ParamError", "'compresor'")
    expect("momentum without optimizer momentum", "ValueError", "momentum", "optimizer_params")
    expect("momentum with optimizer momentum 0", "ValueError", "momentum", "optimizer_params")
    expect("list of parameters", "TypeError", "ParameterDict", "list")
    assert errors["caller optimizer_params"] == {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-4}
    assert errors["optimizer momentum, wd"] == [0.0, 0.0]  # onebit: both moved to the codec chain
    assert errors["grad views"] == [[False, True]] * 4  # zero-copy: writes land in the NDArray
    assert errors["copy fallback"] == [True, [0, 1, 2, 3], [1, 2, 3, 4]]
    assert errors["single process max diff"] < 1e-6
