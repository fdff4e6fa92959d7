"""Where DiLoCo's outer step runs (bps_gc/torch/diloco.py's ``outer_step``, docs/diloco.md "The
outer step on the servers"): on the workers, or on the parameter server's servers as reducer
``outer_sgd`` (compress/outer.py), which takes torch.optim.SGD's step from the settings here
and keeps the global copy and the momentum; and which one DiLoCo takes by default."""
import torch

import bps_gc.core as core

from ..compress import CompressionParams, choose_reducer

SERVERS_GLOBAL = "global_copy"  # outer_sgd's state holding a partition's global copy (compress/outer.py)
# the servers' outer step in the warm phase: the update is -mean (momentum untouched: outer.py)
PLAIN_AVERAGE = {"outer_lr": 1.0, "outer_momentum": 0.0, "outer_nesterov": False}


def default_outer_step(outers, compression_params):
    """outer_step=None's choice: "servers" where bps_gc runs the parameter server with servers
    to reach (not a lone worker) and they can take this outer step (check_servers_step), else
    "workers"."""
    if not core.is_initialized():
        return "workers"
    if not core.communicator().runs_server_reducers:
        return "workers"
    try:
        check_servers_step(outers, compression_params)
    except ValueError:  # another outer optimizer, or a codec outer_sgd cannot decode (thc's phases)
        return "workers"
    return "servers"


def check_servers_step(outers, compression_params):
    """A ValueError naming what the servers' outer step cannot take: an outer optimizer that is
    not plain SGD (server_settings), or a codec whose pushes reducer outer_sgd cannot decode."""
    for outer in outers:
        server_settings(outer)
    params = CompressionParams.from_dict(servers_codec(compression_params))
    try:
        choose_reducer(params, "outer_sgd")
    except ValueError as e:
        raise ValueError(f"DiLoCo: the servers' outer step: {e}") from None


def servers_codec(compression_params):
    """The compression parameters of the servers' outer step: dense pseudo-gradients (no
    compressor) go through ``identity`` (compress/identity.py: the elements as they are, the
    dense push's bytes, at any size), which the servers' reducer decodes as any codec's."""
    params = dict(compression_params or {})
    return params if params.get("compressor") else {**params, "compressor": "identity"}


def server_settings(outer):
    """The step context entries of the servers' outer step (compress/outer.py) from the outer
    optimizer, which must be plain torch.optim.SGD: a ValueError names what is not."""
    if type(outer) is not torch.optim.SGD:
        raise ValueError(f"DiLoCo: the servers' outer step is torch.optim.SGD's; got {type(outer).__name__}")
    group = outer.param_groups[0]
    extra = {k: group[k] for k in ("dampening", "weight_decay") if group.get(k)}
    if extra or group.get("maximize") or len(outer.param_groups) > 1:
        what = extra or ("maximize" if group.get("maximize") else "several parameter groups")
        raise ValueError(f"DiLoCo: the servers' outer step is SGD with lr, momentum and nesterov only, in one "
                         f"parameter group; got {what}")
    return {"outer_lr": float(group["lr"]), "outer_momentum": float(group["momentum"]),
            "outer_nesterov": bool(group["nesterov"])}
