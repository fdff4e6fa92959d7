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

# COMPRESSION: onebit (over the socket), or none: a dense tensor of 800 KB, which goes through
# the shared memory of the worker and its server on the same host (wire/shm.py)
LOOP = textwrap.dedent("""
    import os, numpy as np, bps_gc.core as bps, time
    bps.init()
    dense = os.environ["COMPRESSION"] == "none"
    n = 200_000 if dense else 50_000
    bps.declare("g", shape=(n,), dtype=np.float32, **({} if dense else {"compressor": "onebit", "ef": "vanilla"}))
    for _ in range(3):  # the first may go before the server's INIT_ACK maps the slot
        bps.push_pull(np.ones(n, np.float32), "g", lr=0.1).wait()
    print("RUNNING shared", bps.metrics().shared_bytes, flush=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        bps.push_pull(np.ones(n, np.float32), "g", lr=0.1).wait()
        time.sleep(0.01)
""")


@pytest.mark.parametrize("compression", ["onebit", "none"])
@pytest.mark.parametrize("victim, named", [
    ("server0", "server 0 (node 1 at 127.0.0.1:"),
    ("worker1", "worker 1 (node 3 at 127.0.0.1"),
    ("scheduler", "scheduler (node 0 at 127.0.0.1:"),
])
def test_kill_9_stops_the_whole_job(victim, named, compression):
    job = Job(2, LOOP, env={"COMPRESSION": compression})
    try:
        job.wait_output(["worker0", "worker1"], "RUNNING")
        shared = job.text("worker0").split("RUNNING shared ")[1].split()[0]
        assert (shared != "0") == (compression == "none"), f"bytes through shared memory: {shared}"
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
    print(f"{victim} killed ({compression}): every launcher exited non-zero after {elapsed:.2f} s",
          file=sys.stderr)
