"""The training loop the layer-wise study's twins share (train_cifar10_resnet9.py,
train_imagenet_nv.py): data-parallel SGD through bps_gc.torch.DistributedOptimizer on whichever
transport the launcher chose (torchrun: torch.distributed; bpslaunch: the parameter server).

Per epoch, rank 0 logs and records: the training loss and accuracy (over all workers), the
validation accuracy (each worker evaluates its share; correct and count are summed), the bytes
this worker pushed per step and the compression ratio, and the time.
"""
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

import bps_gc.core
import bps_gc.torch as bps
import epoch_checkpoint
from bps_gc.config import transport_from_env
from study_flags import compress_every_layer, require_launcher
from torch_device import MixedPrecision, on_device, pick_device
from training_utils import make_logger


def summed(values, name):
    """The element-wise sum of ``values`` over all workers."""
    return bps.push_pull(torch.tensor(values, dtype=torch.float64), average=False, name=name).tolist()


def evaluate(model, batches, device=torch.device("cpu")):
    """(correct, count) of the model over ``batches`` of (images, labels), on ``device``."""
    model.eval()
    correct = count = 0
    with torch.no_grad():
        for x, y in on_device(batches, device):
            correct += int((model(x).argmax(1) == y).sum())
            count += len(y)
    model.train()
    return correct, count


def tell_epoch(opt, epoch):
    """Codecs with a per-epoch schedule (DGC's sparsity warm-up) read the epoch from the step
    context the optimizer builds."""
    if hasattr(opt, "set_epoch"):
        opt.set_epoch(epoch)


def needs_epochs(params):
    """Whether the codec's schedule changes with the epoch (DGC warm-up)."""
    return bool(params) and bool(params.get("warmup_epochs") or params.get("warmup_densities"))


def check_epoch_support(opt, params):
    if needs_epochs(params) and not hasattr(opt, "set_epoch"):
        raise SystemExit("--warmup-epochs: this bps_gc's DistributedOptimizer cannot pass the epoch to "
                         "the codec (no set_epoch); use --warmup-epochs 0")


def train(model, opt, logger, *, epochs, train_batches, val_batches, lr_at, print_freq=0, device=None,
          amp=None, checkpoint=""):
    """Run ``epochs``; ``train_batches(epoch)`` gives (steps, iterable of that many (x, y)
    batches), the same number of steps on every worker; ``val_batches(epoch)`` this worker's
    validation share; ``lr_at(fractional epoch)`` the rate; ``device`` where the model is,
    ``amp`` its MixedPrecision. Returns one dict per epoch.
    ``checkpoint``: a folder where each rank saves its state after every epoch (codec state
    included, epoch_checkpoint.py), resumed from when it holds one."""
    device = device or torch.device("cpu")
    amp = amp or MixedPrecision(device)
    history, first = [], 0
    saved = epoch_checkpoint.resume(checkpoint, bps.rank(), bps.size(), model, opt, summed)
    if saved is not None:
        history, first = saved["history"], saved["epoch"] + 1
        logger.info("resumed from %s after epoch %d", checkpoint, saved["epoch"])
    for epoch in range(first, epochs):
        tell_epoch(opt, epoch)
        bps_gc.core.metrics()  # reset: traffic is reported per epoch
        model.train()
        tic = time.perf_counter()
        loss_sum = correct = seen = 0.0
        done = 0
        steps, batches = train_batches(epoch)
        for i, (x, y) in enumerate(on_device(batches, device)):
            lr = lr_at(epoch + i / steps)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad()
            with amp.autocast():
                out = model(x)
                loss = F.cross_entropy(out, y)
            amp.backward_and_step(loss, opt)
            loss_sum += loss.item() * len(y)
            correct += int((out.argmax(1) == y).sum())
            seen += len(y)
            done = i + 1
            if print_freq and done % print_freq == 0:
                logger.info("[Epoch %d] step %d/%d: loss=%.4f lr=%.5f", epoch, done, steps, float(loss), lr)
        elapsed = time.perf_counter() - tic
        m = bps_gc.core.metrics()
        loss_sum, correct, seen = summed([loss_sum, correct, seen], "metric.train")
        val_correct, val_seen = summed(list(evaluate(model, val_batches(epoch), device)), "metric.val")
        row = {"epoch": epoch, "steps": done, "time_s": elapsed, "train_loss": loss_sum / max(seen, 1),
               "train_accuracy": correct / max(seen, 1), "val_accuracy": val_correct / max(val_seen, 1),
               "pushed_bytes_per_step": m.pushed_wire / max(done, 1),
               "ratio": m.pushed_raw / m.pushed_wire if m.pushed_wire else 1.0}
        logger.info("[Epoch %d] speed: %d samples/sec\ttime cost: %f", epoch, int(seen / elapsed), elapsed)
        logger.info("[Epoch %d] training: loss=%f accuracy=%f", epoch, row["train_loss"], row["train_accuracy"])
        logger.info("[Epoch %d] validation: accuracy=%f", epoch, row["val_accuracy"])
        logger.info("[Epoch %d] traffic per worker: %.0f bytes/step pushed, compression ratio %.1f",
                    epoch, row["pushed_bytes_per_step"], row["ratio"])
        history.append(row)
        if checkpoint:
            epoch_checkpoint.save(checkpoint, bps.rank(), model, opt, epoch, history=history)
    return history


def write_summary(path, args, params, workers, history):
    """<path>: the flags, the compression_params they meant, the workers and each epoch's row."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"args": vars(args), "compression_params": params, "workers": workers,
                   "transport": transport_from_env(),
                   "history": history}, f, indent=1)


def distribute(opt, model, params, script):
    """``opt`` wrapped by bps_gc with ``params``, the model broadcast from rank 0; a combination
    bps_gc refuses exits naming the script and the reason."""
    try:
        opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression_params=params)
    except ValueError as e:  # a codec/momentum combination this bps_gc refuses: its message
        raise SystemExit(f"{script}: {e}")
    check_epoch_support(opt, params)
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    return opt


def train_and_summarize(args, params, model, opt, logger, threads, train_batches, **train_args):
    """train() with ``train_batches(epoch, executor)`` fed by ``threads`` loader threads (none:
    on the caller's thread); rank 0 writes <logdir>/<name>.json; bps_gc is shut down."""
    executor = ThreadPoolExecutor(threads) if threads > 0 else None
    try:
        history = train(model, opt, logger, train_batches=lambda epoch: train_batches(epoch, executor),
                        checkpoint=args.checkpoint, **train_args)
    finally:
        if executor is not None:
            executor.shutdown(cancel_futures=True)
    if bps.rank() == 0:
        write_summary(os.path.join(args.logdir, f"{args.name}.json"), args, params, bps.size(), history)
    bps.shutdown()


def start_job(args, script, log_name):
    """Checks the launcher, picks the device (--device), joins the job; (rank, size, logger,
    device), the logger in <logdir>/<name>.log with the flags and the device logged first."""
    require_launcher(script)
    compress_every_layer(args)
    device, device_lines = pick_device(args.device)  # a GPU this host lacks: before joining
    bps.init()
    rank, size = bps.rank(), bps.size()
    os.makedirs(args.logdir, exist_ok=True)
    logger = make_logger(log_name, os.path.join(args.logdir, f"{args.name}.log"), rank)
    logger.info(args)
    for line in device_lines:
        logger.info(line)
    return rank, size, logger, device
