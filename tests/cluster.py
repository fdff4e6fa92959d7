"""Runs a job on a local cluster (``bpslaunch --local``: real processes, loopback only)."""
import json
import os
import subprocess
import sys

import numpy as np

from conftest import LAUNCH_PYTHONPATH, ROOT

TESTS = os.path.join(ROOT, "tests")


def run_local(command, workers=2, servers=2, env=None, timeout=180, local_size=1, worker_env=None):
    """``worker_env`` overrides variables for the worker processes only (via ``env`` on the
    command line), e.g. a wrong token."""
    full_env = dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH,
                    BPS_GC_HEARTBEAT_INTERVAL="0.2", BPS_GC_HEARTBEAT_TIMEOUT="3")
    full_env.update(env or {})
    if worker_env:
        command = ["env", *(f"{k}={v}" for k, v in worker_env.items()), *command]
    argv = [sys.executable, "-m", "bps_gc.launcher.cli", "--local", "--workers", str(workers),
            "--servers", str(servers), "--local-size", str(local_size), "--", *command]
    return subprocess.run(argv, env=full_env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def run_job(spec, tmp_path, workers=2, servers=2, env=None, local_size=1):
    """Run tests/cluster_job.py with ``spec``; returns each rank's results and metrics."""
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    job_env = {"BYTEPS_PARTITION_BYTES": str(spec["partition_bytes"]),
               "BYTEPS_MIN_COMPRESS_BYTES": str(spec["min_compress_bytes"]), **(env or {})}
    result = run_local([sys.executable, os.path.join(TESTS, "cluster_job.py"), str(spec_path), str(tmp_path)],
                       workers, servers, job_env, local_size=local_size)
    assert result.returncode == 0, f"job failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    size = workers * local_size
    results = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(size)]
    metrics = [json.loads((tmp_path / f"metrics{r}.json").read_text()) for r in range(size)]
    return results, metrics
