"""What scripts/elastic_netns.py checks once its job ended: statuses, the membership sequence
every node logged, the numpy oracle of that sequence (onebit: tests/reference.py's
elastic_means; diloco: the servers' outer SGD over each round's members), the joiner equal to
the others after its first round; and the time lost per failure (scripts/elastic_lost.py)."""
import os
import re
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import elastic_lost  # noqa: E402
from chaos_elastic import SPEC, equal_numpy, events_of  # noqa: E402

def starts(text):
    """The first step (outer round) of each rank a launcher ran: its START lines."""
    return [int(s) for s in re.findall(r"^START (\d+)", text, re.M)]


def everything(run):
    c, L, death = run.cluster, run.local, run.death
    report = lambda names: c.report(names)  # noqa: E731
    bad = {n: c.procs[n].returncode for n in run.nodes() if c.procs[n].returncode != 0}
    assert not bad, f"nodes exited with {bad}\n{report(list(bad))}"
    assert c.procs[death["name"]].returncode != 0, report([death["name"]])
    for name in run.nodes():  # each rank started once: no restart
        if name.startswith("worker"):
            assert len(starts(c.text(name))) == L, f"{name} started {starts(c.text(name))}\n{report([name])}"
    for name in c.procs:
        assert "Traceback" not in c.text(name), report([name])
    sequence = events_of(c.text("scheduler"))
    dead = list(range(death["host"] * L, death["host"] * L + L))
    assert [(k, list(r), e) for k, r, e, _, _ in sequence] == [("left", dead, 1), ("joined", dead, 2)], sequence
    for name in run.nodes():
        mine = events_of(c.text(name))
        want = sequence[1:] if name == run.joiner else sequence
        assert sorted(mine) == sorted(want * (L if name.startswith("worker") else 1)), (name, mine, sequence)
    half = lame = None
    if "half" in c.procs:
        half, lame = half_joins(run)
    members = [(0, list(range(run.args.workers * L)))] + [(g, list(m)) for _, _, _, g, m in sequence]
    oracle = onebit if run.args.task == "onebit" else diloco
    result = oracle(run, members, sequence)
    death = dict(death, from_group=sequence[0][3])
    lost = elastic_lost.measure(death, c.stamps, run.args.heartbeat_timeout)
    killed = dict(host=death["host"], local_rank=death["local_rank"], seeded_step=death["seeded_step"], at=death["at"])
    result.update(half_join=half, lame_join=lame, sequence=[list(map(str, e)) for e in sequence], lost=lost,
                  killed=killed,
                  joiner=f"joined at {'step' if run.args.task == 'onebit' else 'outer round'} {sequence[1][3]}")
    return result


def half_joins(run):
    """The hosts that could not join (elastic_netns.py's half_joins): how each ended, in a line."""
    c = run.cluster
    text = c.text("half")  # a rank died once registered: refused, or its launcher stopped the rest first
    assert c.procs["half"].returncode != 0 and "dies once registered" in text, c.report(["half"])
    refused = [x for x in text.splitlines() if x.startswith("bps_gc: NodeFailure:")]
    half = refused[0] if refused else "its launcher stopped the other ranks"
    text, missing = c.text("lame"), (run.death["host"] + 1) * run.local - 1  # its last local rank never registered
    refused = [x for x in text.splitlines() if x.startswith("bps_gc: NodeFailure:")]
    want = (f"local rank {run.local - 1} (worker {missing}) did not register within "
            f"BPS_GC_JOIN_TIMEOUT={run.lame_bound:g} s")
    assert c.procs["lame"].returncode != 0 and len(refused) == run.local - 1 and all(want in x for x in refused), \
        c.report(["lame", "scheduler"])
    assert f"join is cancelled: its host's {want}" in c.text("scheduler"), c.report(["scheduler"])
    return half, refused[0]


def live_ranks(run):
    """{rank: (node name, first step)} of every rank alive at the end."""
    out = {}
    for host, name in run.live.items():
        first = starts(run.cluster.text(name))[0]
        for local in range(run.local):
            out[host * run.local + local] = (name, first)
    return out


def onebit(run, members, sequence):
    epochs = [(0, 0)] + [(g, e) for _, _, e, g, _ in sequence]
    ranks = live_ranks(run)
    hosts = {r: np.load(os.path.join(run.out, f"rank{r}.{first}.npz")) for r, (_, first) in ranks.items()}
    last = max(int(h["start"]) + len(h["crcs"]) - 1 for h in hosts.values())
    equal_numpy(hosts, members, epochs, last, "rank")
    first = sequence[1][3]  # the joiner, after its first step, holds what every member holds
    crcs = {int(h["crcs"][first - int(h["start"])]) for h in hosts.values()}
    assert len(crcs) == 1, (first, crcs)
    return {"steps": last + 1, "ranks_checked": sorted(hosts)}


def diloco(run, members, sequence):
    """Every rank's global copy at every outer round it ran, and the servers' at the end, equal
    the outer SGD (lr 0.7, momentum 0.9, Nesterov) of the mean of the round's members'
    pseudo-gradients, summed in rank order, in float32."""
    from test_diloco import build_model
    files = {}  # (rank, first round) -> saved arrays; the dead host's too (saved before each push)
    for name in os.listdir(run.out):
        m = re.fullmatch(r"rank(\d+)\.(\d+)\.npz", name)
        if m:
            files[int(m.group(1)), int(m.group(2))] = dict(np.load(os.path.join(run.out, name)))
    ranks = live_ranks(run)
    last = max(int(k.split("/")[1]) for r, (_, first) in ranks.items() for k in files[r, first] if k.startswith("global/"))

    def pushed(r, rnd):  # the file of rank r's process that ran round rnd
        first = max(f for (q, f) in files if q == r and f <= rnd)
        return files[r, first]

    f = np.float32
    copies = {n: p.detach().numpy().copy() for n, p in build_model().named_parameters()}
    momentum = {n: np.zeros_like(v) for n, v in copies.items()}
    for rnd in range(last + 1):
        these = [m for g, m in members if g <= rnd][-1]
        for name in copies:
            total = pushed(these[0], rnd)[f"pseudo/{rnd}/{name}"]
            for r in these[1:]:
                total = total + pushed(r, rnd)[f"pseudo/{rnd}/{name}"]
            mean = total / f(len(these))
            momentum[name] = momentum[name] * f(0.9) + mean
            copies[name] = copies[name] + -(f(0.7) * (mean + f(0.9) * momentum[name]))
        for r, (_, first) in ranks.items():
            if rnd >= first:
                for name, value in copies.items():
                    got = files[r, first][f"global/{rnd}/{name}"]
                    assert got.tobytes() == value.tobytes(), f"rank {r}'s global {name} at round {rnd} differs from numpy's"
    for r, (_, first) in ranks.items():
        for name, value in copies.items():
            assert files[r, first][f"pulled/{name}"].tobytes() == value.reshape(-1).tobytes(), (r, name)
    return {"rounds": last + 1, "ranks_checked": sorted(ranks)}


def line(summary, args):
    lost = summary.get("lost")
    timing = "time lost: not measured" if not lost else (
        f"time lost {lost['lost_s']} s (stall {lost['stall_s']} s, kill to commit {lost['commit_s']} s, round "
        f"{lost['round_s']} s; bound {lost['bound_s']} s = heartbeat timeout {args.heartbeat_timeout:g} s + one round: "
        f"{'within' if lost['within'] else 'NOT within'})")
    what = (f"{args.workers} worker hosts x {args.local_ranks} local ranks, {args.task}, seed {args.seed}, "
            "each node in its own network namespace")
    unit = "step" if args.task == "onebit" else "outer round"
    if not summary["ok"]:
        return f"summary: FAILED ({what}) after {summary['seconds']} s"
    return (f"summary: OK ({what}): killed host {summary['killed']['host']} (local rank "
            f"{summary['killed']['local_rank']}) at {unit} {summary['killed']['at']}; joiner: {summary['joiner']}; "
            f"{summary.get('steps') or summary.get('rounds')} {'steps' if args.task == 'onebit' else 'outer rounds'}, "
            f"no process restarted, live ranks bit-identical and equal to numpy; {timing}; {summary['seconds']} s; "
            f"box: {summary['machine']}, load average before {summary['load_before']}, after {summary['load_after']}")
