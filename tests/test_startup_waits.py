"""What a newcomer sees after a start-up mistake (issue 36), with real processes: every wait
says what it waits for (a node joining the scheduler, the scheduler for its nodes, a rank at the
torch.distributed rendezvous) within 10 s (the two jobs that wait out a join timeout run side
by side), and a worker that trains alone says so, naming BYTEPS_FORCE_DISTRIBUTED, and ends the
scheduler and server started for it, each saying why, instead of leaving them to time out.
Multi-host mode: one bpslaunch per role (tests/multihost.py)."""
import io
import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from bps_gc.launcher.local import free_port
from bps_gc.wire import waiting
from conftest import LAUNCH_PYTHONPATH, ROOT
from multihost import Job

FIRST_LINE_BOUND = 10.0  # the "within 10 s" (the first line is due 5 s into the wait)
STEPS = textwrap.dedent("""
    import numpy as np, bps_gc.core as bps
    bps.init()
    bps.declare("g", shape=(1000,), dtype=np.float32)
    print("RESULT", bps.push_pull(np.full(1000, 3.0, np.float32), "g").wait()[:2], flush=True)
    bps.shutdown()
""")


def first_time(job, name, text, bound):
    """Seconds from the job's start until ``text`` appears in ``name``'s output."""
    deadline = job.started + bound
    while time.monotonic() < deadline:
        if text in job.text(name):
            return time.monotonic() - job.started
        time.sleep(0.05)
    raise AssertionError(f"no {text!r} from {name} within {bound} s:\n{job.report()}")


def test_wait_lines_come_first_after_the_delay_then_at_the_cadence(monkeypatch):
    monkeypatch.setattr(waiting, "FIRST_LINE", 0.3)
    monkeypatch.setattr(waiting, "EVERY", 0.5)
    out = io.StringIO()
    lines = waiting.WaitLines(lambda: "waiting for the scheduler at 10.0.0.1:1234", 9, out=out)
    stamps = []
    started = time.monotonic()
    while time.monotonic() - started < 1.45:
        before = out.getvalue().count("\n")
        lines.tick()
        if out.getvalue().count("\n") > before:
            stamps.append(time.monotonic() - started)
        time.sleep(0.01)
    text = out.getvalue().splitlines()
    assert len(text) == 3, text  # at 0.3, 0.8 and 1.3 s
    assert all(re.fullmatch(r"bps_gc: waiting for the scheduler at 10\.0\.0\.1:1234 "
                            r"\(\d+ s of 9; BPS_GC_JOIN_TIMEOUT\)", line) for line in text), text
    assert abs(stamps[0] - 0.3) < 0.1 and all(abs(b - a - 0.5) < 0.1 for a, b in zip(stamps, stamps[1:])), stamps


def start_rendezvous():
    """torch.distributed: rank 0 (hosting the store) waits for rank 1, which never comes; a
    rank 1 started alone waits for a store nobody hosts (join timeout 7 s). Returns the port,
    the processes and the threads that note when each names the rendezvous (``seen``)."""
    port = free_port()
    base = dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH, DMLC_NUM_WORKER="2", DMLC_NUM_SERVER="0",
                DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port), BPS_GC_JOIN_TIMEOUT="7")
    # the wait starts after torch's import, which alone can take 10 s on a loaded box
    code = ("import sys, torch, bps_gc.collective, bps_gc.core as bps; print('INIT', file=sys.stderr, flush=True); "
            "bps.init()")
    procs = {rank: subprocess.Popen([sys.executable, "-c", code], env=dict(base, DMLC_WORKER_ID=str(rank),
                                    DMLC_PS_ROOT_PORT=str(port if rank == 0 else free_port())),
                                    stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)}
    seen, started = {}, {}

    def watch(rank):
        for line in procs[rank].stderr:
            if line.strip() == "INIT":
                started[rank] = time.monotonic()
            if "waiting for the other ranks at the rendezvous" in line and rank not in seen:
                seen[rank] = (time.monotonic() - started[rank], line.strip())
    readers = [threading.Thread(target=watch, args=(rank,)) for rank in procs]
    for reader in readers:
        reader.start()
    return port, procs, readers, seen


@pytest.fixture(scope="module")
def waits():
    """The two jobs below that wait out a join timeout, run side by side (each mostly waits):
    the multi-host job with a wrong scheduler port, started first (its first lines are timed
    from its launchers' start), then the two torch.distributed ranks of the rendezvous."""
    wrong = free_port()
    job = Job(1, STEPS, env={"BPS_GC_JOIN_TIMEOUT": "8", "BYTEPS_FORCE_DISTRIBUTED": "1"},
              role_env={"worker0": {"DMLC_PS_ROOT_PORT": str(wrong)}})
    port, procs, readers, seen = start_rendezvous()
    try:
        took = {
            "worker0": first_time(job, "worker0", f"bps_gc: waiting for the scheduler at 127.0.0.1:{wrong} (", 15),
            "scheduler": first_time(job, "scheduler", f"the scheduler at 127.0.0.1:{job.port} waits for the "
                                    "cluster: joined server at 127.0.0.1:", 15),
            "server0": first_time(job, "server0", f"joined the scheduler at 127.0.0.1:{job.port}; waiting for "
                                  "the other nodes", 15),
        }
        statuses, elapsed = job.wait_all(30)
        rendezvous_statuses = {rank: proc.wait(timeout=40) for rank, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
        for reader in readers:
            reader.join()
    return {"multihost": (job, wrong, took, statuses, elapsed), "rendezvous": (port, seen, rendezvous_statuses)}


def test_multihost_wrong_scheduler_port_is_named_by_the_waits(waits):
    """The worker was given the wrong DMLC_PS_ROOT_PORT: it names the address it waits for, the
    scheduler names who joined (the server) and who has not (the worker), the server that it
    waits for the others; each within 10 s, and all exit at the join timeout."""
    job, wrong, took, statuses, elapsed = waits["multihost"]
    report = job.report(statuses)
    assert all(t < FIRST_LINE_BOUND for t in took.values()), (took, report)
    assert "missing the workers of 1 hosts (DMLC_NUM_WORKER; none joined yet)" in job.text("scheduler"), report
    assert re.search(r"\(\d+ s of 8; BPS_GC_JOIN_TIMEOUT\)", job.text("worker0")), report
    assert all(s != 0 for s in statuses.values()), report
    print(f"first waiting lines after {took} s (from the launchers' start); all exited after {elapsed:.1f} s",
          file=sys.stderr)


def test_rendezvous_waits_are_named(waits):
    """torch.distributed: rank 0 (hosting the store) waits for rank 1, which never comes; a
    rank 1 started alone waits for a store nobody hosts. Each names the rendezvous within 10 s."""
    port, seen, statuses = waits["rendezvous"]
    assert sorted(seen) == [0, 1], seen
    assert all(t < FIRST_LINE_BOUND for t, _ in seen.values()), seen
    assert re.fullmatch(rf"bps_gc: rank 0 of 2 waiting for the other ranks at the rendezvous at 127\.0\.0\.1:{port} "
                        r"\(\d+ s of 7; BPS_GC_JOIN_TIMEOUT\)", seen[0][1]), seen
    assert all(s != 0 for s in statuses.values())


def test_multihost_lone_worker_ends_the_job_it_was_meant_for():
    """One worker process and BYTEPS_FORCE_DISTRIBUTED unset (the README's roles block without
    NVIDIA_VISIBLE_DEVICES): the worker trains alone and says so; the scheduler and server it
    was started with exit 0 at once, each saying why, instead of waiting out the join timeout."""
    job = Job(1, STEPS, env={"BPS_GC_JOIN_TIMEOUT": "120"})
    statuses, elapsed = job.wait_all(10)
    report = job.report(statuses)
    assert statuses == {"scheduler": 0, "server0": 0, "worker0": 0}, report
    worker = job.text("worker0")
    assert "RESULT [3. 3.]" in worker, report  # alone: its own gradient, unaveraged by anyone
    assert ("bps_gc: one worker process: DMLC_NUM_WORKER=1, BYTEPS_LOCAL_SIZE=1, BYTEPS_FORCE_DISTRIBUTED "
            "unset: this worker trains alone and nothing leaves the process; BYTEPS_FORCE_DISTRIBUTED=1 "
            "sends through the servers") in worker, report
    assert f"told the scheduler at 127.0.0.1:{job.port} and its servers to exit" in worker, report
    why = "worker 0 at 127.0.0.1 trains alone (one worker process"
    assert why in job.text("scheduler") and "the scheduler exits" in job.text("scheduler"), report
    assert why in job.text("server0") and "this server exits" in job.text("server0"), report
    assert "Traceback" not in report
    print(f"lone worker: all three exited 0 after {elapsed:.2f} s", file=sys.stderr)
