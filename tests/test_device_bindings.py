"""bps_gc.torch through device codec chains (BPS_GC_DEVICE_CODECS, docs/device_codecs.md).

Two workers, real processes: the same job (tests/device_bindings_job.py) runs once with
BPS_GC_DEVICE_CODECS=torch (device chains for the CPU tensors: compressed and decoded as torch
tensors, only payloads handed to the transport) and once with =numpy (host numpy chains), over
the parameter server and over torch.distributed. Every push_pull must equal, bit for bit, the
numpy run and reference.py's independent numpy recomputation; DistributedOptimizer's
parameters after a few steps must equal the numpy run's. The CUDA variant runs the same on GPU
tensors where torch sees a GPU.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from cluster import TESTS, run_local
from collective_cluster import bpslaunch_argv, job_env
from conftest import ROOT
from reference import expected_results

from bps_gc.compress.device import DEVICE_COMPRESSORS

JOB = os.path.join(TESTS, "device_bindings_job.py")
ONEBIT_EF = {"compressor": "onebit", "scaling": True, "ef": "vanilla"}
SPEC = {
    "steps": 3, "lrs": [0.1, 0.05, 0.2], "partition_bytes": 4000, "min_compress_bytes": 300,
    "ctx": {"gain": 0.5},  # read by the plugin codec: the step context reaches every chain
    "tensors": [
        {"name": "onebit_ef", "shape": [1500], "dtype": "float32", "params": ONEBIT_EF},
        {"name": "topk", "shape": [40, 30], "dtype": "float32", "params": {"compressor": "topk", "k": 0.05}},
        {"name": "topk_lossless", "shape": [1200], "dtype": "float64", "reducer": "lossless",
         "params": {"compressor": "topk", "k": 0.05}},
        {"name": "topk_fp16_wire", "shape": [900], "dtype": "float32",
         "params": {"compressor": "topk", "k": 0.05, "ef": "vanilla", "fp16": True}},
        {"name": "sign_majority", "shape": [1000], "dtype": "float32", "reducer": "majority",
         "params": {"compressor": "sign"}},
        # a plugin without a device implementation: its numpy chain behind HostBridge
        {"name": "plugin", "shape": [700], "dtype": "float32", "params": {"compressor": "test_step_mask"}},
        {"name": "small_dense", "shape": [50], "dtype": "float32", "params": ONEBIT_EF},  # < 300 B: dense
    ],
    "optimizer": ONEBIT_EF, "optimizer_steps": 3,
    "local_sgd": {"compressor": "signnorm", "ef": "vanilla"}, "choco": {"compressor": "topk", "k": 0.1},
}
COMPRESSED = ["onebit_ef", "plugin", "sign_majority", "topk", "topk_fp16_wire", "topk_lossless"]
# the tiny network's gradients (tests/tiny_torch_net.py) of at least 300 bytes: its weights
# (DistributedOptimizer's and LocalSGD's names)
OPTIMIZER_COMPRESSED = ["Gradient.optimizer.0.weight", "Gradient.optimizer.2.weight", "LocalSGD.local.0.weight",
                        "LocalSGD.local.2.weight"]


def run(tmp_path, transport, mode, device="cpu", hosts=2, local_size=1):
    out = tmp_path / f"{transport}-{mode}-{device}"
    out.mkdir()
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(dict(SPEC, device=device)))
    env = {"BPS_GC_DEVICE_CODECS": mode, "BPS_GC_PLUGINS": "plugin_step_codec",
           "BYTEPS_PARTITION_BYTES": str(SPEC["partition_bytes"]),
           "BYTEPS_MIN_COMPRESS_BYTES": str(SPEC["min_compress_bytes"])}
    if transport == "ps":
        result = run_local([sys.executable, JOB, str(spec_path), str(out)], workers=hosts, servers=1,
                           env=env, timeout=120, local_size=local_size)
    else:
        # bpslaunch --servers 0: torch.distributed without torchrun's agent (~1.2 s of CPU a launch)
        result = subprocess.run(bpslaunch_argv([JOB, str(spec_path), str(out)], 2), env=job_env(env),
                                capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, f"{transport} {mode} job failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return [(dict(np.load(out / f"rank{r}.npz")), json.loads((out / f"paths{r}.json").read_text()))
            for r in range(2)]


def check_same(device_run, numpy_run, transport):
    import plugin_step_codec  # noqa: F401  (registers the plugin here, for the reference)
    expected = expected_results(SPEC, 2)
    for rank, ((results, paths), (numpy_results, numpy_paths)) in enumerate(zip(device_run, numpy_run)):
        assert paths["device_chains"] == sorted(COMPRESSED + OPTIMIZER_COMPRESSED), paths
        assert numpy_paths["device_chains"] == [] and numpy_paths["chains"] == {}
        # torch.distributed sums the dense tensor on the device; the servers on the host
        assert paths["dense_on_device"] == (["small_dense"] if transport == "collective" else [])
        assert numpy_paths["dense_on_device"] == []
        for run_paths in (paths, numpy_paths):
            assert run_paths["wrong_shape"].startswith("push_pull('topk'): got (7,) ")
            assert "first used as (40, 30)" in run_paths["wrong_shape"]
        # a codec with a device implementation runs it; the plugin's numpy chain runs bridged
        bridged = {t["name"] for t in SPEC["tensors"] if t["name"] in COMPRESSED
                   and t["params"]["compressor"] not in DEVICE_COMPRESSORS}
        assert {n for n, kind in paths["chains"].items() if kind == "HostBridge"} == bridged
        assert "plugin" in bridged and "topk" not in bridged and "onebit_ef" not in bridged
        assert paths["choco_gossip"] == "DeviceChocoGossip"
        assert numpy_paths.get("choco_gossip", "ChocoGossip") == "ChocoGossip"  # absent on CUDA
        assert sorted(results) == sorted(numpy_results) or "choco_gossip" not in numpy_paths
        for key, value in results.items():
            if key in numpy_results:
                assert np.array_equal(value, numpy_results[key], equal_nan=True), f"rank {rank} {key}: device != numpy"
            if key in expected:
                assert value.dtype == expected[key].dtype
                assert np.array_equal(value, expected[key], equal_nan=True), f"rank {rank} {key}: != reference"
        for trained in ("optimizer", "local", "choco"):
            assert any(key.startswith(f"{trained}/2/") for key in results), trained


@pytest.fixture(scope="module")
def numpy_run(tmp_path_factory):
    """The numpy chains' run, over the parameter server (the collective's numpy path gives the
    same bits: tests/test_collective_exact.py)."""
    return run(tmp_path_factory.mktemp("numpy"), "ps", "numpy")


@pytest.mark.parametrize("transport", ["ps", "collective"])
def test_device_chains_match_numpy(tmp_path, transport, numpy_run):
    check_same(run(tmp_path, transport, "torch"), numpy_run, transport)


def test_two_levels_keep_the_host_path_and_its_bits(tmp_path):
    """One host of 2 local ranks on the parameter server: the host level sums each tensor and
    its owner compresses the host's sum, so a compressed tensor keeps the host path (a rank's own
    device payloads would be counted as its host's push); torch mode gives numpy mode's bits."""
    device_run = run(tmp_path, "ps", "torch", hosts=1, local_size=2)
    numpy_run = run(tmp_path, "ps", "numpy", hosts=1, local_size=2)
    for (results, paths), (numpy_results, _) in zip(device_run, numpy_run):
        assert not set(paths["device_chains"]) & set(COMPRESSED), paths
        assert sorted(results) == sorted(numpy_results)
        for key, value in results.items():
            assert np.array_equal(value, numpy_results[key], equal_nan=True), key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: torch.cuda.is_available() is False here")
@pytest.mark.parametrize("transport", ["ps", "collective"])
def test_cuda_device_chains_match_numpy(tmp_path, transport, monkeypatch):
    """``auto`` on CUDA tensors: device chains (only payloads reach the host), bit for bit
    the numpy chains'. The collective shares one GPU between the ranks through gloo where there
    are fewer GPUs than ranks (NCCL refuses two ranks on one GPU)."""
    if torch.cuda.device_count() < 2:
        monkeypatch.setenv("BPS_GC_BACKEND", "gloo")
    check_same(run(tmp_path, transport, "auto", "cuda"), run(tmp_path, transport, "numpy", "cuda"), transport)


def test_bad_setting_stops_the_launcher_naming_it():
    result = run_local([sys.executable, "-c", "pass"], workers=1, servers=1,
                       env={"BPS_GC_DEVICE_CODECS": "gpu"}, timeout=60)
    assert result.returncode == 2
    assert "BPS_GC_DEVICE_CODECS: unknown value 'gpu'; allowed: auto, torch, numpy" in result.stderr
    assert "Traceback" not in result.stderr


class MeanOfDecoded:
    """A reducer with no device implementation (as a plugin's would be): the mean of the
    decoded pushes, as a dense reply."""
    summed = False

    def __init__(self, params, n, dtype, codecs):
        self.n, self.dtype, self.decoder = n, np.dtype(dtype), codecs("decode")

    def reduce(self, payloads, compressed, ctx=None):
        acc = np.zeros(self.n, self.dtype)
        for payload in payloads:
            self.decoder.decompress_add(payload, acc)
        return (acc / self.dtype.type(len(payloads))).view(np.uint8)

    def decode(self, reply, out, ctx=None):
        out[:] = np.frombuffer(np.ascontiguousarray(reply), self.dtype)
        return out


@pytest.mark.parametrize("reducer,params,dtype", [
    ("recompress", {"compressor": "topk", "k": 0.1, "ef": "vanilla"}, np.float32),
    ("recompress", {"compressor": "onebit", "scaling": True}, np.float16),
    ("lossless", {"compressor": "topk", "k": 0.05}, np.float64),  # sparse sum: index/value records
    ("lossless", {"compressor": "onebit", "scaling": True}, np.float32),  # dense reply
    ("majority", {"compressor": "sign"}, np.float32),
    ("majority-nan", {"compressor": "sign"}, np.float32),  # a non-finite push: NaN everywhere
    ("test_device_mean", {"compressor": "onebit"}, np.float32),  # numpy on host copies
])
def test_device_reductions_give_the_numpy_reducers_bits(reducer, params, dtype):
    """device_codecs' reducers (decoding a server's reply; reducing every rank's payloads, as
    the collective does) against compress.reducers, in one process."""
    from bps_gc.compress import CompressionParams, build_chain, make_reducer
    from bps_gc.compress.reducers import REDUCERS, register_reducer
    from bps_gc.compress.device.reducers import device_reduction
    if "test_device_mean" not in REDUCERS:
        register_reducer("test_device_mean")(MeanOfDecoded)
    nan = reducer.endswith("-nan")
    reducer = reducer.removesuffix("-nan")
    params, n, key, ctx = CompressionParams.from_dict(params), 1000, 3 << 16 | 1, {"lr": 0.1, "step": 2, "epoch": 0}
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal(n).astype(dtype) for _ in range(3)]
    if nan:
        inputs[1][17] = np.nan
    payloads = [build_chain(params, n, dtype, key=key, role="worker").compress(x, ctx) for x in inputs]
    numpy_reducer = make_reducer(reducer, params, n, dtype, key)
    reply = numpy_reducer.reduce(payloads, True, ctx)
    expected = numpy_reducer.decode(reply, np.empty(n, dtype), ctx)
    assert np.isnan(expected).all() == nan
    cpu = torch.device("cpu")
    decoded, reduced = torch.empty(n, dtype=TORCH_DTYPE[dtype]), torch.empty(n, dtype=TORCH_DTYPE[dtype])
    device_reduction(reducer, params, n, dtype, key, cpu).decode(
        torch.from_numpy(np.array(reply, np.uint8)), decoded, ctx)
    device_reduction(reducer, params, n, dtype, key, cpu).reduce(
        [torch.from_numpy(np.array(p, np.uint8)) for p in payloads], reduced, ctx)
    assert np.array_equal(decoded.numpy(), expected, equal_nan=True)
    assert np.array_equal(reduced.numpy(), expected, equal_nan=True)


TORCH_DTYPE = {np.float32: torch.float32, np.float64: torch.float64, np.float16: torch.float16}


@pytest.mark.parametrize("algorithm,params", [("choco", None), ("choco", {"compressor": "topk", "k": 3}),
                                              ("choco", {"compressor": "signnorm"}), ("dpsgd", None)])
def test_gossip_on_the_device_is_the_numpy_gossip_bit_for_bit(algorithm, params, monkeypatch):
    """DeviceChocoGossip (state, arithmetic and Q on the device) against ChocoGossip, and
    DeviceDPSGDGossip against DPSGDGossip: a ring of 4 nodes in one process (test_choco_math's mailbox),
    4 rounds of the same gradients."""
    from test_choco_math import flat, make_nodes, round_of
    rng = np.random.default_rng(9)
    grads = [[rng.standard_normal(shape).astype(np.float32) for shape in ((4,), (4, 4))] for _ in range(4)]
    models = {}
    for mode in ("torch", "numpy"):
        monkeypatch.setenv("BPS_GC_DEVICE_CODECS", mode)  # read from the environment before init
        nodes, _ = make_nodes(4, "ring", algorithm=algorithm, params=params, gamma=0.3)
        numpy_class = {"choco": "ChocoGossip", "dpsgd": "DPSGDGossip"}[algorithm]
        assert {type(opt.gossip).__name__ for _, opt in nodes} == \
            {"Device" + numpy_class if mode == "torch" else numpy_class}
        for _ in range(4):
            round_of(nodes, lambda r, k, shape: grads[r][k].reshape(shape).copy())
        for _, opt in nodes:
            opt.finish()
        models[mode] = [flat(model) for model, _ in nodes]
    for device_model, numpy_model in zip(models["torch"], models["numpy"]):
        assert np.array_equal(device_model, numpy_model)
    assert not np.array_equal(models["torch"][0], models["torch"][1])  # the nodes did differ
