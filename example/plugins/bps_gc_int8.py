"""An example bps_gc plugin: int8 linear quantization (4x smaller than float32).

Use it on every worker and server of a job without touching bps_gc:

    export BPS_GC_PLUGINS=bps_gc_int8        # a module on PYTHONPATH
    ... compression_params={"compressor": "int8", "int8_round": "nearest"}

Payload: the float32 scale max|x| / 127, then one int8 per element.
"""
import numpy as np

from bps_gc.compress import Codec, register_compressor

ROUNDINGS = ("nearest", "floor")


def rounding(value):
    if value not in ROUNDINGS:
        raise ValueError(f"allowed: {', '.join(ROUNDINGS)}")
    return value


@register_compressor("int8", options={"int8_round": rounding})
class Int8(Codec):
    def __init__(self, params, n, dtype, seed=None):
        super().__init__(params, n, dtype)
        options = dict(params.options)
        self.round = np.floor if options.get("int8_round") == "floor" else np.rint

    def compress(self, x, ctx=None):
        x = self._input(x).astype(np.float32)
        scale = np.float32(np.abs(x).max() / 127) if x.size else np.float32(0)
        q = self.round(x / scale) if scale else np.zeros(self.n)
        out = np.empty(4 + self.n, np.uint8)
        out[:4] = np.array([scale], np.float32).view(np.uint8)
        out[4:] = np.clip(q, -127, 127).astype(np.int8).view(np.uint8)
        return out

    def decompress(self, payload, out=None):
        buf = self._payload(payload, 4 + self.n)
        scale = buf[:4].view(np.float32)[0]
        out = self._output(out)
        out[:] = buf[4:].view(np.int8).astype(np.float32) * scale
        return out
