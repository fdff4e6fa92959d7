"""launch/: run.sh (and the role scripts it starts) on this host, as the only host of a job.

The job-name -> flags mapping, host roles and worker ids are checked with --dry-run (which
prints each role's command); real runs use a tiny training script that push_pulls through the
servers, and check that nothing the scripts started is left afterwards: the PIDs they report
are gone, and no process carries the test's marker variable in its environment.
"""
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from bps_gc.launcher.local import free_port
from conftest import ROOT, alive, LAUNCH_PYTHONPATH

RUN_SH = os.path.join(ROOT, "launch", "run.sh")
TIMEOUT = 60  # per run.sh; a hang fails the test instead of blocking the suite

ONEBIT = ["--compressor", "onebit", "--onebit-scaling", "--ef", "vanilla", "--compress-momentum", "nesterov"]
TOPK = ["--compressor", "topk", "--k", "0.001", "--ef", "vanilla"]
RANDOMK = ["--compressor", "randomk", "--k", "0.001", "--ef", "vanilla"]
DITHERING = ["--compressor", "dithering", "--k", "2"]

# Joins, push_pulls a compressed tensor through the servers, reports to its last argument, exits.
TINY_TRAIN = """
import json, sys
import numpy as np
import bps_gc.core as bps
bps.init()
x = np.full(100000, 2.0, dtype=np.float32)
bps.declare("x", shape=x.shape, dtype=x.dtype, compressor="onebit", scaling=True, ef="vanilla")
bps.push_pull(x, "x", average=True, lr=0.1).wait()
m = bps.metrics()
with open(sys.argv[-1], "w") as f:
    json.dump({"rank": bps.rank(), "size": bps.size(), "head": x[:4].tolist(),
               "pushed_wire": m.pushed_wire, "pushed_raw": m.pushed_raw, "argv": sys.argv[1:]}, f)
bps.shutdown()
"""
# Joins, says so, and waits to be stopped.
SLOW_TRAIN = """
import sys, time
import bps_gc.core as bps
bps.init()
print("joined", flush=True)
time.sleep(120)
"""


def launch_env(tmp_path, hosts=("127.0.0.1",), **extra):
    """A clean environment for run.sh: nothing from ours that it reads, an empty config file."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "BYTEPS_", "BPS_GC_")) and k not in ("WORKER_ID",)}
    (tmp_path / "hosts").write_text("# test hosts\n" + "".join(f"{h}\n" for h in hosts))
    (tmp_path / "empty.conf").write_text("")
    env.update(DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(free_port()),
               BPS_GC_LAUNCH_CONFIG=str(tmp_path / "empty.conf"), BPS_GC_HOSTS_FILE=str(tmp_path / "hosts"),
               BPS_GC_LOG_DIR=str(tmp_path / "logs"), BPS_GC_PYTHON=sys.executable,
               BPS_GC_BPSLAUNCH=f"{sys.executable} -m bps_gc.launcher.cli",
               PYTHONPATH=LAUNCH_PYTHONPATH + os.pathsep + env.get("PYTHONPATH", ""), BPS_GC_TEST_MARK=uuid.uuid4().hex)
    env.update(extra)
    return env


def dry_run(tmp_path, job, **extra):
    result = subprocess.run([RUN_SH, "--dry-run", job], env=launch_env(tmp_path, **extra), cwd=tmp_path,
                            capture_output=True, text=True, timeout=TIMEOUT)
    lines = {}
    for line in result.stdout.splitlines():
        label, _, command = line.partition(": ")
        lines[label] = shlex.split(command)
    return result, lines


@pytest.mark.parametrize("job, flags", [
    ("baseline", []),
    ("onebit", ONEBIT),
    ("topk", TOPK),
    ("randomk", RANDOMK),
    ("dithering", DITHERING),
    ("onebit_fp16", ONEBIT + ["--fp16-pushpull"]),
    ("topk_fp16", TOPK + ["--fp16-pushpull"]),
    ("fp16_dithering", DITHERING + ["--fp16-pushpull"]),
    ("fp16", ["--fp16-pushpull"]),
])
def test_job_name_selects_flags(tmp_path, job, flags):
    result, lines = dry_run(tmp_path, job, BPS_GC_TRAIN_SCRIPT="train.py", BPS_GC_DATA_DIR="/data/c100",
                            BPS_GC_TRAIN_ARGS="--batch-size 64  --num-epochs 3")
    assert result.returncode == 0, result.stderr
    argv = lines["worker"]
    env = dict(a.split("=", 1) for a in argv if re.match(r"^[A-Z_]+=", a))
    assert env["DMLC_ROLE"] == "worker" and env["DMLC_WORKER_ID"] == "0"
    command = [a for a in argv if not re.match(r"^[A-Z_]+=", a)]
    assert command[:4] == [sys.executable, "-m", "bps_gc.launcher.cli", sys.executable]
    assert command[4:] == ["train.py", "--data-dir", "/data/c100", "--logging-file", job] + flags + \
        ["--batch-size", "64", "--num-epochs", "3"]


def test_roles_on_the_root_host(tmp_path):
    result, lines = dry_run(tmp_path, "onebit", BPS_GC_TRAIN_SCRIPT="train.py")
    assert result.returncode == 0, result.stderr
    assert list(lines) == ["scheduler", "server0", "server1", "worker"]
    for label in ("scheduler", "server0", "server1"):
        env = dict(a.split("=", 1) for a in lines[label] if re.match(r"^[A-Z_]+=", a))
        assert env["DMLC_ROLE"] == label.rstrip("01")
        # one host: one worker, two servers; servers are used even with a single worker
        assert env["DMLC_NUM_WORKER"] == "1" and env["DMLC_NUM_SERVER"] == "2"
        assert env["DMLC_PS_ROOT_URI"] == "127.0.0.1" and env["BYTEPS_FORCE_DISTRIBUTED"] == "1"
        assert lines[label][-3:] == [sys.executable, "-m", "bps_gc.launcher.cli"]  # no command


def test_hosts_file_gives_counts_roles_and_worker_id(tmp_path):
    hosts = ("10.0.0.1", "ubuntu@10.0.0.2:22", "10.0.0.3")
    # this host is the second line, not the root: two servers and worker 1, no scheduler
    result, lines = dry_run(tmp_path, "topk", hosts=hosts, DMLC_PS_ROOT_URI="10.0.0.1",
                            BPS_GC_HOST_ADDR="10.0.0.2", BPS_GC_TRAIN_SCRIPT="train.py")
    assert result.returncode == 0, result.stderr
    assert list(lines) == ["server0", "server1", "worker"]
    assert "DMLC_WORKER_ID=1" in lines["worker"]
    assert "DMLC_NUM_WORKER=3" in lines["worker"] and "DMLC_NUM_SERVER=6" in lines["worker"]
    # the root host also starts the scheduler; WORKER_ID and the counts can be given
    result, lines = dry_run(tmp_path, "topk", hosts=hosts, DMLC_PS_ROOT_URI="10.0.0.1",
                            BPS_GC_HOST_ADDR="10.0.0.1", WORKER_ID="2", DMLC_NUM_SERVER="5",
                            BPS_GC_SERVERS_PER_HOST="1", DMLC_INTERFACE="eth7", BPS_GC_TRAIN_SCRIPT="train.py")
    assert result.returncode == 0, result.stderr
    assert list(lines) == ["scheduler", "server0", "worker"]
    assert "DMLC_WORKER_ID=2" in lines["worker"]
    assert "DMLC_NUM_SERVER=5" in lines["worker"] and "DMLC_INTERFACE=eth7" in lines["worker"]
    # a host that is in no line cannot guess its worker id
    result, _ = dry_run(tmp_path, "topk", hosts=hosts, DMLC_PS_ROOT_URI="10.0.0.1",
                        BPS_GC_HOST_ADDR="10.0.0.9", BPS_GC_TRAIN_SCRIPT="train.py")
    assert result.returncode == 2 and "worker id" in result.stderr


def test_config_file_fills_in_what_the_environment_leaves_unset(tmp_path):
    conf = tmp_path / "job.conf"
    conf.write_text(textwrap.dedent("""\
        : "${DMLC_PS_ROOT_PORT:=4321}"
        : "${BPS_GC_TRAIN_SCRIPT:=/opt/train.py}"
        : "${BPS_GC_TRAIN_ARGS:=--num-epochs 7}"
        : "${BPS_GC_SERVERS_PER_HOST:=3}"
    """))
    env = {"BPS_GC_LAUNCH_CONFIG": str(conf), "DMLC_PS_ROOT_PORT": ""}
    result, lines = dry_run(tmp_path, "randomk_fp16", **env)
    assert result.returncode == 0, result.stderr
    assert list(lines) == ["scheduler", "server0", "server1", "server2", "worker"]
    assert "DMLC_PS_ROOT_PORT=4321" in lines["worker"] and "DMLC_NUM_SERVER=3" in lines["worker"]
    assert lines["worker"][-len(RANDOMK) - 3:] == RANDOMK + ["--fp16-pushpull", "--num-epochs", "7"]
    # the environment wins over the file
    result, lines = dry_run(tmp_path, "baseline", BPS_GC_LAUNCH_CONFIG=str(conf), DMLC_PS_ROOT_PORT="5555")
    assert "DMLC_PS_ROOT_PORT=5555" in lines["worker"]


def test_the_example_config_and_hosts(tmp_path):
    launch = os.path.join(ROOT, "launch")
    result, lines = dry_run(tmp_path, "dithering", BPS_GC_LAUNCH_CONFIG=os.path.join(launch, "config.example"),
                            BPS_GC_HOSTS_FILE=os.path.join(launch, "hosts.example"), BPS_GC_HOST_ADDR="10.0.0.2",
                            DMLC_PS_ROOT_URI="", DMLC_PS_ROOT_PORT="", BPS_GC_PYTHON="", BPS_GC_BPSLAUNCH="")
    assert result.returncode == 0, result.stderr
    assert list(lines) == ["server0", "server1", "worker"]
    worker = lines["worker"]
    for setting in ("DMLC_PS_ROOT_URI=10.0.0.1", "DMLC_PS_ROOT_PORT=1234", "DMLC_NUM_WORKER=2",
                    "DMLC_NUM_SERVER=4", "DMLC_WORKER_ID=1"):
        assert setting in worker
    script = worker.index(os.path.join(ROOT, "example", "mxnet", "train_cifar100_byteps_gc.py"))
    assert worker[script + 1:script + 3] == ["--data-dir", os.path.expanduser("~/data/cifar100")]
    assert worker[script + 3:script + 5 + len(DITHERING)] == ["--logging-file", "dithering"] + DITHERING
    assert worker[script + 5 + len(DITHERING)] == "--batch-size"


@pytest.mark.parametrize("args, message", [
    (["onebits"], "unknown job name"),
    ([], "usage"),
    (["onebit", "topk"], "usage"),
])
def test_bad_job_names_and_usage(tmp_path, args, message):
    result = subprocess.run([RUN_SH, *args], env=launch_env(tmp_path), cwd=tmp_path,
                            capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 2 and message in result.stderr
    assert not (tmp_path / "logs").exists() or not list((tmp_path / "logs").glob("*.pid"))


def test_missing_root_address_is_an_error(tmp_path):
    result = subprocess.run([RUN_SH, "--dry-run", "onebit"], env=launch_env(tmp_path, DMLC_PS_ROOT_URI=""),
                            cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 2 and "DMLC_PS_ROOT_URI" in result.stderr


def started_pids(stderr):
    """{label: pid} from run.sh's `started LABEL (pid N, ...)` lines."""
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"started (\S+) \(pid (\d+)", stderr)}


def marked_processes(mark):
    """PIDs of our processes whose environment carries BPS_GC_TEST_MARK=mark."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if f"BPS_GC_TEST_MARK={mark}".encode() in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                pass
    return found


def assert_nothing_left(env, pids):
    deadline = time.monotonic() + 5  # reaped by run.sh already; /proc may lag a moment
    while time.monotonic() < deadline and (any(alive(p) for p in pids.values()) or
                                          marked_processes(env["BPS_GC_TEST_MARK"])):
        time.sleep(0.1)
    assert not [label for label, pid in pids.items() if alive(pid)]
    assert marked_processes(env["BPS_GC_TEST_MARK"]) == []


def test_run_sh_runs_a_job_on_one_host_and_leaves_nothing(tmp_path):
    (tmp_path / "tiny.py").write_text(TINY_TRAIN)
    report = tmp_path / "report.json"
    env = launch_env(tmp_path, BPS_GC_TRAIN_SCRIPT=str(tmp_path / "tiny.py"), BPS_GC_TRAIN_ARGS=str(report))
    result = subprocess.run([RUN_SH, "onebit_fp16"], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout + result.stderr
    pids = started_pids(result.stderr)
    assert sorted(pids) == ["scheduler", "server0", "server1", "worker"]
    assert "worker exited with status 0" in result.stderr
    out = json.loads(report.read_text())
    assert out["rank"] == 0 and out["size"] == 1
    assert out["pushed_wire"] > 0  # through the servers, compressed
    assert out["pushed_wire"] < out["pushed_raw"] / 10
    # the worker got the job's flags (the report path came last, from BPS_GC_TRAIN_ARGS)
    assert out["argv"] == ["--logging-file", "onebit_fp16"] + ONEBIT + ["--fp16-pushpull", str(report)]
    # its output was shown, and every role has its log; the PID files are gone
    assert "== " in result.stdout and "worker" in result.stdout
    logs = tmp_path / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["scheduler.log", "server0.log", "server1.log", "worker.log"]
    assert_nothing_left(env, pids)


def test_failed_worker_stops_the_host_at_once(tmp_path):
    (tmp_path / "fail.py").write_text("import bps_gc.core as bps, sys\nbps.init()\nsys.exit(3)\n")
    env = launch_env(tmp_path, BPS_GC_TRAIN_SCRIPT=str(tmp_path / "fail.py"), BPS_GC_KILL_GRACE="2")
    started = time.monotonic()
    result = subprocess.run([RUN_SH, "baseline"], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=TIMEOUT)
    assert result.returncode == 3, result.stderr
    assert "worker exited with status 3" in result.stderr
    assert time.monotonic() - started < 20  # not the 30 s shutdown timeout
    assert_nothing_left(env, started_pids(result.stderr))
    assert not list((tmp_path / "logs").glob("*.pid"))


def test_configuration_errors_start_nothing(tmp_path):
    env = launch_env(tmp_path, BPS_GC_TRAIN_SCRIPT=str(tmp_path / "missing.py"))
    result = subprocess.run([RUN_SH, "onebit"], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=TIMEOUT)
    assert result.returncode == 2 and "BPS_GC_TRAIN_SCRIPT" in result.stderr
    assert "started" not in result.stderr and marked_processes(env["BPS_GC_TEST_MARK"]) == []


def test_run_sh_stop_stops_a_running_job(tmp_path):
    (tmp_path / "slow.py").write_text(SLOW_TRAIN)
    env = launch_env(tmp_path, BPS_GC_TRAIN_SCRIPT=str(tmp_path / "slow.py"), BPS_GC_FOLLOW="0",
                     BPS_GC_KILL_GRACE="2")
    run = subprocess.Popen([RUN_SH, "baseline"], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        worker_log = tmp_path / "logs" / "worker.log"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (worker_log.exists() and "joined" in worker_log.read_text()):
            assert run.poll() is None, run.communicate()
            time.sleep(0.1)
        assert "joined" in worker_log.read_text()
        pid_files = sorted(p.name for p in (tmp_path / "logs").glob("*.pid"))
        assert pid_files == ["run.pid", "scheduler.pid", "server0.pid", "server1.pid", "worker.pid"]
        recorded = {p.stem: int(p.read_text()) for p in (tmp_path / "logs").glob("*.pid")}
        # a second run.sh on the same host refuses to start
        second = subprocess.run([RUN_SH, "baseline"], env=env, cwd=tmp_path, capture_output=True, text=True,
                                timeout=TIMEOUT)
        assert second.returncode == 2 and "already running" in second.stderr

        stop = subprocess.run([RUN_SH, "stop"], env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=TIMEOUT)
        assert stop.returncode == 0, stop.stderr
        _, stderr = run.communicate(timeout=TIMEOUT)
        assert run.returncode == 128 + signal.SIGTERM
        assert started_pids(stderr) == {k: v for k, v in recorded.items() if k != "run"}
        assert recorded["run"] == run.pid
        assert_nothing_left(env, recorded)
        assert not list((tmp_path / "logs").glob("*.pid"))
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
