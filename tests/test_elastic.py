"""BPS_GC_ELASTIC: a worker host killed half-way through a round (SIGKILL) leaves the job,
which goes on with the survivors, each round whole (docs/elastic.md).

One job (one bpslaunch per role, 3 worker hosts, 2 servers) pushes onebit+EF+nesterov with
the servers' recompress (server error feedback: the reducer has state), a dense tensor, both
split over both servers, and a onebit tensor with error feedback; worker 2 pushes the first
tensor of step PAUSE_AT, then is killed: the servers sum those rounds again without it (REDO),
their recompress state rolled back to before the round. The survivors must finish every step without a restart, pull
bit-identical results, equal to a numpy recomputation (reference.py's codec chains) of the
membership sequence every node logged, and see bps.size() change at that round only."""
import os
import re
import signal
import time

import numpy as np

from elastic_host_events import BOUND, JOIN_STARTS, REDO_TIMEOUT, START_BOUND, death_during_redo, joiner_dies, \
    printed_by_both, two_deaths_in_one_change
from elastic_jobs import LINE, host_command, membership, start_job, two_tensors
import pytest
from reference import gradient, partitions, step_ctx

from bps_gc.algorithms.entire_model import chunk_bounds
from bps_gc.comm.host_sum import add_in_order
from bps_gc.compress import CompressionParams, build_chain
from bps_gc.compress.entire_model import WholeVectorCodec

ENTIRE = {"name": "em", "shape": [1500], "dtype": "float32",
          "params": {"compressor": "topk", "k": 0.1, "ef": "vanilla"}}
STEPS, PAUSE_AT, VICTIM = 7, 3, 2
SPEC = {
    "steps": STEPS, "pause_at": PAUSE_AT, "victim": VICTIM,
    "lrs": [0.1] * STEPS, "partition_bytes": 4096, "min_compress_bytes": 0,
    "tensors": [{"name": "recompress", "shape": [3000], "dtype": "float32",
                 "params": {"compressor": "onebit", "scaling": True, "ef": "vanilla",
                            "momentum": "nesterov", "mu": 0.9}},
                *two_tensors(3000, 1500)],
}


def expected(spec, sequence, ranks, local_size=1):
    """{'name/step': array}: what every member pulls, the members of each step given by
    ``sequence`` ([(first step, members)]); every pusher's codec chain compresses each step it
    pushes (its error feedback runs on; a pusher that joins again starts from zero), the
    server's once per step. ``local_size`` > 1: two levels, a host's ranks summed in local-rank
    order and pushed once (the pushers are hosts)."""
    out = {}
    for index, t in enumerate(spec["tensors"]):
        params = CompressionParams.from_dict(t.get("params", {}))
        n = int(np.prod(t["shape"]))
        parts = partitions(n, np.float32, spec["partition_bytes"])
        pushers = sorted({r // local_size for r in ranks})
        chains = {p: ({h: build_chain(params, b - a, np.float32, key=index << 16 | p, role="worker") for h in pushers},
                      build_chain(params, b - a, np.float32, key=index << 16 | p, role="server"))
                  for p, a, b in parts} if params.compressed else {}
        before = set(pushers)
        for step in range(spec["steps"]):
            members = [m for first, m in sequence if first <= step][-1]
            ctx = step_ctx(spec, step)
            ranks_of = {}
            for r in members:
                ranks_of.setdefault(r // local_size, []).append(gradient(r, step, t).reshape(-1))
            x = {h: add_in_order(inputs, np.empty(n, np.float32)) for h, inputs in ranks_of.items()}
            hosts = sorted(x)
            for h in set(hosts) - before:  # joined again: its codec chains were just built
                for p, a, b in parts if params.compressed else ():
                    chains[p][0][h] = build_chain(params, b - a, np.float32, key=index << 16 | p, role="worker")
            before = set(hosts)
            result = np.empty(n, np.float32)
            for p, a, b in parts:
                if params.compressed:
                    workers, server = chains[p]
                    acc = np.zeros(b - a, np.float32)
                    for h in hosts:
                        acc += workers[h].decompress(workers[h].compress(x[h][a:b], ctx))
                    acc = server.decompress(server.compress(acc, ctx))
                else:  # raw pushes: the first copied, the others added, in rank (host) order
                    acc = x[hosts[0]][a:b].copy()
                    for h in hosts[1:]:
                        acc += x[h][a:b]
                result[a:b] = acc / np.float32(len(members))
            out[f"{t['name']}/{step}"] = result
    return out


def entire_expected(spec, sequence, ranks):
    """{'name/step': array} of the spec's ``entire`` vector (granularity 'entiremodel'): every
    member rank compresses its whole gradient with its own chain (error feedback from zero
    where it joins again), the servers add the decodings to zeros in rank order (lossless),
    the mean divides by the member ranks."""
    t = spec["entire"]
    params = CompressionParams.from_dict(dict(t["params"], granularity="entiremodel"))
    n = int(np.prod(t["shape"]))
    bounds = chunk_bounds(n, 4, spec["partition_bytes"])

    def codec():  # the first EntireModel of a process: its vector's key is group 0's
        return WholeVectorCodec(params, n, np.dtype(np.float32), bounds, key=1 << 63)
    codecs, before, out = {r: codec() for r in ranks}, set(ranks), {}
    for step in range(spec["steps"]):
        members = [m for first, m in sequence if first <= step][-1]
        for r in set(members) - before:
            codecs[r] = codec()
        before = set(members)
        ctx = step_ctx(spec, step)
        acc = np.zeros(n, np.float32)
        for r in members:
            acc += codecs[r].decoder.decompress(codecs[r].chain.compress(gradient(r, step, t).reshape(-1), ctx))
        out[f"{t['name']}/{step}"] = acc / np.float32(len(members))
    return out


def test_worker_killed_mid_round_leaves_and_the_rest_go_on(tmp_path):
    servers_say = {"BYTEPS_LOG_LEVEL": "INFO"}  # which rounds they sum again
    job = start_job("elastic_job.py", SPEC, tmp_path, servers=2, role_env={"server0": servers_say, "server1": servers_say})
    job.wait_output([f"worker{VICTIM}"], "HALF", START_BOUND)
    job.wait_output([f"worker{r}" for r in range(3) if r != VICTIM], f"PUSHED {PAUSE_AT}", START_BOUND)
    time.sleep(1.0)  # the first tensor's rounds of that step complete with the victim's pushes
    os.kill(job.child_of(f"worker{VICTIM}"), signal.SIGKILL)
    statuses, _ = job.wait_all(BOUND)
    report = job.report(statuses)
    survivors = [r for r in range(3) if r != VICTIM]
    assert all(statuses[f"worker{r}"] == 0 for r in survivors), report
    assert statuses["scheduler"] == 0 and statuses["server0"] == 0 and statuses["server1"] == 0, report
    assert statuses[f"worker{VICTIM}"] != 0, report
    # one line per change on every node, alike
    logged = {name: membership(job.text(name)) for name in ["scheduler", "server0", "server1"] +
              [f"worker{r}" for r in survivors]}
    sequence = logged["worker0"]
    assert len(sequence) == 1 and sequence[0][0] == 1 and sequence[0][2] == survivors, report
    assert all(seq == sequence for seq in logged.values()), logged
    assert f"worker {VICTIM} left" in job.text("scheduler"), report
    # the recompress rounds it pushed were summed with it, then again without it
    again = job.text("server0") + job.text("server1")
    assert f"round {PAUSE_AT} is summed again over epoch 1's members" in again, report
    assert any(f"key {p}: round {PAUSE_AT} is summed again" in again for p in range(3)), report  # recompress's
    first = sequence[0][1]
    assert first == PAUSE_AT, report  # the dead host's half round counts none of its pushes
    pulled = {r: np.load(tmp_path / f"rank{r}.npz") for r in survivors}
    want = expected(SPEC, [(0, [0, 1, 2]), (first, sequence[0][2])], range(3))
    for r in survivors:
        assert list(pulled[r]["sizes"]) == [3] * first + [2] * (STEPS - first)
        for name, value in want.items():
            assert pulled[r][name].tobytes() == pulled[survivors[0]][name].tobytes(), (r, name)
            np.testing.assert_array_equal(pulled[r][name], value, err_msg=f"rank {r} {name}")


def test_fewer_workers_than_the_minimum_stop_the_job_naming_the_count(tmp_path):
    """Also: thc and PowerSGD, declared by the same job, are refused (docs/elastic.md)."""
    two_phase = [{"name": c, "shape": [4096], "dtype": "float32", "params": dict(compressor=c, **extra)}
                 for c, extra in (("thc", {}), ("powersgd", {"rank": 1}))]
    spec = dict(SPEC, steps=1000, pause_at=2, victim=1, tensors=SPEC["tensors"][1:2], refused=two_phase)
    job = start_job("elastic_job.py", spec, tmp_path, workers=2, env={"BPS_GC_MIN_WORKERS": "2"})
    job.wait_output(["worker1"], "HALF", START_BOUND)
    os.kill(job.child_of("worker1"), signal.SIGKILL)
    statuses, _ = job.wait_all(BOUND)
    report = job.report(statuses)
    named = "1 worker host left after worker 1 died, fewer than BPS_GC_MIN_WORKERS=2"
    assert all(status != 0 for status in statuses.values()), report
    for name in ("scheduler", "server0", "worker0"):
        assert named in job.text(name), report
    assert "Traceback" not in job.text("worker0"), report
    for reducer in ("thc", "powersgd"):  # summed in phases: refused at declaration, in one line
        assert f"REFUSED '{reducer}': reducer '{reducer}' sums in phases, which BPS_GC_ELASTIC does not cover yet" \
            in job.text("worker0"), report


@pytest.mark.parametrize("hierarchy", ["auto", "host"])
def test_a_worker_hosts_local_rank_dies_and_the_host_leaves(tmp_path, hierarchy):
    """4 worker hosts x 2 local ranks (one bpslaunch per host, NVIDIA_VISIBLE_DEVICES=0,1),
    each rank pushing for itself (auto: flat, what BPS_GC_ELASTIC runs with local ranks) or two
    levels (host: 5 hosts; the host's ranks sum in shared memory, each partition's owner pushes).
    First local rank 1 of host 1 (worker 3) pushes the first tensor of step PAUSE_AT and is
    killed (SIGKILL) between keys: its launcher stops its mate at once, naming it; one epoch
    drops both ranks and the servers sum the first tensor's rounds again without them (REDO).
    Two levels: it pushes every tensor but a one-partition one its host's local rank 1 owns, so
    on the others local rank 0 holds every reply of the step (summed with host 1) and rank 1
    does not: rank 0 must not hand the step out alone (elastic.py's HELD notes); host 4 dies
    during the REDO (``death_during_redo``), so the step is summed again without it too; a
    vector reduced as one ('entiremodel', every rank pushes it) is pushed by the victim too.
    Host 1 started again: two levels, first with its local rank 1 killed once the members
    pledged (the join cancelled, the members told, the job going on), then refused in one line
    with BPS_GC_HIERARCHY=flat; both: admitted and killed in its first round (``joiner_dies``;
    members wait at a gate until the join started); then flat, with another
    BYTEPS_PARTITION_BYTES, it is refused in one line naming both, and two levels, with the
    job's settings, it joins as a unit. Then local rank 1 of host 3 (worker 7) goes silent
    (SIGSTOP): flat, before step STALL_AT; two levels, during its pull: its host pushed every
    tensor of STALL_AT and the others pulled them. Its launcher sees nothing, so the scheduler
    tells its mate, which stops naming it. Then local rank 1 of host 2 (worker 5) goes silent
    before its host pushes anything of that step (two levels: the next), before host 3's epoch
    is committed (``two_deaths_in_one_change``): one change drops both (flat: host 0 remains). The
    live ranks pull bit-identical results equal to the numpy oracle of the logged membership
    sequence."""
    join_at, rejoin_at, two_levels = 4, 6, hierarchy == "host"
    stall_at, n_steps = (7, 9) if two_levels else (5, STEPS)
    hosts = 5 if two_levels else 4
    gates = {str(s): str(tmp_path / f"gate{s}") for s in ((join_at, rejoin_at) if two_levels else (join_at,))}
    spec = dict(SPEC, victim=3, stall_rank=7, stall_at=stall_at, steps=n_steps, lrs=[0.1] * n_steps, gates=gates,
                silent_rank=5, silent_at=stall_at + two_levels, pushed_at=[PAUSE_AT, join_at])
    if two_levels:
        # owners (i + p) mod 2: local rank 1 owns all of tensor 1 (one partition), rank 0 owns
        # nothing the victim's host does not push
        tensors = [SPEC["tensors"][0], dict(SPEC["tensors"][1], name="small", shape=[1000]), *SPEC["tensors"][2:],
                   SPEC["tensors"][1]]
        spec.update(stall_after_push=True, tensors=tensors, half=[0, 2, 3, "entire"], entire=ENTIRE)
    servers_say = {"BYTEPS_LOG_LEVEL": "INFO"}  # and the scheduler's: the reports, the joins' starts
    two = {"NVIDIA_VISIBLE_DEVICES": "0,1", "BPS_GC_HIERARCHY": hierarchy}
    job = start_job("elastic_job.py", spec, tmp_path, workers=hosts, servers=2,
                    env={"BPS_GC_HEARTBEAT_TIMEOUT": str(REDO_TIMEOUT)},
                    role_env={"server0": servers_say, "server1": servers_say, "scheduler": servers_say,
                              **{f"worker{h}": two for h in range(hosts)}})
    job.wait_output(["worker1"], "HALF", START_BOUND)
    printed_by_both(job, [f"worker{h}" for h in range(hosts) if h != 1], "PUSHED", START_BOUND)  # at step PAUSE_AT
    time.sleep(1.0)  # the first tensor's rounds of that step complete with the victim's pushes
    if two_levels:  # found before the kill: the next steps are timed
        held, late = job.local_rank_of("worker3", 1), [job.local_rank_of("worker4", r) for r in (0, 1)]
    os.kill(job.local_rank_of("worker1", 1), signal.SIGKILL)
    killed = time.monotonic()
    if two_levels:
        death_during_redo(job, killed, held, late)
    host_status = job.launchers["worker1"].wait(timeout=10)
    host_stopped = time.monotonic() - killed
    first_text = job.text("worker1")
    # host 1 started again: refused in one line (flat), or joins (two levels); the job goes on
    job.wait_output(["worker0"], "membership: worker 8, 9 left" if two_levels else "membership: worker 2, 3 left", BOUND)
    if two_levels and [m for _, _, m in membership(job.text("scheduler"))] != [[0, 1, *range(4, 10)], [0, 1, 4, 5, 6, 7]]:
        job.kill_all()  # worker 7 stopped too late, or too long: the box too slow for the timing
        raise AssertionError(f"not host 1's epoch, then host 4's:\n{job.report()}")
    setting = {} if two_levels else {"BYTEPS_PARTITION_BYTES": "8192"}
    host1 = dict(job.base, DMLC_ROLE="worker", DMLC_WORKER_ID="1")
    command = host_command("elastic_job.py", tmp_path / "spec.json", tmp_path)
    if two_levels:  # a join cancelled: its local rank 1 killed once the members pledged (they wait at the gate)
        job.launch("half1", command, dict(host1, **two))
        job.wait_output(["scheduler"], JOIN_STARTS, BOUND)
        os.kill(job.local_rank_of("half1", 1), signal.SIGKILL)
        job.launchers["half1"].wait(timeout=BOUND)
        job.wait_output(["worker0"], "did not join: it left", BOUND)
        # then another BPS_GC_HIERARCHY: refused in one line
        job.launch("flat1", command, dict(host1, **dict(two, BPS_GC_HIERARCHY="flat")))
        job.wait_output(["flat1"], "cannot join the running job", BOUND)
        job.launchers["flat1"].wait(timeout=BOUND)
    joiner_dies(job, host1, two, spec, tmp_path, starts=1 + two_levels)  # two levels: the cancelled join's first
    job.launch("worker1", command, dict(host1, **setting, **two))
    if two_levels:
        printed_by_both(job, ["scheduler"], JOIN_STARTS, BOUND, times=3)  # the members pledged REJOIN_AT
        (tmp_path / f"gate{rejoin_at}").touch()
    else:
        job.wait_output(["worker1"], "cannot join the running job", BOUND)
    job.wait_output(["worker3"], "STALL", BOUND)
    if two_levels:  # the others have step STALL_AT's results, summed with host 3's pushes
        printed_by_both(job, ["worker0", "worker1", "worker2"], "PULLED", BOUND)  # at STALL_AT
    # found before the stop: the next steps are timed
    job.wait_output(["worker2"], "SILENT", BOUND)  # its host pushes nothing of that (two levels: the next) step
    second, held = job.local_rank_of("worker2", 1), job.local_rank_of("worker0", 1)
    os.kill(job.local_rank_of("worker3", 1), signal.SIGSTOP)
    two_deaths_in_one_change(job, time.monotonic(), second, held)  # then host 2, before host 3's commit
    statuses, _ = job.wait_all(BOUND, since=time.monotonic())  # each step above was bounded: the end within BOUND
    report = job.report(statuses)
    assert host_status != 0 and host_stopped < 5, (host_stopped, report)  # SIGTERM to the mate, no grace
    assert "bpslaunch: local rank 1 (worker 3) exited with status 137; stopping the others" in first_text, report
    scheduler = job.text("scheduler")
    # whichever rank registers first
    refused = r"the scheduler refused this worker: worker [23] at 127.0.0.1 cannot join the running job: it has "
    if two_levels:
        refused += r"BPS_GC_HIERARCHY=flat, the job host"
        assert re.search(refused, job.text("flat1")) and statuses["flat1"] != 0, report
        assert "Traceback" not in job.text("flat1"), report
        half = job.text("half1")  # the cancelled join
        assert "bpslaunch: local rank 1 (worker 3) exited with status 137; stopping the others" in half, report
        assert statuses["half1"] != 0 and "Traceback" not in half, report
        assert re.search(r"worker [23] left before it was admitted \(.*\); the job goes on", scheduler), report
        # every member, pledged and waiting, told the join is off (each host's launcher prints both ranks')
        assert all(len(re.findall(r"membership: worker \[2, 3\] did not join: it left", job.text(f"worker{h}"))) == 2
                   for h in (0, 2, 3)), report
        assert statuses["worker4"] != 0 and "Traceback" not in job.text("worker4"), report
    else:
        refused += r"BYTEPS_PARTITION_BYTES=8192, the job BYTEPS_PARTITION_BYTES=4096"
        assert re.search(refused, job.text("worker1")) and statuses["worker1"] != 0, report
    assert "Traceback" not in job.text("worker1"), report
    died = job.text("die1")  # admitted, then dead in its first round
    assert "bpslaunch: local rank 1 (worker 3) exited with status 137; stopping the others" in died, report
    assert statuses["die1"] != 0 and f"membership: worker 2, 3 joined; epoch {2 + two_levels}" in died, report
    assert "worker 7, a local rank of this worker host, left the job (no heartbeat); the host leaves with it, " \
           "and worker 6 stops" in job.text("worker3"), report
    assert "bpslaunch: local rank 0 (worker 6) exited with status 1; stopping the others" in job.text("worker3"), report
    assert statuses["worker3"] != 0, report
    assert "Traceback" not in first_text + job.text("worker3"), report
    assert not [name for name in job.launchers if "Traceback" in job.text(name)], report  # no node, none
    assert "worker 5, a local rank of this worker host, left the job (no heartbeat); the host leaves with it, " \
           "and worker 4 stops" in job.text("worker2") and statuses["worker2"] != 0, report
    alive = ("scheduler", "server0", "server1", "worker0") + (("worker1",) if two_levels else ())
    assert all(statuses[name] == 0 for name in alive), report
    everyone = list(range(2 * hosts))
    between = [r for r in everyone if r not in (2, 3)]
    after = [0, 1, 2, 3] if two_levels else [0, 1]
    logged = {name: LINE.findall(job.text(name)) for name in alive}  # who, left/joined, epoch, group, members
    sequence = membership(job.text("scheduler"))
    # two levels: host 4 leaves; host 1 joins and dies in its first round (index dies: the join), joins again (joined)
    dies, joined = (2, 4) if two_levels else (1, None)
    without, up = [0, 1, 4, 5, 6, 7], ("2, 3", "joined")
    # hosts 2 and 3 leave in one change: the epoch prepared for the first, superseded
    changes = [(1, between), (2, without), (3, list(range(8))), (4, without), (5, list(range(8))),
               (7, after)] if two_levels else [(1, between), (2, list(range(8))), (3, without), (5, after)]
    who = [("2, 3", "left"), ("8, 9", "left"), up, ("2, 3", "left"), up, ("4, 5, 6, 7", "left")] if two_levels else \
        [("2, 3", "left"), up, ("2, 3", "left"), ("4, 5, 6, 7", "left")]
    assert [(e, m) for e, _, m in sequence] == changes and [w[:2] for w in logged["scheduler"]] == who, report
    # a host's launcher prints both its ranks' lines, one rank's after the other's; a joiner's from its join on
    assert all(sorted(seq) == sorted(logged["scheduler"][joined if name == "worker1" else 0:] *
                                      (2 if name.startswith("worker") else 1)) for name, seq in logged.items()), logged
    # host 1's two heartbeats stop together (its launcher stopped the mate): either may be named first
    assert re.search(r"worker ([23]) \(node .* left: no heartbeat.*\n.*worker (?!\1)[23] leaves with it: local ranks "
                     r"of the same worker host", scheduler), report
    assert re.search(r"worker 7 \(node .* left: no heartbeat.*\n.*worker 6 leaves with it", scheduler), report
    assert "membership: worker 2, 3 left; epoch 1" in job.text("worker0"), report
    again = job.text("server0") + job.text("server1")
    assert f"round {PAUSE_AT} is summed again over epoch 1's members" in again, report
    firsts = [first for _, first, _ in sequence]
    # two levels: host 3 took part in all of step STALL_AT (every other host handed it out)
    assert firsts[0] == PAUSE_AT and firsts[-1] == stall_at + two_levels, report
    assert firsts[dies] == join_at, report  # the members pledged, waiting at the gate
    # the joiner died in its first round: no host handed it out, its rounds summed without it
    assert firsts[dies + 1] == join_at and f"round {join_at} is summed again over epoch {dies + 2}'s members" in again, \
        report
    if two_levels:
        # host 4 died during the REDO: its REDOs never came, the step is summed again without it
        assert firsts[1] == PAUSE_AT and f"round {PAUSE_AT} is summed again over epoch 2's members" in again, report
        assert firsts[joined] == rejoin_at, report
    steps = [(0, everyone)] + [(first, members) for _, first, members in sequence]
    want = expected(spec, steps, everyone, local_size=2 if two_levels else 1)
    if two_levels:
        want.update(entire_expected(spec, steps, everyone))
    pulled = {r: np.load(tmp_path / f"rank{r}.npz") for r in after}
    for r in after:
        start = firsts[joined] if r in (2, 3) and two_levels else 0  # the joiners'
        sizes = [len([m for first, m in steps if first <= s][-1]) for s in range(start, n_steps)]
        assert list(pulled[r]["sizes"]) == sizes, (r, report)
        for name, value in want.items():
            if int(name.split("/")[1]) < start:
                continue
            assert pulled[r][name].tobytes() == pulled[0][name].tobytes(), (r, name)
            np.testing.assert_array_equal(pulled[r][name], value, err_msg=f"rank {r} {name}")
