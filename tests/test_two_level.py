"""Two levels (BPS_GC_HIERARCHY=host, the default with several local ranks per host): 2 hosts
(network namespaces) x 3 local ranks, one bpslaunch per role. Every codec and reducer pulls,
bit for bit, what tests/local_ranks.py's HostModel computes: each host's sum compressed once by
its owner, the servers' reduction of one push per host (a majority vote is one vote per host).
BPS_GC_HIERARCHY=flat keeps the old path: reference.py's model of 6 separate pushers."""
import json
import os
import sys

import numpy as np
import pytest

import reference
from cluster import TESTS, run_job, run_local
from local_ranks import expected_results, machines, run_spec  # noqa: F401
from test_granularity import layers, topk

CODECS = {
    "dense": ({}, None),
    "fp16": ({"fp16": True}, None),
    "recompress": ({"compressor": "topk", "k": 0.05, "ef": "vanilla"}, "recompress"),
    "lossless": ({"compressor": "randomk", "k": 0.05, "seed": 7}, "lossless"),
    "majority": ({"compressor": "onebit", "scaling": True}, "majority"),
    "recipe-onebit": ({"compressor": "onebit", "scaling": True, "ef": "vanilla", "momentum": "nesterov",
                       "mu": 0.9}, None),
    "dithering": ({"compressor": "dithering", "k": 2, "normalize": "l2"}, None),
    "dgc": ({"compressor": "dgc", "k": 0.05}, None),
}
SPEC = {"steps": 2, "lrs": [0.1, 0.05], "partition_bytes": 2048, "min_compress_bytes": 0,
        "tensors": [{"name": name, "shape": [1100], "dtype": "float32", "params": params, "reducer": reducer}
                    for name, (params, reducer) in CODECS.items()]
        + [{"name": "sum", "shape": [7, 3], "dtype": "float32", "average": False, "params": {}}]}
POWERSGD = {"name": "powersgd", "shape": [24, 16], "dtype": "float32", "params": {"compressor": "powersgd", "rank": 2}}


def test_every_codec_two_levels_and_flat(machines, tmp_path):  # noqa: F811
    spec = dict(SPEC, tensors=SPEC["tensors"] + [POWERSGD])
    (tmp_path / "host").mkdir()
    (tmp_path / "flat").mkdir()
    two = run_spec(machines, spec, tmp_path / "host", hosts=2, local_size=3, servers=2)
    flat = run_spec(machines, spec, tmp_path / "flat", hosts=2, local_size=3, servers=2,
                    env={"BPS_GC_HIERARCHY": "flat"})
    host_model, flat_model = expected_results(SPEC, 2, 3), reference.expected_results(SPEC, 6)
    for rank in range(6):
        for key in host_model:
            assert two[rank][key].tobytes() == host_model[key].tobytes(), \
                f"two levels, rank {rank} {key}: max diff {np.abs(two[rank][key] - host_model[key]).max()}"
            assert flat[rank][key].tobytes() == flat_model[key].tobytes(), f"flat, rank {rank} {key}"
        for step in range(spec["steps"]):
            # PowerSGD: every rank still compresses its own gradient; the phases' sums are the
            # same sums, added in another order
            key = f"powersgd/{step}"
            np.testing.assert_allclose(two[rank][key], flat[0][key], rtol=1e-4, atol=1e-5)
            assert two[rank][key].tobytes() == two[0][key].tobytes()
    # the host level changes what a codec sees: the sums differ from the flat path's
    assert two[0]["recompress/0"].tobytes() != flat[0]["recompress/0"].tobytes()


ASYNC = """
import numpy as np, bps_gc.core as bps
w = bps.init(); r, n = bps.rank(), bps.size()
assert w.host is not None  # two levels: 2 hosts x 2 local ranks on loopback
bps.declare("w", shape=(50_000,), dtype=np.float32, compressor="onebit", scaling=True)
bps.declare("d", shape=(1000,), dtype=np.float32)
for _ in range(5):
    bps.push_pull(np.full(50_000, r + 1, np.float32), "w", average=False).wait()
    bps.push_pull(np.full(1000, r + 1, np.float32), "d", average=False).wait()
bps.barrier()
final = bps.push_pull(np.zeros(50_000, np.float32), "w", average=False).wait()
dense = bps.push_pull(np.zeros(1000, np.float32), "d", average=False).wait()
# the servers' stores hold every push: 5 steps of each host's sum (onebit+scaling keeps a constant)
expected = 5 * sum(k + 1 for k in range(n))
assert np.array_equal(final, np.full_like(final, expected)) and np.array_equal(dense, np.full_like(dense, expected))
print("ASYNC-OK", flush=True)
bps.shutdown()
"""


def test_async_mode():
    """BYTEPS_ENABLE_ASYNC: each owner's push of its host's sum goes into the servers' stores."""
    result = run_local([sys.executable, "-c", ASYNC], workers=2, servers=2, local_size=2, timeout=120,
                       env={"BYTEPS_ENABLE_ASYNC": "1", "BYTEPS_MIN_COMPRESS_BYTES": "0"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stdout.count("ASYNC-OK") == 4, result.stdout


def test_local_sgd_h1_is_synchronous_sgd_bit_for_bit(tmp_path):
    """Local SGD with two levels (one host of 2 ranks, pushing once: torch's import is what
    costs here): syncing every step equals synchronous SGD, bit for bit on the exact grid of
    tests/test_local_sgd.py, on every rank."""
    pytest.importorskip("torch")
    exact = {"lr": 1 / 64, "momentum": 0.5}
    configs = [{"name": "sync-exact", "algorithm": "sync", "model": "exact", "optimizer": exact, "steps": 4},
               {"name": "h1-exact", "algorithm": "local", "model": "exact", "optimizer": exact, "steps": 4,
                "local_steps": 1, "steps_per_epoch": 4}]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"configs": configs}))
    result = run_local([sys.executable, os.path.join(TESTS, "local_sgd_job.py"), str(spec), str(tmp_path)],
                       workers=1, servers=1, local_size=2, timeout=240,
                       # torch's import on a busy 2-core box can starve heartbeats for seconds
                       env={"BYTEPS_MIN_COMPRESS_BYTES": "0", "BPS_GC_HEARTBEAT_TIMEOUT": "20"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    runs = [dict(np.load(tmp_path / f"local{r}.npz")) for r in range(2)]

    def params(run, cfg, step):
        return {k.split("/", 3)[3].split(".", 1)[1]: v for k, v in run.items() if k.startswith(f"{cfg}/{step}/param/")}
    for step in range(4):
        for r in range(2):
            local, sync = params(runs[r], "h1-exact", step), params(runs[r], "sync-exact", step)
            assert sync and local.keys() == sync.keys()
            for name in sync:
                assert np.array_equal(local[name], sync[name]), f"step {step} rank {r} {name}"
                assert np.array_equal(sync[name], params(runs[0], "sync-exact", step)[name])


def test_one_host_local_reduce_keeps_its_flat_path(tmp_path):
    """BPS_GC_LOCAL_REDUCE=1 with every rank on one host (2 hosts x 2 ranks on loopback): dense
    sums stay in shared memory, compressed tensors are pushed by every rank (the flat model),
    although the hosts run several local ranks."""
    names = ("dense", "recompress", "majority")
    spec = dict(SPEC, tensors=[t for t in SPEC["tensors"] if t["name"] in names])
    results, metrics = run_job(spec, tmp_path, workers=2, servers=1, local_size=2,
                               env={"BPS_GC_LOCAL_REDUCE": "1", "BPS_GC_DENSE_PARTITION_BYTES": "2048"})
    expected = reference.expected_results(spec, 4)
    for rank, got in enumerate(results):
        for key, value in expected.items():
            assert got[key].tobytes() == value.tobytes(), f"rank {rank} {key}"


ENTIRE = """
import json, sys, numpy as np, bps_gc.core as bps
from bps_gc.algorithms.entire_model import EntireModel
from test_granularity import SHAPES, layers
bps.init()
model = EntireModel("em", SHAPES, np.float32, {"compressor": "topk", "k": 0.05})
arrays = [a.copy() for a in layers(bps.rank())]
model.reduce(arrays, {"lr": 0.1}, average=True)
np.save(sys.argv[1] + f"/em{bps.rank()}.npy", np.concatenate([a.reshape(-1) for a in arrays]))
bps.shutdown()
"""


def test_entire_model_is_pushed_by_every_rank(tmp_path):
    """Entire-model granularity with two levels (2 hosts x 2 ranks): its codec runs in the
    binding over each rank's whole gradient, so every rank pushes its chunks (the servers count
    one push per rank for those keys) while layer-wise tensors push once per host: the result
    is the sum of every rank's top-k of its whole vector (numpy), averaged."""
    result = run_local([sys.executable, "-c", ENTIRE, str(tmp_path)], workers=2, servers=2, local_size=2,
                       timeout=120, env={"BYTEPS_PARTITION_BYTES": "1024", "BYTEPS_MIN_COMPRESS_BYTES": "0"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    want = np.zeros(sum(int(np.prod(s.shape)) for s in layers(0)), np.float32)
    for rank in range(4):
        want += topk(np.concatenate([a.reshape(-1) for a in layers(rank)]), 0.05)
    want /= np.float32(4)
    for rank in range(4):
        got = np.load(tmp_path / f"em{rank}.npy")
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
