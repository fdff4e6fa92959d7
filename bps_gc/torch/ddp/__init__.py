"""The DDP side of bps_gc.torch: ``comm_hook`` (hook.py) and the pipeline it runs on its three
threads (``CompressionHook``), which torch/exchange.py's ``CompressedExchange`` runs for named
tensors on any process group. Its parts: gradient_codecs.py (each gradient's codec, by
parameter or name), hook_two_levels.py (several ranks per host), phased_buckets.py (summable
codecs: thc), futures.py (futures and CUDA side streams), dtypes.py (the codecs' dtype)."""
from .hook import CompressionHook, comm_hook

__all__ = ["CompressionHook", "comm_hook"]
