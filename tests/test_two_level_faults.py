"""Faults with several local ranks per host, in multi-host mode (one bpslaunch per role, hosts as
network namespaces, two levels): local rank 1 of host 1 (worker 3) killed (-9), raising, Ctrl-C'd
or ending early while every rank push_pulls. Every launcher exits within BOUND seconds, non-zero;
the other host's ranks say, in one line, which worker failed or left; no process of the job is
left, and no shared memory with it: the host's sums live in memfd arenas, freed by the kernel
with their last user (nothing is ever created in /dev/shm)."""
import os
import signal
import sys
import textwrap
import time

import pytest

from local_ranks import HostsJob, machines  # noqa: F401

BOUND = 15.0  # seconds from the fault to the last launcher gone (heartbeat timeout: 2 s)
START_BOUND = 90.0
TRAIN = textwrap.dedent("""
    import os, signal, numpy as np, bps_gc.core as bps
    bps.init()
    rank = bps.rank()
    mode = os.environ.get(f"MODE_{rank}", "")
    bps.declare("grad", shape=(3000,), dtype=np.float32)
    bps.declare("code", shape=(3000,), dtype=np.float32, compressor="onebit", ef="vanilla")
    for step in range(1000000):
        bps.push_pull(np.ones(3000, np.float32), "grad", average=False).wait()
        bps.push_pull(np.ones(3000, np.float32), "code", lr=0.1).wait()
        if step == 3:
            print("RUNNING", rank, flush=True)
        if step == 5 and mode == "raise":
            raise RuntimeError("the training script failed")
        if step == 5 and mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if step == 5 and mode == "fewer":
            break
    print("DONE", rank, flush=True)
    bps.shutdown()
""")


def shm_files():
    return {name for name in os.listdir("/dev/shm") if "bps_gc" in name}


@pytest.mark.parametrize("mode", ["kill", "raise", "sigint", "fewer"])
def test_a_local_rank_failing_stops_the_job(machines, mode):  # noqa: F811
    before = shm_files()
    # 3 partitions a tensor: both local ranks of a host own some
    env = {"BYTEPS_PARTITION_BYTES": "4096", "BPS_GC_DENSE_PARTITION_BYTES": "4096",
           "BYTEPS_MIN_COMPRESS_BYTES": "0", **({} if mode == "sigint" else {"MODE_3": mode})}
    job = HostsJob(machines, 2, [2, 2], 1, [sys.executable, "-c", TRAIN], env=env)
    try:
        job.wait_output(["worker0", "worker1"], "RUNNING", START_BOUND)
        if mode == "sigint":  # Ctrl-C at host 1's terminal: bpslaunch forwards it to its ranks
            job.launchers["worker1"].send_signal(signal.SIGINT)
        fault = time.monotonic()
        statuses, elapsed = job.wait_all(BOUND, since=fault)
    finally:
        job.kill_all()
    report = job.report(statuses)
    assert all(status != 0 for status in statuses.values()), report
    survivors = job.text("worker0")
    failures = [line for line in survivors.splitlines() if "NodeFailure" in line]
    # one line per rank of host 0 (its bpslaunch may stop the second before it prints)
    assert 1 <= len(failures) <= 2 and all("worker 2" in line or "worker 3" in line for line in failures), report
    assert "Traceback" not in survivors, report
    assert shm_files() == before
    print(f"two levels, local rank {mode}: every launcher exited after {elapsed:.2f} s; {failures[0]}",
          file=sys.stderr)
