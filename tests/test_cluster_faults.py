"""kill -9 one node mid-run: everyone else stops, non-zero, within the heartbeat bound, naming it.

Each role runs under its own bpslaunch, as on separate hosts, so failures are found by the
heartbeat protocol and not by a shared launcher tearing the job down.
"""
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from conftest import ROOT, alive

INTERVAL, TIMEOUT = 0.2, 2.0
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


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    def __init__(self, workers=2):
        port = free_port()
        base = dict(os.environ, PYTHONPATH=ROOT, DMLC_NUM_WORKER=str(workers), DMLC_NUM_SERVER="1",
                    DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port), PYTHONUNBUFFERED="1",
                    BPS_GC_HEARTBEAT_INTERVAL=str(INTERVAL), BPS_GC_HEARTBEAT_TIMEOUT=str(TIMEOUT),
                    BPS_GC_KILL_GRACE="2")
        launch = [sys.executable, "-m", "bps_gc.launcher.cli"]
        self.launchers = {
            "scheduler": self.start(launch, dict(base, DMLC_ROLE="scheduler")),
            "server": self.start(launch, dict(base, DMLC_ROLE="server")),
        }
        for w in range(workers):
            self.launchers[f"worker{w}"] = self.start(
                [*launch, sys.executable, "-c", LOOP], dict(base, DMLC_ROLE="worker", DMLC_WORKER_ID=str(w)))
        self.output = {name: [] for name in self.launchers}
        for name, proc in self.launchers.items():
            threading.Thread(target=self.collect, args=(name, proc), daemon=True).start()

    @staticmethod
    def start(argv, env):
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def collect(self, name, proc):
        for line in proc.stdout:
            self.output[name].append(line)

    def text(self, name):
        return "".join(self.output[name])

    def child_of(self, name):
        """PID of the role process the launcher started."""
        launcher = self.launchers[name].pid
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == launcher:
                            return int(entry)
                except (OSError, IndexError, ValueError):
                    continue
        raise AssertionError(f"no child of {name}'s launcher")

    def wait_running(self, workers, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if all("RUNNING" in self.text(f"worker{w}") for w in range(workers)):
                return
            time.sleep(0.1)
        self.kill_all()
        raise AssertionError("job did not start:\n" + "\n".join(self.text(n) for n in self.output))

    def kill_all(self):
        for proc in self.launchers.values():
            if proc.poll() is None:
                proc.kill()



@pytest.mark.parametrize("victim, named", [
    ("server", "server 0 (node 1 at 127.0.0.1:"),
    ("worker1", "worker 1 (node 3 at 127.0.0.1"),
    ("scheduler", "scheduler (node 0 at 127.0.0.1:"),
])
def test_kill_9_stops_the_whole_job(victim, named):
    job = Job(workers=2)
    try:
        job.wait_running(2)
        children = {name: job.child_of(name) for name in job.launchers}
        time.sleep(0.3)
        os.kill(children[victim], signal.SIGKILL)
        killed_at = time.monotonic()
        statuses = {}
        for name, proc in job.launchers.items():
            left = BOUND - (time.monotonic() - killed_at)
            statuses[name] = proc.wait(timeout=max(left, 0.1))
        elapsed = time.monotonic() - killed_at
    finally:
        job.kill_all()
    report = "\n".join(f"--- {n} ({statuses.get(n)})\n{job.text(n)[-1500:]}" for n in job.launchers)
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
