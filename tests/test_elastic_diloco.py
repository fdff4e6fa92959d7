"""BPS_GC_ELASTIC with DiLoCo (docs/elastic.md; docs/diloco.md). One job (3
worker hosts, 1 server, one bpslaunch per role) trains the small MLP of test_diloco.py at H = 4,
every element of the weights' pseudo-gradients sent exactly (threshold 0), the biases
uncompressed (BYTEPS_MIN_COMPRESS_BYTES=256), first with the outer step on the servers (the
biases': the workers', as for any tensor sent uncompressed). Worker 2 is SIGKILLed in the middle
of an H window (before pushing that round); the survivors go on. Then a fresh host with its
DMLC_WORKER_ID joins through DiLoCo.elastic_start(): it takes the global copy from the servers,
and after its first outer round its global copy is the others' bit for bit. At every outer
round, every live host's global copy equals a numpy recomputation of the servers' outer SGD (lr
0.7, momentum 0.9, Nesterov) over the mean of the pseudo-gradients of the members that pushed
that round (recorded by each worker; the biases: torch's SGD, the joiner's momentum of them from
a live worker), bit for bit, and so does the copy each pulls from the servers at the end. In the
same job the live hosts then train a fresh model with the outer step on the workers: the joiner
dies mid-window, and another fresh host joins, taking the global copy, the outer momentum and
the step count from a live worker; the same checks against torch's SGD recomputed in numpy (one
joiner process more, ~2.4 s CPU). An elastic join with fragments is refused in one line."""
import json
import os
import signal

import numpy as np

from elastic_jobs import host_command, membership, start_job
from test_diloco import build_model

BOUND = 90.0
VICTIM = 2
SPEC = {"sync_every": 4, "max_rounds": 400, "victim": VICTIM, "kill_at": 6, "sleep": 0.05, "join_epoch": 2,
        "after_join": 2, "compression_params": {"compressor": "threshold", "threshold": 0.0},
        "workers_phase": {"kill_at": 6, "join_epoch": 4}}


UNCOMPRESSED = ("0.bias", "2.bias")  # below BYTEPS_MIN_COMPRESS_BYTES=256: their outer step is the workers'


def outer_sgd(hosts, last, tag="", on_workers=()):
    """[global copy after each round] in numpy, float32, on the mean over the hosts that pushed
    each round (summed in rank order, divided by their count): the servers' outer SGD (lr 0.7,
    momentum 0.9, Nesterov: compress/outer.py), or for the parameters ``on_workers`` torch's. Its
    CPU kernels take ``a.add(b, alpha=s)`` as one fused multiply-add (one rounding): so here, the
    exact float64 product and sum rounded once to float32; its momentum starts as the first mean."""
    f = np.float32

    def fused(a, s, b):
        return (a.astype(np.float64) + np.float64(f(s)) * b.astype(np.float64)).astype(f)

    copies = {n: p.detach().numpy().copy() for n, p in build_model().named_parameters()}
    momentum = {n: np.zeros_like(v) for n, v in copies.items() if n not in on_workers}
    out = []
    for rnd in range(last + 1):
        pushed = [h for _, h in sorted(hosts.items()) if f"{tag}pseudo/{rnd}/0.weight" in h]
        for name in copies:
            total = pushed[0][f"{tag}pseudo/{rnd}/{name}"]
            for h in pushed[1:]:
                total = total + h[f"{tag}pseudo/{rnd}/{name}"]
            mean = total / f(len(pushed))
            if name in on_workers:
                momentum[name] = mean.copy() if name not in momentum else fused(momentum[name] * f(0.9), 1.0, mean)
                copies[name] = fused(copies[name], -0.7, fused(mean, 0.9, momentum[name]))
            else:
                momentum[name] = momentum[name] * f(0.9) + mean
                copies[name] = copies[name] + -(f(0.7) * (mean + f(0.9) * momentum[name]))
        out.append({n: c.copy() for n, c in copies.items()})
    return out


def test_diloco_survives_deaths_and_joiners_take_the_global_copy_on_the_servers_and_on_the_workers(tmp_path):
    job = start_job("elastic_diloco_job.py", SPEC, tmp_path, env={"BYTEPS_MIN_COMPRESS_BYTES": "256"})
    try:
        job.wait_output([f"worker{VICTIM}"], "HALF", BOUND)
        os.kill(job.child_of(f"worker{VICTIM}"), signal.SIGKILL)
        job.wait_output(["worker0", "worker1"], f"worker {VICTIM} left; epoch 1", BOUND)
        job.launch("joiner", host_command("elastic_diloco_job.py", tmp_path / "spec.json", tmp_path),
                   dict(job.base, DMLC_ROLE="worker", DMLC_WORKER_ID=str(VICTIM)))
        job.wait_output(["joiner"], "HALF", BOUND)  # the workers' phase: the joiner dies in its turn
        os.kill(job.child_of("joiner"), signal.SIGKILL)
        job.wait_output(["worker0", "worker1"], f"worker {VICTIM} left; epoch 3", BOUND)
        (tmp_path / "spec2.json").write_text(json.dumps(dict(SPEC, workers_joiner=True)))
        job.launch("joiner2", host_command("elastic_diloco_job.py", tmp_path / "spec2.json", tmp_path),
                   dict(job.base, DMLC_ROLE="worker", DMLC_WORKER_ID=str(VICTIM)))
        statuses, _ = job.wait_all(BOUND)
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
    hosts, last = phase_hosts(tmp_path, "victim", str(joined_at), left_at, joined_at)
    assert "fragments=1 and delay=0" in str(hosts["0"]["refused"]), hosts["0"]["refused"]
    oracle = outer_sgd(hosts, last, on_workers=UNCOMPRESSED)
    for rnd, want in enumerate(oracle):
        live = [k for k, h in hosts.items() if f"global/{rnd}/0.weight" in h]
        assert len(live) == (3 if rnd < left_at or rnd >= joined_at else 2), (rnd, live)
        for name, value in want.items():
            for k in live:
                assert hosts[k][f"global/{rnd}/{name}"].tobytes() == value.tobytes(), (rnd, k, name)
    for k in ("0", "1", "2 (joined)"):  # the servers' copy at the end (of the parameters they hold)
        assert sorted(n[len("pulled/"):] for n in hosts[k] if n.startswith("pulled/")) == ["0.weight", "2.weight"]
        for name in ("0.weight", "2.weight"):
            assert hosts[k][f"pulled/{name}"].tobytes() == oracle[-1][name].reshape(-1).tobytes(), (k, name)
    assert not np.array_equal(oracle[-1]["0.weight"], oracle[0]["0.weight"])
    assert not np.array_equal(oracle[-1]["0.bias"], oracle[0]["0.bias"])
    check_the_workers_phase(tmp_path, sequence, last + 1)


def phase_hosts(tmp_path, died, joined, left_at, joined_at, prefix=""):
    """A phase's saved hosts (the victim's file ``rank<VICTIM>.<died>``, the joiner's
    ``rank<VICTIM>.<joined>``) and its last round, checking who pushed each round: the three
    hosts, then the two survivors, then with the joiner."""
    hosts = {"0": np.load(tmp_path / "rank0.0.npz"), "1": np.load(tmp_path / "rank1.0.npz"),
             "2 (died)": np.load(tmp_path / f"rank{VICTIM}.{died}.npz"),
             "2 (joined)": np.load(tmp_path / f"rank{VICTIM}.{joined}.npz")}
    hosts = {k: dict(h) for k, h in hosts.items()}
    assert int(hosts["2 (joined)"][f"{prefix}start"]) == joined_at > left_at == 1
    last = joined_at + SPEC["after_join"] - 1
    for rnd in range(last + 1):
        pushed = sorted(k for k, h in hosts.items() if f"{prefix}pseudo/{rnd}/0.weight" in h)
        want = ["0", "1", "2 (died)"] if rnd < left_at else ["0", "1"] if rnd < joined_at else ["0", "1", "2 (joined)"]
        assert pushed == want, (rnd, pushed)
    return hosts, last


def check_the_workers_phase(tmp_path, sequence, groups_before):
    """The same job's second phase, the outer step on the workers: the first joiner dies in the
    middle of a window and a second joins, taking the global copy, the outer momentum and the
    step count from a live worker; every live host's global copy at every round bit-identical,
    the joiner's from its first round on, and equal to the numpy outer SGD of the members."""
    left_at, joined_at = sequence[2][1] - groups_before, sequence[3][1] - groups_before
    hosts, last = phase_hosts(tmp_path, str(sequence[1][1]), f"w{joined_at}", left_at, joined_at, "w/")
    oracle = outer_sgd(hosts, last, "w/", on_workers=tuple(n for n, _ in build_model().named_parameters()))
    for rnd, want in enumerate(oracle):
        live = [k for k, h in hosts.items() if f"w/global/{rnd}/0.weight" in h]
        assert len(live) == (3 if rnd < left_at or rnd >= joined_at else 2), (rnd, live)
        for name, value in want.items():
            for k in live:
                assert hosts[k][f"w/global/{rnd}/{name}"].tobytes() == value.tobytes(), ("workers", rnd, k, name)
    assert not np.array_equal(oracle[-1]["0.weight"], oracle[0]["0.weight"])
