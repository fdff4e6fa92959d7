#!/usr/bin/env python3
"""Issue 41's churn target: a bounded, seeded chaos loop on an elastic parameter-server job
(BPS_GC_ELASTIC=1; docs/elastic.md).

One bpslaunch per role on loopback: a scheduler, servers and --workers worker hosts
(scripts/chaos_worker.py) train p -= lr * mean of a dense tensor and a onebit tensor with
error feedback. A schedule drawn from --seed then, one event at a time, either SIGKILLs a
random live worker once the job is a random number of steps further, or starts a fresh
process with a dead host's DMLC_WORKER_ID, which joins. Each event is complete once every
live node logged it; every wait is bounded (a hang fails the run, naming what was awaited).
At the end every host stops at the same step and the loop checks:

  * every node logged the same membership events (a joiner from its own join on);
  * the live hosts' parameters are bit-identical, step by step (a CRC of their bytes) and at
    the end, and bps.size() / bps.membership_epoch() followed the logged sequence;
  * they equal a numpy recomputation of that sequence (tests/reference.py, elastic_means).

It also measures each death's time lost on its survivors against the heartbeat timeout plus one
round (scripts/elastic_lost.py says how), reported per death and summed up, beside the box and
its load average: a report, not a check.

Events are serialised: the loop never kills during a join or a death's commit, nor starts a
join before the last death committed (docs/elastic.md says why).

    python scripts/chaos_elastic.py --events 60 --seconds 600 --seed 1 --workers 4
It prints each event as it completes, then a table and a summary line; --json writes both.
"""
import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from bps_gc.launcher.local import free_port  # noqa: E402
from reference import elastic_means  # noqa: E402
import chaos_mnist  # noqa: E402
import elastic_lost  # noqa: E402
from bench_common import machine_info, pythonpath  # noqa: E402
import procs  # noqa: E402

WORKER = os.path.join(ROOT, "scripts", "chaos_worker.py")
SPEC = {"lr": 0.5, "sleep": 0.02, "partition_bytes": 4096,
        "tensors": [{"name": "dense", "shape": [1500], "dtype": "float32"},
                    {"name": "signs", "shape": [1200], "dtype": "float32",
                     "params": {"compressor": "onebit", "ef": "vanilla"}}]}
LINE = re.compile(r"membership: worker ([\d, ]+) (left|joined); epoch (\d+) from round group (\d+); "
                  r"members \[([\d, ]*)\]")
STEP = re.compile(r"^(?:STEP|ROUND) (\d+) ", re.M)  # a step, or a DiLoCo job's outer round
START_BOUND, EVENT_BOUND, STOP_MARGIN = 60.0, 45.0, 25


def equal_numpy(hosts, members, epochs, last, who):
    """Every host's CRC, size and epoch at every step it ran, and its final parameters, equal a
    numpy recomputation (dense + onebit with EF: elastic_means) of the logged membership
    (``members``/``epochs``: (first step, value)); ``who`` names a host in a failure."""
    p = {t["name"]: np.linspace(-1, 1, int(np.prod(t["shape"])), dtype=np.float32) for t in SPEC["tensors"]}
    for step, means in elastic_means(SPEC, members, last):
        for name, mean in means.items():
            p[name] = p[name] - np.float32(SPEC["lr"]) * mean
        crc = zlib.crc32(b"".join(a.tobytes() for a in p.values()))
        size = len([m for g, m in members if g <= step][-1])
        epoch = [e for g, e in epochs if g <= step][-1]
        for r, h in hosts.items():
            i = step - int(h["start"])
            if i >= 0:
                assert (h["crcs"][i], h["sizes"][i], h["epochs"][i]) == (crc, size, epoch), \
                    f"{who} {r} at step {step}: crc/size/epoch {h['crcs'][i]}/{h['sizes'][i]}/{h['epochs'][i]}, " \
                    f"numpy {crc}/{size}/{epoch}"
    for r, h in hosts.items():
        assert len(h["crcs"]) == last + 1 - int(h["start"]), (r, len(h["crcs"]), last)
        for name, want in p.items():
            assert h[f"param.{name}"].tobytes() == want.tobytes(), f"{who} {r}'s {name} differs from numpy's"


class Hang(AssertionError):
    """A bounded wait ran out."""


def events_of(text):
    """The membership events a node logged: (kind, ranks, epoch, from group, members)."""
    return [(kind, tuple(int(r) for r in ranks.split(",")), int(e), int(g),
             tuple(int(m) for m in members.split(",") if m.strip()))
            for ranks, kind, e, g, members in LINE.findall(text)]


class Cluster:
    """The job's launchers, their output kept per node: scheduler, server<i>, worker<r>.<n>
    (the n-th process of worker rank r). ``place(name)``: the argv prefix that runs a node
    where it lives (scripts/elastic_netns.py: its network namespace); ``env``: settings of
    every role (DMLC_PS_ROOT_URI there: the scheduler's address), ``worker_env``: the workers'."""

    def __init__(self, workers, servers, out, heartbeat_timeout, command=None, place=None, env=None, worker_env=None):
        self.out, self.port = out, free_port()
        self.place, self.worker_env = place or (lambda name: []), worker_env or {}
        self.command = command or [sys.executable, WORKER, os.path.join(out, "spec.json"), out]
        self.spec_path = os.path.join(out, "spec.json")
        self.base = dict(os.environ, PYTHONPATH=pythonpath(ROOT), PYTHONUNBUFFERED="1", DMLC_NUM_WORKER=str(workers),
                         DMLC_NUM_SERVER=str(servers), DMLC_PS_ROOT_URI="127.0.0.1",
                         DMLC_PS_ROOT_PORT=str(self.port), BPS_GC_ELASTIC="1",
                         BYTEPS_PARTITION_BYTES=str(SPEC["partition_bytes"]), BYTEPS_MIN_COMPRESS_BYTES="0",
                         BPS_GC_HEARTBEAT_INTERVAL=str(heartbeat_timeout / 10),
                         BPS_GC_HEARTBEAT_TIMEOUT=str(heartbeat_timeout), BPS_GC_KILL_GRACE="2")
        self.base.update(env or {})
        self.procs, self.output, self.events, self.incarnation = {}, {}, {}, {}
        self.stamps, self.event_times = {}, {}  # node -> [(time read, step)], [time read] of its events
        self.lock = threading.Lock()
        self.launch("scheduler", [], DMLC_ROLE="scheduler")
        for s in range(servers):
            self.launch(f"server{s}", [], DMLC_ROLE="server")
        for r in range(workers):
            self.start_worker(r)

    def launch(self, name, command, **env):
        proc = subprocess.Popen([*self.place(name), sys.executable, "-m", "bps_gc.launcher.cli", *command],
                                env=dict(self.base, **env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs[name], self.output[name], self.events[name] = proc, [], []
        self.stamps[name], self.event_times[name] = [], []
        threading.Thread(target=self.collect, args=(name, proc), daemon=True).start()

    def start_worker(self, rank):
        n = self.incarnation[rank] = self.incarnation.get(rank, -1) + 1
        name = f"worker{rank}.{n}"
        self.launch(name, self.command, DMLC_ROLE="worker", DMLC_WORKER_ID=str(rank), **self.worker_env)
        return name

    def collect(self, name, proc):
        with open(os.path.join(self.out, f"{name}.log"), "w") as log:
            for line in proc.stdout:
                now = time.monotonic()
                self.output[name].append(line)
                if line.startswith(("STEP ", "ROUND ")):
                    self.stamps[name].append((now, int(line.split()[1])))
                if "membership:" in line:
                    found = events_of(line)
                    self.events[name] += found
                    self.event_times[name] += [now] * len(found)
                log.write(line)

    def text(self, name):
        return "".join(self.output[name])

    def last_step(self, name):
        steps = STEP.findall("".join(self.output[name][-8:]))
        return int(steps[-1]) if steps else -1

    def child_of(self, name):
        """PID of the process a launcher started (the worker itself)."""
        pid = procs.child_of(self.procs[name].pid)
        if pid is None:
            raise Hang(f"{name}'s launcher has no child")
        return pid

    def wait_for(self, what, done, bound, watch=()):
        """Until ``done()``, at most ``bound`` seconds; a node of ``watch`` exiting fails it."""
        deadline = time.monotonic() + bound
        while not done():
            gone = [n for n in watch if self.procs[n].poll() is not None]
            if gone:
                raise AssertionError(f"{gone} exited while waiting for {what}\n{self.report(gone)}")
            if time.monotonic() > deadline:
                raise Hang(f"no {what} within {bound:.0f} s")
            time.sleep(0.05)

    def report(self, names=None):
        return "\n".join(f"--- {n} (exit {self.procs[n].poll()})\n{self.text(n)[-1500:]}"
                         for n in (names or self.procs))

    def kill_all(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class Chaos:
    def __init__(self, args, out):
        self.args, self.out = args, out
        self.rng = np.random.default_rng(args.seed)
        self.live = {r: f"worker{r}.0" for r in range(args.workers)}  # rank -> its running process
        self.dead, self.rows, self.started = [], [], time.monotonic()
        self.kills = {}  # event number -> {kill: time of the SIGKILL, survivors: node names}

    def nodes(self):
        """Every live node's name: each logs each event."""
        return ["scheduler", *[f"server{s}" for s in range(self.args.servers)], *self.live.values()]

    def logged(self, count):
        """Every live node logged ``count`` events since it started (a joiner: from its join on)."""
        first = self.first_event
        return all(len(self.cluster.events[n]) >= count - first.get(n, 0) for n in self.nodes())

    def run(self):
        with open(os.path.join(self.out, "spec.json"), "w") as f:
            json.dump(dict(SPEC, stop_file=os.path.join(self.out, "stop")), f)
        command = chaos_mnist.worker_command(self.out, os.path.join(self.out, "stop"), self.args.model_seed,
                                             scale_lr=self.args.scale_lr) \
            if self.args.task == "mnist" else None
        self.cluster = c = Cluster(self.args.workers, self.args.servers, self.out, self.args.heartbeat_timeout, command)
        self.first_event = {}  # node -> the index of the first event it logs
        try:
            c.wait_for("first step from every worker", lambda: all(c.last_step(n) >= 0 for n in self.live.values()),
                       START_BOUND, self.nodes())
            while len(self.rows) < self.args.events and time.monotonic() - self.started < self.args.seconds:
                self.event()
            return self.finish()
        finally:
            c.kill_all()

    def event(self):
        c, rng = self.cluster, self.rng
        kill = not self.dead or (len(self.live) > 1 and rng.random() < 0.5)
        step = max(c.last_step(n) for n in self.live.values()) + int(rng.integers(1, self.args.max_gap + 1))
        c.wait_for(f"step {step}", lambda: max(c.last_step(n) for n in self.live.values()) >= step, EVENT_BOUND,
                   self.nodes())
        if not kill and len(self.live) > 1 and rng.random() < self.args.overlap:
            return self.join_meets_death()
        count, t0 = len(self.rows) + 1, time.monotonic()
        if kill:
            rank = int(rng.choice(sorted(self.live)))
            name = self.live.pop(rank)
            at, pid = c.last_step(name), c.child_of(name)
            self.kills[count] = {"kill": time.monotonic(), "survivors": list(self.live.values())}
            os.kill(pid, signal.SIGKILL)
            self.dead.append(rank)
        else:
            rank = self.dead.pop(int(rng.integers(len(self.dead))))
            at = max(c.last_step(n) for n in self.live.values())
            name = self.live[rank] = c.start_worker(rank)
            self.first_event[name] = count - 1
        try:
            c.wait_for(f"event {count} ({'death' if kill else 'join'} of worker {rank}) on every node",
                       lambda: self.logged(count), EVENT_BOUND, self.nodes())
        except Hang as e:
            raise Hang(f"{e}\n{c.report(self.nodes() + [name])}") from None
        if kill:
            c.wait_for(f"{name}'s launcher to exit", lambda: c.procs[name].poll() is not None, EVENT_BOUND)
        self.record(count, "death" if kill else "join", rank, at, t0)

    def record(self, count, event, rank, at, t0, note=""):
        kind, ranks, epoch, group, members = self.cluster.events["scheduler"][count - 1]
        row = {"n": count, "event": event, "rank": rank, "at_step": at, "epoch": epoch, "from_step": group,
               "members": list(members), "seconds": round(time.monotonic() - t0, 2), "note": note}
        assert kind == ("left" if event == "death" else "joined") and ranks == (rank,), (row, kind, ranks)
        self.rows.append(row)
        print(f"[{time.monotonic() - self.started:6.1f} s] #{count} {event} of worker {rank} at step {at}: "
              f"epoch {epoch} from step {group}, members {list(members)} ({row['seconds']} s) {note}", flush=True)

    def measure(self):
        """Each death's time lost on its survivors (scripts/elastic_lost.py), into its row."""
        c = self.cluster
        for row in self.rows:
            if row["event"] == "death" and row["n"] in self.kills:
                times = c.event_times["scheduler"]
                death = dict(self.kills[row["n"]], from_group=row["from_step"],
                             committed=times[row["n"] - 1] if len(times) >= row["n"] else None)
                row["lost"] = elastic_lost.measure(death, c.stamps, self.args.heartbeat_timeout)

    def join_meets_death(self):
        """A member killed just before a host joins: the join waits for the dead member's pledge
        until its heartbeats time out, so the death comes while the join is under way (the join
        is cancelled and the joiner refused; if it registered late: refused, or joins after)."""
        c, rng = self.cluster, self.rng
        victim = int(rng.choice(sorted(self.live)))
        rank = self.dead.pop(int(rng.integers(len(self.dead))))
        vname, t0 = self.live.pop(victim), time.monotonic()
        at, pid = c.last_step(vname), c.child_of(vname)
        kill = {"kill": time.monotonic(), "survivors": list(self.live.values())}
        os.kill(pid, signal.SIGKILL)
        name = c.start_worker(rank)
        self.dead.append(victim)
        logged = lambda: any(e[0] == "left" and e[1] == (victim,) for e in c.events["scheduler"][len(self.rows):])  # noqa: E731
        c.wait_for(f"the death of worker {victim} during worker {rank}'s join", lambda: logged() and (
            c.procs[name].poll() is not None or any(e[0] == "joined" for e in c.events[name])), EVENT_BOUND)
        c.wait_for(f"{vname}'s launcher to exit", lambda: c.procs[vname].poll() is not None, EVENT_BOUND)
        joined = c.procs[name].poll() is None
        if joined:
            self.live[rank] = name
            self.first_event[name] = next(i for i, e in enumerate(c.events["scheduler"]) if e[0] == "joined"
                                          and e[1] == (rank,) and i >= len(self.rows))
        else:
            self.dead.append(rank)
            text = c.text(name)
            assert "cannot join the running job" in text and "Traceback" not in text, text
        for kind, ranks, *_ in c.events["scheduler"][len(self.rows):len(self.rows) + 1 + joined]:
            count, who = len(self.rows) + 1, ranks[0]
            if kind == "left":
                self.kills[count] = kill
            c.wait_for(f"event {count} on every node", lambda: self.logged(count), EVENT_BOUND, self.nodes())
            self.record(count, "death" if kind == "left" else "join", who, at, t0, note="overlap")
        if not joined:
            self.rows[-1]["note"] = f"worker {rank}'s join cancelled"
            print(f"    worker {rank}'s join was cancelled: {text.strip().splitlines()[-1][-120:]}", flush=True)

    def finish(self):
        c = self.cluster
        last = max(c.last_step(n) for n in self.live.values()) + STOP_MARGIN
        with open(os.path.join(self.out, "stop.tmp"), "w") as f:
            f.write(str(last))
        os.replace(os.path.join(self.out, "stop.tmp"), os.path.join(self.out, "stop"))
        live = [n for n in ["scheduler", *[f"server{s}" for s in range(self.args.servers)], *self.live.values()]]
        c.wait_for("every live node to exit", lambda: all(c.procs[n].poll() is not None for n in live), EVENT_BOUND)
        failed = {n: c.procs[n].returncode for n in live if c.procs[n].returncode != 0}
        if failed:
            raise AssertionError(f"nodes exited with {failed}\n{c.report(list(failed))}")
        return self.check(last)

    def check(self, last):
        c = self.cluster
        sequence = events_of(c.text("scheduler"))
        assert len(sequence) == len(self.rows), (sequence, self.rows)
        for name in c.procs:  # each node's events: the scheduler's, from its first on (a dead one's stop early)
            mine, first = events_of(c.text(name)), self.first_event.get(name, 0)
            whole = name in self.nodes()
            if name.startswith("worker") or name.startswith("server"):
                assert mine == sequence[first:first + len(mine)] and (not whole or first + len(mine) == len(sequence)), \
                    f"{name} logged {mine}, the scheduler {sequence[first:]}"
        members = [(0, list(range(self.args.workers)))] + [(g, list(m)) for _, _, _, g, m in sequence]
        epochs = [(0, 0)] + [(g, e) for _, _, e, g, _ in sequence]
        hosts = {r: np.load(os.path.join(self.out, f"rank{r}.{self.start_of(n)}.npz")) for r, n in self.live.items()}
        if self.args.task == "mnist":  # no numpy oracle for torch's training: the hosts agree
            return chaos_mnist.check(hosts, members, epochs, last, self.args.scale_lr)
        equal_numpy(hosts, members, epochs, last, "worker")
        return last

    def start_of(self, name):
        match = re.search(r"^START (\d+)", self.cluster.text(name), re.M)
        return int(match.group(1))


def table(rows):
    lines = [f"{'#':>3} {'event':<6} {'rank':>4} {'at step':>8} {'epoch':>6} {'from step':>9} {'seconds':>8} "
             f"{elastic_lost.HEADER}  members"]
    lines += [f"{r['n']:>3} {r['event']:<6} {r['rank']:>4} {r['at_step']:>8} {r['epoch']:>6} {r['from_step']:>9} "
              f"{r['seconds']:>8} {elastic_lost.cells(r)}  {r['members']} {r['note']}" for r in rows]
    return "\n".join(lines)


def run(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=60, help="deaths and joins in all (at most)")
    parser.add_argument("--seconds", type=float, default=600, help="no new event after this many seconds")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--max-gap", type=int, default=8, help="steps between events: 1 to this many")
    parser.add_argument("--overlap", type=float, default=0.2,
                        help="the share of joins during which a member dies (the join is cancelled)")
    parser.add_argument("--heartbeat-timeout", type=float, default=2.0)
    parser.add_argument("--task", choices=["synthetic", "mnist"], default="synthetic",
                        help="synthetic: numpy gradients checked against numpy; mnist: "
                             "example/pytorch/train_mnist_elastic.py, its final loss beside undisturbed runs")
    parser.add_argument("--baseline-seeds", type=int, default=3, help="--task mnist: undisturbed runs to compare with")
    parser.add_argument("--model-seed", type=int, default=0, help="--task mnist: the churned run's example --seed")
    parser.add_argument("--scale-lr", type=float, metavar="R", help="--task mnist: every run's (churned, "
                        "undisturbed, replayed) lr is 0.1 x its step's hosts / R (the linear scaling rule)")
    parser.add_argument("--out", help="folder for the nodes' logs and arrays (a new temporary one)")
    parser.add_argument("--json", default="chaos_elastic.json")
    args = parser.parse_args(argv)
    if args.workers < 2:
        parser.error("--workers must be at least 2: one host always stays")
    if args.scale_lr is not None and not (math.isfinite(args.scale_lr) and args.scale_lr > 0):
        parser.error(f"--scale-lr must be a positive number of hosts, not {args.scale_lr:g}")
    if args.scale_lr is not None and args.task != "mnist":
        parser.error("--scale-lr is for --task mnist (the synthetic task has no learning rate)")
    out = args.out or tempfile.mkdtemp(prefix="chaos_elastic.")
    os.makedirs(out, exist_ok=True)
    print(f"chaos: {args.workers} worker hosts, {args.servers} servers, seed {args.seed}, up to {args.events} "
          f"events in {args.seconds:g} s; logs in {out}", flush=True)
    chaos = Chaos(args, out)
    summary = {"ok": False, "error": None, "machine": machine_info(), "load_before": elastic_lost.load()}
    try:
        last = chaos.run()
        summary.update(ok=True, steps=last + 1)
    except AssertionError as e:
        summary["error"] = str(e)
    rows = chaos.rows
    if hasattr(chaos, "cluster"):
        chaos.measure()
    summary.update(lost=elastic_lost.summary(rows), heartbeat_timeout=args.heartbeat_timeout,
                   load_after=elastic_lost.load())
    seconds = time.monotonic() - chaos.started
    summary.update(events=len(rows), deaths=sum(r["event"] == "death" for r in rows),
                   joins=sum(r["event"] == "join" for r in rows),
                   cancelled=sum("cancelled" in r["note"] for r in rows), seconds=round(seconds, 1),
                   workers=args.workers, servers=args.servers, seed=args.seed, out=out,
                   port=getattr(getattr(chaos, "cluster", None), "port", None))
    if summary["ok"] and args.task == "mnist":
        summary["mnist"] = chaos_mnist.compare(Cluster, chaos, args, out, summary["steps"])
    print(table(rows))
    print(elastic_lost.line(summary["lost"], args.heartbeat_timeout))
    print(f"box: {summary['machine']}; load average before {summary['load_before']}, after {summary['load_after']}")
    if summary["error"]:
        print(summary["error"][-6000:], file=sys.stderr)
    print(f"summary: {'OK' if summary['ok'] else 'FAILED'}: {summary['events']} events ({summary['deaths']} deaths, "
          f"{summary['joins']} joins, {summary['cancelled']} joins cancelled by a death) in {summary['seconds']} s, {summary.get('steps', '?')} steps, "
          f"{args.workers} worker hosts, seed {args.seed}; every node logged every event, live hosts "
          + ("bit-identical and equal to numpy" if args.task == "synthetic" else "bit-identical")
          + chaos_mnist.line(summary.get("mnist")) if summary["ok"] else f"summary: FAILED after {len(rows)} events")
    with open(args.json, "w") as f:
        json.dump({"summary": summary, "events": rows}, f, indent=1)
    return summary


if __name__ == "__main__":
    sys.exit(0 if run()["ok"] else 1)
