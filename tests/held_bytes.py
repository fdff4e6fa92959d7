"""What a bps_gc object holds: the bytes of arrays reachable from it (tests/fsdp_bytes.py's
FSDP2 hooks, tests/ddp_hook_job.py's DDP hook, scripts/ddp_hook_memory.py)."""
import numpy as np
import torch


def array_bytes(values):
    return sum(v.nbytes if isinstance(v, np.ndarray) else v.numel() * v.element_size()
               for v in values if isinstance(v, (np.ndarray, torch.Tensor)))


def held_bytes(roots):
    """The bytes of the distinct buffers of every array reachable from ``roots`` through bps_gc
    objects, lists, tuples and dicts (a view counts its base array once)."""
    seen, buffers, todo = set(), {}, list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            base = obj
            while isinstance(base.base, np.ndarray):
                base = base.base
            buffers[(base.__array_interface__["data"][0], base.nbytes)] = base.nbytes
        elif isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            buffers[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            todo.extend(obj)
        elif type(obj).__module__.startswith("bps_gc."):
            todo.extend(getattr(obj, "__dict__", {}).values())
    return sum(buffers.values())
