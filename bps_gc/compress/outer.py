"""DiLoCo's outer step on the parameter server's servers (docs/diloco.md): reducer ``outer_sgd``.

The workers push a fragment's pseudo-gradient (global copy - local parameters) through the
tensor's codec; the server decodes the pushes, sums them in rank order, divides by the number
of workers, and takes torch.optim.SGD's step (dampening 0, no weight decay) with that mean as
the gradient, keeping the momentum buffer:

    v <- mu v + mean;   g = mean + mu v (Nesterov) or v (mu > 0) or mean;   reply = -lr g

The reply is that update, dense (the partition's elements); every worker adds it to its global
copy, so the copies stay the same bits on every worker. The server keeps the partition's global
copy too (``global_copy``) and adds the same update to it, in the same dtype, so it holds the
same bits: a worker fetches it with a state request (STATE_GET), and DiLoCo seeds it with the
initial parameters before the first round (STATE_PUT). Replying the update rather than the new
global values costs the same bytes and keeps the reducer's reply format. The momentum and the
global copy are this partition's state (its server's, in the checkpoint's ``server/`` part); the
partitions are spread over the servers, so the global parameters and the outer state are
sharded over them. The round's step context carries the settings, the
same on every push: ``outer_lr``, ``outer_momentum``, ``outer_nesterov``, ``outer_workers``
(what the sum is divided by). Any codec whose pushes decode and add (those that support
``lossless``) may use it.
"""
import numpy as np

from .context import step_context
from .reducers import Reducer, register_reducer

SETTINGS = ("outer_lr", "outer_momentum", "outer_nesterov", "outer_workers")


@register_reducer("outer_sgd")
class OuterSGD(Reducer):
    summed = False  # the reply is the update, never divided by the workers
    decodes_pushes = True  # any codec whose payloads decode and add (reducers.choose_reducer)
    state_attrs = ("momentum", "global_copy")

    def __init__(self, params, n, dtype, codecs):
        super().__init__(params, n, dtype, codecs)
        self.momentum = np.zeros(self.n, self.dtype)
        self.global_copy = np.zeros(self.n, self.dtype)  # the sum of the updates until seeded

    def reduce(self, payloads, compressed, ctx=None):
        ctx = step_context(ctx)
        missing = [key for key in SETTINGS if key not in ctx]
        if missing:
            raise ValueError(f"outer_sgd: the step context lacks {', '.join(missing)} (DiLoCo's outer step "
                             "on the servers sets them)")
        f = self.dtype.type
        # BPS_GC_ELASTIC: the server counts the members whose pushes it sums ("pushes"): a
        # worker's size at push time may count a host that died or miss one that joined
        mean = self.total(payloads, compressed) / f(ctx.get("pushes", ctx["outer_workers"]))
        mu = f(ctx["outer_momentum"])
        step = mean
        if mu:
            self.momentum *= mu
            self.momentum += mean
            step = mean + mu * self.momentum if ctx["outer_nesterov"] else self.momentum
        update = (-(f(ctx["outer_lr"]) * step)).astype(self.dtype, copy=False)
        self.global_copy += update  # what every worker adds to its own copy: the same bits
        return update.view(np.uint8)

    def decode(self, reply, out, ctx=None):
        buf = np.frombuffer(reply, np.uint8) if not isinstance(reply, np.ndarray) else reply.reshape(-1)
        if buf.size != self.n * self.dtype.itemsize:
            raise ValueError(f"outer_sgd reply of {buf.size} bytes, expected {self.n * self.dtype.itemsize} "
                             f"({self.n} {self.dtype} elements)")
        out = out.reshape(-1)
        out[:] = np.ascontiguousarray(buf).view(self.dtype)
        return out
