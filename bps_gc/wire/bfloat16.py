"""bfloat16 on the wire: numpy has none, so its elements travel as their 16 bits, in a numpy
dtype of their own (``BFLOAT16``: one uint16 field, which no float dtype equals), and are
summed in float32: ``widen`` is exact, ``narrow`` rounds to nearest, ties to even, as torch's
``.to(torch.bfloat16)`` does (a NaN stays a NaN)."""
import numpy as np

BFLOAT16 = np.dtype([("bfloat16", "<u2")])


def widen(bits):
    """float32 values of a BFLOAT16 array (or a uint8 buffer of one)."""
    return (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def narrow(values, out):
    """Round float32 ``values`` into BFLOAT16 array ``out`` (nearest, ties to even)."""
    word = np.ascontiguousarray(values, np.float32).view(np.uint32)
    rounded = ((word + (np.uint32(0x7FFF) + ((word >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():  # a NaN's rounding could carry into the exponent (an infinity): keep it quiet
        rounded[nan] = ((word[nan] >> 16) | 0x0040).astype(np.uint16)
    out.view(np.uint16)[:] = rounded
    return out
