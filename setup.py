"""Builds the codec kernels as a plain shared library (loaded with ctypes, no Python API)."""
import importlib.util
import os

from setuptools import Extension, setup

here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location(
    "_native_flags", os.path.join(here, "bps_gc", "compress", "_native_flags.py"))
flags = importlib.util.module_from_spec(spec)
spec.loader.exec_module(flags)

setup(ext_modules=[Extension("bps_gc.compress._kernels", ["bps_gc/compress/_kernels.c"],
                             extra_compile_args=flags.CFLAGS, libraries=["m"])])
