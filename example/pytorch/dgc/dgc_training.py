"""The training run of example/pytorch/dgc/train.py: data, model, bps_gc's DistributedOptimizer
with the resolved compression_params, DGC's learning-rate schedule, per-epoch evaluation,
checkpoints and resuming (see train.py's docstring)."""
import json
import math
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F

import bps_gc.config
import bps_gc.core
import bps_gc.torch as bps
from cifar100_data import augment, epoch_batches, prefetch
from imagenet_resnet import ResNet, batchnorm_parameters
from study_training import distribute, summed, tell_epoch
from torch_device import MixedPrecision, on_device, pick_device, pinned
from training_utils import make_logger

# DGC compresses every tensor of more than one dimension, whatever its size: no BytePS size
# floor unless set. (Its selection is per tensor; bps_gc's per partition: a tensor above
# BYTEPS_PARTITION_BYTES, 4 MB by default, is selected in parts; set it on every node to change.)
DGC_ENV = {"BYTEPS_MIN_COMPRESS_BYTES": "0"}


class Data:
    """The training set (this worker's batches per epoch) and this worker's share of the test set."""

    def __init__(self, c):
        self.c = c
        root, name = c.dataset.root, c.dataset.name
        if name == "cifar10":
            from cifar10_data import load_split
            self.train_x, self.train_y = load_split(root, "train", "--configs.dataset.root")
            self.test_x, self.test_y = load_split(root, "test", "--configs.dataset.root")
            self.classes = 10
            self.count = len(self.train_y)
        else:
            from imagenet_folder import scan
            classes, self.train_items = scan(root, "train")
            _, self.test_items = scan(root, "val", classes)
            self.classes = len(classes)
            self.count = len(self.train_items)
        if self.classes > c.model.num_classes:
            raise SystemExit(f"{root}: {self.classes} classes but configs.model.num_classes is {c.model.num_classes}")

    def steps(self, size):
        bs = self.c.train.batch_size
        steps = self.count // size // bs
        if steps == 0:
            raise SystemExit(f"{self.count} training images make no batch of {bs} for each of {size} workers")
        limit = self.c.train.max_steps_per_epoch
        return min(steps, limit) if limit else steps

    def train_batch(self, item, rank, device):
        """The batch in page-locked memory when it goes to a GPU (loader threads pin it)."""
        epoch, i, indices = item
        rng = np.random.default_rng([self.c.seed, rank, epoch, i])
        if self.c.dataset.name == "cifar10":
            from cifar10_data import normalize
            x = normalize(augment(self.train_x[indices], rng))
            return pinned((torch.from_numpy(x), torch.from_numpy(self.train_y[indices])), device)
        from imagenet_folder import normalize, train_image
        size = self.c.dataset.image_size
        x = np.stack([train_image(self.train_items[j][0], size, rng) for j in indices])
        return pinned((torch.from_numpy(normalize(x)), torch.tensor([self.train_items[j][1] for j in indices])),
                      device)

    def test_batches(self, rank, size):
        bs = self.c.train.batch_size
        if self.c.dataset.name == "cifar10":
            from cifar10_data import normalize
            x, y = self.test_x[rank::size], self.test_y[rank::size]
            for first in range(0, len(y), bs):
                yield torch.from_numpy(normalize(x[first:first + bs])), torch.from_numpy(y[first:first + bs])
            return
        from imagenet_folder import normalize, val_image
        mine = self.test_items[rank::size]
        for first in range(0, len(mine), bs):
            chunk = mine[first:first + bs]
            x = np.stack([val_image(path, self.c.dataset.image_size) for path, _ in chunk])
            yield torch.from_numpy(normalize(x)), torch.tensor([label for _, label in chunk])


def build_model(c):
    if c.dataset.name == "cifar10":
        from train_cifar100_byteps_gc import resnet
        try:
            return resnet(c.model.name, c.model.num_classes)
        except ValueError as e:
            raise SystemExit(f"configs.model.name: {e}")
    return ResNet(c.model.name, c.model.num_classes, c.model.get("width", 64), c.model.get("zero_init_residual", False))


def parameter_groups(c, model):
    """One group, or with optimize_bn_separately (dense training) BatchNorm without weight decay;
    with DGC bps_gc needs one weight decay (dgc_settings notes it)."""
    if not c.train.optimize_bn_separately or c.train.dgc:
        return model.parameters()
    bn = batchnorm_parameters(model)
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n not in bn]},
            {"params": [p for n, p in named if n in bn], "weight_decay": 0.0}]


def learning_rate(c, epoch, step, steps, size):
    """DGC's schedule: lr * workers, reached by a linear ramp from lr over the warm-up epochs
    (per step), then a cosine to 0 over the remaining epochs (per epoch, or per step)."""
    peak = c.train.optimizer.lr * size
    warm = c.train.warmup_lr_epochs
    if epoch < warm:
        e = epoch + step / steps
        return peak * (e * (size - 1) / warm + 1) / size
    if c.train.scheduler.get("name") in ("none", None):
        return peak
    t = epoch - warm + (0 if c.train.schedule_lr_per_epoch else step / steps)
    return peak * (1 + math.cos(math.pi * t / max(1, c.train.num_epochs - warm))) / 2


def evaluate(model, batches, device):
    """{meter: percent} of top-1 and top-5 accuracy over all workers' shares."""
    model.eval()
    top1 = top5 = count = 0
    with torch.no_grad():
        for x, y in on_device(batches, device):
            out = model(x)
            best = out.topk(min(5, out.shape[1]), 1).indices
            top1 += int((best[:, 0] == y).sum())
            top5 += int((best == y[:, None]).any(1).sum())
            count += len(y)
    model.train()
    top1, top5, count = summed([top1, top5, count], "meters.test")
    return {"acc/test_top1": 100 * top1 / max(count, 1), "acc/test_top5": 100 * top5 / max(count, 1)}


def resume(c, rank, model, logger):
    """(last epoch, best metric, optimizer state or None) from this worker's latest checkpoint;
    every worker takes rank 0's epoch."""
    path = c.train.latest_pth_path.format(rank=rank)
    # a corrupt file: named; on the CPU first, the model moves to its device after loading
    state = bps.load_checkpoint(path, map_location="cpu") if os.path.isfile(path) else None
    if state is not None:
        model.load_state_dict(state["model"])
        logger.info("[resume_path] = %s", path)
    last = state["epoch"] if state is not None else -1
    best = state.get("best_metric") if state is not None else None
    last = int(summed([last if rank == 0 else 0], "resume.epoch")[0])
    if state is None and last >= 0:
        raise SystemExit(f"rank {rank}: no {path} while rank 0 resumes at epoch {last + 1}")
    if state is None:
        logger.info("==> train from scratch")
    return last, best, (state or {}).get("optimizer")


def save_checkpoint(c, rank, epoch, state, best):
    """Every file written atomically (a temporary file, then renamed), so a worker killed
    mid-save leaves the previous latest checkpoint whole; ``state["optimizer"]`` holds this
    rank's codec state (DGC's memory) under "bps_gc"."""
    path, latest = c.train.checkpoint_path.format(epoch=epoch, rank=rank), c.train.latest_pth_path.format(rank=rank)
    os.makedirs(os.path.dirname(latest), exist_ok=True)
    bps.save_checkpoint(state, latest)  # the one a run resumes from, first
    for copy in [path] + ([c.train.best_pth_path.format(rank=rank)] if best else []):
        shutil.copyfile(latest, copy + ".tmp")
        os.replace(copy + ".tmp", copy)
    old = c.train.checkpoint_path.format(epoch=epoch - c.train.keep_checkpoints, rank=rank)
    if epoch >= c.train.keep_checkpoints and os.path.isfile(old):
        os.remove(old)
    return path


def run(c, args, set_paths):
    for name, value in (DGC_ENV.items() if c.train.dgc else ()):
        os.environ.setdefault(name, value)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(c.data.num_threads_per_worker)
    data = Data(c)  # a missing data set stops here, before joining the job
    device, device_lines = pick_device(c.device)  # a GPU this host lacks: before joining too
    bps.init()
    rank, size = bps.rank(), bps.size()
    set_paths(size)
    os.makedirs(c.train.save_path, exist_ok=True)
    logger = make_logger("dgc", os.path.join(c.train.save_path, "train.log"), rank)
    logger.info("[train.save_path] = %s", c.train.save_path)
    logger.info(json.dumps(c.to_plain(), sort_keys=True))
    for note in c.bps_gc.notes:
        logger.info("note: %s", note)
    for line in device_lines:
        logger.info(line)
    amp = MixedPrecision(device, getattr(torch, c.train.mixed_precision) if c.train.get("mixed_precision") else None)
    logger.info("precision: %s", amp.describe())
    params = c.bps_gc.compression_params
    torch.manual_seed(c.seed)
    model = build_model(c)
    opt = c.train.optimizer
    optimizer = torch.optim.SGD(parameter_groups(c, model), lr=opt.lr * size, momentum=opt.momentum,
                                weight_decay=opt.weight_decay, nesterov=bool(opt.nesterov) and opt.momentum > 0)
    if args.evaluate:  # DGC's --evaluate: the best checkpoint
        c.train.latest_pth_path = c.train.best_pth_path
    last, best_metric, optimizer_state = resume(c, rank, model, logger)
    model.to(device)  # after loading: the optimizer's state follows its parameters' device
    # a resumed rank keeps its own BatchNorm statistics; --evaluate runs rank 0's broadcast ones (DGC's)
    own = optimizer_state is not None and not args.evaluate
    resumed = {k: v.clone() for k, v in model.state_dict().items()} if own else None
    optimizer = distribute(optimizer, model, params, SCRIPT_NAME)
    if optimizer_state is not None:
        if resumed is not None:
            model.load_state_dict(resumed)  # this rank's own BatchNorm statistics, not rank 0's broadcast ones
        optimizer.load_state_dict(optimizer_state)
    logger.info("%s on %s, %d workers (%s), compression_params %s", c.model.name, c.dataset.name, size,
                bps_gc.config.transport_from_env(), params)
    if args.evaluate:
        for key, value in evaluate(model, data.test_batches(rank, size), device).items():
            logger.info("[%s] = %f", key, value)
        bps.shutdown()
        return 0
    steps = data.steps(size)
    executor = ThreadPoolExecutor(c.data.num_threads_per_worker) if c.data.num_threads_per_worker > 0 else None
    try:
        for epoch in range(last + 1, c.train.num_epochs):
            logger.info("==> training epoch %d/%d", epoch, c.train.num_epochs)
            meters, best_metric, best = train_epoch(c, data, model, optimizer, executor, epoch, steps, rank, size,
                                                    best_metric, logger, amp)
            state = {"epoch": epoch, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "meters": meters, "best_metric": best_metric}
            logger.info("[save_path] = %s", save_checkpoint(c, rank, epoch, state, best))
    finally:
        if executor is not None:
            executor.shutdown(cancel_futures=True)
    bps.shutdown()
    return 0


def train_epoch(c, data, model, optimizer, executor, epoch, steps, rank, size, best_metric, logger, amp):
    tell_epoch(optimizer, epoch)  # DGC's sparsity warm-up
    bps_gc.core.metrics()  # reset: traffic per epoch
    model.train()
    tic = time.perf_counter()
    loss_sum = seen = 0.0
    items = epoch_batches(c.seed, epoch, data.count, rank, size, steps, c.train.batch_size)
    depth = max(1, c.data.num_threads_per_worker)
    batches = prefetch(executor, lambda item: data.train_batch(item, rank, amp.device), items, depth)
    for i, (x, y) in enumerate(on_device(batches, amp.device)):
        lr = learning_rate(c, epoch, i, steps, size)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        with amp.autocast():
            loss = F.cross_entropy(model(x), y)
        amp.backward_and_step(loss, optimizer)
        loss_sum, seen = loss_sum + loss.item() * len(y), seen + len(y)
    elapsed = time.perf_counter() - tic
    m = bps_gc.core.metrics()
    loss_sum, seen = summed([loss_sum, seen], "meters.train")
    meters = evaluate(model, data.test_batches(rank, size), amp.device)
    meters["loss/train"] = loss_sum / max(seen, 1)
    metric = meters[c.train.metric]
    best = best_metric is None or metric > best_metric
    best_metric = metric if best else best_metric
    meters[c.train.metric + "_best"] = best_metric
    for key in sorted(meters):
        logger.info("[%s] = %f", key, meters[key])
    ratio = m.pushed_raw / m.pushed_wire if m.pushed_wire else 1.0
    logger.info("[Epoch %d] lr=%g time %.1f s, %d steps; traffic per worker: %.0f bytes/step pushed, "
                "compression ratio %.1f", epoch, lr, elapsed, steps, m.pushed_wire / steps, ratio)
    if rank == 0:
        row = dict(meters, epoch=epoch, lr=lr, steps=steps, time_s=elapsed, pushed_bytes_per_step=m.pushed_wire / steps,
                   compression_ratio=ratio)
        with open(os.path.join(c.train.save_path, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
    return meters, best_metric, best


SCRIPT_NAME = "example/pytorch/dgc/train.py"
