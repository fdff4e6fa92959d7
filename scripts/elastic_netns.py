#!/usr/bin/env python3
"""Issue 41's death and join targets in network namespaces, as users run the job
(BPS_GC_ELASTIC=1; docs/elastic.md).

Every node on its own "machine" (scripts/netns.py's SwitchedMachines: a namespace with one NIC
on a switch): the scheduler, the server, --workers worker hosts (one bpslaunch each, with
NVIDIA_VISIBLE_DEVICES naming --local-ranks devices, as BytePS's recipe runs them) and a spare
machine for the host that joins. The hosts train either
  * onebit: p -= lr * mean of a dense tensor and a onebit tensor with error feedback
    (scripts/chaos_worker.py), or
  * diloco: the small MLP under DiLoCo with the outer step on the servers (H = 4, every
    element sent exactly; tests/elastic_diloco_job.py).
Once the job is a seeded number of steps (outer rounds) in, one local rank of a seeded host is
killed with SIGKILL (its launcher stops the host's other rank); a few steps after the death's
epoch a fresh host on the spare machine starts with the dead host's DMLC_WORKER_ID and joins
(a host of 2 local ranks joins as a unit). It checks:

  * every process started once ends with status 0 (none restarted, none lost but the victim);
  * every node logged the same membership sequence (the joiner from its join on);
  * onebit: the live ranks' parameters, step by step (a CRC) and at the end, are bit-identical
    and equal a numpy recomputation of that sequence (tests/reference.py's elastic_means);
    diloco: every live rank's global copy at every outer round, and the servers' copy at the
    end, equal a numpy outer SGD over the pseudo-gradients of each round's members;
  * the joiner's parameters after its first round equal the others';
  * with --half-join, two hosts started first cannot join and the job goes on: one whose last
    local rank dies once registered (dropped when it goes silent), then one whose last local
    rank never registers (its join cancelled after its BPS_GC_JOIN_TIMEOUT, its registered
    ranks refused in one line naming the missing rank, its launcher ending, no orphan);

and measures the time lost on the survivors against the heartbeat timeout plus one round
(scripts/elastic_lost.py): a report, not a check.

    python scripts/elastic_netns.py --task onebit --local-ranks 1 --seed 1
Root only (network namespaces); it prints a summary line and writes --json.
"""
import argparse
import json
import os
import signal
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "tests")]
import elastic_lost  # noqa: E402
import elastic_netns_check as check  # noqa: E402
from bench_common import machine_info  # noqa: E402
from chaos_elastic import SPEC, Cluster, Hang  # noqa: E402
from netns import SwitchedMachines  # noqa: E402

BOUND = 90.0
LAME_BOUND = 2  # --half-join: the BPS_GC_JOIN_TIMEOUT of the host one of whose ranks never registers
DILOCO = {"sync_every": 4, "victim": -1, "kill_at": -1, "sleep": 0.05, "save_each_round": True, "max_rounds": 10**6,
          "join_epoch": 10**6, "after_join": 1,
          "compression_params": {"compressor": "threshold", "threshold": 0.0}}


def local_rank_pid(launcher, local_rank):
    """PID of the process a bpslaunch started for ``local_rank`` (its BYTEPS_LOCAL_RANK)."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != launcher:
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if f"BYTEPS_LOCAL_RANK={local_rank}".encode() in env or (local_rank == 0 and not any(
                e.startswith(b"BYTEPS_LOCAL_RANK=") for e in env)):
            return int(entry)
    raise Hang(f"no local rank {local_rank} under launcher {launcher}")


class Run:
    def __init__(self, args, net, out):
        self.args, self.net, self.out = args, net, out
        self.rng = np.random.default_rng(args.seed)
        self.local = args.local_ranks
        workers = args.workers
        # machine 0: the scheduler, 1: the server, 2..: the worker hosts, the last: the joiner's
        machine = {"scheduler": 0, "server0": 1, **{f"worker{h}.0": 2 + h for h in range(workers)}}
        self.joiner_machine = 2 + workers
        place = lambda name: net.command(machine.get(name, self.joiner_machine), [])  # noqa: E731
        stop = {"stop_file": os.path.join(out, "stop")}  # every host stops at the step written there
        if args.task == "onebit":
            spec, command = dict(SPEC, **stop), None  # chaos_worker.py
        else:
            spec = dict(DILOCO, **stop)
            command = [sys.executable, os.path.join(ROOT, "tests", "elastic_diloco_job.py"), os.path.join(out, "spec.json"), out]
        with open(os.path.join(out, "spec.json"), "w") as f:
            json.dump(spec, f)
        self.spec = spec
        devices = {"NVIDIA_VISIBLE_DEVICES": ",".join(map(str, range(self.local)))} if self.local > 1 else {}
        self.cluster = Cluster(workers, 1, out, args.heartbeat_timeout, command, place,
                               env={"DMLC_PS_ROOT_URI": net.addr[0], "OMP_NUM_THREADS": "1"}, worker_env=devices)
        self.live = {h: f"worker{h}.0" for h in range(workers)}

    def nodes(self):
        return ["scheduler", "server0", *self.live.values()]

    def last(self):
        return max(self.cluster.last_step(n) for n in self.live.values())

    def reach(self, step, bound=BOUND):
        c = self.cluster
        c.wait_for(f"step {step}", lambda: self.last() >= step, bound, self.nodes())

    def logged(self, count, joiner=None):
        """Every live node logged ``count`` events (a host's launcher prints each rank's line; the
        joiner its own join on)."""
        c = self.cluster
        need = {n: count * (self.local if n.startswith("worker") else 1) for n in self.nodes()}
        if joiner:
            need[joiner] = self.local
        return all(len(c.events[n]) >= k for n, k in need.items())

    def run(self):
        c, args, rng = self.cluster, self.args, self.rng
        c.wait_for("the first step from every worker", lambda: all(c.last_step(n) >= 0 for n in self.live.values()),
                   BOUND, self.nodes())
        kill_step = int(rng.integers(args.kill_after[0], args.kill_after[1] + 1))
        host, local_rank = int(rng.integers(args.workers)), int(rng.integers(self.local))
        self.reach(kill_step)
        name = self.live.pop(host)
        pid = local_rank_pid(c.procs[name].pid, local_rank)
        at = self.last()
        self.death = {"kill": time.monotonic(), "survivors": list(self.live.values())}
        os.kill(pid, signal.SIGKILL)
        c.wait_for("the death's epoch on every node", lambda: self.logged(1), BOUND, self.nodes())
        c.wait_for(f"{name}'s launcher to exit", lambda: c.procs[name].poll() is not None, BOUND)
        self.death.update(name=name, host=host, local_rank=local_rank, at=at, seeded_step=kill_step,
                          committed=c.event_times["scheduler"][0])
        self.reach(self.last() + int(rng.integers(2, 6)))
        if args.half_join:
            self.half_joins(host)
        joiner = self.joiner = c.start_worker(host)  # on the spare machine, all its local ranks
        c.wait_for("the join on every node", lambda: self.logged(2, joiner), BOUND, self.nodes() + [joiner])
        self.live[host] = joiner
        return self.finish()

    def half_joins(self, host):
        """Before the host that joins, two that cannot, the job going on through both: "half",
        whose last local rank dies (SIGKILL) once registered (its launcher stops the others; the
        scheduler drops the join when a registered rank goes silent), then "lame", whose last
        local rank hangs before it registers: the scheduler cancels that join after the host's
        BPS_GC_JOIN_TIMEOUT (LAME_BOUND) and refuses its registered ranks, naming the missing one."""
        c, self.lame_bound = self.cluster, LAME_BOUND
        c.launch("half", c.command, DMLC_ROLE="worker", DMLC_WORKER_ID=str(host), **c.worker_env,
                 ELASTIC_DIE_AFTER_INIT=str(self.local - 1))
        c.wait_for("the failing host's launcher to exit", lambda: c.procs["half"].poll() is not None, BOUND,
                   self.nodes())
        ended = time.monotonic()
        c.wait_for("the scheduler to drop the failing host's join",
                   lambda: "left before it was admitted" in c.text("scheduler"), BOUND, self.nodes())
        # each of its ranks that registered died by its launcher's end: all are noticed silent by then
        time.sleep(max(0.0, ended + self.args.heartbeat_timeout + 0.5 - time.monotonic()))
        c.launch("lame", c.command, DMLC_ROLE="worker", DMLC_WORKER_ID=str(host), **c.worker_env,
                 ELASTIC_HANG_BEFORE_INIT=str(self.local - 1), BPS_GC_JOIN_TIMEOUT=str(LAME_BOUND))
        c.wait_for("the lame host's launcher to exit", lambda: c.procs["lame"].poll() is not None, BOUND,
                   self.nodes())

    def finish(self):
        c = self.cluster
        with open(os.path.join(self.out, "stop.tmp"), "w") as f:
            f.write(str(self.last() + 10))
        os.replace(os.path.join(self.out, "stop.tmp"), os.path.join(self.out, "stop"))
        c.wait_for("every live node to exit", lambda: all(c.procs[n].poll() is not None for n in self.nodes()), BOUND)
        return check.everything(self)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=["onebit", "diloco"], default="onebit")
    parser.add_argument("--local-ranks", type=int, choices=[1, 2], default=1)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kill-after", type=int, nargs=2, default=[5, 15], metavar=("LOW", "HIGH"),
                        help="the kill comes once the job is a seeded step (outer round) in [LOW, HIGH] in")
    parser.add_argument("--half-join", action="store_true",
                        help="before the join, a host whose last local rank dies once registered, then one whose last "
                             "local rank never registers (both refused)")
    parser.add_argument("--heartbeat-timeout", type=float, default=2.0)
    parser.add_argument("--rate", default="10gbit", help="each machine's NIC (scripts/netns.py)")
    parser.add_argument("--out", help="the nodes' logs and arrays (a new temporary folder)")
    parser.add_argument("--json", default="elastic_netns.json")
    args = parser.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="elastic_netns.")
    os.makedirs(out, exist_ok=True)
    summary = {"ok": False, "error": None, "task": args.task, "local_ranks": args.local_ranks, "workers": args.workers,
               "seed": args.seed, "machine": machine_info(), "load_before": elastic_lost.load(), "out": out}
    started = time.monotonic()
    with SwitchedMachines(args.rate, args.workers + 3, tag=f"{os.getpid() % 100000}e") as net:
        run = Run(args, net, out)
        summary["port"] = run.cluster.port
        try:
            summary.update(run.run())
            summary["ok"] = True
        except AssertionError as e:
            summary["error"] = str(e)
        finally:
            run.cluster.kill_all()
    summary.update(seconds=round(time.monotonic() - started, 1), load_after=elastic_lost.load())
    print(check.line(summary, args))
    if summary["error"]:
        print(summary["error"][-6000:], file=sys.stderr)
    with open(args.json, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
