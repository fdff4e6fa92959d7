"""A codec plugin whose output depends on the step context (loaded through BPS_GC_PLUGINS on
every worker and server by test_cluster_reducers.py): at step s it keeps the elements whose
index is a multiple of s + 2 (and scales them by the context's ``gain``, 1 when absent), and
sends them densely. A server that saw another step than the workers would mask other indices."""
import numpy as np

from bps_gc.compress import Codec, register_compressor, step_context


def step_mask(n, ctx):
    ctx = step_context(ctx)
    return np.arange(n) % (int(ctx["step"]) + 2) == 0, ctx.get("gain", 1.0)


@register_compressor("test_step_mask")
class StepMask(Codec):
    def __init__(self, params, n, dtype, seed=None):
        super().__init__(params, n, dtype)

    def compress(self, x, ctx=None):
        keep, gain = step_mask(self.n, ctx)
        return np.where(keep, self._input(x) * self.dtype.type(gain), 0).astype(self.dtype).view(np.uint8)

    def decompress(self, payload, out=None):
        out = self._output(out)
        out[:] = self._payload(payload, self.n * self.dtype.itemsize).view(self.dtype)
        return out
