"""bpslaunch with real processes: local ranks, failures, signals, orphans, bad environments.

The launcher runs as `python -m bps_gc.launcher.cli`; worker commands are small `python -c`
scripts that report through files in tmp_path. Everything is bounded by subprocess timeouts.
The --local cluster's orchestration is driven with a stand-in for `python -m bps_gc.node`.
"""
import io
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from bps_gc.config import ConfigError
from bps_gc.launcher import local, machine, numa, output
from bps_gc.launcher.settings import LauncherSettings
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
           if not k.startswith(("DMLC_", "BYTEPS_", "BPS_GC_", "NVIDIA_"))}
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

def test_one_process_per_visible_device(tmp_path):
    result = launch(python(REPORT_ENV, tmp_path),
                    clean_env(**WORKER_ENV, NVIDIA_VISIBLE_DEVICES="0,1,2", BYTEPS_NUMA_ON="0"))
    assert result.returncode == 0, result.stderr
    assert [(r["rank"], r["size"], r["devices"]) for r in reports(tmp_path)] == \
        [(0, 3, "0,1,2"), (1, 3, "0,1,2"), (2, 3, "0,1,2")]


@pytest.mark.parametrize("devices", [None, ""])
def test_no_visible_devices_means_one_rank(tmp_path, devices):
    env = clean_env(**WORKER_ENV)
    if devices is not None:
        env["NVIDIA_VISIBLE_DEVICES"] = devices
    result = launch(python(REPORT_ENV, tmp_path), env)
    assert result.returncode == 0, result.stderr
    assert [(r["rank"], r["size"]) for r in reports(tmp_path)] == [(0, 1)]


def test_command_is_run_without_a_shell_and_leading_double_dash_is_dropped(tmp_path):
    result = launch(["--", *python(REPORT_ENV, tmp_path)], clean_env(**WORKER_ENV))
    assert result.returncode == 0, result.stderr
    assert len(reports(tmp_path)) == 1


def test_failing_rank_stops_siblings_and_sets_exit_status(tmp_path):
    started = time.monotonic()
    result = launch(python(ONE_RANK_FAILS, tmp_path),
                    clean_env(**WORKER_ENV, NVIDIA_VISIBLE_DEVICES="0,1,2"))
    assert result.returncode == 3, result.stderr
    assert time.monotonic() - started < 10
    assert "rank1 exited with status 3" in result.stderr
    siblings = pids_in(tmp_path)
    assert len(siblings) == 2 and not any(alive(pid) for pid in siblings)


def test_sibling_ignoring_sigterm_is_killed_after_the_grace(tmp_path):
    started = time.monotonic()
    result = launch(python(ONE_RANK_FAILS, tmp_path, "ignore-sigterm"),
                    clean_env(**WORKER_ENV, NVIDIA_VISIBLE_DEVICES="0,1,2",
                              BPS_GC_KILL_GRACE="0.5"))
    assert result.returncode == 3, result.stderr
    assert time.monotonic() - started < 10
    assert not any(alive(pid) for pid in pids_in(tmp_path))


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGUSR1])
def test_rank_killed_by_signal_gives_128_plus_n(signum):
    result = launch(python(f"import os; os.kill(os.getpid(), {int(signum)})"),
                    clean_env(**WORKER_ENV))
    assert result.returncode == 128 + signum, result.stderr


def test_unknown_program_gives_127():
    result = launch(["bps-gc-no-such-program"], clean_env(**WORKER_ENV))
    assert result.returncode == 127
    assert "bps-gc-no-such-program" in result.stderr


# --- signals and orphans ---------------------------------------------------------------------

@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_is_forwarded_to_every_rank(tmp_path, signum):
    launcher = subprocess.Popen(LAUNCHER + python(WAIT_FOR_SIGNAL, tmp_path), cwd=ROOT,
                                env=clean_env(**WORKER_ENV, NVIDIA_VISIBLE_DEVICES="0,1"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert wait_until(lambda: len(pids_in(tmp_path)) == 2)
        launcher.send_signal(signum)
        launcher.communicate(timeout=10)
    finally:
        launcher.kill()
        launcher.wait()
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["0.pid", "1.pid", f"0.got{int(signum)}", f"1.got{int(signum)}"])
    assert launcher.returncode == 128 + signum  # interrupted, though the ranks exited 0


# Starts a grandchild that writes its PID and sleeps, then exits with status argv[2].
LEAVES_A_GRANDCHILD = """
import os, subprocess, sys, time
out = sys.argv[1]
subprocess.Popen([sys.executable, "-c", "import os, sys, time; "
                  "open(os.path.join(sys.argv[1], 'tmp'), 'w').write(str(os.getpid())); "
                  "os.replace(os.path.join(sys.argv[1], 'tmp'), "
                  "           os.path.join(sys.argv[1], 'grandchild.pid')); "
                  "time.sleep(60)", out])
while not os.path.exists(os.path.join(out, "grandchild.pid")):
    time.sleep(0.02)
sys.exit(int(sys.argv[2]))
"""


@pytest.mark.parametrize("status", [0, 5])
def test_what_a_rank_started_does_not_outlive_the_launcher(tmp_path, status):
    result = launch(python(LEAVES_A_GRANDCHILD, tmp_path, status), clean_env(**WORKER_ENV))
    assert result.returncode == status, result.stderr
    grandchild, = pids_in(tmp_path)
    assert wait_until(lambda: not alive(grandchild), timeout=5)


def test_sigkill_of_launcher_leaves_no_child_alive(tmp_path):
    launcher = subprocess.Popen(LAUNCHER + python(WAIT_FOR_SIGNAL, tmp_path), cwd=ROOT,
                                env=clean_env(**WORKER_ENV, NVIDIA_VISIBLE_DEVICES="0,1"),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: len(pids_in(tmp_path)) == 2)
    finally:
        launcher.kill()
        launcher.wait()
    children = pids_in(tmp_path)
    assert wait_until(lambda: not any(alive(pid) for pid in children), timeout=5)


# --- configuration errors --------------------------------------------------------------------

@pytest.mark.parametrize("change, variable", [
    ({"DMLC_NUM_WORKER": "two"}, "DMLC_NUM_WORKER"),
    ({"DMLC_ROLE": "boss"}, "DMLC_ROLE"),
    ({"DMLC_ROLE": None}, "DMLC_ROLE"),
    ({"DMLC_WORKER_ID": None}, "DMLC_WORKER_ID"),
    ({"DMLC_WORKER_ID": "2"}, "DMLC_WORKER_ID"),  # only 2 worker machines
    ({"DMLC_PS_ROOT_PORT": None}, "DMLC_PS_ROOT_PORT"),
    ({"BYTEPS_LOG_LEVEL": "LOUD"}, "BYTEPS_LOG_LEVEL"),
    ({"BYTEPS_NUMA_ON": "maybe"}, "BYTEPS_NUMA_ON"),
    ({"BPS_GC_KILL_GRACE": "soon"}, "BPS_GC_KILL_GRACE"),
])
def test_bad_environment_exits_2_naming_the_variable(tmp_path, change, variable):
    env = clean_env(**WORKER_ENV)
    for name, value in change.items():
        env.pop(name) if value is None else env.__setitem__(name, value)
    result = launch(python(REPORT_ENV, tmp_path), env)
    assert result.returncode == 2
    assert result.stderr.startswith("bpslaunch: ") and variable in result.stderr
    assert reports(tmp_path) == []  # nothing was started


@pytest.mark.parametrize("role", ["server", "scheduler"])
def test_command_for_server_or_scheduler_is_an_error(role):
    result = launch(["python", "train.py"], clean_env(**JOB_ENV, DMLC_ROLE=role))
    assert result.returncode == 2
    assert f"DMLC_ROLE={role} takes no command" in result.stderr


def test_worker_without_command_is_an_error():
    result = launch([], clean_env(**WORKER_ENV))
    assert result.returncode == 2 and "needs a command" in result.stderr


@pytest.mark.parametrize("args", [["--workers", "2", "python"], ["--local"],
                                  ["--local", "--workers", "0", "--", "python"],
                                  ["--local", "--port", "70000", "--", "python"]])
def test_bad_arguments_exit_2(args):
    result = launch(args, clean_env())
    assert result.returncode == 2 and "bpslaunch" in result.stderr


def test_help_documents_the_modes():
    result = launch(["--help"], clean_env())
    assert result.returncode == 0
    for word in ("--local", "NVIDIA_VISIBLE_DEVICES", "BYTEPS_NUMA_ON", "BPS_GC_KILL_GRACE",
                 "BPS_GC_SHUTDOWN_TIMEOUT", "128+N"):
        assert word in result.stdout


# --- NUMA binding ----------------------------------------------------------------------------

def _at_most_two_cpus():
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])


def test_numa_on_with_more_ranks_than_cpus_runs_unbound(tmp_path):
    result = launch(python(REPORT_ENV, tmp_path),
                    clean_env(**WORKER_ENV, NVIDIA_VISIBLE_DEVICES="0,1,2", BYTEPS_NUMA_ON="1"),
                    preexec_fn=_at_most_two_cpus)
    assert result.returncode == 0, result.stderr
    assert [r["rank"] for r in reports(tmp_path)] == [0, 1, 2]
    assert result.stderr.count("running unbound") == 1


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_numa_on_binds_ranks_to_disjoint_cpus(tmp_path):
    result = launch(python(REPORT_ENV, tmp_path),
                    clean_env(**WORKER_ENV, NVIDIA_VISIBLE_DEVICES="0,1", BYTEPS_NUMA_ON="1"))
    assert result.returncode == 0, result.stderr
    first, second = (set(r["cpus"]) for r in reports(tmp_path))
    assert first and second and not first & second
    assert first | second <= os.sched_getaffinity(0)


def test_cpu_slices_are_disjoint_and_cover_everything():
    slices = numa.cpu_slices(3, set(range(8)), sort_key=lambda cpu: cpu)
    assert slices == [{0, 1, 2}, {3, 4, 5}, {6, 7}]
    assert numa.cpu_slices(3, {0, 1}) is None


def test_visible_device_count():
    assert [machine.visible_device_count(v) for v in (None, "", "0", "0,1,2", "3, 5,", "all")] \
        == [1, 1, 1, 3, 2, 1]


# --- local mode: helpers ---------------------------------------------------------------------

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
