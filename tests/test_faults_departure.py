"""D1: a worker that leaves mid-job (exception, Ctrl-C, fewer steps) stops the others at once,
naming the worker and the tensor; a normal end exits 0 everywhere. Plus the stall warning.

Multi-host mode (one bpslaunch per role) and `bpslaunch --local`; each bound is asserted."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

from cluster import run_local
from conftest import LAUNCH_PYTHONPATH, ROOT
from multihost import Job, processes_with

BOUND = 10.0  # seconds from the departure to the last process gone; a hang would be forever
START_BOUND = 60.0

TRAIN = textwrap.dedent("""
    import os, numpy as np, bps_gc.core as bps
    bps.init()
    rank = bps.rank()
    steps = int(os.environ.get(f"STEPS_{rank}", "1000000"))
    mode = os.environ.get(f"MODE_{rank}", "")
    # COMPRESSION=none: a dense 800 KB tensor, through shared memory with the same-host server
    dense = os.environ.get("COMPRESSION") == "none"
    n = 200_000 if dense else 20_000
    bps.declare("grad", shape=(n,), dtype=np.float32, **({} if dense else {"compressor": "onebit", "ef": "vanilla"}))
    for step in range(steps):
        out = bps.push_pull(np.ones(n, np.float32), "grad", average=False, lr=0.1).wait()
        if step == 2:
            print("RUNNING shared", bps.metrics().shared_bytes, flush=True)
        if step == 5 and mode == "raise":
            raise RuntimeError("the training script failed")
    print("DONE", steps, flush=True)
    bps.shutdown()
""")

NAMED = "worker 1 left the job before pushing tensor 'grad#0'"


def check_survivor(text, report):
    assert NAMED in text and "NodeFailure" in text and "Traceback" not in text, report


@pytest.mark.parametrize("compression", ["onebit", "none"])
@pytest.mark.parametrize("mode", ["raise", "sigint", "fewer"])
def test_multihost_worker_leaving_stops_the_others(mode, compression):
    env = {"MODE_1": mode} if mode == "raise" else {"STEPS_1": "8"} if mode == "fewer" else {}
    job = Job(2, TRAIN, env={**env, "COMPRESSION": compression})
    try:
        if mode == "sigint":
            job.wait_output(["worker0", "worker1"], "RUNNING", START_BOUND)
            job.launchers["worker1"].send_signal(signal.SIGINT)  # Ctrl-C at worker 1's terminal
        else:
            job.wait_output(["worker1"], "DONE" if mode == "fewer" else "RuntimeError", START_BOUND)
        left_at = time.monotonic()
        statuses, elapsed = job.wait_all(BOUND, since=left_at)
    finally:
        job.kill_all()
    report = job.report(statuses)
    expected_zero = {"worker1"} if mode == "fewer" else set()
    assert all((s == 0) == (n in expected_zero) for n, s in statuses.items()), report
    check_survivor(job.text("worker0"), report)
    assert NAMED in job.text("scheduler") and NAMED in job.text("server0"), report
    shared = job.text("worker0").split("RUNNING shared ")[1].split()[0]
    assert (shared != "0") == (compression == "none"), f"bytes through shared memory: {shared}\n{report}"
    print(f"multi-host worker 1 {mode} ({compression}): every launcher exited after {elapsed:.2f} s",
          file=sys.stderr)


@pytest.mark.parametrize("compression", ["onebit", "none"])
def test_multihost_normal_end_exits_0_everywhere(compression):
    job = Job(2, TRAIN, env={"STEPS_0": "20", "STEPS_1": "20", "COMPRESSION": compression})
    statuses, elapsed = job.wait_all(START_BOUND)
    assert all(s == 0 for s in statuses.values()), job.report(statuses)
    shared = job.text("worker0").split("RUNNING shared ")[1].split()[0]
    assert (shared != "0") == (compression == "none"), f"bytes through shared memory: {shared}"
    print(f"multi-host normal end ({compression}): all exited 0 after {elapsed:.2f} s", file=sys.stderr)


@pytest.mark.parametrize("mode", ["raise", "fewer"])
def test_local_worker_leaving_stops_the_others(mode):
    env = {"MODE_1": mode} if mode == "raise" else {"STEPS_1": "8"}
    started = time.monotonic()
    result = run_local([sys.executable, "-c", TRAIN], workers=2, servers=1, env=env, timeout=START_BOUND)
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    if mode == "fewer":  # --local does not tear the job down: worker 1 exits 0
        check_survivor(result.stderr, result.stderr[-3000:])
    assert elapsed < START_BOUND
    print(f"--local worker 1 {mode}: bpslaunch exited {result.returncode} after {elapsed:.2f} s", file=sys.stderr)


def test_local_ctrl_c_stops_every_process():
    """Ctrl-C at the terminal of `bpslaunch --local` (SIGINT to its whole process group): it
    ends within the bound, non-zero, without a traceback, and leaves no process behind."""
    mark = f"BPS_GC_TEST_JOB={uuid.uuid4().hex}"
    env = dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH,
               BPS_GC_HEARTBEAT_INTERVAL="0.2", BPS_GC_HEARTBEAT_TIMEOUT="3")
    env.update([mark.split("=")])
    argv = [sys.executable, "-m", "bps_gc.launcher.cli", "--local", "--workers", "2", "--servers", "1",
            "--", sys.executable, "-c", TRAIN]
    launcher = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    out, err = [], []
    readers = [threading.Thread(target=lambda s=s, d=d: d.extend(s), daemon=True)
               for s, d in ((launcher.stdout, out), (launcher.stderr, err))]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + START_BOUND
        while sum("RUNNING" in line for line in out) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum("RUNNING" in line for line in out) == 2, "".join(out + err)[-3000:]
        os.killpg(launcher.pid, signal.SIGINT)
        pressed = time.monotonic()
        status = launcher.wait(timeout=BOUND)
        elapsed = time.monotonic() - pressed
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    for reader in readers:
        reader.join(5)
    text = "".join(err)
    assert status != 0 and "Traceback" not in text, text[-3000:]
    deadline = time.monotonic() + 3
    while processes_with(mark) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not processes_with(mark), f"left running: {processes_with(mark)}"
    print(f"--local Ctrl-C: bpslaunch exited {status} after {elapsed:.2f} s", file=sys.stderr)


STALL = textwrap.dedent("""
    import os, time, numpy as np, bps_gc.core as bps
    bps.init()
    bps.declare("late", shape=(100,), dtype=np.float32)
    if bps.rank() == 1:
        time.sleep(3)  # diverged: rank 1 pushes 'late' long after rank 0
    bps.push_pull(np.ones(100, np.float32), "late").wait()
    print("DONE", flush=True)
    bps.shutdown()
""")


def test_stall_warning_names_the_tensor_and_the_ranks():
    job = Job(2, STALL, env={"BPS_GC_STALL_TIMEOUT": "1"})
    statuses, elapsed = job.wait_all(START_BOUND)
    assert all(s == 0 for s in statuses.values()), job.report(statuses)
    assert "stall: tensor 'late#0' (key 0) round 0 waited 1 s: ranks [0] pushed it, ranks [1] did not" \
        in job.text("server0"), job.report(statuses)
    result = run_local([sys.executable, "-c", STALL], workers=2, servers=1,
                       env={"BPS_GC_STALL_TIMEOUT": "1"}, timeout=START_BOUND)
    assert result.returncode == 0 and "ranks [0] pushed it, ranks [1] did not" in result.stderr
