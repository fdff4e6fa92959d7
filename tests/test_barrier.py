"""bps.barrier() on the parameter server: every barrier waits for every worker, also when a
scheduler message (a heartbeat's answer) reaches a worker between two barriers, and a worker's
barriers from two threads count as two. Real processes (bpslaunch --local)."""
import os
import sys

from cluster import TESTS, run_local


def test_barriers_wait_for_every_worker_and_count_each_thread_s_own(tmp_path):
    # heartbeats every 10 ms: their answers keep arriving while a worker starts its next
    # barrier (a shared, cleared event was set again by them: an early return, then a hang)
    env = {"BPS_GC_HEARTBEAT_INTERVAL": "0.01", "BPS_GC_HEARTBEAT_TIMEOUT": "3"}
    result = run_local([sys.executable, os.path.join(TESTS, "barrier_job.py"), str(tmp_path / "entered"), "1000"],
                       workers=3, servers=1, env=env, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in range(3):
        assert (tmp_path / f"entered.{rank}").read_text() == "1000"
