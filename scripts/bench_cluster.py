"""bench_pushpull: starting one cluster's processes (loopback or two shaped network namespaces),
waiting for them with a timeout, and always stopping them (bps_gc's launcher supervisor)."""
import os
import subprocess
import time


from bench_common import DROPPED_ENV, DROPPED_ENV_PREFIXES, KILL_GRACE, LOOPBACK, NODE_EXIT_SECONDS, PY, ROOT, SCRIPT

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


def wait_all(children, deadline):
    """Wait until all exit or the deadline; returns the first child that failed (or None)."""
    while True:
        for c in children:
            rc = c.proc.poll()
            if rc is not None and rc != 0:
                return c
        if all(c.proc.poll() is not None for c in children) or time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def child_env(extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(DROPPED_ENV_PREFIXES) and k not in DROPPED_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


class Loopback:
    """Everything on 127.0.0.1 in this namespace."""
    name = "loopback"
    srv_host = wrk_host = LOOPBACK
    veth = None

    def wrap(self, side, argv):
        return argv

    def port(self):
        return free_port()


class Shaped:
    """Scheduler and server in one namespace, workers in the other (scripts/netns.py)."""

    def __init__(self, link):
        self.link = link
        self.name = link.rate
        self.srv_host, self.wrk_host = link.addr["srv"], link.addr["wrk"]
        self.veth = link.veth["wrk"]
        self._port = 9300

    def wrap(self, side, argv):
        return self.link.command(side, argv)

    def port(self):  # fresh namespaces: nothing else listens there; a new port per cluster
        self._port += 1
        return self._port


class ClusterFailed(RuntimeError):
    pass


def run_cluster(children, plan, worker_names, timeout, log_dir):
    """Start [(name, argv, env)], wait for the workers (timeout), then the rest; stop all."""
    started = []
    try:
        for name, argv, env in plan:
            started.append(children.start(name, argv, env, log_dir))
            if name in ("scheduler", "server"):
                time.sleep(0.2)  # let it bind before the others connect (both sides retry anyway)
        workers = [c for c in started if c.name in worker_names]
        deadline = time.monotonic() + timeout
        failed = wait_all(workers, deadline)
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


def bps_plan(config, topo, args, result_dir, log_dir, rounds, warmup):
    worker_cmd = [PY, SCRIPT, "_bps-worker", "--config", config, "--warmup", str(warmup),
                  "--rounds", str(rounds), "--result-dir", result_dir]
    if args.profile:
        worker_cmd.append("--profile")
    if isinstance(topo, Loopback) and not args.profile:
        argv = [PY, "-m", "bps_gc.launcher.cli", "--local", "--workers", "2", "--servers", "1",
                "--", *worker_cmd]
        return [("bpslaunch-local", argv, child_env({}))], {"bpslaunch-local"}
    port = topo.port()
    common = {"DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": topo.srv_host,
              "DMLC_PS_ROOT_PORT": str(port), "BYTEPS_NUMA_ON": "0"}
    launch = [PY, "-m", "bps_gc.launcher.cli"]
    plan = [("scheduler", topo.wrap("srv", launch),
             child_env({**common, "DMLC_ROLE": "scheduler", "DMLC_NODE_HOST": topo.srv_host}))]
    server_cmd = launch
    if args.profile:
        server_cmd = [PY, SCRIPT, "_profiled-node", os.path.join(result_dir, "server-profile.txt")]
    plan.append(("server", topo.wrap("srv", server_cmd),
                 child_env({**common, "DMLC_ROLE": "server", "DMLC_NODE_HOST": topo.srv_host})))
    for w in range(2):
        env = {**common, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(w),
               "DMLC_NODE_HOST": topo.wrk_host}
        if topo.veth:
            env["BENCH_VETH"] = topo.veth
        plan.append((f"worker{w}", topo.wrap("wrk", launch + worker_cmd), child_env(env)))
    return plan, {"worker0", "worker1"}


def mx_plan(config, topo, result_dir, rounds, warmup):
    port = topo.port()
    common = {"DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": topo.srv_host,
              "DMLC_PS_ROOT_PORT": str(port)}
    node = [PY, "-c", "import mxnet"]
    plan = [("scheduler", topo.wrap("srv", node),
             child_env({**common, "DMLC_ROLE": "scheduler", "DMLC_NODE_HOST": topo.srv_host})),
            ("server", topo.wrap("srv", node),
             child_env({**common, "DMLC_ROLE": "server", "DMLC_NODE_HOST": topo.srv_host}))]
    worker_cmd = [PY, SCRIPT, "_mx-worker", "--config", config, "--warmup", str(warmup),
                  "--rounds", str(rounds), "--result-dir", result_dir]
    for w in range(2):
        env = {**common, "DMLC_ROLE": "worker", "DMLC_NODE_HOST": topo.wrk_host}
        if topo.veth:
            env["BENCH_VETH"] = topo.veth
        plan.append((f"worker{w}", topo.wrap("wrk", worker_cmd), child_env(env)))
    return plan, {"worker0", "worker1"}


