"""The DDP side of bps_gc.torch: ``comm_hook`` (hook.py), an adapter from a DDP bucket to the
compressed exchange's named parts (bps_gc/collective/exchange/), which torch/exchange.py's
``CompressedExchange`` runs for named tensors on any process group too."""
from .hook import CompressionHook, comm_hook

__all__ = ["CompressionHook", "comm_hook"]
