"""The step context: what codecs and reducers learn about the step a push belongs to.

It is a small flat mapping that travels with every push (``bps_gc.wire.wire`` encodes and
validates it), so workers and servers agree on per-step schedules. Keys every node may rely on:
``lr`` (float), ``step`` (int, counted by the caller), ``epoch`` (int); a codec may read its own
per-step keys too (DGC's ``density``). Values are finite numbers or booleans. Under
BPS_GC_ELASTIC a server adds ``pushes`` (int) to a compressed round's context: how many members'
pushes that round sums (outer_sgd's mean divides by it).
"""
from collections.abc import Mapping

DEFAULTS = {"lr": 0.0, "step": 0, "epoch": 0}


def step_context(ctx=None):
    """A dict with at least lr, step and epoch, from None, a mapping, or a bare learning rate
    (what BytePS's codecs were given)."""
    if ctx is None:
        return dict(DEFAULTS)
    if isinstance(ctx, Mapping):
        if all(k in ctx for k in DEFAULTS):
            return ctx if isinstance(ctx, dict) else dict(ctx)
        return {**DEFAULTS, **ctx}
    if isinstance(ctx, (int, float)) and not isinstance(ctx, bool):
        return {**DEFAULTS, "lr": float(ctx)}
    raise TypeError(f"step context must be a mapping (lr, step, epoch, ...) or a learning rate, "
                    f"got {type(ctx).__name__}")
