"""kill -9 one node mid-run: everyone else stops, non-zero, within the heartbeat bound, naming it.

Each role runs under its own bpslaunch, as on separate hosts, so failures are found by the
heartbeat protocol and not by a shared launcher tearing the job down.
"""
import os
import signal
import sys
import textwrap
import time

import pytest

from conftest import alive
from multihost import INTERVAL, TIMEOUT, Job

BOUND = TIMEOUT + 2 * INTERVAL + 5.0  # detection + broadcast + process exit, on a loaded CI box

LOOP = textwrap.dedent("""
    import numpy as np, bps_gc.core as bps, time
    bps.init()
    bps.declare("g", shape=(50_000,), dtype=np.float32, compressor="onebit", ef="vanilla")
    print("RUNNING", flush=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        bps.push_pull(np.ones(50_000, np.float32), "g", lr=0.1).wait()
        time.sleep(0.01)
""")


@pytest.mark.parametrize("victim, named", [
    ("server0", "server 0 (node 1 at 127.0.0.1:"),
    ("worker1", "worker 1 (node 3 at 127.0.0.1"),
    ("scheduler", "scheduler (node 0 at 127.0.0.1:"),
])
def test_kill_9_stops_the_whole_job(victim, named):
    job = Job(2, LOOP)
    try:
        job.wait_output(["worker0", "worker1"], "RUNNING")
        children = {name: job.child_of(name) for name in job.launchers}
        time.sleep(0.3)
        os.kill(children[victim], signal.SIGKILL)
        killed_at = time.monotonic()
        statuses, elapsed = job.wait_all(BOUND, since=killed_at)
    finally:
        job.kill_all()
    report = job.report(statuses)
    assert all(s != 0 for s in statuses.values()), report
    assert elapsed < BOUND, report
    survivors = [w for w in ("worker0", "worker1") if w != victim]
    for w in survivors:
        text = job.text(w)
        assert "NodeFailure" in text and named in text and "failed" in text, report
    deadline = time.time() + 5
    while any(alive(pid) for pid in children.values()) and time.time() < deadline:
        time.sleep(0.05)
    assert not [n for n, pid in children.items() if alive(pid)], "processes left behind"
    print(f"{victim} killed: every launcher exited non-zero after {elapsed:.2f} s", file=sys.stderr)
