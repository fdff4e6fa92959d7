"""On torch.distributed, a rank that leaves in the middle of a job (an exception, Ctrl-C, or a
clean exit after fewer steps) stops the others at once with a NodeFailure naming it, instead of
leaving them in a collective until the timeout; and a normal end exits 0 everywhere. Two hosts:
one bpslaunch per rank (DMLC_NUM_SERVER=0) or one torchrun agent per rank, real gloo ranks.
Rank 0 hosts the rendezvous store under bpslaunch, so both the host and a non-host leaving are
covered."""
import os
import signal
import subprocess
import sys
import time

import pytest

from collective_cluster import TESTS, free_port, job_env, torchrun_argv
from conftest import ROOT

JOB = os.path.join(TESTS, "collective_departure_job.py")
START_BOUND = 90
BOUND = 8.0  # a heartbeat interval (0.2 s) plus interpreter teardown on 2 shared cores


class Hosts:
    """One launcher per rank, as on separate machines; output to OUT/launcher<rank>.txt."""

    def __init__(self, tmp_path, kind, launcher="bpslaunch", ranks=2, env=None):
        self.out, self.procs, self.files = tmp_path, [], []
        port = free_port()
        for rank in range(ranks):
            if launcher == "torchrun":
                argv, extra = torchrun_argv([JOB, str(tmp_path), kind], 1, port, nnodes=ranks, node_rank=rank), {}
            else:
                argv = [sys.executable, "-m", "bps_gc.launcher.cli", sys.executable, JOB, str(tmp_path), kind]
                extra = {"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": str(ranks), "DMLC_NUM_SERVER": "0",
                         "DMLC_WORKER_ID": str(rank), "DMLC_PS_ROOT_URI": "127.0.0.1",
                         "DMLC_PS_ROOT_PORT": str(port)}
            log = open(tmp_path / f"launcher{rank}.txt", "w")
            self.files.append(log)
            self.procs.append(subprocess.Popen(argv, env=job_env({**extra, **(env or {})}), cwd=ROOT,
                                               stdout=log, stderr=subprocess.STDOUT, text=True))

    def output(self, rank):
        return (self.out / f"launcher{rank}.txt").read_text()

    def wait_output(self, rank, text, timeout=START_BOUND):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.output(rank):
                return time.monotonic()
            if any(p.poll() is not None for p in self.procs) and text not in self.output(rank):
                raise AssertionError(f"a launcher exited before rank {rank} printed {text!r}:\n{self.report()}")
            time.sleep(0.05)
        raise AssertionError(f"rank {rank} did not print {text!r}:\n{self.report()}")

    def wait_all(self, since, timeout=60):
        for p in self.procs:
            p.wait(timeout=max(0.1, since + timeout - time.monotonic()))
        return time.monotonic() - since

    def report(self):
        return "\n".join(f"--- rank {r} (exit {p.poll()}):\n{self.output(r)[-2500:]}" for r, p in enumerate(self.procs))

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in self.files:
            f.close()


def leave(hosts, rank, mode):
    """Make ``rank`` leave (the job was started with its MODE/STEPS); when it left."""
    if mode == "sigint":
        hosts.wait_output(rank, "RUNNING")
        hosts.procs[rank].send_signal(signal.SIGINT)  # Ctrl-C at its launcher's terminal
        return time.monotonic()
    return hosts.wait_output(rank, "DONE" if mode == "fewer" else "RuntimeError")


def mode_env(rank, mode):
    return {f"MODE_{rank}": "raise"} if mode == "raise" else {f"STEPS_{rank}": "8"} if mode == "fewer" else {}


def check_the_others_stopped(hosts, leaver, mode, seconds, launcher="bpslaunch"):
    """The leaver exits 0 only after a clean exit; every other rank non-zero, with one line
    naming the leaver and no traceback (torchrun's agent prints its own on a failed child: only
    the rank's lines count there)."""
    report = hosts.report()
    for rank, p in enumerate(hosts.procs):
        if rank == leaver:
            assert (p.returncode == 0) == (mode == "fewer"), report
            continue
        text = hosts.output(rank)
        if launcher == "torchrun":
            text = "\n".join(line for line in text.splitlines() if line.startswith(f"[rank{rank}]:"))
        # status 1, as an uncaught error ends a script: not an abort (134) after the line
        assert p.returncode == 1 and "terminate called" not in hosts.output(rank), report
        assert f"NodeFailure: bps_gc: rank {leaver} left the job" in text, report
        raised = {"raise": "RuntimeError", "sigint": "KeyboardInterrupt"}.get(mode)
        assert (f"its script raised {raised} after" in text) if raised else ("shut down after" in text), report
        assert "Traceback" not in text, report
    assert seconds < BOUND, f"the job took {seconds:.1f} s to end after rank {leaver} left:\n{report}"


@pytest.mark.parametrize("mode", ["raise", "sigint", "fewer"])
@pytest.mark.parametrize("leaver", [1, 0])
def test_multihost_rank_leaving_a_reduction_stops_the_others(tmp_path, mode, leaver):
    hosts = Hosts(tmp_path, "reduce", env=mode_env(leaver, mode))
    try:
        seconds = hosts.wait_all(leave(hosts, leaver, mode))
        print(f"bpslaunch, reduce, rank {leaver} {mode}: the job ended {seconds:.2f} s after it left",
              file=sys.stderr)
        check_the_others_stopped(hosts, leaver, mode, seconds)
        assert "'topk'" in hosts.output(1 - leaver) or "'dense'" in hosts.output(1 - leaver), hosts.report()
    finally:
        hosts.close()


def test_multihost_hung_rank_ends_the_other_within_its_bound(tmp_path):
    """Rank 1 stopped (SIGSTOP: alive, silent, its sockets open) mid-job: rank 0 names it within
    the heartbeat's timeout and ends with status 1 within the bound after its line, although its
    collective on rank 1 never returns (gloo would wait out its 30-minute timeout there)."""
    hosts = Hosts(tmp_path, "reduce")
    stopped = None
    try:
        hosts.wait_output(1, "RUNNING")
        stopped = int((tmp_path / "pid1").read_text())
        os.kill(stopped, signal.SIGSTOP)
        since = time.monotonic()
        hosts.procs[0].wait(timeout=60)
        seconds = time.monotonic() - since
        text, report = hosts.output(0), hosts.report()
        assert hosts.procs[0].returncode == 1 and "terminate called" not in text, report
        assert "NodeFailure: bps_gc: rank 1 sent no heartbeat for 3 s" in text and "Traceback" not in text, report
        # the timeout (3 s), then at most twice the timeout and interval (6.4 s), on 2 shared cores
        assert seconds < 3 + 6.4 + BOUND, f"rank 0 ended {seconds:.1f} s after rank 1 stopped:\n{report}"
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGKILL)
        hosts.close()


@pytest.mark.parametrize("leaver", [1, 0])
def test_multihost_rank_leaving_a_gossip_ring_stops_the_others(tmp_path, leaver):
    """Three ranks in a ring of messages; ``leaver`` ends early: the rank waiting on its message
    fails at once, and the rank whose message it no longer takes is released too."""
    hosts = Hosts(tmp_path, "gossip", ranks=3, env=mode_env(leaver, "fewer"))
    try:
        seconds = hosts.wait_all(leave(hosts, leaver, "fewer"))
        print(f"bpslaunch, gossip, rank {leaver} of 3 fewer: the job ended {seconds:.2f} s after it left",
              file=sys.stderr)
        check_the_others_stopped(hosts, leaver, "fewer", seconds)
    finally:
        hosts.close()


def test_torchrun_rank_leaving_stops_the_others(tmp_path):
    hosts = Hosts(tmp_path, "reduce", launcher="torchrun", env=mode_env(1, "raise"))
    try:
        seconds = hosts.wait_all(leave(hosts, 1, "raise"))
        print(f"torchrun, reduce, rank 1 raise: the job ended {seconds:.2f} s after it left", file=sys.stderr)
        check_the_others_stopped(hosts, 1, "raise", seconds, launcher="torchrun")
    finally:
        hosts.close()


def test_multihost_normal_end_exits_0_everywhere(tmp_path):
    """Reductions and gossip messages each step (one launch for both kinds of job)."""
    hosts = Hosts(tmp_path, "reduce+gossip", env={"STEPS_0": "20", "STEPS_1": "20"})
    try:
        hosts.wait_all(time.monotonic(), timeout=START_BOUND)
        assert [p.returncode for p in hosts.procs] == [0, 0], hosts.report()
        assert all("DONE 20" in hosts.output(r) for r in range(2)), hosts.report()
    finally:
        hosts.close()
