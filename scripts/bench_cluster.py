"""bench_pushpull: starting one cluster's processes (loopback or two shaped network namespaces),
waiting for them with a timeout, and always stopping them (bps_gc's launcher supervisor)."""
import os
import re
import sys
import subprocess
import time


from bench_common import CONFIG_ENV, DROPPED_ENV, DROPPED_ENV_PREFIXES, KILL_GRACE, LOOPBACK, NODE_EXIT_SECONDS, PY, ROOT, SCRIPT, \
    pythonpath

from bps_gc.launcher.local import free_port
from bps_gc.launcher.supervisor import Supervisor


class Children:
    """Every process the driver started, under bps_gc's launcher supervisor (own process group,
    dies with the driver even on SIGKILL, SIGTERM then SIGKILL, reaped, group swept); each
    child's output goes to its own log file."""

    def __init__(self):
        self.supervisor = Supervisor(KILL_GRACE)

    def start(self, name, argv, env, log_dir):
        log_path = os.path.join(log_dir, f"{name}.log")
        with open(log_path, "ab") as log:
            child = self.supervisor.start(name, argv, env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        child.log_path = log_path
        return child

    def stop(self, children):
        """Stop the running ones of ``children`` (a cluster's: every earlier one is stopped)."""
        if any(c.proc.poll() is None for c in children):
            self.supervisor.stop_all()
        self.supervisor.sweep()

    def stop_all(self):
        self.supervisor.stop_all()
        self.supervisor.sweep()


def log_tail(child, lines=25):
    try:
        with open(child.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def wait_all(children, deadline, tick=None):
    """Wait until all exit or the deadline; returns the first child that failed (or None).
    ``tick()``, if given, runs on every poll (a progress bar reading the children's logs)."""
    while True:
        for c in children:
            rc = c.proc.poll()
            if rc is not None and rc != 0:
                return c
        if tick is not None:
            tick()
        if all(c.proc.poll() is not None for c in children) or time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


class RowsProgress:
    """A progress bar over a benchmark's rows, for runs whose ranks write to log files: rank 0
    prints ``<row>: ...`` as each row ends (under bpslaunch with a ``[label] `` in front), and
    ``follow(log_path)`` then calling the object, on every poll, reads what the log gained."""
    LABEL = re.compile(r"^\[[^\]]*\] ")

    def __init__(self, rows, desc="rows", unit="row"):
        from tqdm import tqdm
        self.rows, self.done = set(rows), set()
        self.bar = tqdm(total=len(self.rows), desc=desc, unit=unit, file=sys.stderr)
        self.path, self.offset, self.partial, self.next_read = None, 0, "", 0.0

    def follow(self, log_path, desc=None):
        """Read ``log_path`` from its end on: a log appended to by an earlier run has been read."""
        self(force=True)
        self.path, self.partial = log_path, ""
        self.offset = os.path.getsize(log_path) if os.path.exists(log_path) else 0
        if desc:
            self.bar.set_description(desc)

    def __call__(self, force=False):
        now = time.monotonic()
        if self.path is None or (now < self.next_read and not force):
            return
        self.next_read = now + 0.5  # a log read twice a second is plenty for a bar
        try:
            with open(self.path, errors="replace") as f:
                f.seek(self.offset)
                text = f.read()
                self.offset = f.tell()
        except OSError:
            return
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            row = self.LABEL.sub("", line).split(": ", 1)[0]
            if row in self.rows and row not in self.done:
                self.done.add(row)
                self.bar.set_postfix_str(row[:40])
                self.bar.update(1)

    def close(self):
        self(force=True)
        self.bar.close()


def child_env(extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(DROPPED_ENV_PREFIXES) and k not in DROPPED_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = pythonpath(ROOT)
    env.update(extra)
    return env


class Loopback:
    """Everything on 127.0.0.1 in this namespace (one machine)."""
    name = "loopback"

    def host(self, machine):
        return LOOPBACK

    def wrap(self, machine, argv):
        return argv

    def veth(self, machine):
        return None

    def port(self):
        return free_port()


class Switched:
    """One namespace per machine on a shaped switch (scripts/netns.py SwitchedMachines)."""

    def __init__(self, net):
        self.net = net
        self.name = net.rate
        self._port = 9300

    def host(self, machine):
        return self.net.addr[machine]

    def wrap(self, machine, argv):
        return self.net.command(machine, argv)

    def veth(self, machine):
        return self.net.veth[machine]

    def port(self):  # fresh namespaces: nothing else listens there; a new port per cluster
        self._port += 1
        return self._port


PLACEMENTS = {
    "colocated": "one server per worker machine (BytePS's co-located mode); scheduler on machine 0",
    "separate": "one server per worker, each on its own machine; scheduler on machine 0",
}


def machines_needed(workers, placements):
    return workers * (2 if "separate" in placements else 1)


def server_machines(workers, placement):
    return list(range(workers)) if placement == "colocated" else list(range(workers, 2 * workers))


class ClusterFailed(RuntimeError):
    pass


def failure_lines(e, limit=3000):
    """A ClusterFailed's message and the last ``limit`` characters of its started children's log
    tails, for a script's one-line exit."""
    tails = "\n".join(f"--- {c.name}\n{log_tail(c)}" for c in (e.args[1] if len(e.args) > 1 else []))
    return f"{e.args[0]}\n{tails[-limit:]}"


def run_or_exit(children, plan, worker_names, timeout, log_dir, what, limit=3000, tick=None):
    """run_cluster, then stop every child; a cluster that failed ends the script in one message
    naming ``what``, with its children's log tails. ``tick()`` on every poll (a RowsProgress)."""
    try:
        run_cluster(children, plan, worker_names, timeout, log_dir, tick)
    except ClusterFailed as e:
        sys.exit(f"{what} failed: {failure_lines(e, limit)}")
    finally:
        children.stop_all()


def run_cluster(children, plan, worker_names, timeout, log_dir, tick=None):
    """Start [(name, argv, env)], wait for the workers (timeout; ``tick()`` on every poll), then
    the rest; stop all."""
    started = []
    try:
        for name, argv, env in plan:
            started.append(children.start(name, argv, env, log_dir))
            if name == "scheduler" or name.startswith("server"):
                time.sleep(0.2)  # let it bind before the others connect (both sides retry anyway)
        workers = [c for c in started if c.name in worker_names]
        deadline = time.monotonic() + timeout
        failed = wait_all(workers, deadline, tick)
        if failed is None and any(c.proc.poll() is None for c in workers):
            raise ClusterFailed(f"timed out after {timeout:.0f} s", started)
        if failed is None:
            # workers done: scheduler and servers should exit by themselves
            failed = wait_all(started, time.monotonic() + NODE_EXIT_SECONDS)
            lingering = [c.name for c in started if c.proc.poll() is None]
            if failed is None and lingering:
                return started, f"{', '.join(lingering)} still running {NODE_EXIT_SECONDS} s " \
                                 "after the workers finished (killed)"
        if failed is not None:
            raise ClusterFailed(f"{failed.name} exited with status {failed.proc.returncode}", started)
        return started, None
    finally:
        children.stop(started)


def cluster_env(topo, workers, servers, port):
    return {"DMLC_NUM_WORKER": str(workers), "DMLC_NUM_SERVER": str(servers),
            "DMLC_PS_ROOT_URI": topo.host(0), "DMLC_PS_ROOT_PORT": str(port), "BYTEPS_NUMA_ON": "0"}


def worker_env(topo, common, w, local_ranks=1):
    """Machine ``w``'s worker launcher; with ``local_ranks`` > 1 bpslaunch starts that many
    processes, one per entry of NVIDIA_VISIBLE_DEVICES, as BytePS's recipe runs its GPUs."""
    env = {**common, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(w), "DMLC_NODE_HOST": topo.host(w)}
    if local_ranks > 1:
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(str(d) for d in range(local_ranks))
    if topo.veth(w):
        env["BENCH_VETH"] = topo.veth(w)
    return env


def node_plan(topo, common, servers, node_cmd, server_cmd=None):
    """Scheduler on machine 0, then the servers on their machines."""
    plan = [("scheduler", topo.wrap(0, node_cmd),
             child_env({**common, "DMLC_ROLE": "scheduler", "DMLC_NODE_HOST": topo.host(0)}))]
    for i, m in enumerate(servers):
        plan.append((f"server{i}", topo.wrap(m, server_cmd or node_cmd),
                     child_env({**common, "DMLC_ROLE": "server", "DMLC_NODE_HOST": topo.host(m)})))
    return plan


def bps_plan(config, topo, args, result_dir, rounds, warmup, workers, placement):
    """bps_gc: `workers` worker machines 0..workers-1 of args.local_ranks ranks each (the
    scheduler and servers are not told: they learn it at join), servers placed by ``placement``."""
    local = getattr(args, "local_ranks", 1)
    worker_cmd = [PY, SCRIPT, "_bps-worker", "--config", config, "--warmup", str(warmup),
                  "--rounds", str(rounds), "--result-dir", result_dir,
                  "--tensors", str(args.tensors), "--elements", str(getattr(args, "elements", 0))]
    if args.profile:
        worker_cmd.append("--profile")
    servers = server_machines(workers, placement)
    names = {f"worker{w}" for w in range(workers)}
    extra = CONFIG_ENV.get(config, {})
    if isinstance(topo, Loopback) and not args.profile:
        argv = [PY, "-m", "bps_gc.launcher.cli", "--local", "--workers", str(workers),
                "--servers", str(len(servers)), "--local-size", str(local), "--", *worker_cmd]
        return [("bpslaunch-local", argv, child_env(extra))], {"bpslaunch-local"}
    common = dict(cluster_env(topo, workers, len(servers), topo.port()), **extra)
    launch = [PY, "-m", "bps_gc.launcher.cli"]
    server_cmd = None
    if args.profile:
        server_cmd = [PY, SCRIPT, "_profiled-node", os.path.join(result_dir, "server-profile.txt")]
    plan = node_plan(topo, common, servers, launch, server_cmd)
    for w in range(workers):
        plan.append((f"worker{w}", topo.wrap(w, launch + worker_cmd),
                     child_env(worker_env(topo, common, w, local))))
    return plan, names


def mx_plan(config, topo, args, result_dir, rounds, warmup, workers, placement):
    """ps-lite the MXNet way (`import mxnet` with DMLC_ROLE set), placed like bps_gc."""
    servers = server_machines(workers, placement)
    common = cluster_env(topo, workers, len(servers), topo.port())
    del common["BYTEPS_NUMA_ON"]
    plan = node_plan(topo, common, servers, [PY, "-c", "import mxnet"])
    worker_cmd = [PY, SCRIPT, "_mx-worker", "--config", config, "--warmup", str(warmup),
                  "--rounds", str(rounds), "--result-dir", result_dir, "--tensors", str(args.tensors),
                  "--elements", str(getattr(args, "elements", 0))]
    for w in range(workers):
        env = worker_env(topo, common, w)
        del env["DMLC_WORKER_ID"]  # ps-lite numbers its workers itself
        plan.append((f"worker{w}", topo.wrap(w, worker_cmd), child_env(env)))
    return plan, {f"worker{w}" for w in range(workers)}
