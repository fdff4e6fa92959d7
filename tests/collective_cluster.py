"""Runs a job on torch.distributed ranks over loopback: ``python -m torch.distributed.run``
(torchrun) or ``bpslaunch --local --servers 0``; real processes, gloo."""
import json
import os
import subprocess
import sys

import numpy as np

from bps_gc.launcher.local import free_port
from conftest import LAUNCH_PYTHONPATH, ROOT

TESTS = os.path.join(ROOT, "tests")


def job_env(env=None):
    return dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH, OMP_NUM_THREADS="1",
                BPS_GC_HEARTBEAT_INTERVAL="0.2", BPS_GC_HEARTBEAT_TIMEOUT="3", **(env or {}))


def torchrun_argv(script_argv, ranks, port=None, nnodes=1, node_rank=0):
    if nnodes == 1 and port is None:  # torchrun binds a free port itself: no race with others
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                str(ranks), *script_argv]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank",
            str(node_rank), "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
            "--master-port", str(port or free_port()), *script_argv]


def runs_job_argv(runs, folder):
    """tests/runs_job.py's arguments for ``runs`` (several runs of a script in one launch), the
    runs written to ``folder``/runs.json."""
    (folder / "runs.json").write_text(json.dumps(runs))
    return [os.path.join(TESTS, "runs_job.py"), str(folder / "runs.json")]


def bpslaunch_argv(script_argv, ranks):
    return [sys.executable, "-m", "bps_gc.launcher.cli", "--local", "--workers", str(ranks),
            "--servers", "0", "--", sys.executable, *script_argv]


def run_torchrun_job(script, spec, tmp_path, ranks, timeout=300, launcher="torchrun"):
    """Run tests/``script`` SPEC.json OUT under torchrun on ``ranks`` gloo ranks, asserting it ends
    well; the job writes its results into ``tmp_path``. ``launcher`` "bpslaunch": bpslaunch
    --servers 0 instead (torch.distributed as under torchrun, without torchrun's agent: ~0.9 s
    of CPU a launch), for a job that starts with bps_gc's init() rather than torch's own."""
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    job = [os.path.join(TESTS, script), str(tmp_path / "spec.json"), str(tmp_path)]
    argv = torchrun_argv(job, ranks) if launcher == "torchrun" else bpslaunch_argv(job, ranks)
    result = subprocess.run(argv, env=job_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, f"{script} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


def run_collective_job(spec, tmp_path, ranks=2, launcher="torchrun", env=None, timeout=180):
    """Run tests/cluster_job.py with ``spec`` on ``ranks`` ranks; each rank's results."""
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    script = [os.path.join(TESTS, "cluster_job.py"), str(spec_path), str(tmp_path)]
    argv = torchrun_argv(script, ranks) if launcher == "torchrun" else bpslaunch_argv(script, ranks)
    full_env = job_env({"BYTEPS_PARTITION_BYTES": str(spec["partition_bytes"]),
                        "BYTEPS_MIN_COMPRESS_BYTES": str(spec["min_compress_bytes"]), **(env or {})})
    result = subprocess.run(argv, env=full_env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, f"job failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(ranks)]
