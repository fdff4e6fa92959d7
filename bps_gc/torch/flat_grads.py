"""Gradients as views of flat buffers, as DDP's ``gradient_as_bucket_view`` lays them out.

    grads = bps_gc.torch.flat_grads(params)      # params in the order their gradients are reduced
    loss.backward()                              # autograd adds into the views, in place
    handles = [bps_gc.torch.push_pull_async(p.grad, name=n) for n, p in ...]   # in that order

Each parameter's ``.grad`` becomes a view into one flat buffer of its dtype, laid out back to back
in the order given. On the collective transport a bucket of such views, reduced in place in that
order, is all_reduced where it lies: no copy into a fused buffer and out again
(collective/flat_views.py). ``DistributedOptimizer(..., gradient_as_bucket_view=True)`` makes
them itself, in the order its gradient hooks fire.

A view stays a view while autograd accumulates into it; setting ``.grad`` to None
(``model.zero_grad()``) drops it: ``attach`` copies the new gradient back into its view, and
``zero_`` zeroes every buffer at once and attaches every view again. Only CPU float16/32/64
parameters are laid out; the others keep gradients of their own.
"""
import torch

DTYPES = (torch.float16, torch.float32, torch.float64)


class FlatGrads:
    """``buffers``: dtype -> flat tensor; ``params``: the parameters laid out, in order;
    ``views``: id(param) -> its gradient's view."""

    def __init__(self, params):
        self.params, self.buffers, self.views = [], {}, {}
        self.lay_out(params)

    def lay_out(self, params):
        """New buffers, ``params`` (those on the CPU, of a float dtype) back to back in this
        order, each ``.grad`` copied into its view (zero where it had none) and set to it."""
        params = [p for p in params if p.device.type == "cpu" and p.dtype in DTYPES]
        sizes = {}
        for p in params:
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
        buffers = {dtype: torch.zeros(n, dtype=dtype) for dtype, n in sizes.items()}
        at, views = dict.fromkeys(buffers, 0), {}
        with torch.no_grad():
            for p in params:
                view = buffers[p.dtype][at[p.dtype]:at[p.dtype] + p.numel()].view(p.shape)
                at[p.dtype] += p.numel()
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = views[id(p)] = view
        self.params, self.buffers, self.views = params, buffers, views

    def attach(self, p):
        """``p``'s gradient in its view again, where it was replaced (its values copied in) or
        dropped (zeros); nothing for a parameter not laid out."""
        view = self.views.get(id(p))
        grad = p.grad
        if view is None or (grad is not None and grad.data_ptr() == view.data_ptr()):
            return
        with torch.no_grad():
            view.copy_(grad) if grad is not None else view.zero_()
        p.grad = view

    def zero_(self):
        """Every buffer zeroed (one pass each), every gradient its view again."""
        for buffer in self.buffers.values():
            buffer.zero_()
        for p in self.params:
            p.grad = self.views[id(p)]


def flat_grads(params):
    """Lay out the gradients of ``params`` (an iterable, in the order they will be reduced) as
    views of flat buffers; returns the FlatGrads."""
    return FlatGrads(list(params))
