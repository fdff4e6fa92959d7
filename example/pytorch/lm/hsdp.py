"""The GPT sharded with FSDP2 on a (replicas, shards) mesh: train.py's --api fsdp and the HSDP
rows of scripts/time_to_accuracy.py --task lm --hsdp. Each block is sharded on its own (its
parameters gathered for its forward and backward only), then the root (embeddings, final
LayerNorm). Three ways across the replicas:

* "native": native HSDP, fully_shard on the 2-D mesh (FSDP2 all-reduces the gradient shards
  over the replicate dimension, dense);
* "hooks": fully_shard on mesh["shard"] and bps_gc.torch.register_fsdp_hooks on
  mesh["replicate"] with the codec (dense without one);
* "none": fully_shard on mesh["shard"] alone: nothing crosses the replicas (each replica
  trains its own model): the step time of the in-host work only, the yardstick's limit.
"""
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import bps_gc.torch as bps

HSDP = ("native", "hooks", "none")


def mesh_for(shards, device_type="cpu"):
    """The (replicas, shards) mesh of the job: ranks r * shards .. r * shards + shards - 1 (one
    host's local ranks under torchrun) shard together."""
    size = dist.get_world_size()
    if shards < 1 or size % shards:
        raise ValueError(f"--shards {shards} must divide the job's {size} ranks")
    return init_device_mesh(device_type, (size // shards, shards), mesh_dim_names=("replicate", "shard"))


def shard_gpt(model, mesh, how, compression_params=None, dense_steps=0):
    """Shard ``model`` (gpt.GPT) in place on ``mesh`` the ``how`` way (HSDP); the hooks'
    CompressedExchange for "hooks", else None."""
    if how not in HSDP:
        raise ValueError(f"HSDP: {how!r} is not one of {HSDP}")
    fully_shard_gpt(model, mesh if how == "native" else mesh["shard"])
    if how == "hooks":
        return bps.register_fsdp_hooks(model, mesh["replicate"], compression_params, dense_steps=dense_steps)
    return None


def fully_shard_gpt(model, mesh):
    """FSDP2 on ``model`` (gpt.GPT) over ``mesh``: each block on its own (its parameters gathered
    for its forward and backward only), then the root (embeddings, final LayerNorm)."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def padded_shard_bytes(model):
    """What native HSDP hands the replicate all-reduce per step on this rank: every FSDP
    module's reduce-scatter output, the rank's padded gradient shards (float32 here)."""
    total = 0
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        if state is None:
            continue
        for group in state()._fsdp_param_groups:  # torch's: the shards' layout
            for p in group.fsdp_params:
                if p.sharded_param.requires_grad:
                    n = 1
                    for d in p.padded_sharded_param_size:
                        n *= d
                    total += n * p.sharded_param.element_size()
    return total
