"""Horovod-style tensor compression around push_pull (framework side)."""
import torch


class Compressor:
    """Horovod's interface: a subclass defines the static methods ``compress(tensor)``, which
    returns (the tensor to send, a context for decompress), and ``decompress(tensor, ctx)``."""


class NoneCompressor(Compressor):
    """Send the tensor as it is."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Send floating tensors as float16; the result comes back in the original dtype."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    none = NoneCompressor
    fp16 = FP16Compressor
