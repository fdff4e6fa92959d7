"""DMLC_NUM_WORKER counts worker hosts, as in BytePS: BytePS's recipe environments (scheduler,
server and worker scripts; NVIDIA_VISIBLE_DEVICES on the workers only, no BYTEPS_LOCAL_SIZE
anywhere) run as written, in multi-host mode (one bpslaunch per role, hosts as network
namespaces), and hosts with different numbers of local ranks are refused at join, naming them."""
import sys

import numpy as np

from local_ranks import TESTS, HostsJob, expected_results, machines, run_spec  # noqa: F401

SPEC = {"steps": 2, "lrs": [0.1, 0.05], "partition_bytes": 1024, "min_compress_bytes": 0,
        "tensors": [{"name": "small", "shape": [5], "dtype": "float32", "params": {}},
                    {"name": "parts", "shape": [700], "dtype": "float32", "params": {}},
                    {"name": "sum", "shape": [33, 2], "dtype": "float32", "average": False, "params": {}}]}


def test_recipe_environment_reduced(machines, tmp_path):  # noqa: F811
    """The recipe's shape at reduced size: 3 hosts x 4 local ranks, 6 servers; every rank
    pulls the exact average (sum) of all 12 ranks' inputs."""
    results = run_spec(machines, SPEC, tmp_path, hosts=3, local_size=4, servers=6)
    expected = expected_results(SPEC, 3, 4)
    for rank, got in enumerate(results):
        for key, value in expected.items():
            assert got[key].tobytes() == value.tobytes(), f"rank {rank} {key}: {got[key]} != {value}"
    # the flat model (every rank pushes) agrees up to rounding: the same job, summed another way
    for key, value in expected.items():
        name = key.split("/")[0]
        t = next(t for t in SPEC["tensors"] if t["name"] == name)
        from reference import gradient
        step = int(key.split("/")[1])
        flat = sum(gradient(r, step, t).astype(np.float64) for r in range(12))
        flat /= 12 if t.get("average", True) else 1
        np.testing.assert_allclose(value, flat, rtol=1e-5, atol=1e-5)


def test_hosts_with_different_local_sizes_are_refused(machines):  # noqa: F811
    """Host 0 runs 2 ranks, host 1 runs 3: every launcher stops within the bound, and the
    scheduler's refusal names both hosts and their sizes."""
    script = "import bps_gc.core as bps; bps.init(); bps.shutdown()"
    job = HostsJob(machines, 2, [2, 3], 1, [sys.executable, "-c", script])
    statuses, elapsed = job.wait_all(20)
    assert all(status != 0 for status in statuses.values()), job.report(statuses)
    everything = "".join(job.text(name) for name in job.launchers)
    assert "worker hosts run different numbers of local ranks" in everything, job.report(statuses)
    assert "BYTEPS_LOCAL_SIZE=2" in everything and "has 3" in everything, job.report(statuses)
    assert "Traceback" not in everything, job.report(statuses)
