"""What the example training scripts share whatever their framework: the rank-0 log, the
learning-rate decay epochs, the per-epoch traffic line and the steps every worker runs."""
import logging
import os
import sys

import bps_gc.core


def make_logger(name, path, rank):
    """Rank 0 logs to stdout and ``path`` (its folder made if missing); the other ranks log nothing."""
    logger = logging.getLogger(name)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # bps_gc.core gives the root logger its own format
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    if rank == 0:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        handlers = [logging.StreamHandler(sys.stdout), logging.FileHandler(path)]
    else:
        handlers = [logging.NullHandler()]
    for handler in handlers:
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    return logger


def decay_epochs(args):
    """The epochs at which a step schedule decays: every --lr-decay-period epochs, or the
    --lr-decay-epoch list."""
    if args.lr_decay_period > 0:
        return list(range(args.lr_decay_period, args.num_epochs, args.lr_decay_period))
    try:
        return [int(e) for e in args.lr_decay_epoch.split(",") if e.strip()]
    except ValueError:
        raise SystemExit(f"--lr-decay-epoch: comma-separated epochs, got {args.lr_decay_epoch!r}")


def log_traffic(logger, epoch):
    """The bytes this worker pushed since the last call, and the compression ratio."""
    m = bps_gc.core.metrics()
    if m.pushed_wire:
        logger.info("[Epoch %d] traffic per worker: pushed %.3f MB (%.3f MB uncompressed, "
                    "ratio %.1f)", epoch, m.pushed_wire / 1e6, m.pushed_raw / 1e6,
                    m.pushed_raw / m.pushed_wire)


def steps_per_epoch(share, images, size, batch_size, max_iters):
    """Whole batches in the smallest worker's ``share`` of the ``images`` (every worker runs
    the same number: each push_pull waits for all of them), at most ``max_iters`` when > 0."""
    steps = share // batch_size
    if max_iters > 0:
        steps = min(steps, max_iters)
    if steps == 0:
        raise SystemExit(f"{images} training images make no full batch of {batch_size} "
                         f"for each of {size} workers")
    return steps
