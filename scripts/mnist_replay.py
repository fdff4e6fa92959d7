#!/usr/bin/env python3
"""The elastic MNIST example's training replayed in ONE process on a membership sequence by
steps: no process, no death, no join protocol; each step averages the gradients of its members'
batches (the example's sampler, example/pytorch/elastic_shards.py) as the servers would. It is
the "same membership without the churn" baseline of scripts/chaos_mnist.py, and a diagnosis
tool: ``--deal restart`` deals as the example did before (each change re-cut the digits into
fixed shards and restarted the hosts' passes), ``--hosts N`` replays N hosts throughout
(``--steps``: for that many steps), ``--scale-lr R`` scales each step's lr as the example's flag does.

    python scripts/mnist_replay.py --json chaos_elastic.json --seeds 5 [--first-seed 0] [--deal restart] \
        [--hosts 2 [--steps N]] [--scale-lr R]

(--json: a ``scripts/chaos_elastic.py --task mnist`` run's, for its sequence and step count.)
Not bit-identical to a launched job (the servers sum in another order); a baseline, not an oracle.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "example", "pytorch"), os.path.join(ROOT, "example", "demo")]
from elastic_shards import ElasticShards  # noqa: E402
from mnist_worker import load_data, network  # noqa: E402

DEFAULTS = {"train_samples": 4000, "batch": 32, "lr": 0.1, "momentum": 0.9, "hidden": 128}


def members_by_step(sequence, steps):
    """[(first step, members)] -> each step's members."""
    return [[m for g, m in sequence if g <= step][-1] for step in range(steps)]


def restart_deal(count, batch, seed):
    """The example's former sampler: at a change each member's shard is every n-th digit from its
    place, and its passes over it restart (a permutation per seed, change, rank and pass)."""
    kept = {}

    def batch_of(change, members, rank):
        shard, order, cursor, passes = kept.get((change, rank)) or (
            np.arange(count)[members.index(rank)::len(members)], None, 0, 0)
        if order is None or cursor + batch > len(order):
            order = np.random.default_rng([seed, change, rank, passes]).permutation(shard)
            cursor, passes = 0, passes + 1
        kept[(change, rank)] = (shard, order, cursor + batch, passes)
        return order[cursor:cursor + batch]
    return batch_of


def train(per_step, seed, deal="stream", scale_lr=None, **settings):
    """(the model, the training digits and labels, the held-out ones) after training on
    ``per_step`` members; ``scale_lr=R``: each step's learning rate is lr x members / R (the
    linear scaling rule, R the membership lr is tuned for)."""
    s = dict(DEFAULTS, **settings)
    torch.set_num_threads(1)
    x, y, x_val, y_val = load_data(s["train_samples"])
    model = network(s["hidden"], seed)
    opt = torch.optim.SGD(model.parameters(), lr=s["lr"], momentum=s["momentum"])
    shards, old = ElasticShards(len(x), s["batch"], seed), restart_deal(len(x), s["batch"], seed)
    position, previous, change = 0, per_step[0], 0
    for members in per_step:
        if deal == "stream":  # a dead host's batch (in previous, not in members) is lost with it
            idx = np.concatenate([shards.batch_of(position, previous, members, r) for r in members])
            position = shards.advance(position, previous, members)
        else:
            change += members != previous
            idx = np.concatenate([old(change, members, r) for r in members])
        previous = members
        if scale_lr is not None:
            opt.param_groups[0]["lr"] = s["lr"] * len(members) / scale_lr
        idx = torch.from_numpy(idx)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])  # the members' mean
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, x, y, x_val, y_val


def replay(per_step, seed, deal="stream", scale_lr=None, **settings):
    """(loss over all training digits, loss over the held-out digits) after ``train``."""
    model, x, y, x_val, y_val = train(per_step, seed, deal, scale_lr, **settings)
    with torch.no_grad():
        return (float(torch.nn.functional.cross_entropy(model(x), y)),
                float(torch.nn.functional.cross_entropy(model(x_val), y_val)))


def losses(per_step, seeds, deal="stream", first=0, scale_lr=None):
    return [replay(per_step, seed, deal, scale_lr) for seed in range(first, first + seeds)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="a chaos_elastic.py --task mnist run's JSON")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--first-seed", type=int, default=0, help="seeds first..first+seeds-1 (a churned run's --model-seed)")
    p.add_argument("--deal", choices=["stream", "restart"], default="stream")
    p.add_argument("--hosts", type=int, help="replay this many hosts at every step instead")
    p.add_argument("--steps", type=int, help="with --hosts: this many steps instead of the run's (e.g. as many "
                   "digits as the churned run dealt: steps x average hosts / hosts)")
    p.add_argument("--scale-lr", type=float, help="R: each step's lr x members / R (linear scaling)")
    args = p.parse_args(argv)
    if args.scale_lr is not None and not args.scale_lr > 0:
        p.error(f"--scale-lr must be a positive number of hosts, not {args.scale_lr:g}")
    with open(args.json) as f:
        mnist = json.load(f)["summary"]["mnist"]
    per_step = members_by_step(mnist["sequence"], mnist["steps"])
    if args.steps is not None and not (args.hosts and args.steps > 0):
        p.error("--steps must be a positive number of steps, with --hosts")
    if args.hosts:
        per_step = [list(range(args.hosts))] * (args.steps or len(per_step))
    got = losses(per_step, args.seeds, args.deal, args.first_seed, args.scale_lr)
    whose = f"{args.hosts} hosts'" if args.hosts else "the churned run's"
    scaled = f", lr x members / {args.scale_lr:g}" if args.scale_lr else ""
    print(f"replay ({args.deal} deal{scaled}, {whose} membership, {len(per_step)} steps, "
          f"average {np.mean([len(m) for m in per_step]):.2f} hosts), seeds {args.first_seed}.."
          f"{args.first_seed + args.seeds - 1}: "
          + "; ".join(f"{what} {', '.join(f'{g[i]:.4f}' for g in got)} (mean {np.mean([g[i] for g in got]):.4f}, "
                      f"spread {np.std([g[i] for g in got]):.4f})"
                      for i, what in enumerate(("final loss", "held-out loss"))))


if __name__ == "__main__":
    main()
