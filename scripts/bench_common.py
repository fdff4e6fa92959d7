"""bench_pushpull: what the driver and the worker processes share (shapes, gradients, counters,
the thread profiler) and the benchmark's constants."""
import io
import json
import os
import resource
import signal
import sys
import time

import numpy as np

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_pushpull.py")  # driver and worker entry
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # this checkout's bps_gc, not an installed one
    sys.path.insert(0, ROOT)
SHAPES_FILE = os.path.join(ROOT, "tests", "data", "resnet50_shapes.json")
MODEL = "resnet50_v1b"
PY = sys.executable
LOOPBACK = "127.0.0.1"

# The codecs both transports run (parameter server and collective): BytePS's, then issue 11's
# (powersgd reduces in two phases of plain sums, comm/phased.py).
BPS_CONFIGS = {
    "dense": {},
    "dense (local reduce)": {},  # CONFIG_ENV: the workers sum in shared memory when on one host
    "dense (host's TCP congestion control)": {},  # CONFIG_ENV: bps_gc's links keep the machines' default
    "dense (flat)": {},  # CONFIG_ENV: every local rank pushes its own copy (the path before two levels)
    "onebit+EF": {"compressor": "onebit", "scaling": True, "ef": "vanilla"},
    "topk 0.1%": {"compressor": "topk", "k": 0.001},
    "topk 1%": {"compressor": "topk", "k": 0.01},
    "randomk 0.1%": {"compressor": "randomk", "k": 0.001},
    "dithering k=2": {"compressor": "dithering", "k": 2},
    "terngrad": {"compressor": "terngrad"},
    "qsgd 4 levels": {"compressor": "qsgd", "levels": 4},
    "sign (majority)": {"compressor": "sign"},
    "signnorm": {"compressor": "signnorm"},
    "threshold 3e-3": {"compressor": "threshold", "threshold": 3e-3},
    "adaptive threshold": {"compressor": "adaptive_threshold"},
    "dgc 0.1%": {"compressor": "dgc", "k": 0.001},
    "powersgd rank 1": {"compressor": "powersgd", "rank": 1},
    "powersgd rank 4": {"compressor": "powersgd", "rank": 4},
    "thc 4-bit": {"compressor": "thc", "bits": 4},  # issue 35: summed codes, stochastic rounding
    "thc 4-bit+EF": {"compressor": "thc", "bits": 4, "feedback": True},
}
# Settings a configuration runs its whole cluster with (every role: they must agree).
CONFIG_ENV = {"dense (local reduce)": {"BPS_GC_LOCAL_REDUCE": "1"},
              "dense (host's TCP congestion control)": {"BPS_GC_TCP_CONGESTION": "system"},
              "dense (flat)": {"BPS_GC_HIERARCHY": "flat"}}
ONE_HOST_ONLY = ("dense (local reduce)",)  # the same as dense when the workers are on other hosts
SHAPED_ONLY = ("dense (host's TCP congestion control)",)  # on loopback the links are unix sockets
LOCAL_RANKS_ONLY = ("dense (flat)",)  # the same as dense with one rank per machine
PSLITE_CONFIGS = {"dense": None, "2bit": {"type": "2bit", "threshold": 0.5}}
QUICK_BPS = ("dense", "onebit+EF")
QUICK_PSLITE = ("dense",)
# Not passed to children: they describe a cluster (we set our own) or change ps-lite's defaults.
DROPPED_ENV_PREFIXES = ("DMLC_", "PS_")
DROPPED_ENV = ("MXNET_KVSTORE_BIGARRAY_BOUND", "BYTEPS_LOCAL_RANK", "BYTEPS_LOCAL_SIZE",
               "BPS_GC_PORT", "BENCH_VETH", "NVIDIA_VISIBLE_DEVICES")
NODE_EXIT_SECONDS = 30     # scheduler/servers get this long to exit after the workers finished
KILL_GRACE = 5


def pythonpath(*paths):
    """PYTHONPATH for a child process: ``paths`` first, then the caller's own, kept (a plugin
    module the user put there, or the test suite's sitecustomize, still loads in the child)."""
    return os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])


def import_netns():
    """scripts/netns.py, wherever this script is run from."""
    if os.path.dirname(SCRIPT) not in sys.path:
        sys.path.insert(0, os.path.dirname(SCRIPT))
    import netns
    return netns


def bps_gc_congestion():
    """What bps_gc's nodes set on their own TCP links (BPS_GC_TCP_CONGESTION; None: the
    machine's default)."""
    from bps_gc.config import EnvReader, tcp_congestion
    return tcp_congestion(EnvReader(os.environ))


def check_tcp_congestion(parser, args):
    """--tcp-congestion: only with --shaped, and one of the kernel's algorithms."""
    if not args.tcp_congestion:
        return
    if not args.shaped:
        parser.error("--tcp-congestion needs --shaped (it sets the namespaces' default)")
    from bps_gc.config import available_congestion_controls
    have = available_congestion_controls()
    if args.tcp_congestion not in have:
        parser.error(f"--tcp-congestion: unknown algorithm {args.tcp_congestion!r}; this kernel has: "
                     f"{', '.join(have) or 'none'}")


def load_shapes(tensors=0, elements=0):
    """ResNet-50 v1b's gradient shapes; the first ``tensors`` of them if > 0 (smoke runs); or,
    with ``elements`` > 0, one float32 tensor of that many elements (matrix_shape's)."""
    if elements > 0:
        return [matrix_shape(elements)]
    with open(SHAPES_FILE) as f:
        shapes = [tuple(int(d) for d in s) for s in json.load(f)[MODEL]]
    return shapes[:tensors] if tensors > 0 else shapes


def matrix_shape(elements):
    """The most nearly square (rows, columns) with rows * columns = elements: a matrix, as a
    layer's weight is, so PowerSGD (torch's and ours) compresses it (both send 1-D tensors
    dense)."""
    rows = max(d for d in range(1, int(elements ** 0.5) + 1) if elements % d == 0)
    return (elements // rows, rows)


def shapes_description(shapes, elements):
    floats = sum(int(np.prod(s)) for s in shapes)
    if elements:
        return f"one float32 tensor of {floats:,} elements ({'x'.join(map(str, shapes[0]))}, {floats * 4 / 1e6:.1f} MB)"
    return f"{MODEL} gradients ({len(shapes)} tensors, {floats * 4 / 1e6:.1f} MB)"


def machine_info():
    """'CPU model, N cores, AVX2/AVX-512' from /proc/cpuinfo (what docs/ must say of a number)."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    simd = [name for name, flag in (("AVX2", "avx2"), ("AVX-512", "avx512f")) if flag in flags]
    return f"{model}, {os.cpu_count()} cores, {'/'.join(simd) or 'no AVX2'}"


def make_grad(shape, rank, index):
    """Worker ``rank``'s gradient for tensor ``index`` (reproducible anywhere, for checks)."""
    rng = np.random.default_rng([rank, index])
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(1e-3)


def link_counters():
    """(tx, rx, TCP counters) of the veth named in BENCH_VETH: its bytes, and the whole
    namespace's (machine's) retransmitted segments and retransmit timeouts, which say whether
    a slow round lost packets at the shaper."""
    nic = nic_bytes()
    return None if nic is None else (*nic, tcp_counters())


def nic_bytes():
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
                    return int(fields[8]), int(fields[0])
    except OSError:
        return None
    return None


def tcp_counters(names=("RetransSegs", "TCPTimeouts", "TCPLossProbes")):
    """The named counters of /proc/net/snmp and /proc/net/netstat (pairs of header and value
    lines); missing ones are left out."""
    found = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for header, values in zip(lines[::2], lines[1::2]):
            for key, value in zip(header.split()[1:], values.split()[1:]):
                if key in names:
                    found[key] = int(value)
    return found


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
    tcp = {k: after[2][k] - v for k, v in before[2].items() if k in after[2]}
    return {"tx_bytes": after[0] - before[0], "rx_bytes": after[1] - before[1], "tcp": tcp}


def write_json_atomic(path, obj):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def thread_rusage(who=resource.RUSAGE_THREAD):
    """getrusage of the calling thread (or ``who``) as a dict of its ru_ fields."""
    usage = resource.getrusage(who)
    return {k: getattr(usage, k) for k in dir(usage) if k.startswith("ru_")}


class ThreadProfiler:
    """cProfile in every thread started after install() (and the main thread), timing each
    thread's CPU time: wall time would charge a function for the other processes sharing the
    cores."""

    def __init__(self):
        import cProfile
        import threading
        self.cProfile, self.threading = cProfile, threading
        self.profiles = []
        original = threading.Thread.run
        profiles = self.profiles
        thread_usage = self.thread_usage = {}

        def run(thread):
            prof = cProfile.Profile(time.thread_time)
            profiles.append((thread.name, prof))
            prof.enable()
            try:
                original(thread)
            finally:
                prof.disable()
                thread_usage[thread.name] = thread_rusage()

        threading.Thread.run = run
        self.main = cProfile.Profile(time.thread_time)
        self.profiles.append(("main", self.main))
        self.main.enable()

    def report(self, top=18):
        import pstats
        self.main.disable()
        for thread in self.threading.enumerate():  # let finished threads flush their profiles
            if thread is not self.threading.current_thread() and not thread.daemon:
                thread.join(2)
        out = io.StringIO()
        dump = os.environ.get("BENCH_PROFILE_DIR")  # raw figures (scripts/bench_calls.py)
        if dump:
            dump = os.path.join(dump, os.environ.get("DMLC_ROLE", "worker") + os.environ.get("DMLC_WORKER_ID", "")
                                + f"-{os.getpid()}")
            with open(f"{dump}.rusage.json", "w") as f:
                json.dump({"process": thread_rusage(resource.RUSAGE_SELF), "main": thread_rusage(),
                           **self.thread_usage}, f)
        for name, prof in self.profiles:
            text = io.StringIO()
            try:
                stats = pstats.Stats(prof, stream=text)
            except TypeError:  # nothing recorded
                continue
            total = sum(v[2] for v in stats.stats.values())
            if dump:
                stats.dump_stats(f"{dump}-{name}.prof")
            if total < 0.05:
                continue
            stats.sort_stats("tottime").print_stats(top)
            body = text.getvalue()
            start = body.find("   ncalls")
            out.write(f"--- thread {name}: {total:.2f} s total own time\n{body[start:].rstrip()}\n")
        return out.getvalue()


def interrupt_on_signals():
    """SIGTERM, SIGHUP and SIGINT (also when started in the background) raise KeyboardInterrupt
    in the main thread, so a benchmark's finally: clean-up runs."""
    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def tear_down(children, net):
    """A benchmark's clean-up: the signals are ignored meanwhile (so it finishes), every child
    process stops and the namespaces (``net``, or None) go."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    children.stop_all()
    if net is not None:
        net.delete()
