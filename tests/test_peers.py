"""Worker-to-worker messages (bps_gc/ps/worker/peers.py): a ring of 4 workers, and a killed peer.

Multi-host mode (one bpslaunch per role), so a dead peer is found by the job's heartbeats."""
import os
import signal
import sys
import textwrap
import time

from multihost import INTERVAL, TIMEOUT, Job

BOUND = TIMEOUT + 2 * INTERVAL + 5.0  # detection + broadcast + exit, on a loaded box

RING = textwrap.dedent("""
    import numpy as np, bps_gc.core as bps, time
    w = bps.init()
    rank, size = bps.rank(), bps.size()
    right, left = (rank + 1) % size, (rank - 1) % size
    rounds = int(__import__("os").environ["ROUNDS"])
    for r in range(rounds):
        w.peers.send(right, "cw", np.array([rank, r], np.int64))
        w.peers.send(left, "ccw", np.arange(r % 7, dtype=np.float32) + rank)
        got = w.peers.recv(left, "cw").view(np.int64)
        assert list(got) == [left, r], (got, left, r)
        back = w.peers.recv(right, "ccw").view(np.float32)
        assert np.array_equal(back, np.arange(r % 7, dtype=np.float32) + right), back
        if r == 0:
            print("RUNNING", flush=True)
    print("RING OK", rounds, flush=True)
    bps.shutdown()
""")


def test_ring_of_4_passes_messages_both_ways_for_100_rounds():
    job = Job(4, RING, env={"ROUNDS": "100"})
    statuses, elapsed = job.wait_all(60)
    assert all(s == 0 for s in statuses.values()), job.report(statuses)
    for w in range(4):
        assert "RING OK 100" in job.text(f"worker{w}"), job.report(statuses)
    print(f"ring of 4, 100 rounds both ways: {elapsed:.2f} s", file=sys.stderr)


def test_killing_a_peer_stops_the_others_naming_it():
    job = Job(4, RING, env={"ROUNDS": "1000000"})
    try:
        job.wait_output([f"worker{w}" for w in range(4)], "RUNNING")
        os.kill(job.child_of("worker2"), signal.SIGKILL)
        killed_at = time.monotonic()
        statuses, elapsed = job.wait_all(BOUND, since=killed_at)
    finally:
        job.kill_all()
    report = job.report(statuses)
    assert all(s != 0 for s in statuses.values()), report
    for w in (0, 1, 3):
        text = job.text(f"worker{w}")
        assert "NodeFailure" in text and "worker 2 (node 4 at 127.0.0.1" in text, report
    print(f"peer worker 2 killed: every launcher exited non-zero after {elapsed:.2f} s", file=sys.stderr)
