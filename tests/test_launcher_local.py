"""bpslaunch --local: the plan of a loopback cluster, labelled output, and whole local jobs
(driven with a stand-in for `python -m bps_gc.node`)."""
import io
import json
import socket
import subprocess
import time

import pytest

from bps_gc.config import ConfigError
from bps_gc.launcher import local, machine, output
from bps_gc.launcher.settings import LauncherSettings
from conftest import ROOT, alive
from launcher_helpers import TIMEOUT, clean_env, pids_in, python
from launcher_helpers import kill_leftovers  # noqa: F401  (autouse: kills what a test left behind)


def test_copy_labelled_prefixes_every_line():
    source = io.BytesIO(b"one\ntwo\n\xff binary\nlast without newline")
    destination = io.BytesIO()
    output.copy_labelled(source, destination, "worker1.0")
    assert destination.getvalue() == (b"[worker1.0] one\n[worker1.0] two\n"
                                      b"[worker1.0] \xff binary\n[worker1.0] last without newline\n")


def test_copy_labelled_labels_a_long_line_once():
    line = b"x" * (3 * output.READ_LIMIT) + b"\n"
    destination = io.BytesIO()
    output.copy_labelled(io.BytesIO(line + b"next\n"), destination, "server0")
    assert destination.getvalue() == b"[server0] " + line + b"[server0] next\n"


def test_copy_labelled_keeps_draining_after_the_destination_breaks():
    class Broken(io.BytesIO):
        def write(self, data):
            raise BrokenPipeError

    source = io.BytesIO(b"a\n" * 1000)
    output.copy_labelled(source, Broken(), "scheduler")
    assert source.read() == b""


def test_free_port_is_below_the_ephemeral_range(tmp_path):
    """Outgoing connections and binds to port 0 take ports from the kernel's ephemeral range:
    the scheduler's port is drawn below it, where none of them can take it first."""
    start = local.ephemeral_start()
    if start <= local.LOW_PORTS:
        pytest.skip(f"the ephemeral range starts at {start}: no room below it")
    ports = {local.free_port() for _ in range(20)}
    assert all(local.LOW_PORTS <= p < start for p in ports), sorted(ports)
    assert len(ports) > 1  # drawn, not one fixed port
    (tmp_path / "range").write_text("40000\t60999\n")
    assert local.ephemeral_start(str(tmp_path / "range")) == 40000
    assert local.ephemeral_start(str(tmp_path / "missing")) == 0


def test_free_port_can_be_bound():
    port = local.free_port()
    assert 1 <= port <= 65535
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))


def test_worker_labels():
    assert local.worker_label(1, 0, 1) == "worker1"
    assert local.worker_label(1, 0, 2) == "worker1.0"


def test_local_plan_environment():
    environ = {"DMLC_INTERFACE": "eth0", "BPS_GC_PORT": "5000", "BYTEPS_LOG_LEVEL": "INFO",
               "DMLC_WORKER_ID": "7", "PATH": "/bin"}
    plan = local.plan_cluster(["train"], 2, 3, 2, 4242, environ, LauncherSettings())
    assert [label for label, *_ in plan] == ["scheduler", "server0", "server1", "server2",
                                             "worker0.0", "worker0.1", "worker1.0", "worker1.1"]
    scheduler_env, worker_env = plan[0][2], plan[-1][2]
    for env in (scheduler_env, worker_env):
        assert env["DMLC_NUM_WORKER"] == "2" and env["DMLC_NUM_SERVER"] == "3"
        assert env["DMLC_PS_ROOT_URI"] == "127.0.0.1" and env["DMLC_PS_ROOT_PORT"] == "4242"
        assert env["BYTEPS_LOG_LEVEL"] == "INFO" and env["PYTHONUNBUFFERED"] == "1"
        assert "DMLC_INTERFACE" not in env and "BPS_GC_PORT" not in env
    assert scheduler_env["DMLC_ROLE"] == "scheduler" and "DMLC_WORKER_ID" not in scheduler_env
    assert (worker_env["DMLC_ROLE"], worker_env["DMLC_WORKER_ID"], worker_env["BYTEPS_LOCAL_RANK"],
            worker_env["BYTEPS_LOCAL_SIZE"]) == ("worker", "1", "1", "2")
    assert plan[-1][1] == ["train"] and plan[0][1] == machine.NODE_COMMAND


def test_local_plan_rejects_bad_environment():
    with pytest.raises(ConfigError) as error:
        local.plan_cluster(["train"], 1, 1, 1, 4242, {"BYTEPS_LOG_LEVEL": "LOUD"},
                           LauncherSettings())
    assert error.value.variable == "BYTEPS_LOG_LEVEL"


# --- local mode: orchestration, with a stand-in for `python -m bps_gc.node` ------------------

RUN_LOCAL = """
import json, os, sys
from bps_gc.launcher.local import run_local
from bps_gc.launcher.settings import LauncherSettings
command, workers, servers, local_size, node = json.loads(sys.argv[1])
sys.exit(run_local(command, workers, servers, local_size, None, os.environ,
                   LauncherSettings.from_env(os.environ), node_command=node))
"""
NODE_EXITS = "import os, time; print(os.environ['DMLC_ROLE'], 'up'); time.sleep(0.3)"
NODE_STAYS = """
import os, sys, time
pid_file = os.path.join(sys.argv[1], str(os.getpid()))
open(pid_file + ".tmp", "w").write(str(os.getpid()))
os.replace(pid_file + ".tmp", pid_file + ".pid")
time.sleep(60)
"""
WORKER_SAYS_HI = """
import os, sys, time
if len(sys.argv) > 2:  # wait for the stand-in nodes to be up: argv[2] holds their PID files
    deadline = time.time() + 10
    while len([f for f in os.listdir(sys.argv[2]) if f.endswith(".pid")]) < 2 and time.time() < deadline:
        time.sleep(0.02)
print("hi from", os.environ["DMLC_WORKER_ID"], os.environ["BYTEPS_LOCAL_RANK"])
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]) if os.environ["DMLC_WORKER_ID"] == "1" else 0)
"""


def run_local_job(command, workers, servers, local_size, node, **env):
    spec = json.dumps([command, workers, servers, local_size, node])
    return subprocess.run(python(RUN_LOCAL, spec), env=clean_env(**env), cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT)


def test_local_job_labels_output_and_succeeds():
    result = run_local_job(python(WORKER_SAYS_HI, 0), 2, 2, 2, python(NODE_EXITS))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for expected in ("[scheduler] scheduler up", "[server0] server up", "[server1] server up",
                     "[worker0.0] hi from 0 0", "[worker0.1] hi from 0 1",
                     "[worker1.0] hi from 1 0", "[worker1.1] hi from 1 1"):
        assert expected in lines
    assert result.stderr.count("to stderr") == 4 and "[worker1.1] to stderr" in result.stderr


def test_local_job_worker_failure_stops_everything(tmp_path):
    result = run_local_job(python(WORKER_SAYS_HI, 3, tmp_path), 2, 1, 1, python(NODE_STAYS, tmp_path))
    assert result.returncode == 3
    assert "bpslaunch: worker1 exited with status 3" in result.stderr
    nodes = pids_in(tmp_path)
    assert len(nodes) == 2 and not any(alive(pid) for pid in nodes)


def test_local_job_scheduler_and_servers_get_a_bounded_shutdown(tmp_path):
    started = time.monotonic()
    result = run_local_job(python(WORKER_SAYS_HI, 0), 2, 1, 1, python(NODE_STAYS, tmp_path),
                           BPS_GC_SHUTDOWN_TIMEOUT="0.5")
    assert result.returncode == 1
    assert "scheduler, server0 still running 0.5 s after the workers finished" in result.stderr
    assert time.monotonic() - started < 10
    assert not any(alive(pid) for pid in pids_in(tmp_path))

