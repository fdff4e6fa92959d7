"""The refusal of a sharded model's parameters (DTensors, from ``fully_shard``) by the callers
that reduce whole gradients, DistributedOptimizer and the DDP hook: the shards' gradients are
reduced by ``register_fsdp_hooks`` (torch/fsdp.py) instead. DDP itself cannot broadcast a
DTensor, and with ``init_sync=False`` it never calls its hook for them (FSDP2 makes their
gradients), so the refusal comes where the hook is made."""
import sys

HOOKS = "bps_gc.torch.register_fsdp_hooks(model, mesh['replicate'], compression_params)"


def is_dtensor(p):
    # a DTensor exists only once torch.distributed.tensor is imported; importing it here would
    # cost every rank ~0.6 s of CPU (it pulls in sympy) to learn that no parameter is one
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(p, module.DTensor)


def refuse_dtensors(who, named, instead):
    """Raise TypeError, one line, if a parameter of ``named`` ([(name, parameter)]) is a
    DTensor: ``who`` names the caller, ``instead`` ends the line (what to use beside the hooks)."""
    sharded = [name for name, p in named if is_dtensor(p)]
    if sharded:
        raise TypeError(f"{who}: {sharded[0]!r} is a DTensor (a model sharded with fully_shard): compress its "
                        f"gradients with {HOOKS} {instead}")
