"""Faults in the jobs of register_fsdp_hooks and DiLoCo run as two hosts on loopback: one
torchrun per host (the HSDP job: 2 hosts x 2 ranks, a (2, 2) mesh, top-k + EF across hosts;
DiLoCo: 2 hosts x 1 rank, top-k + EF, two staggered fragments), under bps_gc.torch.init() (the
collective communicator's heartbeat). A rank killed mid-job (SIGKILL) ends every other process
within BOUND seconds: the other host's ranks each say in one line that the killed rank died,
with no traceback; the killed rank's launcher names it as the root cause; no rank is left. A
Ctrl-C at both hosts' terminals ends every rank with one line each (HSDP's ranks may be inside
FSDP2's own all_gather: no rank waits for a last barrier after an interrupted end). A rank that
ends its script early (``sys.exit(0)``) mid-job fails the ranks waiting on it in bps_gc's
compressed exchange at once, naming it, and only them: DiLoCo's other rank; of
CompressedExchange on two sub-groups (2 hosts x 2 ranks, groups {0, 1} and {2, 3}), its
group-mate, while the other group's ranks exchange on and end normally; in HSDP, its
replicate-mate in the hook's exchange and its shard-mate in FSDP2's all_gather (a gloo error
there is named by the leaver's Ending, not printed as gloo's traceback)."""
import contextlib
import json
import os
import re
import signal
import subprocess
import time

import pytest

from collective_cluster import TESTS, free_port, job_env, torchrun_argv
from conftest import ROOT, alive
from test_collective_faults import wait_for_pids

# the heartbeat's bound (3 + 0.2 s), a hook's wait letting the heartbeat name a closed socket's
# rank (twice that bound), the ranks' exits and torchrun's teardown, on 2 shared cores
BOUND = 25.0
# a rank that aborted after its line: gloo settling a collective at the interpreter's finalization
ABORTED = re.compile(r"terminate called|SIGABRT|exitcode\s*:\s*-6")
TOPK = {"compressor": "topk", "k": 0.25, "ef": "vanilla"}
JOBS = {"hsdp": ("fsdp_job.py", 2, {"mode": "fault", "compression_params": TOPK}),
        "diloco": ("diloco_resume_job.py", 1, {"phase": "fault", "sync_every": 4, "fragments": 2, "delay": 1,
                                               "steps": 0, "compression_params": TOPK}),
        "subgroups": ("exchange_leave_job.py", 2, {"groups": [[0, 1], [2, 3]], "compression_params": TOPK})}


def launch_two_hosts(tmp_path, job, spec):
    """One torchrun per host (its own session, as at a terminal), stderr to OUT/host<i>.err."""
    script, per_host, base = JOBS[job]
    (tmp_path / "spec.json").write_text(json.dumps({**base, **spec}))
    argv, port = [os.path.join(TESTS, script), str(tmp_path / "spec.json"), str(tmp_path)], free_port()
    return [subprocess.Popen(torchrun_argv(argv, per_host, port, nnodes=2, node_rank=node), env=job_env(), cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"host{node}.err", "w"),
                             start_new_session=True) for node in range(2)], 2 * per_host


def wait_all(procs, timeout):
    """The time.time() each launcher exited at (None: still running after ``timeout``)."""
    ends, deadline = [None] * len(procs), time.monotonic() + timeout
    while None in ends and time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if ends[i] is None and p.poll() is not None:
                ends[i] = time.time()
        time.sleep(0.05)
    return ends


def stopped(procs, pids):
    """Whether no rank is left, a few seconds after the launchers (torchrun reaps its own)."""
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(pid) for pid in pids)


def cleanup(procs, pids):
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def two_hosts(tmp_path, job, spec):
    """The job on two hosts, once every rank runs: (its launchers, the ranks' pids); none is left
    after, however the test ends."""
    procs, ranks = launch_two_hosts(tmp_path, job, spec)
    pids = []
    try:
        pids = wait_for_pids(tmp_path, ranks, procs, timeout=180)
        yield procs, pids
    finally:
        cleanup(procs, pids)


def host_logs(tmp_path):
    """Each host's torchrun's stderr."""
    return [(tmp_path / f"host{node}.err").read_text() for node in range(2)]


def fault_time(tmp_path):
    """When the victim did its fault (its time.time())."""
    return float((tmp_path / "fault_time").read_text())


# torch's own C++ warning when a rank's store client writes or reads after the store's host (host 0's
# torchrun agent, stopped too) has gone: torch prints it, not bps_gc, and no setting of a
# running process silences it; a traceback or a second bps_gc line still counts
STORE_GONE = re.compile(r"\[rank\d+\]:\[W\d{4} [\d:.]+ \S*TCPStore\.cpp:\d+\] \[c10d\] (send|recv)(Bytes|Value) failed "
                        r"on .*(Broken pipe|Connection reset by peer|Did the remote server shutdown or crash\?)$")


def rank_lines(text, rank):
    """Rank ``rank``'s lines in a host's log, less torch's STORE_GONE warnings."""
    return [line for line in text.splitlines()
            if line.startswith(f"[rank{rank}]:") and not STORE_GONE.match(line)]


@pytest.mark.parametrize("job", ["hsdp", "diloco"])
def test_a_killed_rank_ends_every_process_naming_it(job, tmp_path):
    victim = 3 if job == "hsdp" else 1  # on host 1: host 0's agent keeps the rendezvous store
    with two_hosts(tmp_path, job, {"fault": "kill", "victim": victim}) as (procs, pids):
        ranks = len(pids)
        ends = wait_all(procs, 120)
        killed = fault_time(tmp_path)
        survivors, victims = host_logs(tmp_path)
        assert None not in ends, f"a launcher still runs 120 s after the kill:\n{survivors[-3000:]}"
        assert all(p.returncode != 0 for p in procs)
        assert not ABORTED.search(survivors), survivors[-3000:]
        for rank in range(ranks // 2):  # host 0's ranks: one line each, naming the killed rank
            lines = rank_lines(survivors, rank)
            named = (f"[rank{rank}]: bps_gc: NodeFailure: bps_gc: rank {victim} sent no heartbeat for 3 s: "
                     "it died or hangs")
            # the victim's host-mate, stopped by its torchrun meanwhile, may be noted after it
            mates = [f" (rank {r} then stopped by a launcher)" for r in range(ranks // 2, ranks) if r != victim]
            assert lines in ([named],) + tuple([named + mate] for mate in mates), survivors[-3000:]
        assert f"rank      : {victim} (local_rank: {victim - ranks // 2})\n  exitcode  : -9" in victims, victims[-3000:]
        assert max(ends) - killed < BOUND, f"the last launcher ended {max(ends) - killed:.1f} s after the kill"
        assert stopped(procs, pids)
        print(f"{job}: rank {victim} killed; the launchers ended {min(ends) - killed:.1f} and "
              f"{max(ends) - killed:.1f} s later")


@pytest.mark.parametrize("job", ["hsdp", "diloco"])
def test_ctrl_c_ends_every_rank_with_one_line(job, tmp_path):
    with two_hosts(tmp_path, job, {}) as (procs, pids):
        per_host = len(pids) // 2
        # a few steps (DiLoCo: outer syncs) under way: every rank wrote its pid at step 2 (and
        # wait_for_pids gave the loop 0.2 s more); a Ctrl-C landing in DiLoCo's wait for an exchange
        # (finish_sync) ends on the one line too (interruptible_wait), so any moment of the run will do
        time.sleep(0.2)
        interrupted = time.time()
        for p in procs:  # Ctrl-C at each host's terminal: its launcher's foreground group
            os.killpg(p.pid, signal.SIGINT)
        ends = wait_all(procs, 60)
        assert None not in ends, "a launcher still runs 60 s after Ctrl-C"
        for node, text in enumerate(host_logs(tmp_path)):
            for rank in range(node * per_host, (node + 1) * per_host):
                lines = rank_lines(text, rank)
                # a rank inside FSDP2's all_gather may see a peer's socket close before its own
                # Ctrl-C is raised: then its line names that interrupted peer
                assert lines == [f"[rank{rank}]: bps_gc: interrupted (Ctrl-C)"] or (
                    job == "hsdp" and len(lines) == 1 and re.fullmatch(
                        rf"\[rank{rank}\]: bps_gc: NodeFailure: bps_gc: rank \d left the job \(its script raised "
                        r"KeyboardInterrupt after \d+ collectives.*", lines[0])), text[-4000:]
        assert max(ends) - interrupted < BOUND, f"the last launcher ended {max(ends) - interrupted:.1f} s after Ctrl-C"
        assert stopped(procs, pids)
        print(f"{job}: Ctrl-C; the launchers ended {min(ends) - interrupted:.1f} and {max(ends) - interrupted:.1f} s later")


def left(rank, group=None):
    """The one line of a rank failed by ``rank``'s early end (on ``group``'s collectives)."""
    on = "" if group is None else re.escape(f" on the group of ranks {group}")
    return re.compile(rf"\[rank\d\]: bps_gc: NodeFailure: bps_gc: rank {rank} left the job \(shut down after "
                      rf"\d+ collectives{on}\) before rank \d's all_gather of .* of DDP bucket \d+")


def test_a_clean_exit_mid_job_ends_diloco_naming_the_leaver(tmp_path):
    with two_hosts(tmp_path, "diloco", {"fault": "exit", "victim": 1}) as (procs, pids):
        ends = wait_all(procs, 60)
        left_at = fault_time(tmp_path)
        survivor, leaver = host_logs(tmp_path)
        assert None not in ends, f"a launcher still runs 60 s after rank 1 left:\n{survivor[-3000:]}"
        lines = rank_lines(survivor, 0)
        assert len(lines) == 1 and left(1).fullmatch(lines[0]), survivor[-3000:]
        assert rank_lines(leaver, 1) == [], leaver[-3000:]
        assert procs[0].returncode != 0 and procs[1].returncode == 0 and not ABORTED.search(survivor), survivor[-3000:]
        assert max(ends) - left_at < BOUND, f"the last launcher ended {max(ends) - left_at:.1f} s after the exit"
        assert stopped(procs, pids)
        print(f"diloco: rank 1 left; the launchers ended {min(ends) - left_at:.1f} and "
              f"{max(ends) - left_at:.1f} s later")


def test_a_clean_exit_mid_job_ends_hsdp_naming_the_leaver(tmp_path):
    """Rank 3 ends its script at step 3: its replicate-mate (rank 1) fails in the hook's exchange
    and its shard-mate (rank 2) in FSDP2's all_gather, each on one line naming rank 3; rank 0
    ends on such a line or is stopped by its launcher; no rank prints a traceback."""
    with two_hosts(tmp_path, "hsdp", {"fault": "exit", "victim": 3}) as (procs, pids):
        ends = wait_all(procs, 60)
        left_at = fault_time(tmp_path)
        logs = host_logs(tmp_path)
        assert None not in ends, f"a launcher still runs 60 s after rank 3 left:\n{logs[0][-3000:]}"
        named = re.compile(r"\[rank\d\]: bps_gc: NodeFailure: bps_gc: rank 3 left the job \(shut down after \d+ "
                           r"collectives(?: on the group of ranks \[1, 3\])?\) (?:before|while) rank \d.*")
        lines = {rank: rank_lines(logs[rank // 2], rank) for rank in range(4)}
        assert len(lines[1]) == 1 and named.fullmatch(lines[1][0]), logs[0][-3000:]
        assert len(lines[2]) == 1 and named.fullmatch(lines[2][0]), logs[1][-3000:]
        assert lines[3] == [] and len(lines[0]) <= 1 and all(named.fullmatch(line) for line in lines[0]), lines
        assert not any(re.match(r"\[rank\d\]: Traceback", line) for text in logs for line in text.splitlines())
        assert not any(ABORTED.search(text) for text in logs), logs
        assert max(ends) - left_at < BOUND, f"the last launcher ended {max(ends) - left_at:.1f} s after the exit"
        assert stopped(procs, pids)
        print(f"hsdp: rank 3 left; the launchers ended {min(ends) - left_at:.1f} and {max(ends) - left_at:.1f} s later")


def test_a_clean_exit_fails_its_own_sub_group_only(tmp_path):
    """Rank 3 leaves (host 1): rank 2 fails at once, naming it; ranks 0 and 1 (host 0) exchange
    3 more times and end normally, alike. Host 0's torchrun then waits in its exit barrier for
    host 1's failed agent (torch's, up to 300 s: elastic's exit_barrier_timeout), so the test
    waits for the ranks, not that launcher."""
    with two_hosts(tmp_path, "subgroups", {"victim": 3}) as (procs, pids):
        ends = wait_all(procs[1:], 60)
        left_at = fault_time(tmp_path)
        deadline = time.monotonic() + 60
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        gone = time.time()
        others, leavers = host_logs(tmp_path)
        assert None not in ends, f"host 1's launcher still runs 60 s after rank 3 left:\n{leavers[-3000:]}"
        lines = rank_lines(leavers, 2)
        assert len(lines) == 1 and left(3, [2, 3]).fullmatch(lines[0]), leavers[-3000:]
        assert rank_lines(leavers, 3) == [], leavers[-3000:]
        assert procs[1].returncode != 0 and not ABORTED.search(leavers), leavers[-3000:]
        assert ends[0] - left_at < BOUND, f"rank 2's launcher ended {ends[0] - left_at:.1f} s after the exit"
        assert rank_lines(others, 0) == rank_lines(others, 1) == [], others[-3000:]
        done = [(tmp_path / f"done{r}").read_text() for r in range(2)]
        assert done[0] == done[1], done  # the group's last average, alike on both
        assert not any(alive(pid) for pid in pids) and gone - left_at < BOUND, "a rank still runs"
        print(f"sub-groups: rank 3 left; rank 2's launcher ended {ends[0] - left_at:.1f} s later, "
              f"the last rank {gone - left_at:.1f} s later")
