"""Faults found when the job assembles: each stops every process within a stated bound, with
one line naming the cause, a non-zero exit, and nothing left running.

Each case runs in multi-host mode (one bpslaunch per role, tests/multihost.py) and under
`bpslaunch --local`."""
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from cluster import run_local
from conftest import LAUNCH_PYTHONPATH, ROOT
from multihost import Job

BOUND = 15.0  # seconds from start to the last process gone (interpreter starts on a loaded box)
JOIN_TIMEOUT = "120"  # what a hang would cost: far above BOUND

STEPS = textwrap.dedent("""
    import numpy as np, bps_gc.core as bps
    bps.init()
    bps.declare("g", shape=(1000,), dtype=np.float32)
    for _ in range(3):
        bps.push_pull(np.ones(1000, np.float32), "g").wait()
    print("DONE", flush=True)
    bps.shutdown()
""")

# (case, per-launcher overrides in multi-host mode, worker-only overrides under --local, named)
CASES = [
    ("num_worker", {"worker1": {"DMLC_NUM_WORKER": "3"}}, {"DMLC_NUM_WORKER": "3"},
     "DMLC_NUM_WORKER=3, the scheduler DMLC_NUM_WORKER=2"),
    ("num_server", {"server0": {"DMLC_NUM_SERVER": "2"}}, {"DMLC_NUM_SERVER": "2"},
     "DMLC_NUM_SERVER=2, the scheduler DMLC_NUM_SERVER=1"),
    ("partition_bytes", {"worker0": {"BYTEPS_PARTITION_BYTES": "8192"}}, {"BYTEPS_PARTITION_BYTES": "8192"},
     "BYTEPS_PARTITION_BYTES=8192, the scheduler BYTEPS_PARTITION_BYTES=4096000"),
    ("dense_partition_bytes", {"worker1": {"BPS_GC_DENSE_PARTITION_BYTES": "8192"}},
     {"BPS_GC_DENSE_PARTITION_BYTES": "8192"},
     "BPS_GC_DENSE_PARTITION_BYTES=8192, the scheduler BPS_GC_DENSE_PARTITION_BYTES=unset"),
    ("duplicate_worker_id", {"worker1": {"DMLC_WORKER_ID": "0"}}, {"DMLC_WORKER_ID": "0"},
     "DMLC_WORKER_ID=0 (BYTEPS_LOCAL_RANK=0) is used twice"),
    ("missing_plugin", {"worker1": {"BPS_GC_PLUGINS": "no_such_codec_mod"}}, {"BPS_GC_PLUGINS": "no_such_codec_mod"},
     "cannot import plugin module 'no_such_codec_mod'"),
]


def assert_one_line_no_traceback(text, named):
    assert named in text
    assert "Traceback" not in text


@pytest.mark.parametrize("case, role_env, _, named", CASES, ids=[c[0] for c in CASES])
def test_multihost_refusal_stops_everyone(case, role_env, _, named):
    job = Job(2, STEPS, env={"BPS_GC_JOIN_TIMEOUT": JOIN_TIMEOUT}, role_env=role_env)
    statuses, elapsed = job.wait_all(BOUND)
    report = job.report(statuses)
    assert all(s != 0 for s in statuses.values()), report
    for name in ("worker0", "worker1"):
        assert_one_line_no_traceback(job.text(name), named)
    assert named in job.text("scheduler"), report
    print(f"multi-host {case}: every launcher exited non-zero after {elapsed:.2f} s", file=sys.stderr)


@pytest.mark.parametrize("case, _, worker_env, named", CASES, ids=[c[0] for c in CASES])
def test_local_refusal_stops_everyone(case, _, worker_env, named):
    started = time.monotonic()
    result = run_local([sys.executable, "-c", STEPS], workers=2, servers=1, timeout=BOUND + 30,
                       env={"BPS_GC_JOIN_TIMEOUT": JOIN_TIMEOUT}, worker_env=worker_env)
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert named in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert elapsed < BOUND, f"{elapsed:.1f} s"
    print(f"--local {case}: bpslaunch exited {result.returncode} after {elapsed:.2f} s", file=sys.stderr)


def test_bad_number_is_named_without_a_traceback():
    """D4: every number is parsed by bps_gc/config.py; bpslaunch reports it and exits 2."""
    started = time.monotonic()
    result = run_local([sys.executable, "-c", STEPS], workers=1, servers=1, timeout=30,
                       env={"BPS_GC_INFLIGHT_BYTES": "abc"})
    assert result.returncode == 2
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert lines == ["bpslaunch: BPS_GC_INFLIGHT_BYTES: must be an integer, got 'abc'"], lines
    job = Job(1, STEPS, role_env={"worker0": {"BPS_GC_STALL_TIMEOUT": "soon"}})
    try:
        status = job.launchers["worker0"].wait(timeout=10)
    finally:
        job.kill_all()
    assert status == 2
    assert job.text("worker0").strip() == "bpslaunch: BPS_GC_STALL_TIMEOUT: must be a number, got 'soon'"
    print(f"D4: bpslaunch exited 2 after {time.monotonic() - started:.2f} s (both modes)", file=sys.stderr)


BAD_SETTINGS = [
    ("BPS_GC_STALL_TIMEOUT", "soon", "BPS_GC_STALL_TIMEOUT: must be a number, got 'soon'"),
    # an algorithm the kernel lacks (and, in test_congestion.py, one this process may not set)
    ("BPS_GC_TCP_CONGESTION", "vegas2", "BPS_GC_TCP_CONGESTION: unknown algorithm 'vegas2'"),
]


@pytest.mark.parametrize("variable, value, named", BAD_SETTINGS, ids=[b[0] for b in BAD_SETTINGS])
def test_multihost_bad_setting_on_one_worker_stops_everyone(variable, value, named):
    """D4 in multi-host mode: the bad host's bpslaunch asks the scheduler to stop the job, so
    the other hosts do not wait out the join timeout."""
    job = Job(2, STEPS, env={"BPS_GC_JOIN_TIMEOUT": JOIN_TIMEOUT},
              role_env={"worker1": {variable: value}})
    statuses, elapsed = job.wait_all(BOUND)
    report = job.report(statuses)
    assert all(s != 0 for s in statuses.values()), report
    assert statuses["worker1"] == 2, report
    for name in ("worker0", "worker1", "scheduler"):
        assert named in job.text(name) and "Traceback" not in job.text(name), report
    print(f"multi-host D4: every launcher exited non-zero after {elapsed:.2f} s", file=sys.stderr)


def test_port_in_use_is_one_line_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        argv = [sys.executable, "-m", "bps_gc.launcher.cli", "--local", "--port", str(port), "--",
                sys.executable, "-c", STEPS]
        result = subprocess.run(argv, env=dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH, BPS_GC_JOIN_TIMEOUT=JOIN_TIMEOUT),
                                capture_output=True, text=True, timeout=BOUND + 30)
        elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert f"port {port} on 127.0.0.1 is already in use" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert elapsed < BOUND
    print(f"port in use: bpslaunch exited {result.returncode} after {elapsed:.2f} s", file=sys.stderr)


def test_multihost_port_in_use_is_one_line_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        job = Job(1, STEPS, env={"BPS_GC_JOIN_TIMEOUT": "5"},
                  role_env={"scheduler": {"DMLC_PS_ROOT_PORT": str(port)}})
        try:
            status = job.launchers["scheduler"].wait(timeout=BOUND)
        finally:
            job.kill_all()
    text = job.text("scheduler")
    assert status != 0 and "Traceback" not in text, text
    assert f"port {port} on 127.0.0.1 is already in use" in text, text
    print(f"multi-host port in use: the scheduler's bpslaunch exited {status} "
          f"after {time.monotonic() - job.started:.2f} s", file=sys.stderr)


def test_multihost_worker_that_never_comes_stops_the_others():
    """worker1's launcher runs a program that never joins (as if that host never started it):
    after BPS_GC_JOIN_TIMEOUT the scheduler, the server and worker0 exit non-zero, naming what
    is missing."""
    job = Job(2, [STEPS, "import time; time.sleep(120)"], env={"BPS_GC_JOIN_TIMEOUT": "3"})
    statuses = {}
    try:
        for name in ("scheduler", "server0", "worker0"):
            try:
                statuses[name] = job.launchers[name].wait(timeout=max(BOUND - (time.monotonic() - job.started), 0.1))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} still runs after {BOUND} s:\n{job.report(statuses)}") from None
        elapsed = time.monotonic() - job.started
    finally:
        job.kill_all()  # worker1's sleeper: nothing of the job itself
    report = job.report(statuses)
    assert all(s != 0 for s in statuses.values()), report
    for name in ("scheduler", "worker0"):
        assert "the cluster did not assemble within 3 s (still missing: {'server': 0, 'worker': 1})" \
            in job.text(name), report
    assert "Traceback" not in job.text("worker0"), report
    print(f"multi-host worker that never comes: the others exited non-zero after {elapsed:.2f} s "
          "(join timeout 3 s)", file=sys.stderr)
