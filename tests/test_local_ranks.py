"""DMLC_NUM_WORKER counts worker hosts, as in BytePS: BytePS's recipe environments (scheduler,
server and worker scripts; NVIDIA_VISIBLE_DEVICES on the workers only, no BYTEPS_LOCAL_SIZE
anywhere) run as written, in multi-host mode (one bpslaunch per role, hosts as network
namespaces), and hosts with different numbers of local ranks are refused at join, naming them."""
import re
import sys

import numpy as np
import pytest

from bps_gc.config import Config, ConfigError
from bps_gc.ps.scheduler.hosts import WorkerHosts
from local_ranks import HostsJob, expected_results, machines, run_spec  # noqa: F401
from reference import gradient

# worker.sh's settings, as written (BYTEPS_PARTITION_BYTES aside: tiny tensors need partitions)
RECIPE_WORKER = {"BYTEPS_LOG_LEVEL": "WARNING", "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "4",
                 "BYTEPS_THREADPOOL_SIZE": "16", "BYTEPS_NUMA_ON": "1"}
SPEC = {"steps": 2, "lrs": [0.1, 0.05], "partition_bytes": 1024, "min_compress_bytes": 0,
        "tensors": [{"name": "small", "shape": [5], "dtype": "float32", "params": {}},
                    {"name": "parts", "shape": [700], "dtype": "float32", "params": {}},
                    {"name": "sum", "shape": [33, 2], "dtype": "float32", "average": False, "params": {}}]}


def test_recipe_environment_reduced(machines, tmp_path):  # noqa: F811
    """The recipe's shape at reduced size: 3 hosts x 4 local ranks, 6 servers; every rank
    pulls the exact average (sum) of all 12 ranks' inputs."""
    results = run_spec(machines, SPEC, tmp_path, hosts=3, local_size=4, servers=6, worker_env=RECIPE_WORKER)
    expected = expected_results(SPEC, 3, 4)
    for rank, got in enumerate(results):
        for key, value in expected.items():
            assert got[key].tobytes() == value.tobytes(), f"rank {rank} {key}: {got[key]} != {value}"
    # the flat model (every rank pushes) agrees up to rounding: the same job, summed another way
    for key, value in expected.items():
        name = key.split("/")[0]
        t = next(t for t in SPEC["tensors"] if t["name"] == name)
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
    # both hosts named with their sizes, in whichever order they joined
    sizes = re.search(r"has BYTEPS_LOCAL_SIZE=(\d), DMLC_WORKER_ID=\d at \S+ has (\d)", everything)
    assert sizes and sorted(sizes.groups()) == ["2", "3"], job.report(statuses)
    assert "Traceback" not in everything, job.report(statuses)


def test_hierarchy_setting_is_validated():
    base = dict(DMLC_ROLE="worker", DMLC_NUM_WORKER="2", DMLC_NUM_SERVER="1", DMLC_PS_ROOT_URI="10.0.0.1",
                DMLC_PS_ROOT_PORT="1234", DMLC_WORKER_ID="1", BYTEPS_LOCAL_SIZE="4", BYTEPS_LOCAL_RANK="3")
    assert Config.from_env(base).hierarchy == "auto"
    assert Config.from_env(dict(base, BPS_GC_HIERARCHY="flat")).hierarchy == "flat"
    assert Config.from_env(base).rank == 7
    with pytest.raises(ConfigError, match="BPS_GC_HIERARCHY: unknown value 'tree'; allowed: auto, flat, host"):
        Config.from_env(dict(base, BPS_GC_HIERARCHY="tree"))


def test_scheduler_checks_each_hosts_registration():
    """The scheduler's rules (ps/scheduler/hosts.py), registration by registration."""

    def reg(worker_id, local_rank, local_size, hierarchy="auto"):
        return {"worker_id": worker_id, "local_rank": local_rank, "local_size": local_size,
                "hierarchy": hierarchy, "host": f"10.0.0.{worker_id + 1}"}
    hosts = WorkerHosts(2)
    assert hosts.expected_workers() is None and hosts.hierarchy() == "flat"
    assert hosts.check(reg(1, 2, 3), 5) == (None, None)
    assert hosts.expected_workers() == 6 and hosts.hierarchy() == "host"
    fatal, _ = hosts.check(reg(2, 0, 3), 6)
    assert "DMLC_WORKER_ID=2, outside [0, 2)" in fatal
    _, problem = hosts.check(reg(0, 1, 3), 4)
    assert "worker rank 4 is not DMLC_WORKER_ID * BYTEPS_LOCAL_SIZE + BYTEPS_LOCAL_RANK (0 * 3 + 1)" in problem
    fatal, _ = hosts.check(reg(0, 0, 3, "flat"), 0)
    assert "workers disagree on BPS_GC_HIERARCHY" in fatal and "10.0.0.2" in fatal and "10.0.0.1" in fatal
    fatal, _ = hosts.check(reg(0, 0, 2), 0)
    assert "DMLC_WORKER_ID=1 at 10.0.0.2 has BYTEPS_LOCAL_SIZE=3, DMLC_WORKER_ID=0 at 10.0.0.1 has 2" in fatal
    flat = WorkerHosts(2)
    flat.check(reg(0, 0, 4, "flat"), 0)
    assert flat.hierarchy() == "flat" and flat.book(type("C", (), {"local_reduce": False})(), [])["local_size"] == 4
