#!/usr/bin/env python3
"""Training time per epoch on a slow link: the counterpart of BytePS's 100 Mbit/s table.

The demo's MNIST network (example/demo) trains for a few epochs per configuration with the
scheduler and server in one network namespace and both workers in another, joined by a veth
pair shaped with `tc tbf` (root only; skipped with a message otherwise). Prints seconds per
epoch, bytes on the wire and the speed-up over the uncompressed baseline; writes JSON.

    sudo python scripts/slow_network.py                     # 100mbit, all configurations
    python scripts/slow_network.py --rate 1gbit --configs baseline,onebit --epochs 1
"""
import argparse
import json
import os
import subprocess
import sys
import time

from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "example", "demo"))
from mnist_demo import CONFIGS  # noqa: E402
from netns import SRV_ADDR, WRK_ADDR, NetnsUnavailable, ShapedLink  # noqa: E402
from bps_gc.launcher.local import free_port  # noqa: E402
from bench_common import pythonpath  # noqa: E402

WORKER = os.path.join(ROOT, "example", "demo", "mnist_worker.py")
# BytePS, CIFAR-100 ResNet18 at 100 Mbit/s: seconds per epoch (the figure we mirror in kind)
BYTEPS_100MBIT = {"baseline": 518, "onebit": 195, "randomk": 90, "topk": 84}


def run_config(link, name, args, out):
    """One cluster across the shaped link; returns rank 0's result."""
    params = CONFIGS[name][1]
    result_dir = os.path.join(out, name)
    os.makedirs(result_dir, exist_ok=True)
    base = dict(os.environ, PYTHONPATH=pythonpath(ROOT), PYTHONUNBUFFERED="1", DMLC_NUM_WORKER="2",
                DMLC_NUM_SERVER="1", DMLC_PS_ROOT_URI=SRV_ADDR, DMLC_PS_ROOT_PORT=str(free_port()))
    launch = [sys.executable, "-m", "bps_gc.launcher.cli"]
    train = [sys.executable, WORKER, "--out", result_dir, "--compression", json.dumps(params or {}),
             "--epochs", str(args.epochs), "--hidden", str(args.hidden), "--eval-every", "1000000"]
    roles = [("srv", launch, dict(base, DMLC_ROLE="scheduler", DMLC_NODE_HOST=SRV_ADDR)),
             ("srv", launch, dict(base, DMLC_ROLE="server", DMLC_NODE_HOST=SRV_ADDR))]
    roles += [("wrk", launch + train, dict(base, DMLC_ROLE="worker", DMLC_WORKER_ID=str(w),
                                            DMLC_NODE_HOST=WRK_ADDR)) for w in range(2)]
    log = open(os.path.join(out, f"{name}.log"), "w")
    procs = [subprocess.Popen(link.command(side, argv), env=env, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL) for side, argv, env in roles]
    try:
        deadline = time.monotonic() + args.timeout
        for p in procs:
            p.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        for p in procs:  # only what this function started
            if p.poll() is None:
                p.kill()
                p.wait()
        log.close()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{name}: a process failed; see {log.name}")
    with open(os.path.join(result_dir, "rank0.json")) as f:
        return json.load(f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="100mbit", help="link rate for tc tbf (default 100mbit)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {', '.join(CONFIGS)}")
    ap.add_argument("--epochs", type=float, default=2.0, help="epochs per configuration (default 2)")
    ap.add_argument("--hidden", type=int, default=512, help="hidden units of the MLP (default 512: 1.6 MB of gradients)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per configuration")
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "slow_network"))
    args = ap.parse_args(argv)
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s) {', '.join(unknown)}")
    os.makedirs(args.out, exist_ok=True)
    try:
        link = ShapedLink(args.rate).__enter__()
    except NetnsUnavailable as e:
        print(f"slow_network: skipped, cannot shape a link here: {e}")
        return 0
    rows = []
    try:
        for name in tqdm(names, desc=f"configurations over {args.rate}", unit="config"):
            r = run_config(link, name, args, args.out)
            steps_per_epoch = r["steps"] / args.epochs
            rows.append({"config": name, "description": CONFIGS[name][0],
                         "epoch_seconds": r["train_seconds"] / args.epochs,
                         "wire_mb_per_epoch": (r["pushed_wire"] + r["pulled_wire"]) / args.epochs / 1e6,
                         "ratio": r["ratio"], "steps_per_epoch": steps_per_epoch,
                         "byteps_100mbit_epoch_seconds": BYTEPS_100MBIT.get(name)})
    finally:
        link.__exit__(None, None, None)
    base = next((r["epoch_seconds"] for r in rows if r["config"] == "baseline"), None)
    print(f"\nMNIST MLP 784-{args.hidden}-10, 2 workers + 1 server, link {args.rate} (tc tbf), "
          f"{rows[0]['steps_per_epoch']:.0f} steps/epoch")
    print(f"{'configuration':<40}{'s/epoch':>9}{'speed-up':>10}{'MB/epoch/worker':>17}{'ratio':>8}{'BytePS s/epoch*':>17}")
    for r in rows:
        speedup = f"{base / r['epoch_seconds']:.1f}x" if base else "-"
        ref = r["byteps_100mbit_epoch_seconds"]
        print(f"{r['config'] + ' (' + r['description'] + ')':<40}{r['epoch_seconds']:>9.2f}{speedup:>10}"
              f"{r['wire_mb_per_epoch']:>17.2f}{r['ratio']:>7.1f}x{(str(ref) if ref else '-'):>17}")
    print("* BytePS's CIFAR-100 ResNet18 at 100 Mbit/s, for the shape of the gains, not the scale")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"rate": args.rate, "epochs": args.epochs, "hidden": args.hidden, "rows": rows}, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'results.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
