"""Every issue-11 codec through the runtime, on a 2-worker x 2-server cluster and on 2 gloo
ranks, in one job per transport (float32 and float16, with and without error feedback where the
codec takes it, sizes from 1 element to 3 partitions; DGC's density comes with the step context):

* terngrad, qsgd, threshold, adaptive_threshold, sign (majority), signnorm and dgc (lossless):
  each pull equals the numpy re-computation of tests/reference.py bit for bit. A 1-element
  threshold push that kept nothing is an empty payload, which the transport must carry.
* powersgd, two phases of plain sums (P, then Q) that the communicators drive (on the PS, also
  summed by the workers themselves with BPS_GC_LOCAL_REDUCE=1): at full rank the
  pull is the exact sum to float32 rounding; at rank 1 it is what a numpy re-computation of
  PowerSGD with error feedback and warm start gives, step after step.
"""
import math

import numpy as np
import pytest

from cluster import run_job
from collective_cluster import run_collective_job
from reference import expected_results, gradient

CODECS = {
    "terngrad": {"compressor": "terngrad"},
    "terngrad-clip": {"compressor": "terngrad", "clip": True},
    "qsgd": {"compressor": "qsgd", "levels": 4},
    "threshold": {"compressor": "threshold", "threshold": 0.8},
    "adaptive_threshold": {"compressor": "adaptive_threshold"},
    "sign": {"compressor": "sign"},  # reducer: majority
    "signnorm": {"compressor": "signnorm"},
    "dgc": {"compressor": "dgc", "k": 0.5},  # reducer: lossless; density 0.25 from ctx
}
NO_EF = ("dgc",)  # carries its own error feedback
SHAPES = {"one": [1], "odd": [37, 3], "three-partitions": [5000]}
PARTITION_BYTES = 8192  # 2048 float32 elements
POWERSGD_SHAPES = {"one": [1], "rows": [37, 3], "two-partitions": [3000]}
SEED = 5


def exact_tensors():
    tensors = []
    for dtype in ("float32", "float16"):
        for codec, params in CODECS.items():
            for ef in (False,) if codec in NO_EF else (False, True):
                for label, shape in SHAPES.items():
                    p = dict(params, ef="vanilla") if ef else dict(params)
                    tensors.append({"name": f"{codec}-{'ef' if ef else 'plain'}-{label}-{dtype}",
                                    "shape": shape, "dtype": dtype, "params": p})
        tensors.append({"name": f"sum-{dtype}", "shape": [33], "dtype": dtype, "average": False, "params": {}})
    return tensors


def powersgd_tensors():
    tensors = []
    for label, shape in POWERSGD_SHAPES.items():
        tensors.append({"name": f"powersgd-full-{label}", "shape": shape, "dtype": "float32",
                        "average": False, "params": {"compressor": "powersgd", "rank": 4096}})
        tensors.append({"name": f"powersgd-rank1-{label}", "shape": shape, "dtype": "float32",
                        "params": {"compressor": "powersgd", "rank": 1, "seed": SEED}})
    tensors.append({"name": "powersgd-fp16-wire", "shape": [300], "dtype": "float32", "average": False,
                    "params": {"compressor": "powersgd", "rank": 4096, "fp16": True}})
    tensors.append({"name": "powersgd-full-float16", "shape": [20, 15], "dtype": "float16",
                    "average": False, "params": {"compressor": "powersgd", "rank": 4096}})
    return tensors


def spec_for(tensors):
    return {"steps": 3, "lrs": [0.1, 0.05, 0.02], "ctx": {"density": 0.25},
            "partition_bytes": PARTITION_BYTES, "min_compress_bytes": 0, "tensors": tensors}


@pytest.fixture(scope="module", params=["ps", "ps-local-reduce", "gloo"])
def job(request, tmp_path_factory):
    """(spec, every rank's pulls) of one job per transport. The exactly checked tensors come
    first, so their keys (declaration indices) are what tests/reference.py assumes. With
    BPS_GC_LOCAL_REDUCE=1 the dense tensors and PowerSGD's phases are summed by the workers."""
    spec = spec_for(exact_tensors() + powersgd_tensors())
    tmp_path = tmp_path_factory.mktemp(f"codecs2-{request.param}")
    if request.param == "ps":
        return spec, run_job(spec, tmp_path, 2, 2)[0]
    if request.param == "ps-local-reduce":
        return spec, run_job(spec, tmp_path, 2, 2, {"BPS_GC_LOCAL_REDUCE": "1"})[0]
    return spec, run_collective_job(spec, tmp_path, 2, launcher="bpslaunch")  # no torchrun agent: ~1.2 s CPU


def test_every_issue11_codec_exact(job):
    spec, results = job
    expected = expected_results(spec_for(exact_tensors()), 2)
    for rank, got in enumerate(results):
        for key, value in expected.items():
            assert got[key].dtype == value.dtype, key
            assert got[key].tobytes() == value.tobytes(), \
                f"rank {rank} {key}: max diff {np.abs(got[key].astype(float) - value).max()}"


def matrix_shape(n, shape):
    """The tensor's rows (first dimension by the rest) when the partition holds whole ones,
    else near-square."""
    if len(shape) >= 2 and n % int(np.prod(shape[1:])) == 0:
        return n // int(np.prod(shape[1:])), int(np.prod(shape[1:]))
    cols = math.ceil(math.sqrt(n))
    return -(-n // cols), cols


def powersgd_pulls(inputs, shape, rank, seed, average):
    """numpy PowerSGD of one partition of a tensor of ``shape``: inputs[step][worker] -> the
    pull of every step."""
    n, workers = inputs[0][0].size, len(inputs[0])
    rows, cols = matrix_shape(n, shape)
    rank = min(rank, rows, cols)
    q = np.random.default_rng(seed).standard_normal((cols, rank)).astype(np.float32)
    errors = [np.zeros(n, np.float64) for _ in range(workers)]
    pulls = []
    for step_inputs in inputs:
        ms = []
        for x, e in zip(step_inputs, errors):
            m = np.zeros(rows * cols)
            m[:n] = x.astype(np.float64) + e
            ms.append(m.reshape(rows, cols))
        p_hat = np.linalg.qr(sum(m @ q for m in ms))[0]
        q = sum(m.T @ p_hat for m in ms)
        approx = (p_hat @ q.T).reshape(-1)[:n]
        errors = [m.reshape(-1)[:n] - approx / workers for m in ms]
        pulls.append(approx / workers if average else approx)
    return pulls


def test_powersgd_two_phases(job):
    spec, results = job
    for t in powersgd_tensors():
        per = PARTITION_BYTES // 4
        size = int(np.prod(t["shape"]))
        for step in range(spec["steps"]):
            key = f"{t['name']}/{step}"
            assert results[0][key].tobytes() == results[1][key].tobytes(), key  # one sum for all
        inputs = [[gradient(r, step, t).reshape(-1) for r in range(2)] for step in range(spec["steps"])]
        if t["params"].get("rank") == 1:
            for start in range(0, size, per):
                stop = min(size, start + per)
                expected = powersgd_pulls([[x[start:stop] for x in s] for s in inputs], t["shape"], 1, SEED, True)
                for step, value in enumerate(expected):
                    got = results[0][f"{t['name']}/{step}"].reshape(-1)[start:stop]
                    np.testing.assert_allclose(got, value, rtol=1e-4, atol=1e-4 * np.abs(value).max(),
                                               err_msg=f"{t['name']} step {step}")
        else:  # full rank: the exact sum to float32 rounding
            for step in range(spec["steps"]):
                total = sum(x.astype(np.float64) for x in inputs[step])
                rows = matrix_shape(min(size, per), t["shape"])[0]
                got = results[0][f"{t['name']}/{step}"].reshape(-1).astype(np.float64)
                half = t["params"].get("fp16") or t["dtype"] == "float16"
                tol = (1e-3 if half else 4e-7 * rows) * np.abs(total).max()
                assert np.abs(got - total).max() <= tol, (t["name"], step, np.abs(got - total).max() / tol)
