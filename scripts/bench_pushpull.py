#!/usr/bin/env python3
"""End-to-end push_pull benchmark: bps_gc against MXNet's ps-lite parameter server.

ResNet-50 v1b gradients (tests/data/resnet50_shapes.json: 161 float32 tensors, 25.56M floats,
102.2 MB), random normal * 1e-3, generated once per worker and pushed every round. 2 workers and
1 server. A round is push_pull of all 161 tensors (priority -i) followed by waiting for all of
them; the time reported is worker 0's median over the timed rounds (after warm-up rounds).

bps_gc configurations: dense, onebit+EF (scaling), topk 0.1%, topk 1%, randomk 0.1%,
dithering k=2. ps-lite: mx.kv.create('dist_sync'), dense and 2bit (threshold 0.5), with its
scheduler and server started as MXNet does (`python -c "import mxnet"` with DMLC_ROLE set).

    python scripts/bench_pushpull.py --quick              # smoke run: dense + onebit, < 1 min
    python scripts/bench_pushpull.py                      # loopback, 2 warm-up + 10 timed rounds
    python scripts/bench_pushpull.py --shaped 1gbit       # root: two netns, veth shaped by tbf
    python scripts/bench_pushpull.py --shaped 100mbit --shaped-rounds 2

Loopback runs bps_gc with `bpslaunch --local`; --shaped puts the scheduler and server in one
network namespace and both workers in another, joined by a veth pair whose ends are each shaped
with `tc ... tbf rate RATE` (scripts/netns.py), and starts each role separately (DMLC_ROLE=...).
There the bytes that crossed the veth are counted too (/proc/net/dev in the workers'
namespace). Columns:
  s/round    worker 0's median seconds per round (min and max beside it)
  push/pull MB  bytes on the wire per round per worker as bps_gc counts them (bps.metrics())
  link MB/w  --shaped: bytes that crossed the veth per round per worker (both directions,
             including TCP/IP and framing overhead)
  GB/s/w     uncompressed bytes pushed per round per worker / round time
  CPU%       how busy the whole machine's CPUs were during worker 0's timed rounds (/proc/stat;
             100 = all CPUs busy: the run is CPU-bound, or something else was running)
  w CPU s    CPU seconds per round used by each worker process (all its threads)
  vs ps-lite round time / ps-lite dense round time measured in the same run
JSON goes to out/bench_pushpull.json (loopback) or out/bench_pushpull_<rate>.json (--shaped)
unless --json says otherwise. Every child process has a timeout and is killed (by PID, with its
process group) when the benchmark ends; the namespaces are always deleted.

BYTEPS_* / BPS_GC_* variables in the environment (e.g. BYTEPS_PARTITION_BYTES) are passed to
bps_gc and recorded in the JSON; DMLC_*, PS_* and MXNET_KVSTORE_BIGARRAY_BOUND are not (ps-lite
runs with its default big-array bound). --profile also cProfiles every thread of bps_gc's worker
0 and server (bps_gc configurations then run with separately started roles) and prints the top
functions.
"""
import argparse
import contextlib
import ctypes
import datetime
import io
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from bps_gc.launcher.local import free_port

SCRIPT = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(SCRIPT))
SHAPES_FILE = os.path.join(ROOT, "tests", "data", "resnet50_shapes.json")
MODEL = "resnet50_v1b"
PY = sys.executable
LOOPBACK = "127.0.0.1"

BPS_CONFIGS = {
    "dense": {},
    "onebit+EF": {"compressor": "onebit", "scaling": True, "ef": "vanilla"},
    "topk 0.1%": {"compressor": "topk", "k": 0.001},
    "topk 1%": {"compressor": "topk", "k": 0.01},
    "randomk 0.1%": {"compressor": "randomk", "k": 0.001},
    "dithering k=2": {"compressor": "dithering", "k": 2},
}
PSLITE_CONFIGS = {"dense": None, "2bit": {"type": "2bit", "threshold": 0.5}}
QUICK_BPS = ("dense", "onebit+EF")
QUICK_PSLITE = ("dense",)
# Reference numbers from the issue (seconds per round, same cluster shape and gradients).
PSLITE_REFERENCE = {"loopback": {"dense": 0.215}, "1gbit": {"dense": 2.71, "2bit": 1.91}}
# Targets from the issue: bps_gc seconds per round at most this.
BPS_TARGETS = {"1gbit": {"onebit+EF": 0.25, "topk 0.1%": 0.2}}
# Not passed to children: they describe a cluster (we set our own) or change ps-lite's defaults.
DROPPED_ENV_PREFIXES = ("DMLC_", "PS_")
DROPPED_ENV = ("MXNET_KVSTORE_BIGARRAY_BOUND", "BYTEPS_LOCAL_RANK", "BYTEPS_LOCAL_SIZE",
               "BPS_GC_PORT", "BENCH_VETH", "NVIDIA_VISIBLE_DEVICES")
NODE_EXIT_SECONDS = 30     # scheduler/servers get this long to exit after the workers finished
KILL_GRACE = 5


# =====================================================================================
# shared by the driver and the worker processes

def import_netns():
    """scripts/netns.py, wherever this script is run from."""
    if os.path.dirname(SCRIPT) not in sys.path:
        sys.path.insert(0, os.path.dirname(SCRIPT))
    import netns
    return netns


def load_shapes():
    with open(SHAPES_FILE) as f:
        return [tuple(int(d) for d in s) for s in json.load(f)[MODEL]]


def make_grad(shape, rank, index):
    """Worker ``rank``'s gradient for tensor ``index`` (reproducible anywhere, for checks)."""
    rng = np.random.default_rng([rank, index])
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(1e-3)


def link_counters():
    """(tx, rx) bytes of the veth named in BENCH_VETH, from this namespace's /proc/net/dev."""
    dev = os.environ.get("BENCH_VETH")
    if not dev:
        return None
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == dev:
                    fields = rest.split()
                    return int(fields[8]), int(fields[0])  # tx bytes, rx bytes
    except OSError:
        return None
    return None


def cpu_counters():
    """(busy, total) jiffies of the whole machine, and this process's CPU seconds."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        fields = None
    t = os.times()
    if fields is None:
        return None, t.user + t.system
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return (total - idle, total), t.user + t.system


def cpu_delta(before, after, rounds):
    machine = None
    if before[0] is not None and after[0] is not None and after[0][1] > before[0][1]:
        machine = (after[0][0] - before[0][0]) / (after[0][1] - before[0][1])
    return {"machine_busy": machine, "process_cpu_per_round": (after[1] - before[1]) / rounds}


def link_delta(before, after):
    if before is None or after is None:
        return None
    return {"tx_bytes": after[0] - before[0], "rx_bytes": after[1] - before[1]}


def write_json_atomic(path, obj):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


class ThreadProfiler:
    """cProfile in every thread started after install() (and the main thread)."""

    def __init__(self):
        import cProfile
        import threading
        self.cProfile, self.threading = cProfile, threading
        self.profiles = []
        original = threading.Thread.run
        profiles = self.profiles

        def run(thread):
            prof = cProfile.Profile()
            profiles.append((thread.name, prof))
            prof.enable()
            try:
                original(thread)
            finally:
                prof.disable()

        threading.Thread.run = run
        self.main = cProfile.Profile()
        self.profiles.append(("main", self.main))
        self.main.enable()

    def report(self, top=18):
        import pstats
        self.main.disable()
        for thread in self.threading.enumerate():  # let finished threads flush their profiles
            if thread is not self.threading.current_thread() and not thread.daemon:
                thread.join(2)
        out = io.StringIO()
        for name, prof in self.profiles:
            text = io.StringIO()
            try:
                stats = pstats.Stats(prof, stream=text)
            except TypeError:  # nothing recorded
                continue
            total = sum(v[2] for v in stats.stats.values())
            if total < 0.05:
                continue
            stats.sort_stats("tottime").print_stats(top)
            body = text.getvalue()
            start = body.find("   ncalls")
            out.write(f"--- thread {name}: {total:.2f} s total own time\n{body[start:].rstrip()}\n")
        return out.getvalue()


# =====================================================================================
# worker processes (started by the driver through bpslaunch / MXNet's way)

def bps_worker(argv):
    parser = argparse.ArgumentParser(prog="bench_pushpull.py _bps-worker")
    parser.add_argument("--config", required=True, choices=list(BPS_CONFIGS))
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--result-dir", required=True)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    profiler = ThreadProfiler() if args.profile and os.environ.get("DMLC_WORKER_ID") == "0" else None

    import bps_gc.core as bps
    shapes = load_shapes()
    compression = BPS_CONFIGS[args.config]
    t_start = time.perf_counter()
    bps.init()
    rank, size = bps.rank(), bps.size()
    grads = [make_grad(s, rank, i) for i, s in enumerate(shapes)]
    outs = [np.empty_like(g) for g in grads]
    names = [f"{MODEL}.{i}" for i in range(len(shapes))]
    for name, shape in zip(names, shapes):
        bps.declare(name, shape=shape, dtype=np.float32, **compression)
    t_ready = time.perf_counter()

    def one_round():
        t0 = time.perf_counter()
        handles = [bps.push_pull(g, name, average=True, priority=-i, lr=0.1, out=o)
                   for i, (g, name, o) in enumerate(zip(grads, names, outs))]
        t1 = time.perf_counter()
        for h in handles:
            h.wait()
        return time.perf_counter() - t0, t1 - t0

    bps.barrier()
    for _ in range(args.warmup):
        one_round()
    bps.metrics()  # reset the counters
    bps.barrier()
    before, cpu_before = link_counters(), cpu_counters()
    rounds = []
    for _ in range(args.rounds):
        seconds, issue = one_round()
        m = bps.metrics()
        rounds.append({"seconds": seconds, "issue_seconds": issue, "pushed_raw": m.pushed_raw,
                       "pushed_wire": m.pushed_wire, "pulled_raw": m.pulled_raw,
                       "pulled_wire": m.pulled_wire, "compress_seconds": m.compress_seconds,
                       "communicate_seconds": m.communicate_seconds,
                       "wait_seconds": m.wait_seconds})
    cpu = cpu_delta(cpu_before, cpu_counters(), args.rounds)
    bps.barrier()  # the other worker's last replies are in too: count the link after it
    link = link_delta(before, link_counters())
    check = None
    if not compression:  # dense: the result is exactly the average of both workers' gradients
        bad = []
        for i in (0, len(shapes) // 2, len(shapes) - 1, int(np.argmax([g.size for g in grads]))):
            expected = sum(make_grad(shapes[i], r, i) for r in range(size)) / np.float32(size)
            if not np.allclose(outs[i], expected, rtol=1e-5, atol=1e-9):
                bad.append(i)
        check = "ok" if not bad else f"MISMATCH in tensors {bad}"
    result = {"system": "bps_gc", "config": args.config, "rank": rank, "size": size,
              "setup_seconds": t_ready - t_start, "rounds": rounds, "link": link,
              "cpu": cpu, "check": check}
    bps.shutdown()
    if profiler is not None:
        result["profile"] = profiler.report()
    write_json_atomic(os.path.join(args.result_dir, f"bps-w{rank}.json"), result)


def mx_worker(argv):
    parser = argparse.ArgumentParser(prog="bench_pushpull.py _mx-worker")
    parser.add_argument("--config", required=True, choices=list(PSLITE_CONFIGS))
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--result-dir", required=True)
    args = parser.parse_args(argv)

    import mxnet as mx
    shapes = load_shapes()
    t_start = time.perf_counter()
    kv = mx.kv.create("dist_sync")
    compression = PSLITE_CONFIGS[args.config]
    if compression:
        kv.set_gradient_compression(compression)
    rank, size = kv.rank, kv.num_workers
    keys = list(range(len(shapes)))
    grads = [mx.nd.array(make_grad(s, rank, i), dtype=np.float32) for i, s in enumerate(shapes)]
    outs = [mx.nd.zeros(s, dtype=np.float32) for s in shapes]
    kv.init(keys, [mx.nd.zeros(s, dtype=np.float32) for s in shapes])
    mx.nd.waitall()
    t_ready = time.perf_counter()

    def one_round():
        t0 = time.perf_counter()
        for i in keys:  # as Module.update does: push then pull each key, priority -index
            kv.push(i, grads[i], priority=-i)
            kv.pull(i, out=outs[i], priority=-i)
        mx.nd.waitall()
        return time.perf_counter() - t0

    kv._barrier()
    for _ in range(args.warmup):
        one_round()
    kv._barrier()
    before, cpu_before = link_counters(), cpu_counters()
    rounds = [{"seconds": one_round()} for _ in range(args.rounds)]
    cpu = cpu_delta(cpu_before, cpu_counters(), args.rounds)
    kv._barrier()  # the other worker's last pulls are in too: count the link after it
    link = link_delta(before, link_counters())
    check = None
    if not compression:
        # No updater on the server: a pull returns the sum of the round's pushes. KVStoreDist
        # pulls into the buffer it pushed from (comm_buf_[key] is the pushed array on CPU), so
        # each round overwrites the gradient with the sum, and every round doubles it.
        bad = []
        scale = np.float32(2.0 ** (args.warmup + args.rounds - 1))
        for i in (0, len(shapes) // 2, len(shapes) - 1, int(np.argmax([np.prod(s) for s in shapes]))):
            expected = sum(make_grad(shapes[i], r, i) for r in range(size)) * scale
            if not np.allclose(outs[i].asnumpy(), expected, rtol=1e-5, atol=1e-9):
                bad.append(i)
        check = "ok" if not bad else f"MISMATCH in tensors {bad}"
    raw = sum(int(np.prod(s)) * 4 for s in shapes)
    for r in rounds:
        r["pushed_raw"] = r["pulled_raw"] = raw
    result = {"system": "ps-lite", "config": args.config, "rank": rank, "size": size,
              "setup_seconds": t_ready - t_start, "rounds": rounds, "link": link,
              "cpu": cpu, "check": check}
    write_json_atomic(os.path.join(args.result_dir, f"mx-w{rank}.json"), result)


def profiled_node(argv):
    """`python -m bps_gc.node` with every thread cProfiled; the report goes to argv[0]."""
    profiler = ThreadProfiler()
    from bps_gc import node
    try:
        status = node.main()
    finally:
        with open(argv[0], "w") as f:
            f.write(profiler.report())
    sys.exit(status)


# =====================================================================================
# the driver: child processes

def _load_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl() if sys.platform.startswith("linux") else None


def _child_setup():
    # own session (so we can kill its whole group by its PID); dies with us even on SIGKILL
    os.setsid()
    if _PRCTL is not None:
        _PRCTL(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


class Child:
    def __init__(self, name, proc, log_path):
        self.name, self.proc, self.log_path = name, proc, log_path

    def tail(self, lines=25):
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


class Children:
    """Every process the driver started; stop() kills by PID (and the PID's process group)."""

    def __init__(self):
        self.all = []

    def start(self, name, argv, env, log_dir):
        log_path = os.path.join(log_dir, f"{name}.log")
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, close_fds=True,
                                    preexec_fn=_child_setup, cwd=ROOT)
        child = Child(name, proc, log_path)
        self.all.append(child)
        return child

    @staticmethod
    def _signal(child, signum):
        for send in (os.killpg, os.kill):  # its group is its PID (setsid); fall back to the PID
            try:
                send(child.proc.pid, signum)
                return
            except (ProcessLookupError, PermissionError):
                continue

    def stop(self, children, grace=KILL_GRACE):
        children = [c for c in children if c.proc.poll() is None]
        for c in children:
            self._signal(c, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(c.proc.poll() is None for c in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        for c in children:
            if c.proc.poll() is None:
                self._signal(c, signal.SIGKILL)
        for c in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(5)
        # anything they left in their process groups
        for c in children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.proc.pid, signal.SIGKILL)

    def stop_all(self):
        self.stop(self.all)


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


# =====================================================================================
# the driver: results

def summarize(system, config, passes):
    """One row from the workers' JSON results of every pass: worker 0's round times (all passes
    pooled), byte counts, CPU and link counters."""
    w0s = [results[0] for results in passes]
    rounds0 = [r for w in w0s for r in w["rounds"]]
    times = [r["seconds"] for r in rounds0]
    med = statistics.median(times)

    def mean(key):
        return statistics.fmean(r.get(key, 0) or 0 for r in rounds0)

    checks = [w.get("check") for w in w0s]
    row = {"system": system, "config": config, "seconds": med, "min": min(times),
           "max": max(times), "times": times, "rounds": len(times), "passes": len(passes),
           "pass_medians": [statistics.median(r["seconds"] for r in w["rounds"]) for w in w0s],
           "pushed_raw": mean("pushed_raw"), "pulled_raw": mean("pulled_raw"),
           "gbps_per_worker": mean("pushed_raw") / med / 1e9,
           "check": next((c for c in checks if c not in (None, "ok")), checks[0]),
           "setup_seconds": w0s[0].get("setup_seconds"),
           "worker1_seconds": statistics.median(r["seconds"] for results in passes
                                                for r in results[1]["rounds"])}
    if system == "bps_gc":
        row.update(pushed_wire=mean("pushed_wire"), pulled_wire=mean("pulled_wire"),
                   issue_seconds=mean("issue_seconds"), compress_seconds=mean("compress_seconds"),
                   communicate_seconds=mean("communicate_seconds"),
                   wait_seconds=mean("wait_seconds"))
    else:
        row.update(pushed_wire=None, pulled_wire=None)
    busy = [(w.get("cpu") or {}).get("machine_busy") for w in w0s]
    busy = [b for b in busy if b is not None]
    row["machine_busy"] = statistics.fmean(busy) if busy else None
    row["worker_cpu_per_round"] = []
    for rank in range(2):
        cpu = [(results[rank].get("cpu") or {}).get("process_cpu_per_round") for results in passes]
        cpu = [c for c in cpu if c is not None]
        row["worker_cpu_per_round"].append(statistics.fmean(cpu) if cpu else None)
    links = [w["link"] for w in w0s if w.get("link")]
    if links and len(links) == len(w0s):
        n = len(times) * 2  # both workers share the veth
        row["link_tx_per_worker"] = sum(link["tx_bytes"] for link in links) / n
        row["link_rx_per_worker"] = sum(link["rx_bytes"] for link in links) / n
    if w0s[0].get("profile"):
        row["worker0_profile"] = w0s[0]["profile"]
    return row


def load_results(result_dir, prefix):
    out = []
    for rank in range(2):
        path = os.path.join(result_dir, f"{prefix}-w{rank}.json")
        if not os.path.exists(path):
            raise ClusterFailed(f"worker rank {rank} wrote no result ({path})", [])
        with open(path) as f:
            out.append(json.load(f))
    return out


def fmt_mb(value):
    return "-" if value is None else f"{value / 1e6:.2f}"


def verdict(row, dense_pslite, topo_name):
    """(target text, ok/MISS/'') for a row."""
    if row.get("error"):
        return "", ""
    if row["system"] == "ps-lite":
        ref = PSLITE_REFERENCE.get(topo_name, {}).get(row["config"])
        return (f"ref {ref:g} s (issue)", "") if ref else ("", "")
    targets = []
    if row["config"] == "dense" and dense_pslite:
        ok = row["seconds"] <= dense_pslite
        targets.append((f"<= ps-lite {dense_pslite:.3f} s", ok))
    limit = BPS_TARGETS.get(topo_name, {}).get(row["config"])
    if limit is not None:
        targets.append((f"<= {limit:g} s", row["seconds"] <= limit))
    if not targets:
        return "", ""
    return "; ".join(t for t, _ in targets), "ok" if all(ok for _, ok in targets) else "MISS"


def print_table(title, rows, topo_name, shaped):
    dense = next((r["seconds"] for r in rows if r["system"] == "ps-lite" and r["config"] == "dense"
                  and not r.get("error")), None)
    head = ["system", "config", "s/round", "min", "max", "push MB/w", "pull MB/w"]
    if shaped:
        head.append("link MB/w")
    head += ["GB/s/w", "CPU%", "w CPU s", "vs ps-lite", "target", ""]
    lines = []
    for r in rows:
        if r.get("error"):
            cells = [r["system"], r["config"], "FAILED", "", "", "", ""] + ([""] if shaped else []) \
                + ["", "", "", "", r["error"][:60], ""]
            lines.append(cells)
            continue
        target, ok = verdict(r, dense, topo_name)
        cells = [r["system"], r["config"], f"{r['seconds']:.3f}", f"{r['min']:.3f}",
                 f"{r['max']:.3f}", fmt_mb(r["pushed_wire"]), fmt_mb(r["pulled_wire"])]
        if shaped:
            link = r.get("link_tx_per_worker")
            cells.append("-" if link is None else fmt_mb(link + r["link_rx_per_worker"]))
        busy = r.get("machine_busy")
        wcpu = [c for c in r.get("worker_cpu_per_round") or [] if c is not None]
        cells += [f"{r['gbps_per_worker']:.3f}", "-" if busy is None else f"{100 * busy:.0f}",
                  "/".join(f"{c:.3f}" for c in wcpu) or "-",
                  f"{r['seconds'] / dense:.2f}" if dense else "-", target, ok]
        lines.append(cells)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    out = [title, "  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip(),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip() for cells in lines]
    text = "\n".join(out)
    print(text, flush=True)
    return text


# =====================================================================================
# the driver

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10, help="timed rounds on loopback (10)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up rounds on loopback (2)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 warm-up + 2 rounds, bps_gc dense and onebit+EF, ps-lite dense")
    p.add_argument("--shaped", metavar="RATE",
                   help="run in two network namespaces joined by a veth shaped to RATE "
                        "(1gbit, 100mbit, ...) instead of loopback; needs root")
    p.add_argument("--shaped-rounds", type=int, default=3, help="timed rounds with --shaped (3)")
    p.add_argument("--shaped-warmup", type=int, default=1, help="warm-up rounds with --shaped (1)")
    p.add_argument("--passes", type=int, default=1,
                   help="run the whole list of configurations this many times, interleaved, "
                        "and pool the rounds (for machines shared with other jobs) (1)")
    p.add_argument("--configs", help=f"comma-separated bps_gc configurations (default all: "
                                     f"{', '.join(BPS_CONFIGS)}; 'none' for none)".replace("%", "%%"))
    p.add_argument("--pslite", default=None,
                   help="comma-separated ps-lite configurations (dense,2bit; 'none' for none)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per configuration before it is killed (loopback 300; "
                        "--shaped: scaled with the rate)")
    p.add_argument("--json", help="where to write the results (out/bench_pushpull.json, "
                                  "or out/bench_pushpull_<rate>.json with --shaped)")
    p.add_argument("--profile", action="store_true",
                   help="cProfile bps_gc's worker 0 and server (all threads) and print the top")
    p.add_argument("--wait-idle", type=float, default=None, metavar="S",
                   help="before each configuration wait up to S seconds until the CPUs are "
                        "<= 25%% busy (other jobs on the machine); default 60, --quick 0")
    p.add_argument("--keep-logs", action="store_true", help="keep the children's logs")
    args = p.parse_args(argv)
    if args.wait_idle is None:
        args.wait_idle = 0.0 if args.quick else 60.0
    if args.quick:
        args.rounds, args.warmup = 2, 1
        args.shaped_rounds, args.shaped_warmup = 2, 1
    for name in ("rounds", "shaped_rounds", "passes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("warmup", "shaped_warmup"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    args.bps = pick(p, args.configs, BPS_CONFIGS, QUICK_BPS if args.quick else None, "--configs")
    args.mx = pick(p, args.pslite, PSLITE_CONFIGS, QUICK_PSLITE if args.quick else None, "--pslite")
    if args.shaped:
        parse_rate = import_netns().parse_rate
        try:
            args.rate_bits = parse_rate(args.shaped)
        except ValueError as e:
            p.error(f"--shaped: {e}")
        args.shaped = args.shaped.lower()
    return args


def pick(parser, text, known, quick_default, flag):
    if text is None:
        return list(quick_default or known)
    if text.strip().lower() == "none":
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n not in known:
            parser.error(f"{flag}: unknown configuration {n!r}; known: {', '.join(known)}")
    return names


def machine_busy(seconds=1.0):
    """Fraction of all CPUs busy over the next ``seconds`` (None if /proc/stat is unreadable)."""
    before = cpu_counters()[0]
    time.sleep(seconds)
    after = cpu_counters()[0]
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def wait_until_idle(max_wait, threshold=0.25):
    """Wait (at most max_wait s) until other processes leave the CPUs mostly idle: timings on a
    shared 2-CPU machine mean little otherwise. Returns (seconds waited, last busy fraction)."""
    start = time.monotonic()
    busy = machine_busy()
    while busy is not None and busy > threshold and time.monotonic() - start < max_wait:
        busy = machine_busy()
    return time.monotonic() - start, busy


def config_timeout(args, shaped):
    if args.timeout:
        return args.timeout
    if not shaped:
        return 300.0
    # dense: each direction carries 2 x 102 MB through the link; allow 2x that per round
    per_round = 2 * 2 * 102.2e6 * 8 / args.rate_bits
    return 180 + (args.shaped_warmup + args.shaped_rounds + 2) * per_round * 2


def run_one(system, config, topo, args, children, result_dir, rounds, warmup, timeout, say):
    """One cluster for one configuration: (the workers' results, extra info) or raises."""
    os.makedirs(result_dir)
    if system == "bps_gc":
        plan, workers = bps_plan(config, topo, args, result_dir, result_dir, rounds, warmup)
    else:
        plan, workers = mx_plan(config, topo, result_dir, rounds, warmup)
    info = {"busy_before": None, "waited_idle_seconds": 0.0}
    if args.wait_idle > 0:
        waited, busy = wait_until_idle(args.wait_idle)
        info.update(busy_before=busy, waited_idle_seconds=waited)
        if busy is not None and busy > 0.25:
            say(f"{system} {config}: machine still {100 * busy:.0f}% busy after waiting "
                f"{waited:.0f} s for other processes; measuring anyway")
    t0 = time.monotonic()
    try:
        _, note = run_cluster(children, plan, workers, timeout, result_dir)
        results = load_results(result_dir, "bps" if system == "bps_gc" else "mx")
    except ClusterFailed as e:
        started = e.args[1] if len(e.args) > 1 else []
        say(f"{system} {config}: FAILED: {e.args[0]} (logs in {result_dir})")
        for c in started:
            tail = c.tail()
            if tail.strip():
                say(f"--- {c.name} (last lines)\n{tail.rstrip()}")
        raise
    info["wall_seconds"] = time.monotonic() - t0
    if note:
        info["note"] = note
        say(f"{system} {config}: note: {note}")
    profile = os.path.join(result_dir, "server-profile.txt")
    if os.path.exists(profile):
        with open(profile) as f:
            info["server_profile"] = f.read()
    w0 = results[0]
    med = statistics.median(r["seconds"] for r in w0["rounds"])
    extra = f", check {w0['check']}" if w0.get("check") else ""
    say(f"{system} {config}: {med:.3f} s/round (median of {len(w0['rounds'])}; worker 1 "
        f"{statistics.median(r['seconds'] for r in results[1]['rounds']):.3f}){extra}")
    return results, info


def run_all(args, topo, children, log_root):
    shaped = not isinstance(topo, Loopback)
    rounds = args.shaped_rounds if shaped else args.rounds
    warmup = args.shaped_warmup if shaped else args.warmup
    timeout = config_timeout(args, shaped)
    configs = [("ps-lite", c) for c in args.mx] + [("bps_gc", c) for c in args.bps]
    # with --passes N the whole list runs N times, interleaved, so that load from other jobs
    # on the machine hits every configuration alike
    work = [(p, system, config) for p in range(args.passes) for system, config in configs]
    runs = {key: [] for key in configs}
    infos = {key: [] for key in configs}
    errors = {}
    from tqdm import tqdm
    bar = tqdm(work, desc=f"push_pull {topo.name}", unit="config", file=sys.stderr)
    for p, system, config in bar:
        bar.set_postfix_str(f"{system} {config}" + (f" (pass {p + 1})" if args.passes > 1 else ""))
        if (system, config) in errors:
            continue
        tag = f"{system}-{config}-{p}".replace(" ", "_").replace("%", "pct").replace("+", "_")
        try:
            results, info = run_one(system, config, topo, args, children,
                                    os.path.join(log_root, tag), rounds, warmup, timeout, tqdm.write)
        except ClusterFailed as e:
            errors[(system, config)] = str(e.args[0])
            args.failed = True
            continue
        runs[(system, config)].append(results)
        infos[(system, config)].append(info)
    bar.close()
    rows = []
    for key in configs:
        if key in errors:
            rows.append({"system": key[0], "config": key[1], "error": errors[key]})
            continue
        row = summarize(key[0], key[1], runs[key])
        info = infos[key]
        row["wall_seconds"] = sum(i["wall_seconds"] for i in info)
        row["busy_before"] = [i["busy_before"] for i in info]
        row["waited_idle_seconds"] = sum(i["waited_idle_seconds"] for i in info)
        notes = [i["note"] for i in info if i.get("note")]
        if notes:
            row["note"] = "; ".join(notes)
        if info and info[0].get("server_profile"):
            row["server_profile"] = info[0]["server_profile"]
        if row.get("check") not in (None, "ok"):
            args.failed = True
        rows.append(row)
    return rows


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.failed = False
    children = Children()
    link = None

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    # also when started in the background by a shell (SIGINT inherited as ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    log_root = tempfile.mkdtemp(prefix="bench_pushpull-")
    shapes = load_shapes()
    floats = sum(int(np.prod(s)) for s in shapes)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "model": MODEL, "tensors": len(shapes), "floats": floats, "bytes": floats * 4,
            "workers": 2, "servers": 1, "env": {k: v for k, v in os.environ.items()
                                                if k.startswith(("BYTEPS_", "BPS_GC_"))},
            "loadavg_before": os.getloadavg()}
    try:
        if args.shaped:
            netns = import_netns()
            NetnsUnavailable, ShapedLink = netns.NetnsUnavailable, netns.ShapedLink
            try:
                link = ShapedLink(args.shaped).__enter__()
            except NetnsUnavailable as e:
                print(f"bench_pushpull: --shaped {args.shaped} skipped: cannot set up network "
                      f"namespaces: {e}", flush=True)
                return 0
            topo = Shaped(link)
            meta["link"] = link.describe()
            print(f"shaped link: {link.describe()}", flush=True)
            rounds, warmup = args.shaped_rounds, args.shaped_warmup
            title_where = (f"shaped {args.shaped} (scheduler+server in {link.ns['srv']}, "
                           f"workers in {link.ns['wrk']})")
        else:
            topo = Loopback()
            rounds, warmup = args.rounds, args.warmup
            title_where = "loopback 127.0.0.1"
        meta.update(rounds=rounds, warmup=warmup, passes=args.passes, topology=topo.name)
        rows = run_all(args, topo, children, log_root)
        if link is not None:
            meta["qdisc_stats"] = {side: link.qdisc_stats(side) for side in ("srv", "wrk")}
        meta["loadavg_after"] = os.getloadavg()
        passes = f" x {args.passes} interleaved passes" if args.passes > 1 else ""
        title = (f"\npush_pull, {title_where}: 2 workers + 1 server, {MODEL} gradients "
                 f"({len(shapes)} tensors, {floats / 1e6:.2f}M floats, {floats * 4 / 1e6:.1f} MB); "
                 f"worker 0's median of {rounds} rounds after {warmup} warm-up{passes}")
        table = print_table(title, rows, topo.name, link is not None)
        print(f"load average before/after: {meta['loadavg_before'][0]:.2f} / "
              f"{meta['loadavg_after'][0]:.2f} (machine has {os.cpu_count()} CPUs)")
        for r in rows:
            if args.passes > 1 and not r.get("error"):
                print(f"  {r['system']} {r['config']}: per-pass medians "
                      f"{', '.join(f'{m:.3f}' for m in r['pass_medians'])} s")
        for r in rows:
            if r.get("system") == "bps_gc" and not r.get("error") and "compress_seconds" in r:
                print(f"  bps_gc {r['config']}: per round on worker 0: issuing push_pulls "
                      f"{r['issue_seconds']:.3f} s, compress (pool threads, summed) "
                      f"{r['compress_seconds']:.3f} s, waiting {r['wait_seconds']:.3f} s")
        for r in rows:
            for key in ("worker0_profile", "server_profile"):
                if r.get(key):
                    print(f"\n=== profile: {r['system']} {r['config']} "
                          f"{key.replace('_profile', '')}\n{r[key]}")
        path = args.json or os.path.join(
            ROOT, "out", "bench_pushpull.json" if not args.shaped else
            f"bench_pushpull_{args.shaped}.json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_json_atomic(path, {"meta": meta, "table": table, "results": rows})
        print(f"wrote {path}")
        return 1 if args.failed else 0
    except KeyboardInterrupt as e:
        print(f"\nbench_pushpull: interrupted ({str(e) or 'Ctrl-C'}); stopping", file=sys.stderr)
        return 130
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # let the clean-up finish
            signal.signal(signum, signal.SIG_IGN)
        children.stop_all()
        if link is not None:
            link.delete()
        if args.failed or args.keep_logs:
            print(f"logs kept in {log_root}", file=sys.stderr)
        else:
            shutil.rmtree(log_root, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_bps-worker":
        bps_worker(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "_mx-worker":
        mx_worker(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "_profiled-node":
        profiled_node(sys.argv[2:])
    else:
        sys.exit(main())
