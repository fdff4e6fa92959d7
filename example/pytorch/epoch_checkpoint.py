"""Per-rank epoch checkpoints of the example scripts (docs/checkpoint.md): each rank saves its
model, its optimizer (whose state_dict() carries bps_gc's codec state: error feedback, DGC's
memory, CHOCO's copies, local SGD's synchronized model) and the run's progress, atomically; a
run started again with the same folder resumes after the last epoch every rank saved."""
import os

import bps_gc.torch as bps


def path_of(folder, rank):
    return os.path.join(folder, f"rank{rank}.pth")


def save(folder, rank, model, opt, epoch, **progress):
    """``progress``: what else the run needs to go on (tensors, numbers, strings, lists, dicts)."""
    os.makedirs(folder, exist_ok=True)
    bps.save_checkpoint({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch, **progress},
                        path_of(folder, rank))


def resume(folder, rank, size, model, opt, summed):
    """The saved dict (epoch, progress) once model and optimizer hold its state, or None to
    start afresh. Every rank must hold the same epoch (``summed``: a sum over the ranks)."""
    path = path_of(folder, rank) if folder else None
    state = bps.load_checkpoint(path) if path and os.path.isfile(path) else None
    epoch = state["epoch"] if state is not None else -1
    total, squares = summed([epoch, epoch * epoch], "resume.epoch")
    if total * total != size * squares:  # equal on every rank exactly when the variance is zero
        raise SystemExit(f"rank {rank}: {path or 'no checkpoint'} holds epoch {epoch}, other ranks another: "
                         "resume from checkpoints of the same epoch")
    if state is None:
        return None
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return state
