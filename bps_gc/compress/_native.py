"""Loads the C kernels (``kernels/*.c``, one shared library) through ctypes.

setup.py builds them as an extension next to this file; a source checkout that was not built
(or whose C file changed since) compiles them once into a per-user cache instead, keyed by a hash
of the source, so every process of a job shares one build.
"""
import ctypes
import importlib.machinery
import os

from ._native_flags import CFLAGS

HERE = os.path.dirname(os.path.abspath(__file__))
KERNELS = os.path.join(HERE, "kernels")
SOURCES = sorted(os.path.join(KERNELS, f) for f in os.listdir(KERNELS) if f.endswith(".c"))
HEADERS = sorted(os.path.join(KERNELS, f) for f in os.listdir(KERNELS) if f.endswith(".h"))

# Error codes the kernels return (keep in step with the enum in kernels/common.h).
ERRORS = {-1: "truncated payload", -2: "index out of range", -3: "malformed bit stream",
          -4: "out of memory", -5: "output buffer too small", -6: "input contains inf or NaN"}
ERR_OVERFLOW = -5
ERR_NONFINITE = -6


def _prebuilt():
    newest = max(os.path.getmtime(f) for f in SOURCES + HEADERS)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(HERE, "_kernels" + suffix)
        if os.path.exists(path) and os.path.getmtime(path) >= newest:
            return path
    return None


def _compile_cached():
    import hashlib  # with subprocess and tempfile: only a checkout that was not built compiles
    import subprocess
    import tempfile
    digest = hashlib.sha256(" ".join(CFLAGS).encode())
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            digest.update(f.read())
    digest = digest.hexdigest()[:16]
    cache = os.environ.get("BPS_GC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "bps_gc")
    os.makedirs(cache, exist_ok=True)
    path = os.path.join(cache, f"kernels-{digest}.so")
    if not os.path.exists(path):
        cc = os.environ.get("CC", "cc")
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            subprocess.run([cc, *CFLAGS, "-shared", "-o", tmp, *SOURCES, "-lm"], check=True,
                           capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as e:
            os.unlink(tmp)
            detail = getattr(e, "stderr", "") or str(e)
            raise ImportError(f"bps_gc: the codec kernels are not built and compiling {KERNELS} "
                              f"with {cc!r} failed: {detail}. Install with 'pip install .' "
                              "on a machine with a C compiler.") from e
        os.replace(tmp, path)  # atomic: concurrent processes never load a half-written file
    return path


def _load():
    lib = ctypes.CDLL(_prebuilt() or _compile_cached())
    P, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    C = ctypes.c_int
    U64, D = ctypes.c_uint64, ctypes.c_double
    # name -> (the suffixes of the types it is built for, restype, argtypes): one signature for all
    sigs = {
        "rng_fill": ((), None, [P, I, P]),
        "randomk_indices": ((), None, [P, I, I, P]),
        "randomk_records": (("f32", "f64"), None, [P, P, I, I, P]),
        "onebit_compress": (("f32", "f64", "f16"), F, [P, I, C, P]),
        "onebit_decompress": (("f32", "f64", "f16"), None, [P, F, I, P]),
        "topk_indices": (("f32", "f64"), I, [P, I, I, P]),
        "onebit_residual": (("f32", "f64"), None, [P, F, I, P]),
        "dithering_compress": (("f32", "f64"), I, [P, I, C, C, C, P, P, I]),
        "dithering_decompress": (("f32", "f64"), I, [P, I, F, I, P]),
        "records_gather": (("f32", "f64"), None, [P, P, I, P]),
        "records_scatter": (("f32", "f64"), I, [P, I, I, P]),
        # quantize.c (TernGrad, QSGD) and scans.c (sparse codecs, DGC, PowerSGD, error feedback)
        "key_max": (("u32", "u16"), U64, [P, I]),
        "key_collect": (("u32", "u16"), I, [P, I, U64, P, I]),
        "all_finite": (("u32", "u16", "u64"), C, [P, I]),
        "scale_add_f32": ((), C, [P, F, P, I, P]),
        "scale_add_f64": ((), C, [P, D, P, I, P]),
        "moments_f32": ((), None, [P, I, P]),
        "terngrad_compress_f32": ((), None, [P, I, F, F, P, P]),
        "terngrad_decompress_f32": ((), I, [P, I, F, P]),
        "qsgd_compress_f32": ((), I, [P, I, F, ctypes.c_uint32, C, P, P]),
        "qsgd_decompress_f32": ((), I, [P, I, I, ctypes.c_uint32, C, F, P]),
        "dgc_accumulate_f32": ((), None, [P, P, P, I, F, C]),
        "sorted_records_add_f32": ((), I, [P, I, I, P, C]),
        "records_gather_u32_f32": ((), None, [P, P, I, P]),
        "lowrank_product_f32": ((), None, [P, P, I, I, I, I, P]),
        "powersgd_p_f32": ((), None, [P, P, I, I, I, P, I, P, P]),
        "powersgd_q_f32": ((), None, [P, I, I, P, I, P]),
        # thc.c (summable codes)
        "thc_pack_f32": ((), None, [P, I, D, C, C, C, C, P, P, P, P, C]),
        "thc_unpack_f64": ((), I, [P, I, I, C, C, D, C, D, P, C]),
        "thc_rotate_f32": ((), None, [P, I, I, P, C, F]),
        "thc_peak_f32": ((), D, [P, P, P, I]),
        "thc_stream_above": ((), I, [I]),
    }
    for stem, (types, restype, argtypes) in sigs.items():
        for name in [f"{stem}_{t}" for t in types] or [stem]:
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
    return lib


lib = _load()


_char = ctypes.c_char


def ptr(array):
    """Address of a numpy array's first byte (the array must stay alive during the call).
    A writable contiguous array goes through the buffer protocol (0.2 us; ``array.ctypes.data``
    costs 1.4 us, which at 1M elements and 0.1% kept was most of a codec call)."""
    try:
        return ctypes.addressof(_char.from_buffer(array))
    except (TypeError, ValueError, BufferError):  # read-only, empty or strided
        return array.__array_interface__["data"][0]


def check(code, what):
    """Turn a kernel's negative return code into a ValueError naming what was being decoded."""
    if code < 0:
        raise ValueError(f"{what}: {ERRORS.get(code, f'error {code}')}")
    return code
