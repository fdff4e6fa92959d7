"""Broadcasting parameters and optimizer state from one rank (a sum where only it contributes)."""
import json

import numpy as np
import torch

import bps_gc.core as core

from .checkpoint import codec_state_left_out
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


def _broadcast_layout(layout, root_rank):
    """Root's JSON ``layout`` on every rank: its length, then its bytes (exact as float32)."""
    data = np.frombuffer(json.dumps(layout).encode(), np.uint8) if core.rank() == root_rank else None
    length = np.array([0.0 if data is None else float(data.size)])
    core.broadcast(length, root_rank, "OptimizerLayout.length")
    carrier = np.zeros(int(length[0]), np.float32)
    if data is not None:
        carrier[:] = data
    core.broadcast(carrier, root_rank, f"OptimizerLayout.{int(length[0])}")
    return json.loads(carrier.astype(np.uint8).tobytes().decode())


def broadcast_optimizer_state(optimizer, root_rank):
    """Every worker ends with root's optimizer state (tensors and scalar hyperparameters).

    Optimizers create their state lazily (SGD's momentum buffers appear at the first step), so
    ranks may hold different entries: the root's layout is broadcast first, the others create
    what they lack (zeros of root's shape and dtype) and drop what root does not have, and then
    every rank broadcasts the same values in the same order."""
    with codec_state_left_out():  # the codec state is per rank
        state_dict = optimizer.state_dict()
    layout = {"groups": [sorted(k for k, v in g.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
                         for g in state_dict["param_groups"]],
              "state": [[pid, key, _describe(value)] for pid, entry in sorted(state_dict["state"].items())
                        for key, value in sorted(entry.items()) if _describe(value) is not None]}
    layout = _broadcast_layout(layout, root_rank)
    for index, keys in enumerate(layout["groups"]):
        group = state_dict["param_groups"][index]
        for key in keys:
            t = torch.tensor([float(group.get(key, 0.0))], dtype=torch.float64)
            _broadcast_tensor(t, root_rank, f"OptimizerGroup.{index}.{key}")
            kind = type(group[key]) if key in group else float
            group[key] = kind(t.item())
            optimizer.param_groups[index][key] = group[key]
    state = {}
    for pid, key, (kind, shape, dtype) in layout["state"]:
        mine = state_dict["state"].get(pid, {}).get(key)
        if kind == "tensor":
            dtype = getattr(torch, dtype)
            value = mine if isinstance(mine, torch.Tensor) and list(mine.shape) == shape and mine.dtype == dtype \
                else torch.zeros(shape, dtype=dtype)
            carrier = value if dtype.is_floating_point and dtype != torch.bfloat16 else value.to(torch.float64)
            _broadcast_tensor(carrier, root_rank, f"OptimizerState.{pid}.{key}")
            if carrier is not value:
                value.copy_(carrier.to(dtype))
        else:  # a Python number (e.g. an older torch's step count)
            carrier = torch.tensor([float(mine if isinstance(mine, (int, float)) else 0)], dtype=torch.float64)
            _broadcast_tensor(carrier, root_rank, f"OptimizerState.{pid}.{key}")
            value = (int if kind == "int" else float)(carrier.item())
        state.setdefault(pid, {})[key] = value
    state_dict["state"] = state
    optimizer.load_state_dict(state_dict)
    return optimizer


def _describe(value):
    """(kind, shape, dtype) of a state entry that can be broadcast, else None."""
    if isinstance(value, torch.Tensor):
        return ["tensor", list(value.shape), str(value.dtype).replace("torch.", "")]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return ["int" if isinstance(value, int) else "float", [], ""]
    return None
