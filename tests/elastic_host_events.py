"""The timed events of tests/test_elastic.py's launches of worker hosts with 2 local ranks
(docs/elastic.md): waits on the hosts' output, a death during a REDO (two levels), a joiner
dead in its first round and two deaths in one change (both launches)."""
import json
import os
import re
import signal
import time

from elastic_jobs import host_command, membership

START_BOUND, BOUND = 60.0, 40.0
# two levels' death during a REDO: the heartbeat timeout (s), and when worker 7 is stopped after
# the kill: halfway, so that either side has 1.3 s to spare on a loaded box (the stop comes
# before the victim's epoch is prepared, the scheduler prepares it before worker 7 is silent for
# the timeout, heartbeats every 0.2 s)
REDO_TIMEOUT, REDO_HOLD = 3.0, 1.5
JOIN_STARTS = "the join of worker 2, 3 starts at round group"  # the scheduler's, at INFO: the members pledged


def printed_by_both(job, names, word, bound, times=2):
    """Until both local ranks of each host in ``names`` printed ``word`` (``times`` in all: once
    each by default; their lines may interleave, "PUSHEDPUSHED 3\n 3")."""
    deadline = time.monotonic() + bound
    while not all(job.text(n).count(word) >= times for n in names):
        if time.monotonic() > deadline:
            job.kill_all()
            raise AssertionError(f"not {word!r} {times} times from each of {names}:\n{job.report()}")
        time.sleep(0.05)


def death_during_redo(job, killed, held, late):
    """Two levels: host 4 dies while the survivors redo the rounds host 1 (killed at ``killed``)
    had pushed. Worker 7 (pid ``held``) is stopped (SIGSTOP) before host 1's epoch is prepared,
    so its commit waits for it; once host 4's ranks (pids ``late``) reported for that epoch they
    are killed (SIGKILL) and worker 7 goes on: the commit counts host 4, whose REDOs never come,
    and the servers finish the REDO at host 4's own epoch. Worker 7 is silent for about 1.5 s,
    under the heartbeat timeout (REDO_TIMEOUT)."""
    time.sleep(max(0.0, killed + REDO_HOLD - time.monotonic()))
    os.kill(held, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + BOUND
        while not all(f"worker {r} reported for epoch 1" in job.text("scheduler") for r in (8, 9)):
            if time.monotonic() > deadline:
                job.kill_all()
                raise AssertionError(f"host 4 did not report for epoch 1:\n{job.report()}")
            time.sleep(0.01)
        for pid in late:
            os.kill(pid, signal.SIGKILL)
        early = "worker 7 reported for epoch 1" in job.text("scheduler")
    finally:
        os.kill(held, signal.SIGCONT)
    assert not early, f"worker 7 reported before it was stopped (the box too slow for this timing):\n{job.report()}"


def joiner_dies(job, host1, env, spec, tmp_path, starts):
    """Host 1 joins (the members wait at their first gate until the scheduler logged the join's
    start, the ``starts``-th: they pledged that step, so the join starts there) and, in its first
    round (admitted: the servers count it), its local rank 1 posts ``half`` and is killed
    (SIGKILL) once the members posted that step (PUSHED) and a second passed, so rounds summed
    with its pushes are summed again without it; its launcher stops the mate. Returns once the
    members logged its leaving."""
    dying = tmp_path / "dying.json"
    dying.write_text(json.dumps(dict(spec, join_victim=3)))
    job.launch("die1", host_command("elastic_job.py", dying, tmp_path), dict(host1, **env))
    printed_by_both(job, ["scheduler"], JOIN_STARTS, BOUND, times=starts)
    open(spec["gates"][min(spec["gates"], key=int)], "w").close()
    job.wait_output(["die1"], "HALF", BOUND)
    epoch, first, _ = membership(job.text("scheduler"))[-1]  # its join's
    printed_by_both(job, ["worker0", "worker2", "worker3"], "PUSHED", BOUND,
                    times=2 * sum(s <= first for s in spec["pushed_at"]))  # up to that step
    time.sleep(1.0)
    os.kill(job.local_rank_of("die1", 1), signal.SIGKILL)
    job.launchers["die1"].wait(timeout=BOUND)
    job.wait_output(["worker0"], f"membership: worker 2, 3 left; epoch {epoch + 1}", BOUND)


def two_deaths_in_one_change(job, stopped, second, held):
    """Host 2 goes silent (worker 5, pid ``second``, SIGSTOP) just after host 3 (at
    ``stopped``); worker 1 (pid ``held``) is stopped halfway through the heartbeat timeout, before
    host 3's epoch is prepared, until the scheduler named both hosts left, so the commit waits for
    it: the second death comes before the first's commit, and one epoch drops both hosts (the
    epoch first prepared is superseded). Worker 1 is silent for about 1.5 s, as in death_during_redo."""
    os.kill(second, signal.SIGSTOP)
    time.sleep(max(0.0, stopped + REDO_HOLD - time.monotonic()))
    os.kill(held, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + BOUND
        while not all(re.search(rf"worker [{pair}] \(node .* left: no heartbeat", job.text("scheduler"))
                      for pair in ("45", "67")):
            if time.monotonic() > deadline:
                job.kill_all()
                raise AssertionError(f"hosts 2 and 3 not both named left:\n{job.report()}")
            time.sleep(0.01)
    finally:
        os.kill(held, signal.SIGCONT)
