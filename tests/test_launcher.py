"""bpslaunch with real processes: local ranks, failures, signals, orphans, bad environments.

The launcher runs as `python -m bps_gc.launcher.cli`; worker commands are small `python -c`
scripts that report through files in tmp_path. Everything is bounded by subprocess timeouts.
The --local cluster's orchestration is driven with a stand-in for `python -m bps_gc.node`.
"""
import os
import signal
import subprocess
import time

import pytest

from bps_gc.launcher import machine, numa
from conftest import ROOT, alive
from launcher_helpers import JOB_ENV, LAUNCHER, ONE_RANK_FAILS, REPORT_ENV, WAIT_FOR_SIGNAL, WORKER_ENV, clean_env, launch, pids_in, python, reports, wait_until
from launcher_helpers import kill_leftovers  # noqa: F401  (autouse: kills what a test left behind)


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
    assert "local rank 1 (worker 4) exited with status 3" in result.stderr
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
    # where the bad variable does not locate the scheduler, bpslaunch asks it to stop the job and
    # waits for its answer up to min(join timeout, 3 s); no scheduler runs here: 0.5 s, not 3
    env = clean_env(**WORKER_ENV, BPS_GC_JOIN_TIMEOUT="0.5")
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

