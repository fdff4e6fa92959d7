"""Broadcasting parameters and optimizer state from one rank (a sum where only it contributes)."""
import torch

import bps_gc.core as core

from .ops import host_view


def _broadcast_tensor(tensor, root_rank, name):
    array, staged = host_view(tensor)
    core.broadcast(array, root_rank, name)
    if staged:
        with torch.no_grad():
            tensor.copy_(torch.from_numpy(array))


def broadcast_parameters(params, root_rank):
    """``params``: a state_dict or named_parameters(); every worker ends with root's values."""
    items = sorted(params.items()) if isinstance(params, dict) else sorted(list(params), key=lambda kv: kv[0])
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"broadcast_parameters: {name!r} is a {type(tensor).__name__}, not a tensor")
        if tensor.dtype.is_floating_point:
            _broadcast_tensor(tensor, root_rank, f"Parameter.{name}")


def broadcast_optimizer_state(optimizer, root_rank):
    """Every worker ends with root's optimizer state (tensors and scalar hyperparameters)."""
    state_dict = optimizer.state_dict()
    # make sure every rank has the same state entries: initialize lazily created buffers
    for index, group in enumerate(state_dict["param_groups"]):
        for key in sorted(group):
            value = group[key]
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                t = torch.tensor([float(value)], dtype=torch.float64)
                _broadcast_tensor(t, root_rank, f"OptimizerGroup.{index}.{key}")
                optimizer.param_groups[index][key] = type(value)(t.item())
    for pid, state in sorted(optimizer.state_dict()["state"].items()):
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor) and value.dtype.is_floating_point:
                _broadcast_tensor(value, root_rank, f"OptimizerState.{pid}.{key}")
    return optimizer
