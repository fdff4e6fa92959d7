"""Payload equality up to the bits of NaN values.

A CUDA GPU writes its one canonical NaN (0x7fffffff in float32, 0x7fff in float16) for any NaN
an arithmetic operation produces, where numpy on x86 carries the input NaN's bits through
(np.nan is 0x7fc00000). Every decoder reads both as NaN, so the device chains match the numpy
chains' bytes except inside a float that is NaN on both sides (docs/device_codecs.md)."""
import numpy as np


def _nan_words(data, width):
    """Boolean per byte: the byte lies in a width-aligned word that is a NaN of that width."""
    dtype = {4: np.float32, 2: np.float16}[width]
    usable = len(data) - len(data) % width
    words = np.isnan(np.frombuffer(data[:usable], dtype=dtype))
    return np.concatenate([np.repeat(words, width), np.zeros(len(data) - usable, bool)])


def assert_equal_but_nan_bits(got, want, message=""):
    """``got`` == ``want`` byte for byte, except bytes inside a 4- or 2-byte aligned float that is
    NaN in both."""
    got, want = bytes(got), bytes(want)
    assert len(got) == len(want), f"{message}: {len(got)} bytes against {len(want)}"
    if got == want:
        return
    differ = np.frombuffer(got, np.uint8) != np.frombuffer(want, np.uint8)
    nan_both = ((_nan_words(got, 4) & _nan_words(want, 4)) | (_nan_words(got, 2) & _nan_words(want, 2)))
    where = np.flatnonzero(differ & ~nan_both)
    assert where.size == 0, f"{message}: payloads differ at byte {where[0]} (not inside a NaN on both sides)"
