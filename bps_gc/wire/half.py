"""The 2-byte floats on the wire, float16 (wire dtype code 2) and bfloat16 (code 4,
bfloat16.py): a server adds a key's pushes in float32 and rounds the sum once (nearest, ties to
even, as torch's ``.to()`` does), where adding in float16 would round after every push.

``SERVER_MEAN``: a push's step-context entry asking the servers for the sum over the round's
pushers divided by their number, in float32, before that one rounding. A worker dividing the
rounded sum would round twice: harmless for 2 or 4 hosts (a power of two divides exactly,
barring float16's subnormals), but over 3 hosts about one element in five lands an ulp off
the rounded float32 mean (tests/test_half_wire.py); pulling the float32 sum instead would
double the bytes pulled."""
import numpy as np

from .bfloat16 import BFLOAT16, narrow, widen

HALF = (np.dtype(np.float16), BFLOAT16)
SERVER_MEAN = "server_mean"
HALF_SUMS = "half-f32-mean"  # in a server's ``sums`` (wire.py): it sums HALF so, and divides


def to_float32(data, dtype):
    """The float32 values (a new array) of a half ``dtype`` array or a uint8 buffer of one."""
    if dtype == BFLOAT16:
        return widen(data)
    return data.view(np.float16).astype(np.float32)


def round_into(values, out):
    """Round float32 ``values`` once into half array ``out`` (nearest, ties to even); returns it."""
    if out.dtype == BFLOAT16:
        return narrow(values, out)
    np.copyto(out, values, casting="same_kind")
    return out
