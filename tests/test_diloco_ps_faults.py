"""Faults in bps_gc.torch.DiLoCo on the parameter server, run as on separate hosts: one
bpslaunch per role (scheduler, two servers, two workers; tests/multihost.py), each worker
training two DiLoCos in lockstep, the outer step on the servers and on the workers
(tests/diloco_fault_job.py: top-k + EF, H = 4, two fragments, tau = 1). Worker 1 killed
(SIGKILL) mid-window with a fragment's exchange in flight, worker 1's script returning early
(sys.exit(0)) there, Ctrl-C at worker 1's terminal (SIGINT to its bpslaunch), and server 0
killed while worker 0 waits on a fragment's exchange; then with each worker host's two local
ranks one replica (replicate="hosts", DDP on the host's group), a local rank of host 1 killed,
and Ctrl-C at host 1's terminal while a rank of it is in the in-host all-gather: every launcher
ends within BOUND seconds of the fault, the survivors (each rank of the surviving host, unless
its launcher stopped a rank for a host-mate that ended on the failure first) each print one line
naming the failed peer, none a traceback nor an abort, and no process of the job is left
(Job.wait_all). The two hosts cases cost about 8 s of wall time each on the loaded
2-core box (two more torch processes than a case with one rank a worker)."""
import os
import re
import signal
import sys
import time

import pytest

from conftest import ROOT
from multihost import INTERVAL, TIMEOUT, Job

JOB = os.path.join(ROOT, "tests", "diloco_fault_job.py")
# detection (heartbeat) + broadcast + the processes' exits: a torch process's interpreter takes
# 1 to 5 s to finalize (its last garbage collection) on the loaded 2-core box, where the last
# launcher ended up to 9.6 s after the fault; a hang runs into the workers' 60 s
BOUND = TIMEOUT + 2 * INTERVAL + 18.0
START_BOUND = 120.0
# the survivors' line when worker 1 left: the first node to see that a round cannot complete
# says so; the others relay it
LEFT = re.compile(r"bps_gc: NodeFailure: (?:the cluster failed: node \d reported: )?(worker 1) left the job before "
                  r"pushing tensor 'exchange\.[01]\.\d\.\w+#0' \(round \d+\); the round cannot complete")
# case: (the job's env, the victim's launcher, the line each survivor ends on, naming the failed
# peer in its group 1). Worker 1 kills itself / returns early after step 6, with fragment 0's
# exchange in flight; Ctrl-C reaches worker 1 while it waits on fragment 1's exchange, which
# worker 0, stalled after step 6, has not pushed to; server 0 is killed while worker 0 waits so
# on worker 1, stalled
CASES = {
    "kill": ({"VICTIM": "1", "FAULT": "kill"}, "worker1",
             re.compile(r"bps_gc: NodeFailure: (worker 1) \(node \d at 127\.0\.0\.1:\d+\) failed: no heartbeat "
                        r"for 2 s")),
    "exit": ({"VICTIM": "1", "FAULT": "exit"}, "worker1", LEFT),
    "ctrl-c": ({"VICTIM": "0", "FAULT": "stall"}, "worker1", LEFT),
    "server": ({"VICTIM": "1", "FAULT": "stall"}, "server0",
               # servers take their ranks in the order they join: launcher server0's may be 1
               re.compile(r"bps_gc: NodeFailure: (server \d) \(node \d at 127\.0\.0\.1:\d+\) failed: no "
                          r"heartbeat for 2 s")),
    # replicate="hosts", 2 hosts x 2 local ranks: local rank 1 of host 1 (rank 3) kills itself
    # after step 6, while its host's rank 0 is in DDP's all-reduce or the parts' all-gather;
    # host 1's launcher stops rank 2 at once, and the scheduler names whichever of the two it
    # missed first
    "hosts-kill": ({"VICTIM": "3", "FAULT": "kill", "REPLICATE": "hosts"}, "worker1",
                   re.compile(r"bps_gc: NodeFailure: (worker [23]) \(node \d at 127\.0\.0\.1:\d+\) failed: no "
                              r"heartbeat for 2 s")),
    # replicate="hosts": Ctrl-C at host 1's terminal while its rank 3 stalls in step 7 before
    # the opt.step that takes fragment 0's outer step, and its rank 2 waits on rank 3 in that
    # step's all-gather of the parts (host 0 waits on fragment 1's exchange). Rank 2's pending
    # all-gather used to abort it at exit (status 134, "terminate called": host_group.py)
    "hosts-ctrl-c": ({"VICTIM": "3", "FAULT": "stall-step", "REPLICATE": "hosts"}, "worker1",
                     re.compile(r"bps_gc: NodeFailure: (?:the cluster failed: node \d reported: )?(worker [23]) left the "
                                r"job before pushing tensor 'exchange\.[01]\.\d\.\w+#part[01]#0' \(round \d+\); the "
                                r"round cannot complete")),
}
# each victim launcher's status: SIGKILL, a clean exit, Ctrl-C (128 + SIGINT)
VICTIM_STATUS = {"kill": 128 + signal.SIGKILL, "exit": 0, "ctrl-c": 128 + signal.SIGINT, "server": 128 + signal.SIGKILL,
                 "hosts-kill": 128 + signal.SIGKILL, "hosts-ctrl-c": 128 + signal.SIGINT}


def launch(tmp_path, env):
    """The job, one bpslaunch per role; with REPLICATE=hosts each worker host runs 2 local ranks."""
    hosts = {f"worker{w}": {"NVIDIA_VISIBLE_DEVICES": "0,1"} for w in range(2)} if "REPLICATE" in env else None
    return Job(2, None, servers=2, command=[sys.executable, JOB], role_env=hosts,
               env={"BYTEPS_MIN_COMPRESS_BYTES": "0", "OUT": str(tmp_path), **env})


def fault(job, case, tmp_path):
    """Brings the case's fault about; the time.time() it happened at."""
    if case in ("kill", "exit", "hosts-kill"):  # the victim does it itself, after step 6
        job.wait_output(["worker0"], "RUNNING", START_BOUND)
        job.launchers["worker1"].wait(START_BOUND)
        return float((tmp_path / "fault_time").read_text())
    stalled = "worker0" if case == "ctrl-c" else "worker1"
    job.wait_output([stalled], "IN FLIGHT", START_BOUND)
    time.sleep(0.5)  # the other worker is in its outer step's wait (its steps take ms)
    at = time.time()
    if case.endswith("ctrl-c"):
        job.launchers["worker1"].send_signal(signal.SIGINT)  # Ctrl-C at worker 1's terminal
    else:
        os.kill(job.child_of("server0"), signal.SIGKILL)
    (tmp_path / "go").write_text("")  # the stalled worker pushes on, into the failed job
    return at


@pytest.mark.parametrize("case", CASES)
def test_a_fault_ends_every_process_naming_the_failed_peer(case, tmp_path):
    env, victim, named = CASES[case]
    ranks = 2 if "REPLICATE" in env else 1  # a host's ranks
    job = launch(tmp_path, env)
    statuses = None
    try:
        at = fault(job, case, tmp_path)
        statuses, elapsed = job.wait_all(BOUND, since=time.monotonic() - (time.time() - at))  # and none is left
    finally:
        job.kill_all()
    report = job.report(statuses)
    assert statuses == {name: VICTIM_STATUS[case] if name == victim else 1 for name in job.launchers}, report
    assert not any("Traceback" in job.text(name) for name in job.launchers), report
    for worker in ("worker0", "worker1"):
        # bps_gc's lines once it ran (before, a slow start may bring lines on the wait to join)
        lines = job.text(worker).split("RUNNING\n", 1)[1].splitlines()
        # (a host's local ranks: torch.distributed's excepthook prefixes "[rank<local rank>]: ")
        ends = [re.sub(r"^\[rank\d\]: ", "", line) for line in lines if re.match(r"(\[rank\d\]: )?bps_gc:", line)]
        if worker == victim:  # its own end: no line, or Ctrl-C's one
            assert ends == (["bps_gc: interrupted (Ctrl-C)"] * ranks if case.endswith("ctrl-c") else []), report
        else:  # besides the worker's log of the failure, the one line (a rank) naming the failed peer
            # a host's rank that ends on the failure first has its launcher stop the others, which
            # may not have printed theirs yet: then the launcher says which rank it stopped them for
            stopped = re.search(r"^bpslaunch: local rank \d \(worker \d\) exited with status 1; stopping the others$",
                                job.text(worker), re.M)
            printed = len(ends) == ranks or (stopped is not None and 1 <= len(ends) < ranks)
            assert printed and all(named.fullmatch(end) for end in ends), report
            peer = named.fullmatch(ends[0]).group(1)
    assert not any(re.search("terminate called|SIGABRT", job.text(name)) for name in job.launchers), report
    for name in ("scheduler", "server0", "server1"):  # the other roles log it, naming the peer
        if name != victim:
            assert f"ERROR {peer}" in job.text(name) or f"reported: {peer}" in job.text(name), report
    print(f"{case}: every launcher ended {elapsed:.2f} s after the fault", file=sys.stderr)
