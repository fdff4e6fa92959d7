"""BPS_GC_ELASTIC with the torch binding (docs/elastic.md): the MNIST
example example/pytorch/train_mnist_elastic.py on 3 worker hosts. Worker 2 is SIGKILLed after a
few steps, the survivors go on; a fresh host with its DMLC_WORKER_ID joins, taking the model and
the SGD momentum from a live worker through bps.elastic_start(model, optimizer). Every host's
parameters are bit-identical at every step they share (a CRC of their bytes) and at the end,
bps.size()/membership_epoch() follow the logged sequence, and the training loss went down.
With --scale-lr each step's learning rate follows its size (the linear scaling rule): the
final parameters are the logged membership's, replayed in one process (scripts/mnist_replay.py),
and the example refuses a bad R."""
import os
import signal
import sys
import time

import numpy as np
import pytest

from conftest import ROOT
from multihost import Job
from test_elastic_join import membership

EXAMPLE = os.path.join(ROOT, "example", "pytorch", "train_mnist_elastic.py")
ENV = {"BPS_GC_ELASTIC": "1", "BYTEPS_PARTITION_BYTES": "65536"}
BOUND = 90.0
SCALE_LR = 3  # lr 0.1 on 3 hosts: 0.0667 on 2


def steps_of(job, name):
    return [int(line.split()[1]) for line in job.text(name).splitlines() if line.startswith("STEP ")]


def wait_step(job, names, step, bound=BOUND):
    deadline = time.monotonic() + bound
    while not all(steps_of(job, n) and steps_of(job, n)[-1] >= step for n in names):
        assert time.monotonic() < deadline, f"no step {step} from {names}:\n{job.report()}"
        time.sleep(0.05)


def test_mnist_hosts_die_and_join_and_stay_bit_identical(tmp_path):
    stop = tmp_path / "stop"
    command = [sys.executable, EXAMPLE, "--out", str(tmp_path), "--stop-file", str(stop), "--sleep", "0.05",
               "--scale-lr", str(SCALE_LR)]
    job = Job(3, None, servers=1, env=ENV, command=command)
    try:
        wait_step(job, ["worker0", "worker1", "worker2"], 3)
        os.kill(job.child_of("worker2"), signal.SIGKILL)
        job.wait_output(["worker0", "worker1"], "worker 2 left; epoch 1", BOUND)
        wait_step(job, ["worker0", "worker1"], max(steps_of(job, "worker0")) + 3)
        job.launch("joiner", command, dict(job.base, DMLC_ROLE="worker", DMLC_WORKER_ID="2"))
        job.wait_output(["worker0", "worker1", "joiner"], "worker 2 joined; epoch 2", BOUND)
        last = max(steps_of(job, "worker0")) + 4
        (tmp_path / "stop.tmp").write_text(str(last))
        os.replace(tmp_path / "stop.tmp", stop)
        statuses, _ = job.wait_all(BOUND, since=time.monotonic())  # each step above was bounded: the end within BOUND
    finally:
        job.kill_all()
    for name in ("scheduler", "server0", "worker0", "worker1", "joiner"):
        assert statuses[name] == 0 and "Traceback" not in job.text(name), job.report(statuses)
    sequence = membership(job.text("worker0"))
    assert [(e, m) for e, _, m in sequence] == [(1, [0, 1]), (2, [0, 1, 2])], sequence
    assert membership(job.text("server0")) == sequence and membership(job.text("joiner")) == sequence[1:]
    (_, left_at, _), (_, joined_at, _) = sequence
    hosts = {r: np.load(tmp_path / f"rank{r}.0.npz") for r in (0, 1)}
    hosts[2] = np.load(tmp_path / f"rank2.{joined_at}.npz")
    assert int(hosts[2]["start"]) == joined_at and len(hosts[0]["crcs"]) == last + 1
    for r in (0, 1):
        assert list(hosts[r]["sizes"]) == [3] * left_at + [2] * (joined_at - left_at) + [3] * (last + 1 - joined_at)
        assert list(hosts[r]["epochs"]) == [0] * left_at + [1] * (joined_at - left_at) + [2] * (last + 1 - joined_at)
    assert list(hosts[2]["epochs"]) == [2] * (last + 1 - joined_at)
    for r in (0, 1, 2):  # the lr of each step, from the step's size (the sizes checked above)
        assert list(hosts[r]["lrs"]) == [0.1 * s / SCALE_LR for s in hosts[0]["sizes"][int(hosts[r]["start"]):]], r
    assert list(hosts[0]["crcs"]) == list(hosts[1]["crcs"])
    assert list(hosts[2]["crcs"]) == list(hosts[0]["crcs"][joined_at:])  # momentum copied too
    names = [k for k in hosts[0].files if k.startswith("param.")]
    assert len(names) == 4
    for name in names:
        assert hosts[0][name].tobytes() == hosts[1][name].tobytes() == hosts[2][name].tobytes(), name
    assert float(hosts[0]["loss"]) == float(hosts[2]["loss"]) < 1.0, float(hosts[0]["loss"])
    assert float(hosts[0]["val_loss"]) == float(hosts[2]["val_loss"]) < 2.3, float(hosts[0]["val_loss"])  # < ln 10
    # the oracle: the logged membership replayed in one process with the lr rule. Not bit for bit
    # (the servers sum the hosts' means, the replay takes one mean), so within float32 noise
    # (1.8e-7 over 109 steps on the dev box); the same replay at a fixed lr lies farther off than
    # that noise (0.22 there), or the check proves nothing
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import mnist_replay
    per_step = mnist_replay.members_by_step([(0, [0, 1, 2])] + [(g, m) for _, g, m in sequence], last + 1)
    launched = np.concatenate([hosts[0][n].ravel() for n in names])
    scaled, fixed = (np.concatenate([p.detach().numpy().ravel() for p in model.parameters()]) for model, *_ in
                     (mnist_replay.train(per_step, 0, scale_lr=r) for r in (SCALE_LR, None)))
    noise, rule = np.abs(launched - scaled).max(), np.abs(launched - fixed).max()
    assert noise < 1e-5 and rule > 100 * noise, (noise, rule)


def test_the_sampler_deals_the_rest_of_a_pass_over_the_new_members():
    """example/pytorch/elastic_shards.py in one process, numpy only: 4 hosts; worker 2 dies during
    step 3 (its batch of that step is lost), joins again at step 7 with a live host's state. Each
    host deals from its own copy of the state, the copies agree after every step, and every digit
    of a pass is dealt exactly once: no pass restarts at a change (101 digits: batches straddle)."""
    sys.path.insert(0, os.path.join(ROOT, "example", "pytorch"))
    from elastic_shards import ElasticShards
    deal, count, batch = ElasticShards(101, 4, seed=5), 101, 4
    states = {r: (0, [0, 1, 2, 3]) for r in range(4)}
    members_at = {3: [0, 1, 3], 7: [0, 1, 2, 3]}  # step -> the step's members, from then on
    members, dealt, learned = [0, 1, 2, 3], [], []
    for step in range(60):
        if step == 7:
            states[2] = states[0]  # the joiner's copy, from the donor
        new = members_at.get(step, members)
        seen = members if step != 7 else new  # bps.membership() before the step, on each host
        batches = {r: deal.batch_of(*states[r], seen, r) for r in states}
        slots = sorted(batches, key=lambda r: ElasticShards.slot(r, states[r][1], seen))
        dealt += [batches[r] for r in slots]
        learned += [batches[r] for r in slots if r in new]
        if step == 7:  # the joiner's first batch is none of the others'
            assert not set(batches[2]) & set(np.concatenate([batches[r] for r in (0, 1, 3)]))
        if step == 3:
            del states[2]
        for r in states:
            states[r] = (deal.advance(*states[r], new), new)
        assert len(set(map(str, states.values()))) == 1, (step, states)
        members = new
    stream = np.concatenate(dealt)
    assert len(stream) == states[0][0] > 2 * count
    for p in range(2):
        assert sorted(stream[p * count:(p + 1) * count]) == list(range(count)), p
    assert len(np.concatenate(learned)) == len(stream) - batch  # only the dead host's step-3 batch


def test_the_example_refuses_a_learning_rate_scale_that_is_not_a_positive_number_of_hosts(capsys):
    """--scale-lr R divides by R: 0, a negative number, inf or NaN is refused before anything starts,
    in one line naming the flag, by the example and by the chaos driver that passes it on
    (in-process: their argument parsing, no launch)."""
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    import train_mnist_elastic
    for bad in ("0", "-2", "inf", "nan"):
        with pytest.raises(SystemExit) as refused:
            train_mnist_elastic.parse_args(["--out", "unused", "--scale-lr", bad])
        assert str(refused.value) == f"--scale-lr must be a positive number of hosts, not {float(bad):g}", refused.value
    assert train_mnist_elastic.parse_args(["--out", "unused", "--scale-lr", "2"]).scale_lr == 2.0
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import chaos_elastic
    for bad, why in ((["--task", "mnist", "--scale-lr", "0"], "--scale-lr must be a positive number of hosts, not 0"),
                     (["--scale-lr", "2"], "--scale-lr is for --task mnist")):
        with pytest.raises(SystemExit):
            chaos_elastic.run(bad + ["--out", "unused"])
        assert why in capsys.readouterr().err.splitlines()[-1]
