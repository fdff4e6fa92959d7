"""bps_gc.compress.device: codec chains over torch tensors on their device (issue 26).

The only part of ``bps_gc.compress`` that imports torch; ``bps_gc.compress.build_chain`` imports
it only when it is given a device, so servers and numpy users never load torch. Payloads are the
numpy codecs' (docs/codecs.md, "Device chains (torch)"). The device implementations register in
registry.py's tables; a codec without one runs behind ``HostBridge``.
"""
import importlib
import importlib.util

try:
    import torch  # noqa: F401
except ImportError as e:
    raise ImportError("bps_gc.compress.device (build_chain with a device) needs torch, which "
                      f"this Python cannot import: {e}") from e

from ..chain import register_device_chains
from .base import DeviceCodec, host_array, resolve_device, torch_dtype
from .bridge import HostBridge
from .registry import (DEVICE_COMPRESSORS, DEVICE_ERROR_FEEDBACKS, DEVICE_MOMENTUMS,
                       build_device_chain, register_device_compressor,
                       register_device_error_feedback, register_device_momentum)

# The built-in device implementations, imported (so they register) where their module exists:
# each is one file here, so adding one touches no other file.
BUILTIN = ("feedback", "onebit", "signs", "sparse", "threshold",
           "randomk", "dithering", "quantize", "dgc", "powersgd", "thc")
for _name in BUILTIN:
    if importlib.util.find_spec(f"{__name__}.{_name}") is not None:
        importlib.import_module(f"{__name__}.{_name}")

# build_chain(..., device=...) loads this package by name; with every built-in registered, its
# chains are these
register_device_chains(build_device_chain)

__all__ = ["DEVICE_COMPRESSORS", "DEVICE_ERROR_FEEDBACKS", "DEVICE_MOMENTUMS", "DeviceCodec",
           "HostBridge", "build_device_chain", "host_array", "register_device_compressor",
           "register_device_error_feedback", "register_device_momentum", "resolve_device",
           "torch_dtype"]
