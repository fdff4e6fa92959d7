"""The step context a framework binding gives its codecs each step (compress/context.py):
``lr``, ``step`` and the ``epoch`` the user set, plus DGC's ``workers``."""


def checked_epoch(epoch):
    """``epoch`` for ``set_epoch``, or a ValueError naming a bad value."""
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"set_epoch: epoch must be a whole number >= 0, got {epoch!r}")
    return epoch


def binding_context(lr, step, epoch, dgc_workers=None):
    """``dgc_workers``: the worker count when the codec is DGC (its clip_norm bound is
    max_norm / sqrt(workers)), else None."""
    ctx = {"lr": float(lr), "step": int(step), "epoch": epoch}
    if dgc_workers is not None:
        ctx["workers"] = dgc_workers
    return ctx
