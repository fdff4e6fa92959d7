"""Builds the codec kernels as a plain shared library (loaded with ctypes, no Python API)."""
import glob
import importlib.util
import os

from setuptools import Extension, setup

here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location(
    "_native_flags", os.path.join(here, "bps_gc", "compress", "_native_flags.py"))
flags = importlib.util.module_from_spec(spec)
spec.loader.exec_module(flags)

kernels = sorted(glob.glob("bps_gc/compress/kernels/*.c"))
setup(ext_modules=[Extension("bps_gc.compress._kernels", kernels, depends=glob.glob("bps_gc/compress/kernels/*.h"),
                             extra_compile_args=flags.CFLAGS, libraries=["m"])])
