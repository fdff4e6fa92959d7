"""BPS_GC_ELASTIC: a worker host joins the running job (docs/elastic.md).

One job (3 worker hosts, 2 servers, one bpslaunch per role) trains parameters p -= lr * mean
of a dense tensor split over both servers and a onebit tensor with error feedback. Worker 2 is
killed half-way through a round; the survivors go on. A host started with worker 2's
variables but another compressor is refused in one line naming both, and the job goes on;
then one whose copy of the parameters from the donor stalls (every rank of its host registered)
is cancelled after its BPS_GC_JOIN_TIMEOUT, refused in one line, and exits once it wakes, the
members going on as they were; then one with the job's settings joins: it gets the parameters from a live worker, its codec
state starts at zero, and after its first step its parameters are bit-identical to the
others'. Every result equals a numpy recomputation of the membership sequence every node
logged, and bps.size() and bps.membership_epoch() change at step boundaries only."""
import copy
import json
import os
import signal
import time

import numpy as np

from elastic_jobs import host_command, membership, start_job, two_tensors
from reference import elastic_means

START_BOUND, BOUND = 60.0, 60.0
STUCK_BOUND = 3  # the stalled joiner's BPS_GC_JOIN_TIMEOUT: its commit comes well within it
VICTIM, PAUSE_AT = 2, 2
SPEC = {
    "max_steps": 400, "pause_at": PAUSE_AT, "victim": VICTIM, "lr": 0.5, "sleep": 0.05,
    "join_epoch": 2, "after_join": 3, "partition_bytes": 4096,
    "tensors": two_tensors(1500, 1200),
}


def expected(spec, sequence, last):
    """{'name/step': mean}: tests/reference.py's elastic_means, every step kept."""
    return {f"{name}/{step}": mean for step, means in elastic_means(spec, sequence, last) for name, mean in means.items()}


def start_joiner(job, name, spec, tmp_path, env=None):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(spec))
    job.launch(name, host_command("elastic_join_job.py", path, tmp_path),
               dict(job.base, DMLC_ROLE="worker", DMLC_WORKER_ID=str(VICTIM), **(env or {})))


def stalled_join_is_cancelled(job, tmp_path):
    """A joiner registers, declares, is committed, then its copy of the parameters stalls
    (scripts/elastic_host.py's stall_copy; its I/O thread heartbeats on): the scheduler cancels
    the join at its bound, the members go on, and the joiner, once it wakes, ends in one line."""
    launched = time.monotonic()
    start_joiner(job, "stuck", dict(SPEC, stall_copy=str(tmp_path / "unstall")), tmp_path,
                 env={"BPS_GC_JOIN_TIMEOUT": str(STUCK_BOUND)})
    job.wait_output(["stuck"], "STALLED", START_BOUND)
    job.wait_output(["worker0", "worker1"], f"membership: worker [{VICTIM}] did not join", BOUND)
    waited = time.monotonic() - launched  # from before its registration: at least the bound
    (tmp_path / "unstall").touch()
    job.launchers["stuck"].wait(BOUND)
    report = job.report()
    assert STUCK_BOUND <= waited < STUCK_BOUND + START_BOUND, (waited, report)
    cause = (f"worker(s) [{VICTIM}] did not reach the join's boundary within BPS_GC_JOIN_TIMEOUT={STUCK_BOUND} s "
             "of the host's first registration")
    assert f"worker {VICTIM}'s join is cancelled: {cause}; the job goes on" in job.text("scheduler"), report
    last = job.text("stuck").strip().splitlines()[-1]
    assert job.launchers["stuck"].returncode not in (None, 0) and "Traceback" not in job.text("stuck"), report
    assert f"cannot join the running job now: {cause}; start it again" in last, report


def test_a_host_joins_after_one_died_and_one_with_other_settings_is_refused(tmp_path):
    job = start_job("elastic_join_job.py", SPEC, tmp_path, servers=2)
    job.wait_output([f"worker{VICTIM}"], "HALF", START_BOUND)
    time.sleep(1.0)
    os.kill(job.child_of(f"worker{VICTIM}"), signal.SIGKILL)
    job.wait_output(["worker0", "worker1"], f"worker {VICTIM} left; epoch 1", BOUND)
    # another compressor: refused, naming both; the job goes on
    other = copy.deepcopy(SPEC)
    other["tensors"][1]["params"] = {"compressor": "topk", "k": 0.1}
    start_joiner(job, "refused", other, tmp_path)
    deadline = time.monotonic() + BOUND
    while job.launchers["refused"].poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    refused = job.text("refused")
    assert job.launchers["refused"].returncode not in (None, 0), job.report()
    assert "cannot join the running job" in refused and "topk" in refused and "onebit" in refused, refused
    assert "Traceback" not in refused, refused
    stalled_join_is_cancelled(job, tmp_path)
    start_joiner(job, "joiner", SPEC, tmp_path)
    statuses, _ = job.wait_all(BOUND, since=time.monotonic())  # each step above was bounded: the end within BOUND
    report = job.report(statuses)
    for name in ("scheduler", "server0", "server1", "worker0", "worker1", "joiner"):
        assert statuses[name] == 0, report
    logged = {name: membership(job.text(name)) for name in ("scheduler", "server0", "server1", "worker0", "worker1")}
    sequence = logged["worker0"]
    assert all(seq == sequence for seq in logged.values()), logged
    assert [(e, m) for e, _, m in sequence] == [(1, [0, 1]), (2, [0, 1, 2])], sequence
    assert membership(job.text("joiner")) == sequence[1:], job.text("joiner")
    (_, left_at, _), (_, joined_at, _) = sequence
    pulled = {r: np.load(tmp_path / f"rank{r}.0.npz") for r in (0, 1)}
    pulled[2] = np.load(tmp_path / f"rank2.{joined_at}.npz")
    last = joined_at + SPEC["after_join"] - 1
    assert int(pulled[2]["start"]) == joined_at
    want = expected(SPEC, [(0, [0, 1, 2]), (left_at, [0, 1]), (joined_at, [0, 1, 2])], last)
    for r in (0, 1):
        steps = last + 1
        assert list(pulled[r]["sizes"]) == [3] * left_at + [2] * (joined_at - left_at) + [3] * (steps - joined_at)
        assert list(pulled[r]["epochs"]) == [0] * left_at + [1] * (joined_at - left_at) + [2] * (steps - joined_at)
    assert list(pulled[2]["sizes"]) == [3] * SPEC["after_join"] and list(pulled[2]["epochs"]) == [2] * SPEC["after_join"]
    for t in SPEC["tensors"]:
        name = t["name"]
        p = np.linspace(-1, 1, int(np.prod(t["shape"])), dtype=np.float32)
        for step in range(last + 1):
            p = p - np.float32(SPEC["lr"]) * want[f"{name}/{step}"]
            for r in (0, 1, 2):
                if r == 2 and step < joined_at:
                    continue
                np.testing.assert_array_equal(pulled[r][f"{name}/{step}"], want[f"{name}/{step}"], err_msg=f"{r} {name} {step}")
                assert pulled[r][f"param.{name}/{step}"].tobytes() == p.tobytes(), (r, name, step)


def test_a_host_joining_as_the_job_ends_is_refused_and_every_process_exits(tmp_path):
    """A join under way when a member says goodbye can never complete (that member will not
    reach the join's boundary): the joiner is refused in one line, and so is a host that comes
    after the goodbye; the job ends, every process exits (no orphan). Before, the scheduler,
    the server and the joiner waited for each other forever."""
    spec = dict(SPEC, max_steps=4, pause_at=1, join_epoch=99, tensors=two_tensors(64, 64), hold=str(tmp_path / "hold"))
    job = start_job("elastic_join_job.py", spec, tmp_path, role_env={"scheduler": {"BYTEPS_LOG_LEVEL": "INFO"}})
    try:
        job.wait_output([f"worker{VICTIM}"], "HALF", START_BOUND)
        os.kill(job.child_of(f"worker{VICTIM}"), signal.SIGKILL)
        job.wait_output(["worker0", "worker1"], "DONE", BOUND)  # both hold before their goodbye
        start_joiner(job, "early", spec, tmp_path)
        job.wait_output(["scheduler"], "asks to join the running job", BOUND)
        (tmp_path / "hold.1").touch()  # worker 1 says goodbye while the join is under way
        job.launchers["worker1"].wait(BOUND)
        job.launchers["early"].wait(BOUND)
        start_joiner(job, "late", spec, tmp_path)  # after a member's goodbye
        job.launchers["late"].wait(BOUND)
        (tmp_path / "hold.0").touch()
        statuses, _ = job.wait_all(BOUND, since=time.monotonic())
    finally:
        job.kill_all()
    report = job.report(statuses)
    for name in ("scheduler", "server0", "worker0", "worker1"):
        assert statuses[name] == 0 and "Traceback" not in job.text(name), report
    for name in ("early", "late"):
        last = job.text(name).strip().splitlines()[-1]
        assert statuses[name] != 0 and "Traceback" not in job.text(name), report
        assert "cannot join the running job" in last and "the job is ending (worker 1 said goodbye)" in last, report
    assert "join is cancelled: the job is ending (worker 1 said goodbye)" in job.text("scheduler"), report
    assert [(e, m) for e, _, m in membership(job.text("worker0"))] == [(1, [0, 1])], report
