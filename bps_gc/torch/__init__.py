"""bps_gc.torch: the Horovod/BytePS PyTorch API, with inter-node compression.

    import bps_gc.torch as bps
    bps.init()
    optimizer = bps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression_params={"compressor": "onebit", "ef": "vanilla"})
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
"""
from ..core import metrics
from .checkpoint import load_checkpoint, load_state_dict, save_checkpoint, state_dict
from .broadcast import broadcast_optimizer_state, broadcast_parameters
from .compression import Compression
from .diloco import DiLoCo
from .elastic import elastic_start, membership, membership_epoch
from .exchange import CompressedExchange
from .flat_grads import flat_grads
from .host_group import host_group
from .ddp.hook import comm_hook
from .ops import (barrier, declare, init, local_rank, local_size, poll, push_pull, push_pull_async,
                  push_pull_inplace, rank, shutdown, size, synchronize)
from .optimizer import DistributedOptimizer
from .local_sgd import LocalSGD
from .choco import DecentralizedOptimizer

__all__ = ["Compression", "CompressedExchange", "DistributedOptimizer", "barrier", "broadcast_optimizer_state",
           "broadcast_parameters", "comm_hook", "declare", "flat_grads", "init", "local_rank", "local_size", "metrics", "poll",
           "push_pull", "push_pull_async", "push_pull_inplace", "rank", "shutdown", "size",
           "synchronize"]
__all__ += ["elastic_start", "membership", "membership_epoch"]
__all__ += ["DiLoCo", "host_group", "host_mesh", "register_fsdp_hooks", "DecentralizedOptimizer", "LocalSGD", "load_checkpoint", "load_state_dict", "save_checkpoint",
            "state_dict"]


def __getattr__(name):
    # torch.distributed.fsdp pulls in sympy (about 1 s of CPU in every launched rank): only the
    # jobs that shard a model pay for it
    if name == "register_fsdp_hooks":
        from .fsdp import register_fsdp_hooks
        return register_fsdp_hooks
    if name == "host_mesh":
        from .fsdp_ps import host_mesh
        return host_mesh
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
