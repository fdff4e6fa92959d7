"""What the gluon examples of this directory share: the optimizer, the device, the
learning-rate schedule and sums over all workers.

The training scripts import it as ``common`` (Python puts the script's directory first on
``sys.path``); importing it also puts ``example/`` on ``sys.path`` for the helpers shared with
the PyTorch examples (``training_utils``, ``cifar100_data``).
"""
import os
import sys

import mxnet as mx
import numpy as np

import bps_gc.mxnet as bps

# the framework-free helpers one directory up (example/), shared with the PyTorch examples
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from training_utils import decay_epochs  # noqa: E402

def optimizer_name(args):
    """BytePS's choice: plain SGD (momentum as given, or in the codec chain) when compressing,
    NAG otherwise."""
    return "sgd" if args.compressor else "nag"


# ------------------------------------------------------------------------------------- set-up

MODES = ("imperative", "hybrid", "hybrib")  # hybrib: BytePS's recipe prints it (see modes_note)


def device(num_gpus):
    """(context, "cpu" or "gpu", note or None): GPU ``local_rank`` with --num-gpus > 0 (bpslaunch
    starts one process per GPU), else the CPU. BytePS's recipe asks for a GPU; on a host without
    one it trains on the CPU rather than refusing the printed command, and says so."""
    if num_gpus > 0:
        if mx.context.num_gpus() == 0:
            return mx.cpu(), "cpu", f"note: --num-gpus {num_gpus}, but MXNet sees no GPU here: training on the CPU"
        return mx.gpu(bps.local_rank() % mx.context.num_gpus()), "gpu", None
    return mx.cpu(), "cpu", None


def mode_note(mode):
    """BytePS's CIFAR-100 recipe passes ``--mode hybrib``; its script hybridized only on
    ``hybrid``, so those published runs trained imperatively, and so do we, saying so."""
    if mode == "hybrib":
        return "note: --mode hybrib is not 'hybrid': the model is not hybridized (as in BytePS's script)"
    return None


def seed_everything(seed, rank):
    """The same initialization everywhere (rank 0's is broadcast anyway), per-rank data order."""
    import random
    mx.random.seed(seed)
    np.random.seed((seed + 7919 * rank) % 2**32)
    random.seed(seed * 1000003 + rank)


def lr_scheduler(args, iters_per_epoch, mode="step"):
    """gluoncv's schedule, per iteration: a linear warm-up from --warmup-lr over
    --warmup-epochs to ``--lr * size / local_size`` (the rate scaled by the number of worker
    machines, as in BytePS), then ``mode`` (step: times --lr-decay at each decay epoch; poly,
    cosine: down to 0 at --num-epochs)."""
    import gluoncv  # importable beside torch 2 since bps_gc.mxnet was imported
    LRScheduler, LRSequential = gluoncv.utils.LRScheduler, gluoncv.utils.LRSequential
    base_lr = args.lr * bps.size() / bps.local_size()
    # the second scheduler counts its iterations from the end of the warm-up
    steps = [e - args.warmup_epochs for e in decay_epochs(args)]
    epochs = max(1, args.num_epochs - args.warmup_epochs)
    # gluoncv divides by (iterations - 1) in linear/poly/cosine: one iteration is its start
    warmup_mode = "constant" if args.warmup_epochs * iters_per_epoch == 1 else "linear"
    if mode != "step" and epochs * iters_per_epoch == 1:
        mode = "constant"
    return LRSequential([
        LRScheduler(warmup_mode, base_lr=args.warmup_lr, target_lr=base_lr,
                    nepochs=args.warmup_epochs, iters_per_epoch=iters_per_epoch),
        LRScheduler(mode, base_lr=base_lr, target_lr=0, nepochs=epochs,
                    iters_per_epoch=iters_per_epoch, step_epoch=steps,
                    step_factor=args.lr_decay, power=2),
    ])


# ------------------------------------------------------------------------------------ training

def summed(values, name):
    """The element-wise sum of the numbers ``values`` over all workers (a list of floats)."""
    array = mx.nd.array(np.asarray(values, np.float64), dtype=np.float64)
    bps.byteps_push_pull(array, name=name, is_average=False)
    return array.asnumpy().tolist()


class OutOfData(RuntimeError):
    pass


def take(iterable, steps, what):
    """The first ``steps`` items of ``iterable``. Every worker must run the same number of
    steps (each push_pull waits for all of them), so running short is an error, not a
    shorter epoch."""
    iterator = iter(iterable)
    for count in range(steps):  # never fetches a batch beyond the last step
        try:
            item = next(iterator)
        except StopIteration:
            raise OutOfData(f"{what}: {count} batches where every worker needs {steps}") from None
        yield item


def save_checkpoint(net, trainer, stem):
    """``<stem>.params`` (rank 0) and ``<stem>.states`` with each rank's codec state beside it
    (DistributedTrainer.save_states: call it on every rank), each written to a temporary file
    and renamed, so a job killed while saving leaves the previous checkpoint whole."""
    from bps_gc.mxnet.trainer_state import write_atomically
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    if bps.rank() == 0:
        write_atomically(stem + ".params", net.save_parameters)
    trainer.save_states(stem + ".states")
