"""What the bpslaunch tests share: the launcher command, job environments, small worker scripts
that report through files, and the fixture that kills whatever a test left behind."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ROOT, alive


LAUNCHER = [sys.executable, "-m", "bps_gc.launcher.cli"]
TIMEOUT = 30  # per launcher run; a hang fails the test instead of blocking the suite

JOB_ENV = {"DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
           "DMLC_PS_ROOT_PORT": "9000"}
WORKER_ENV = dict(JOB_ENV, DMLC_ROLE="worker", DMLC_WORKER_ID="1")

# Worker scripts; argv[1] is the report directory.
REPORT_ENV = """
import json, os, sys
rank = os.environ["BYTEPS_LOCAL_RANK"]
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": int(rank), "size": int(os.environ["BYTEPS_LOCAL_SIZE"]),
               "devices": os.environ.get("NVIDIA_VISIBLE_DEVICES"),
               "cpus": sorted(os.sched_getaffinity(0))}, f)
"""
# Rank 1 fails with status 3 once the others are up; the others would sleep for a minute.
ONE_RANK_FAILS = """
import os, signal, sys, time
out, rank = sys.argv[1], os.environ["BYTEPS_LOCAL_RANK"]
if len(sys.argv) > 2:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if rank == "1":
    deadline = time.time() + 10
    while len([f for f in os.listdir(out) if f.endswith(".pid")]) < 2 and time.time() < deadline:
        time.sleep(0.02)
    sys.exit(3)
open(os.path.join(out, f"{rank}.tmp"), "w").write(str(os.getpid()))  # renamed: never seen half-written
os.replace(os.path.join(out, f"{rank}.tmp"), os.path.join(out, f"{rank}.pid"))
time.sleep(60)
"""
# Writes its PID, then "ready" once its SIGTERM/SIGINT handler is in place, then sleeps.
WAIT_FOR_SIGNAL = """
import os, signal, sys, time
out, rank = sys.argv[1], os.environ["BYTEPS_LOCAL_RANK"]
def stop(signum, frame):
    open(os.path.join(out, f"{rank}.got{signum}"), "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
open(os.path.join(out, f"{rank}.tmp"), "w").write(str(os.getpid()))  # renamed: never seen half-written
os.replace(os.path.join(out, f"{rank}.tmp"), os.path.join(out, f"{rank}.pid"))
time.sleep(60)
"""


def clean_env(**overrides):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "BYTEPS_", "BPS_GC_", "NVIDIA_"))
           or k == "BPS_GC_CENSUS"}  # scripts/suite_census.py's record, not a setting
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env.update(overrides)
    return env


def launch(args, env, timeout=TIMEOUT, **kwargs):
    return subprocess.run(LAUNCHER + list(args), env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, **kwargs)


def python(script, *args):
    return [sys.executable, "-c", textwrap.dedent(script), *map(str, args)]


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def pids_in(directory):
    return [int(open(directory / name).read()) for name in os.listdir(directory)
            if name.endswith(".pid")]


def reports(directory):
    return sorted((json.load(open(directory / name)) for name in os.listdir(directory)
                   if name.endswith(".json")), key=lambda report: report["rank"])


@pytest.fixture(autouse=True)
def kill_leftovers(tmp_path):
    """If a test fails, don't let the processes that reported a PID outlive it."""
    yield
    for pid in pids_in(tmp_path):
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


# --- worker machines: local ranks ------------------------------------------------------------

