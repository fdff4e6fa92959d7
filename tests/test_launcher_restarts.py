"""``bpslaunch --local --max-restarts N`` (issue 33): a process that dies takes the whole group
down (no orphans) and the job starts again, resuming from its checkpoint; after N restarts the
launcher gives up with one clear line."""
import json
import os
import signal
import subprocess
import sys
import time
import uuid

from conftest import LAUNCH_PYTHONPATH, ROOT
from multihost import processes_with
from test_ps_state import ENV, JOB, assert_same, finals, make_spec

LAUNCH = [sys.executable, "-m", "bps_gc.launcher.cli", "--local", "--workers", "2", "--servers", "1"]


def job_env(tag):
    return dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH,
                BPS_GC_HEARTBEAT_INTERVAL="0.2", BPS_GC_HEARTBEAT_TIMEOUT="2", BPS_GC_KILL_GRACE="2",
                RESTART_TEST_TAG=tag, **ENV)


def worker_pid(tag, worker_id, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        mine = set(processes_with(f"RESTART_TEST_TAG={tag}"))
        found = mine & set(processes_with(f"DMLC_WORKER_ID={worker_id}")) & \
            set(processes_with("DMLC_ROLE=worker"))
        if found:
            return min(found)
        time.sleep(0.1)
    raise AssertionError(f"no worker {worker_id} of job {tag}")


def test_kill_9_of_a_worker_restarts_the_job_from_its_checkpoint(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for out, spec in ((straight, make_spec()), (killed, make_spec(save_at=2, hang_after_save=True))):
        out.mkdir()
        (out / "spec.json").write_text(json.dumps(spec))
    command = lambda out: [sys.executable, JOB, str(out / "spec.json"), str(out)]  # noqa: E731
    done = subprocess.run(LAUNCH + ["--", *command(straight)], env=job_env(uuid.uuid4().hex),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tag = uuid.uuid4().hex
    launcher = subprocess.Popen(LAUNCH + ["--max-restarts", "2", "--", *command(killed)],
                                env=job_env(tag), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while not all((killed / f"ckpt{r}.bin").exists() for r in range(2)):
            assert time.monotonic() < deadline and launcher.poll() is None, "no checkpoint"
            time.sleep(0.1)
        os.kill(worker_pid(tag, 1), signal.SIGKILL)  # mid-job: the others wait in the step after
        output, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, output[-4000:]
    assert "restarting the job (1 of 2) after worker1 failed" in output, output[-4000:]
    assert output.count("resumed at step 3") == 2, output[-4000:]
    assert_same(finals(killed, 2), finals(straight, 2), "killed and restarted vs never killed")
    time.sleep(0.5)
    assert not processes_with(f"RESTART_TEST_TAG={tag}"), "processes left behind"


def test_gives_up_after_max_restarts(tmp_path):
    tag = uuid.uuid4().hex
    code = "import os, sys; print('start', os.environ['BPS_GC_RESTART_COUNT'], flush=True); sys.exit(3)"
    done = subprocess.run(LAUNCH[:4] + ["--servers", "1", "--max-restarts", "1", "--",
                                        sys.executable, "-c", code],
                          env=job_env(tag), capture_output=True, text=True, timeout=120)
    text = done.stdout + done.stderr
    assert done.returncode == 3, text
    assert "start 0" in text and "start 1" in text and "start 2" not in text, text
    assert "worker0 failed again after 1 restart(s) (--max-restarts 1); giving up with status 3" in text, text
    assert not processes_with(f"RESTART_TEST_TAG={tag}")
