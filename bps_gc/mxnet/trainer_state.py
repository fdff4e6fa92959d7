"""DistributedTrainer's codec state beside gluon's optimizer states (issue 33).

``save_states(fname)`` writes gluon's file as gluon does (a temporary file renamed onto
``fname``) and this rank's codec state to ``<fname>.bps_gc.rank<r>`` (encode_state bytes,
also atomically): ``bps_gc.core.state_dict()`` (every compressed gradient's chains and the
servers' state this rank restores) under ``core/``, the post-pull adapters (NAG and weight-
decay momentum moved out of the optimizer) under ``adapter/<i>/`` and the whole-model codec
(granularity 'entiremodel') under ``entire/``. ``load_states(fname)`` loads gluon's file,
then the side file when there is one (without it: one warning line, the codec state starts
fresh, as before issue 33); every part is checked before any is loaded.
"""
import os
import sys

import numpy as np

from .. import core
from ..compress.stateful import StateError, StateGroup
from ..compress.state_bytes import decode_state, encode_state


def side_file(fname, rank):
    return f"{fname}.bps_gc.rank{rank}"


def write_atomically(fname, write):
    """``write(path)`` to a temporary file, then renamed onto ``fname``."""
    tmp = f"{fname}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, fname)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _own_state(trainer):
    """The trainer's own state (adapters, whole-model codec) as one StateGroup; makes the
    adapters and the whole-model codec a first step would make (shapes must be known)."""
    members = {}
    for i, param in enumerate(trainer._params):
        if param.grad_req == "null" or (i not in trainer._grad_tensors and i not in trainer._in_entire):
            continue
        if i not in trainer._adapters and param.shape is not None and all(d > 0 for d in param.shape):
            trainer._adapter(i, np.empty(param.shape, np.dtype(param.dtype)))
        if trainer._adapters.get(i) is not None:
            members[f"adapter/{i}"] = trainer._adapters[i]
    if trainer._in_entire and trainer._entire is None:
        hosts = [np.empty(trainer._params[i].shape, np.dtype(trainer._params[i].dtype))
                 for i in sorted(trainer._in_entire)]
        trainer._make_entire_model(hosts)
    if trainer._entire is not None and trainer._entire.codec is not None:
        members["entire"] = trainer._entire.codec
    return StateGroup(members)


def save(trainer, fname, save_gluon):
    write_atomically(fname, save_gluon)
    sd = {**{f"core/{k}": v for k, v in core.state_dict().items()},
          **{f"trainer/{k}": v for k, v in _own_state(trainer).state_dict().items()}}
    data = encode_state(sd)

    def write(path):
        with open(path, "wb") as f:
            f.write(data)
    write_atomically(side_file(fname, core.rank()), write)


def load(trainer, fname, load_gluon):
    path = side_file(fname, core.rank())
    own = _own_state(trainer)  # declares what a first step would, alike on every rank
    if not os.path.exists(path):
        load_gluon(fname)
        print(f"bps_gc: warning: {path} not found: the codec state (error feedback, momentum, "
              "the servers' state) starts fresh", file=sys.stderr, flush=True)
        return
    with open(path, "rb") as f:
        data = f.read()
    try:
        sd = decode_state(data)
        before = own.state_dict()
        own.load_state_dict({k[len("trainer/"):]: v for k, v in sd.items() if k.startswith("trainer/")})
        try:
            core.load_state_dict({k[len("core/"):]: v for k, v in sd.items() if k.startswith("core/")})
        except StateError:
            own.load_state_dict(before)  # nothing half-loaded
            raise
    except StateError as e:
        raise StateError(f"{path}: {e}") from None
    load_gluon(fname)
