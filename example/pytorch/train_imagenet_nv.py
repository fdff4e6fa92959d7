#!/usr/bin/env python3
"""The twin of the layer-wise study's training/train_imagenet_nv.py (itself the imagenet18 /
fast.ai script with compressed communication): ResNet on an ImageNet folder tree with the
study's compression flags, under torchrun or bpslaunch. The seed's command runs as written:

    python -m torch.distributed.run --nproc-per-node 2 example/pytorch/train_imagenet_nv.py \\
        --logdir DIR --distributed --init-bn0 --no-bn-wd --name RUN --compress=layerwise \\
        --method=Topk --ratio=0.3
    bpslaunch --local --workers 2 --servers 1 -- python example/pytorch/train_imagenet_nv.py ...

Data: the positional DIR (default ~/data/imagenet) holds train/<wnid>/*.JPEG and
val/<wnid>/*.JPEG (imagenet_folder.py). --phases is the imagenet18 schedule: a Python/JSON list
of dicts, each with an epoch 'ep' (a start, or a (start, end) range) and any of 'sz' (image
size), 'bs' (batch per worker), 'min_scale' (smallest crop area), 'lr' (a rate, or a (from, to)
pair over the range, 'mode' linear or cos). The run lasts until the latest range end (or one
epoch past the latest start). Keys the imagenet18 schedules use for their file layout
('trndir', 'rect_val', 'keep_dl') are accepted and logged as unused here.

Training runs on the GPU (--device, default cuda as the study's: cuda:LOCAL_RANK; a note and
the CPU where there is none). --fp16 trains in mixed precision as the seed does: autocast float16
and a gradient scaler starting at --loss-scale, the gradients pushed and pulled as float16. The
seed's other GPU and cluster flags are accepted and each is explained by --help and logged when
given; none is silently ignored.
"""
import argparse
import ast
import math
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from cifar100_data import epoch_batches, prefetch  # noqa: E402
from imagenet_folder import normalize, scan, train_image, val_image  # noqa: E402
from imagenet_resnet import LAYOUTS, ResNet, batchnorm_parameters  # noqa: E402
from study_flags import OneLineParser, add_study_args, study_compression  # noqa: E402
from study_training import distribute, start_job, train_and_summarize  # noqa: E402
from torch_device import MixedPrecision, add_device_arg, pinned  # noqa: E402

DEFAULT_PHASES = ("[{'ep': 0, 'sz': 128, 'bs': 64}, {'ep': (0, 5), 'lr': (0.1, 0.4)}, "
                  "{'ep': (5, 14), 'lr': (0.4, 0.04)}, {'ep': 14, 'sz': 224, 'bs': 32}, "
                  "{'ep': (14, 18), 'lr': (0.02, 0.0002)}]")
PHASE_KEYS = {"ep", "sz", "bs", "lr", "min_scale", "mode"}
UNUSED_PHASE_KEYS = {"trndir", "rect_val", "keep_dl"}
SHORT_EPOCH_STEPS = 10


def build_parser():
    p = OneLineParser(description="ImageNet ResNet with the layer-wise study's compression flags "
                                            "(the twin of its training/train_imagenet_nv.py), under torchrun "
                                            "or bpslaunch.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("data", metavar="DIR", nargs="?", default="~/data/imagenet",
                   help="the folder holding train/<wnid>/ and val/<wnid>/")
    p.add_argument("--phases", default=DEFAULT_PHASES,
                   help="the schedule: a Python/JSON list of dicts (see the module docstring); "
                        "imagenet18's base64 pickles are not read")
    p.add_argument("--arch", "-a", default="resnet50", choices=sorted(LAYOUTS))
    p.add_argument("--width", type=int, default=64, help="channels of the stem (64: the paper's ResNet)")
    p.add_argument("-j", "--workers", type=int, default=8, help="threads decoding images (0: in the training loop)")
    p.add_argument("--wd", "--weight-decay", dest="wd", type=float, default=5e-5, help="weight decay")
    p.add_argument("--init-bn0", action="store_true",
                   help="start the last BatchNorm scale of every residual branch at 0")
    p.add_argument("--no-bn-wd", action="store_true", help="no weight decay on BatchNorm parameters")
    p.add_argument("--print-freq", "-p", type=int, default=5, help="log every this many steps")
    p.add_argument("--short-epoch", action="store_true",
                   help=f"at most {SHORT_EPOCH_STEPS} training and {SHORT_EPOCH_STEPS} validation batches per "
                        "epoch (for debugging)")
    p.add_argument("--seed", type=int, default=0, help="initial weights, data order and augmentation")
    p.add_argument("--logdir", default="logs", help="where NAME.log and NAME.json go")
    p.add_argument("--name", default="imagenet", help="name of the run")
    g = p.add_argument_group("the seed's GPU and cluster flags: mapped to the launcher or explained")
    g.add_argument("--distributed", action="store_true",
                   help="always distributed here: torchrun or bpslaunch started the workers")
    g.add_argument("--dist-url", default="env://", help="torchrun's variables (env://) are what is read")
    g.add_argument("--dist-backend", default="nccl",
                   help="the launcher picks the transport: torchrun torch.distributed (gloo), bpslaunch the "
                        "parameter server (ZeroMQ)")
    g.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=0,
                   help="given by torch.distributed.launch; LOCAL_RANK is what is read")
    g.add_argument("--fp16", action="store_true",
                   help="mixed precision: the forward pass under autocast float16, a gradient scaler, the "
                        "gradients pushed and pulled as float16 (parameters and codec state stay float32)")
    g.add_argument("--loss-scale", type=float, default=1024,
                   help="--fp16: the gradient scaler's first scale (it then adapts, as torch.amp's does)")
    g.add_argument("--skip-auto-shutdown", action="store_true",
                   help="imagenet18 shut its cloud instance down after training; nothing is shut down here")
    g.add_argument("--auto-shutdown-success-delay-mins", type=int, default=10, help="see --skip-auto-shutdown")
    g.add_argument("--auto-shutdown-failure-delay-mins", type=int, default=60, help="see --skip-auto-shutdown")
    add_device_arg(g, default="cuda")  # the study trains on CUDA; without a GPU: a note, the CPU
    add_study_args(p)
    return p


def parse_phases(text, parser):
    """The schedule as a list of dicts, checked (a literal: nothing is executed or unpickled)."""
    try:
        phases = ast.literal_eval(text) if isinstance(text, str) else text
    except (ValueError, SyntaxError) as e:
        parser.error(f"--phases: not a Python/JSON list of dicts ({e})")
    if not isinstance(phases, (list, tuple)) or not phases or not all(isinstance(ph, dict) for ph in phases):
        parser.error("--phases: want a non-empty list of dicts like [{'ep': 0, 'sz': 128, 'bs': 64}, ...]")
    for ph in phases:
        unknown = set(ph) - PHASE_KEYS - UNUSED_PHASE_KEYS
        ep = ph.get("ep")
        if unknown:
            parser.error(f"--phases: unknown key {sorted(unknown)[0]!r} in {ph}")
        if not (isinstance(ep, (int, float)) or (isinstance(ep, (list, tuple)) and len(ep) == 2 and ep[0] < ep[1])):
            parser.error(f"--phases: 'ep' must be an epoch or a (start, end) pair, in {ph}")
        if "lr" in ph and isinstance(ph["lr"], (list, tuple)) and not isinstance(ep, (list, tuple)):
            parser.error(f"--phases: a (from, to) 'lr' needs an (start, end) 'ep', in {ph}")
        if ph.get("mode", "linear") not in ("linear", "cos"):
            parser.error(f"--phases: 'mode' is linear or cos, in {ph}")
    if not any("sz" in ph for ph in phases) or not any("bs" in ph for ph in phases) \
            or not any("lr" in ph for ph in phases):
        parser.error("--phases: needs 'sz', 'bs' and 'lr' somewhere")
    return [dict(ph) for ph in phases]


def start(ph):
    return ph["ep"][0] if isinstance(ph["ep"], (list, tuple)) else ph["ep"]


def total_epochs(phases):
    ends = [ph["ep"][1] for ph in phases if isinstance(ph["ep"], (list, tuple))]
    return int(math.ceil(max(ends + [start(ph) + 1 for ph in phases])))


def setting(phases, key, epoch, default=None):
    """The value of ``key`` from the latest phase that sets it and has started by ``epoch``."""
    value = default
    for ph in sorted(phases, key=start):
        if key in ph and start(ph) <= epoch:
            value = ph[key]
    return value


def phase_lr(phases, epoch):
    lr = None
    for ph in sorted(phases, key=start):
        if "lr" not in ph or start(ph) > epoch:
            continue
        if isinstance(ph["ep"], (list, tuple)) and isinstance(ph["lr"], (list, tuple)):
            (a, b), (lo, hi) = ph["ep"], ph["lr"]
            t = min(1.0, (epoch - a) / (b - a))
            if ph.get("mode") == "cos":
                t = (1 - math.cos(math.pi * t)) / 2
            lr = lo + (hi - lo) * t
        else:
            lr = ph["lr"]
    return lr if lr is not None else 0.0


def notes(args, phases):
    out = []
    if not args.distributed:
        out.append("--distributed not given: the launcher's workers train together all the same")
    if args.dist_backend != "nccl" or args.dist_url != "env://":
        out.append(f"--dist-backend {args.dist_backend} / --dist-url {args.dist_url}: the launcher's variables "
                   "pick the transport")
    if args.skip_auto_shutdown:
        out.append("--skip-auto-shutdown: nothing is shut down here")
    unused = sorted({k for ph in phases for k in ph} & UNUSED_PHASE_KEYS)
    if unused:
        out.append(f"--phases keys {', '.join(unused)} describe imagenet18's file layout; unused here")
    return out


def parameter_groups(model, args):
    if not args.no_bn_wd:
        return model.parameters()
    bn = batchnorm_parameters(model)
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n in bn], "weight_decay": 0.0},
            {"params": [p for n, p in named if n not in bn]}]


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    phases = parse_phases(args.phases, parser)
    params = study_compression(args, parser)
    if args.fp16:
        params = dict(params or {}, fp16=True)
    classes, train_items = scan(args.data, "train")
    _, val_items = scan(args.data, "val", classes)
    rank, size, logger, device = start_job(args, os.path.basename(__file__), "imagenet_nv")
    amp = MixedPrecision(device, torch.float16 if args.fp16 else None, args.loss_scale)
    logger.info("precision: %s", amp.describe())
    for note in notes(args, phases):
        logger.info("note: %s", note)
    logger.info("%s (width %d), %d classes, %d training and %d validation images; compression_params %s on "
                "%d workers", args.arch, args.width, len(classes), len(train_items), len(val_items), params, size)

    torch.manual_seed(args.seed)
    model = ResNet(args.arch, len(classes), args.width, args.init_bn0).to(device)
    opt = torch.optim.SGD(parameter_groups(model, args), lr=phase_lr(phases, 0), momentum=args.momentum,
                          weight_decay=args.wd, nesterov=args.nesterov and args.momentum > 0)
    opt = distribute(opt, model, params, "train_imagenet_nv")
    val_mine = val_items[rank::size]

    def train_batches(epoch, executor):
        sz, bs = int(setting(phases, "sz", epoch)), int(setting(phases, "bs", epoch))
        min_scale = float(setting(phases, "min_scale", epoch, 0.08))
        steps = len(train_items) // size // bs
        if args.short_epoch:
            steps = min(steps, SHORT_EPOCH_STEPS)
        if steps == 0:
            raise SystemExit(f"{len(train_items)} training images make no batch of {bs} for each of {size} workers")

        def batch(item):
            _, i, indices = item
            rng = np.random.default_rng([args.seed, rank, epoch, i])
            x = np.stack([train_image(train_items[j][0], sz, rng, min_scale) for j in indices])
            return pinned((torch.from_numpy(normalize(x)), torch.tensor([train_items[j][1] for j in indices])),
                          device)
        items = epoch_batches(args.seed, epoch, len(train_items), rank, size, steps, bs)
        return steps, prefetch(executor, batch, items, max(1, args.workers))

    def val_batches(epoch):
        sz, bs = int(setting(phases, "sz", epoch)), int(setting(phases, "bs", epoch))
        for n, first in enumerate(range(0, len(val_mine), bs)):
            if args.short_epoch and n == SHORT_EPOCH_STEPS:
                return
            chunk = val_mine[first:first + bs]
            x = np.stack([val_image(path, sz) for path, _ in chunk])
            yield torch.from_numpy(normalize(x)), torch.tensor([label for _, label in chunk])

    train_and_summarize(args, params, model, opt, logger, args.workers, epochs=total_epochs(phases),
                        train_batches=train_batches, val_batches=val_batches,
                        lr_at=lambda e: phase_lr(phases, e), print_freq=args.print_freq, device=device, amp=amp)


if __name__ == "__main__":
    main()
