"""Compiler flags for kernels/*.c, shared by setup.py and the on-demand build in _native.py.
-ffp-contract=off: no fused multiply-add, so float math rounds like numpy and BytePS."""
CFLAGS = ["-O3", "-std=gnu11", "-ffp-contract=off", "-fvisibility=hidden", "-fPIC"]
