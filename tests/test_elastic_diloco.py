"""BPS_GC_ELASTIC with DiLoCo (docs/elastic.md; docs/diloco.md). One job (3
worker hosts, 1 server, one bpslaunch per role) trains the small MLP of test_diloco.py at H = 4,
every element of the weights' pseudo-gradients sent exactly (threshold 0), the biases
uncompressed (BYTEPS_MIN_COMPRESS_BYTES=256), first with the outer step on the servers (the
biases': the workers', as for any tensor sent uncompressed). Worker 2 is SIGKILLed in the middle
of an H window (before pushing that round); the survivors go on. Then a fresh host with its
DMLC_WORKER_ID joins through DiLoCo.elastic_start(): it takes the global copy from a live
worker, and after its first outer round its global copy is the others' bit for bit. At every
outer round, every live host's global copy equals a numpy recomputation of the servers' outer
SGD (lr 0.7, momentum 0.9, Nesterov) over the mean of the pseudo-gradients of the members that
pushed that round (recorded by each worker; the biases: torch's SGD, the joiner's momentum of
them from a live worker), bit for bit, and so does the copy each pulls from the servers at the
end. In the same job the live hosts then train a fresh model with the outer step on the
workers, 2 fragments, delay 1 and a warm phase of 10 steps (check_the_workers_phase): the joiner
dies in the warm phase, and another fresh host joins inside it (the survivors wait for the join
at a step: by construction), taking the global copies and the step count from a live worker;
the same checks, per exchange, against torch's SGD recomputed in numpy, the warm exchanges and
the H-step windows after them (one joiner process more, ~2.4 s CPU).

A second launch runs a host's local ranks as one replica (``replicate="hosts"``), the servers'
outer step then the workers': see
test_a_host_of_local_ranks_as_one_replica_dies_and_a_fresh_one_joins_servers_then_workers."""
import glob
import json
import os
import signal
import time

import numpy as np

from elastic_host_events import JOIN_STARTS, printed_by_both
from elastic_jobs import host_command, membership, start_job
from test_diloco import build_model

BOUND = 90.0
VICTIM = 2
SPEC = {"sync_every": 4, "max_rounds": 400, "victim": VICTIM, "kill_at": 6, "sleep": 0.05, "join_epoch": 2,
        "after_join": 2, "compression_params": {"compressor": "threshold", "threshold": 0.0}, "parameters": True,
        "workers_phase": {"sync_every": 3, "fragments": 2, "delay": 1, "kill_at": 5, "join_epoch": 4, "pause_at": 2,
                          "warm_steps": 10, "warm_every": 2, "gate_at": 7, "after_join": 4}}


SAYS_JOINS = {"scheduler": {"BYTEPS_LOG_LEVEL": "INFO"}}  # its INFO line: a join's first round group
UNCOMPRESSED = ("0.bias", "2.bias")  # below BYTEPS_MIN_COMPRESS_BYTES=256: their outer step is the workers'


def outer_sgd(hosts, last, tag="", on_workers=(), warm=()):
    """[global copy after each round] in numpy, float32, on the mean over the hosts that pushed
    each round (summed in rank order, divided by their count; the rounds ``warm``: copy - mean,
    the momentum untouched, as DiLoCo's warm phase on the workers): the servers' outer SGD (lr 0.7,
    momentum 0.9, Nesterov: compress/outer.py), or for the parameters ``on_workers`` torch's. Its
    CPU kernels take ``a.add(b, alpha=s)`` as one fused multiply-add (one rounding): so here, the
    exact float64 product and sum rounded once to float32; its momentum starts as the first mean."""
    f = np.float32

    def fused(a, s, b):
        return (a.astype(np.float64) + np.float64(f(s)) * b.astype(np.float64)).astype(f)

    copies = {n: p.detach().numpy().copy() for n, p in build_model().named_parameters()}
    momentum = {n: np.zeros_like(v) for n, v in copies.items() if n not in on_workers}
    out = []
    for rnd in range(last + 1):  # exchange rnd: one fragment's parameters (those pushed)
        pushed = [h for _, h in sorted(hosts.items()) if f"{tag}size/{rnd}" in h]
        for name in [n for n in copies if f"{tag}pseudo/{rnd}/{n}" in pushed[0]]:
            total = pushed[0][f"{tag}pseudo/{rnd}/{name}"]
            for h in pushed[1:]:
                total = total + h[f"{tag}pseudo/{rnd}/{name}"]
            mean = total / f(len(pushed))
            if rnd in warm:
                copies[name] = copies[name] - mean
            elif name in on_workers:
                momentum[name] = mean.copy() if name not in momentum else fused(momentum[name] * f(0.9), 1.0, mean)
                copies[name] = fused(copies[name], -0.7, fused(mean, 0.9, momentum[name]))
            else:
                momentum[name] = momentum[name] * f(0.9) + mean
                copies[name] = copies[name] + -(f(0.7) * (mean + f(0.9) * momentum[name]))
        out.append({n: c.copy() for n, c in copies.items()})
    return out


def test_diloco_survives_deaths_and_joiners_take_the_global_copy_on_the_servers_and_on_the_workers(tmp_path):
    spec = dict(SPEC, workers_phase=dict(SPEC["workers_phase"], gate=str(tmp_path / "gate")))
    job = start_job("elastic_diloco_job.py", spec, tmp_path, env={"BYTEPS_MIN_COMPRESS_BYTES": "256"},
                    role_env=SAYS_JOINS)
    try:
        job.wait_output([f"worker{VICTIM}"], "HALF", BOUND)
        os.kill(job.child_of(f"worker{VICTIM}"), signal.SIGKILL)
        job.wait_output(["worker0", "worker1"], f"worker {VICTIM} left; epoch 1", BOUND)
        job.launch("joiner", host_command("elastic_diloco_job.py", tmp_path / "spec.json", tmp_path),
                   dict(job.base, DMLC_ROLE="worker", DMLC_WORKER_ID=str(VICTIM)))
        job.wait_output(["joiner"], "HALF", BOUND)  # the workers' phase: the joiner dies in its turn
        os.kill(job.child_of("joiner"), signal.SIGKILL)
        job.wait_output(["worker0", "worker1"], f"worker {VICTIM} left; epoch 3", BOUND)
        (tmp_path / "spec2.json").write_text(json.dumps(dict(spec, workers_joiner=True)))
        job.launch("joiner2", host_command("elastic_diloco_job.py", tmp_path / "spec2.json", tmp_path),
                   dict(job.base, DMLC_ROLE="worker", DMLC_WORKER_ID=str(VICTIM)))
        # the survivors idle after inner step gate_at: they pledged the next warm step's group
        printed_by_both(job, ["scheduler"], f"the join of worker {VICTIM} starts at round group", BOUND)
        (tmp_path / "gate").touch()
        statuses, _ = job.wait_all(BOUND, since=time.monotonic())  # each step above was bounded: the end within BOUND
    finally:
        job.kill_all()
    report = job.report(statuses)
    for name in ("scheduler", "server0", "worker0", "worker1", "joiner2"):
        assert statuses[name] == 0 and "Traceback" not in job.text(name), report
    sequence = membership(job.text("worker0"))
    assert [(e, m) for e, _, m in sequence] == [(1, [0, 1]), (2, [0, 1, 2]), (3, [0, 1]), (4, [0, 1, 2])], sequence
    assert membership(job.text("server0")) == sequence and membership(job.text("joiner")) == sequence[1:2]
    assert membership(job.text("joiner2")) == sequence[3:]
    (_, left_at, _), (_, joined_at, _) = sequence[:2]
    assert left_at == 1, sequence
    hosts, last = phase_hosts(tmp_path, "victim", str(joined_at), left_at, joined_at)
    oracle = outer_sgd(hosts, last, on_workers=UNCOMPRESSED)
    check_global_copies(hosts, oracle, left_at, joined_at)
    for k in ("0", "1", "2 (joined)"):  # the servers' copy at the end (of the parameters they hold)
        assert sorted(n[len("pulled/"):] for n in hosts[k] if n.startswith("pulled/")) == ["0.weight", "2.weight"]
        for name in ("0.weight", "2.weight"):
            assert hosts[k][f"pulled/{name}"].tobytes() == oracle[-1][name].reshape(-1).tobytes(), (k, name)
    assert not np.array_equal(oracle[-1]["0.weight"], oracle[0]["0.weight"])
    assert not np.array_equal(oracle[-1]["0.bias"], oracle[0]["0.bias"])
    check_the_workers_phase(tmp_path, sequence, last + 1)


def check_global_copies(hosts, oracle, left_at, joined_at, prefix=""):
    """Every live host's global copy after each exchange (its fragment's parameters) equals the
    oracle's bit for bit: the three hosts, the two survivors, then with the joiner's first on
    (and the joiner's of an exchange in flight at its join, applied once it joined)."""
    for rnd, want in enumerate(oracle):
        live = [k for k, h in hosts.items() if f"{prefix}size/{rnd}" in h]
        names = [n for n in want if f"{prefix}global/{rnd}/{n}" in hosts[live[0]]]
        assert len(live) == (3 if rnd < left_at or rnd >= joined_at else 2) and names, (rnd, live)
        for name in names:
            key = f"{prefix}global/{rnd}/{name}"
            for k in [k for k, h in hosts.items() if key in h]:
                assert hosts[k][key].tobytes() == want[name].tobytes(), (prefix, rnd, k, name)


def phase_hosts(tmp_path, died, joined, left_at, joined_at, prefix="", fragments=1, after_join=SPEC["after_join"]):
    """A phase's saved hosts (the victim's file ``rank<VICTIM>.<died>``, the joiner's
    ``rank<VICTIM>.<joined>``) and its last exchange, checking who pushed each exchange: the
    three hosts, then the two survivors, then with the joiner."""
    hosts = {"0": np.load(tmp_path / "rank0.0.npz"), "1": np.load(tmp_path / "rank1.0.npz"),
             "2 (died)": np.load(tmp_path / f"rank{VICTIM}.{died}.npz"),
             "2 (joined)": np.load(tmp_path / f"rank{VICTIM}.{joined}.npz")}
    hosts = {k: dict(h) for k, h in hosts.items()}
    assert int(hosts["2 (joined)"][f"{prefix}start"]) == joined_at > left_at >= 1
    last = joined_at + after_join * fragments - 1
    for rnd in range(last + 1):
        pushed = sorted(k for k, h in hosts.items() if f"{prefix}size/{rnd}" in h)
        want = ["0", "1", "2 (died)"] if rnd < left_at else ["0", "1"] if rnd < joined_at else ["0", "1", "2 (joined)"]
        assert pushed == want, (rnd, pushed)
    return hosts, last


def check_the_workers_phase(tmp_path, sequence, groups_before):
    """The same job's second phase, the outer step on the workers, H = 3, 2 fragments, a warm
    phase of 10 steps (H0 = 2: both fragments' exchanges after inner steps 2, 4, ..., 10, each
    step's one round group; then 11 (fragment 0), 13 (1), 14 (0), 16 (1), ...), each applied 1
    inner step later. The first joiner dies at inner step 5 (its 2 warm steps done; the
    survivors' third, at 6, waits for the death's commit); the survivors idle after step 7 until
    the second joiner's join started (the scheduler's log), so it joins at the warm step 8 (its
    exchanges 6 and 7) by construction, with nothing in flight (step 6's were applied at 7),
    taking the global copies and the step count from a live worker, and the phase runs on past
    the warm phase, 2 windows of each fragment with outer momentum: every live host's global copy
    after every exchange bit-identical and equal to the numpy plain averaging (warm), then outer
    SGD of each fragment over the members' mean; the joiner's model after each outer step the others'."""
    phase = SPEC["workers_phase"]
    warm = phase["warm_steps"] // phase["warm_every"]  # warm steps: 2 exchanges, one group each

    def exchange(group):
        return 2 * (group - groups_before) if group - groups_before < warm else group - groups_before + warm
    left_at, joined_at = exchange(sequence[2][1]), exchange(sequence[3][1])
    assert (left_at, joined_at) == (4, 6) and joined_at < 2 * warm, (sequence, groups_before)  # inside the warm phase
    assert os.path.exists(tmp_path / f"rank{VICTIM}.w{joined_at}.npz"), sorted(os.listdir(tmp_path))  # its start
    hosts, last = phase_hosts(tmp_path, str(sequence[1][1]), f"w{joined_at}", left_at, joined_at, "w/", 2,
                              phase["after_join"])
    assert last >= 2 * warm + 3, last  # each fragment's outer step twice after the warm phase
    oracle = outer_sgd(hosts, last, "w/", on_workers=tuple(n for n, _ in build_model().named_parameters()),
                       warm=range(2 * warm))
    check_global_copies(hosts, oracle, left_at, joined_at, "w/")
    assert hosts["2 (joined)"]["w/landed"].size == 0, hosts["2 (joined)"]["w/landed"]
    assert {n for n in hosts["0"] if n.startswith(f"w/pseudo/{joined_at}/")} != \
        {n for n in hosts["0"] if n.startswith(f"w/pseudo/{joined_at + 1}/")}  # two fragments, one group
    params = [k for k in hosts["2 (joined)"] if k.startswith("w/param/") and int(k.split("/")[2]) <= last]
    assert any(k.startswith(f"w/param/{last}/") for k in params), params
    for key in params:
        assert hosts["2 (joined)"][key].tobytes() == hosts["0"][key].tobytes() == hosts["1"][key].tobytes(), key
    assert not np.array_equal(oracle[-1]["0.weight"], oracle[2 * warm - 1]["0.weight"])


HOSTS_SPEC = {"sync_every": 3, "fragments": 2, "delay": 1, "replicate": "hosts", "outer_step": "servers",
              "max_rounds": 400, "victim": 1, "kill_at": 5, "sleep": 0.05, "pause_at": 0, "join_epoch": 2,
              "after_join": 2, "parameters": True,
              "compression_params": {"compressor": "threshold", "threshold": 0.0},
              "workers_phase": {"sync_every": 3, "fragments": 2, "delay": 1, "kill_at": 5, "join_epoch": 4,
                                "gate_at": 6}}
TWO_RANKS = {"NVIDIA_VISIBLE_DEVICES": "0,1"}


def test_a_host_of_local_ranks_as_one_replica_dies_and_a_fresh_one_joins_servers_then_workers(tmp_path):
    """DiLoCo(replicate="hosts") under BPS_GC_ELASTIC: 2 worker hosts x 2 local ranks, 1 server,
    H = 3, 2 fragments, delay 1; each host's ranks step on the host's batches (identical
    replicas). First the servers' outer step (the parts below BYTEPS_MIN_COMPRESS_BYTES=256: the
    workers', with their momentum): host 1's local rank 1 is SIGKILLed mid-window (its launcher
    stops rank 0); host 0 goes on alone, then a fresh host 1 (both ranks) joins, each rank taking
    the global copies, outer momentum, exchange in flight and step count from its counterpart on
    host 0. Then, in the same job, a fresh model with the workers' outer step (every parameter's
    outer step and momentum theirs): the joined host dies the same way at inner step 5, host 0
    idles after step 6 until the next fresh host's join started, so that host joins at fragment
    0's exchange at step 7 (by construction), fragment 1's in flight. In each phase every rank's
    global copy after every exchange equals the numpy outer SGD over the mean of the hosts that
    pushed it (each host's pseudo-gradient the same bits on its two ranks), bit for bit: the
    joiner's from the exchange in flight at its join on, its model's parameters then the
    others'; and so does the servers' copy each rank pulls at the end of the first."""
    spec = dict(HOSTS_SPEC, gate=str(tmp_path / "gate"),  # host 0 idles from the death until the joiner is made
                workers_phase=dict(HOSTS_SPEC["workers_phase"], gate=str(tmp_path / "gate2")))
    job = start_job("elastic_diloco_job.py", spec, tmp_path, workers=2, env={"BYTEPS_MIN_COMPRESS_BYTES": "256"},
                    role_env={"worker0": TWO_RANKS, "worker1": TWO_RANKS, **SAYS_JOINS})
    joiner = dict(job.base, DMLC_ROLE="worker", DMLC_WORKER_ID="1", **TWO_RANKS)
    try:
        printed_by_both(job, ["worker1"], "HALF", BOUND)  # both saved their pushes
        os.kill(job.local_rank_of("worker1", 1), signal.SIGKILL)
        job.wait_output(["worker0"], "membership: worker 2, 3 left; epoch 1", BOUND)
        job.launch("joiner", host_command("elastic_diloco_job.py", tmp_path / "spec.json", tmp_path), joiner)
        job.wait_output(["joiner"], "JOINING", BOUND)
        (tmp_path / "gate").touch()
        printed_by_both(job, ["joiner"], "HALF", BOUND)  # the workers' phase: the joined host dies in its turn
        os.kill(job.local_rank_of("joiner", 1), signal.SIGKILL)
        job.wait_output(["worker0"], "membership: worker 2, 3 left; epoch 3", BOUND)
        (tmp_path / "spec2.json").write_text(json.dumps(dict(spec, workers_joiner=True)))
        job.launch("joiner2", host_command("elastic_diloco_job.py", tmp_path / "spec2.json", tmp_path), joiner)
        printed_by_both(job, ["scheduler"], JOIN_STARTS, BOUND)  # host 0 pledged the group after step 7
        (tmp_path / "gate2").touch()
        statuses, _ = job.wait_all(BOUND, since=time.monotonic())  # each step above was bounded: the end within BOUND
    finally:
        job.kill_all()
    report = job.report(statuses)
    for name in ("worker1", "joiner"):
        assert "local rank 1 (worker 3) exited with status 137; stopping the others" in job.text(name), report
    assert not [name for name in job.launchers if "Traceback" in job.text(name)], report
    assert all(statuses[name] == 0 for name in ("scheduler", "server0", "worker0", "joiner2")), report
    sequence = membership(job.text("scheduler"))
    assert [(e, m) for e, _, m in sequence] == [(1, [0, 1]), (2, [0, 1, 2, 3]), (3, [0, 1]), (4, [0, 1, 2, 3])], \
        sequence
    joined = tuple(os.path.basename(glob.glob(str(tmp_path / f"rank{r}.[1-9]*.npz"))[0])[:-4] for r in (2, 3))
    files = {"0": ("rank0.0", "rank1.0"), "1 (died)": ("rank2.victim", "rank3.victim"), "1 (joined)": joined}
    last = check_host_replicas(tmp_path, files, sequence[0][1], sequence[1][1], "", True)
    left_at, joined_at = sequence[2][1] - last - 1, sequence[3][1] - last - 1  # one group per exchange
    assert (left_at, joined_at) == (3, 4), (sequence, last)  # its push at step 6 missing; fragment 0's at 7
    files = {"0": files["0"], "1 (died)": joined, "1 (joined)": ("rank2.w4", "rank3.w4")}
    check_host_replicas(tmp_path, files, left_at, joined_at, "w/", False)


def check_host_replicas(tmp_path, files, left_at, joined_at, prefix, servers):
    """One phase of the test above (its keys ``prefix``; ``files``: each host's two ranks' saved
    files): the hosts that pushed each exchange, each host's ranks the same pushes, every rank's
    global copy after every exchange and the joiner's model after each outer step against the
    numpy outer SGD, and (``servers``) the servers' copy pulled at the end; its last exchange."""
    ranks = {k: [dict(np.load(tmp_path / f"{name}.npz")) for name in names] for k, names in files.items()}
    assert all(int(h[f"{prefix}start"]) == joined_at for h in ranks["1 (joined)"]), (files, joined_at)
    # the last exchange pushed (in flight at the stop, or not: delay 1); the servers' copy has it
    last = max(int(n.split("/")[-1]) for n in ranks["0"][0] if n.startswith(f"{prefix}size/"))
    assert last >= joined_at + HOSTS_SPEC["after_join"] * 2 - 1, (last, joined_at)
    for k, (mine, mate) in ranks.items():  # a host's two ranks: one replica, the same pushes
        pseudo = sorted(n for n in mine if n.startswith(f"{prefix}pseudo/"))
        assert pseudo == sorted(n for n in mate if n.startswith(f"{prefix}pseudo/")), k
        assert all(mine[n].tobytes() == mate[n].tobytes() for n in pseudo), k
    hosts = {k: mine for k, (mine, _) in ranks.items()}
    for rnd in range(last + 1):
        pushed = sorted(k for k, h in hosts.items() if f"{prefix}size/{rnd}" in h)
        assert pushed == (["0", "1 (died)"] if rnd < left_at else ["0"] if rnd < joined_at else ["0", "1 (joined)"]), \
            (prefix, rnd, pushed)
    everything = tuple(n for n, _ in build_model().named_parameters())
    on_workers = tuple(hosts["0"]["on_workers"]) if servers else everything  # servers: the parts below 256 bytes
    assert ("2.weight" in on_workers and "0.weight" not in on_workers) if servers else on_workers, on_workers
    oracle = outer_sgd(hosts, last, prefix, on_workers=on_workers)
    landed = ranks["1 (joined)"][0][f"{prefix}landed"]  # the due step of the exchange in flight at the join, if any
    assert landed.size == (joined_at % 2 == 0), (joined_at, landed)  # fragment 0's exchange: fragment 1's
    for rnd, want in enumerate(oracle):
        keys = [f"{prefix}global/{rnd}/{name}" for name in want]
        holders = [h for rs in ranks.values() for h in rs if any(key in h for key in keys)]
        both = rnd < left_at or rnd >= joined_at or rnd == joined_at - 1 and landed.size
        assert len(holders) == (4 if both else 2) or rnd == last and not holders, (prefix, rnd, len(holders))
        for h in holders:
            for key in [key for key in keys if key in h]:
                assert h[key].tobytes() == want[key.rsplit("/", 1)[1]].tobytes(), (rnd, key)
    params = [k for k in ranks["1 (joined)"][0] if k.startswith(f"{prefix}param/")]  # the joiner's model after
    assert any(k.startswith(f"{prefix}param/{joined_at}/") for k in params), params  # each outer step: the others'
    for key in params:
        assert all(h[key].tobytes() == ranks["0"][0][key].tobytes() for h in ranks["0"] + ranks["1 (joined)"]), key
    for h in ranks["0"] + ranks["1 (joined)"] if servers else ():
        assert h["pulled/0.weight"].tobytes() == oracle[-1]["0.weight"].reshape(-1).tobytes()
    assert not np.array_equal(oracle[-1]["0.weight"], oracle[0]["0.weight"])
    return last
