"""All codec and algorithm state of this rank in one dict, and back (docs/checkpoint.md):

    torch.save({"model": model.state_dict(), "bps_gc": bps.state_dict()}, path)   # or save_checkpoint
    ...
    bps.load_state_dict(torch.load(path, weights_only=True)["bps_gc"])    # before the first step

The dict holds tensors, ints, floats and strs only (``torch.load(..., weights_only=True)``
reads it): ``format``, ``rank``, ``world_size``; ``communicator``: the chains of every declared
tensor (bps_gc.core.state_dict, by tensor name and partition); ``device``: the device chains of
bps_gc.torch's push_pull (device.py, by tensor name and device); ``objects``: every
comm_hook (by parameter name), DistributedOptimizer (post-pull adapters, entire-model codec,
step and epoch), LocalSGD (its synchronized model, counters) and DecentralizedOptimizer (CHOCO,
D-PSGD) made in this process, named ``<kind>.<i>`` in the order they were made.

Another world size or rank is refused, naming both, unless ``drop_rank_state=True`` or
BPS_GC_RESUME_DROP_RANK_STATE=1: then nothing is loaded (the codecs start afresh) and one
warning line says so. Everything is checked before anything is assigned.
"""
import contextlib
import itertools
import os
import sys
import threading
import weakref

import numpy as np
import torch

import bps_gc.core as core

from ..compress.stateful import StateError, StateGroup, Stateful
from .device import _partitions, device_partitions

FORMAT = "bps_gc.torch.state/1"
KEY = "bps_gc"  # the codec state's key in a wrapping optimizer's state_dict()
DROP_SETTING = "BPS_GC_RESUME_DROP_RANK_STATE"
_registered = []  # [(name, weakref, job)] in the order they were made
_counters = {}  # (job, kind) -> count


def register(obj, kind):
    """Make ``obj``'s state part of state_dict(), as ``<kind>.<i>``, counted from 0 in each job
    (until its shutdown(): core.jobs_ended), as a fresh process resuming that job counts; returns obj."""
    job = core.jobs_ended()
    count = _counters.setdefault((job, kind), itertools.count())
    _registered.append((f"{kind}.{next(count)}", weakref.ref(obj), job))
    return obj


def _live():
    """[(name, object)] of this job's objects still alive. Those of a job that ended are no part
    of a later one's state, even while alive (torch keeps the frames of the first optimizer
    constructor's import of torch._dynamo, and with them the script's frame and its objects)."""
    job = core.jobs_ended()
    _registered[:] = [entry for entry in _registered if entry[1]() is not None and entry[2] == job]
    return [(name, ref()) for name, ref, _ in _registered]


class Fields(Stateful):
    """Attributes of an object that is not Stateful itself (an optimizer), saved by name."""

    def __init__(self, target, attrs, identity=None):
        self.__dict__.update(_target=target, state_attrs=tuple(attrs), _identity=dict(identity or {}))

    def state_identity(self):
        return self._identity

    def __getattr__(self, name):
        return getattr(self.__dict__["_target"], name)

    def __setattr__(self, name, value):
        setattr(self._target, name, value)


def _optimizer_state(opt):
    parts = {"counters": Fields(opt, ("_steps", "_epoch"))}
    if opt._plan is not None:
        parts["plan"] = opt._plan
        parts["post_pull"] = StateGroup({opt._names[pid]: a for pid, a in opt._post_pull.items()})
    if opt._entire is not None and opt._entire.codec is not None:
        parts["entire_model"] = opt._entire.codec
    return StateGroup(parts)


def _local_sgd_state(opt):
    return Fields(opt, ("steps", "epoch", "synchronizations", "x_sync"),
                  {"local_steps": opt.local_steps, "local_from_epoch": opt.local_from_epoch, "sign": int(opt.sign)})


def _gossip_state(opt):
    """CHOCO / D-PSGD: after the neighbours' last messages are in, as the node's own
    state_dict() does (a group of states reads the node's attributes, not its state_dict())."""
    opt.gossip.collect()
    return opt.gossip


STATES = {"DistributedOptimizer": _optimizer_state, "LocalSGD": _local_sgd_state,
          "DecentralizedOptimizer": _gossip_state}


def _objects_state():
    return StateGroup({name: obj.codec_state() if hasattr(obj, "codec_state") else STATES[name.split(".")[0]](obj)
                       for name, obj in _live()})


def _as_saved(value):
    """Numpy arrays as tensors, in dicts at any depth (torch.save with weights_only reads
    tensors, not arrays)."""
    if isinstance(value, dict):
        return {k: _as_saved(v) for k, v in value.items()}
    return torch.from_numpy(np.array(value)) if isinstance(value, np.ndarray) else value


def state_dict():
    """This rank's codec and algorithm state (see the module doc); call it between steps, on
    every rank (CHOCO collects its neighbours' last messages first)."""
    if not core.is_initialized():
        raise RuntimeError("bps_gc.torch.state_dict(): call bps_gc.torch.init() first")
    return {"format": FORMAT, "rank": core.rank(), "world_size": core.size(),
            "communicator": _as_saved(core.state_dict()),
            "device": _as_saved(_device_state(None).state_dict()),
            "objects": _as_saved(_objects_state().state_dict())}


def _drop_setting(drop_rank_state):
    if drop_rank_state is not None:
        return bool(drop_rank_state)
    value = os.environ.get(DROP_SETTING, "0").strip().lower()
    if value not in ("0", "1", "", "false", "true"):
        raise ValueError(f"{DROP_SETTING}={value!r}: expected 0 or 1")
    return value in ("1", "true")


def _moved(value, map_location):
    """``value``'s tensors on ``map_location`` (None: where they are), in dicts at any depth."""
    if isinstance(value, dict):
        return {k: _moved(v, map_location) for k, v in value.items()}
    return value.to(map_location) if map_location is not None and isinstance(value, torch.Tensor) else value


def _checked(sd):
    """The three parts of a state_dict() result; StateError for anything else."""
    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        found = sd.get("format") if isinstance(sd, dict) else type(sd).__name__
        raise StateError(f"not a bps_gc.torch state (format {found!r}, expected {FORMAT!r}): pass "
                         "what bps_gc.torch.state_dict() returned")
    for part in ("communicator", "device", "objects"):
        if not isinstance(sd.get(part), dict):
            raise StateError(f"bps_gc.torch state: part {part!r} is missing or not a dict")
    return sd


def _transport(communicator):
    """The transport of a communicator, or of its saved state (the PS's has meta.transport)."""
    ps = "meta.transport" in communicator if isinstance(communicator, dict) else \
        type(communicator).__module__.startswith("bps_gc.ps.")
    return "the parameter server" if ps else "torch.distributed"


def load_state_dict(sd, map_location=None, drop_rank_state=None):
    """Restore ``state_dict()``'s result into this rank's objects (make them, and declare the
    tensors, first; load before the first step). Tensors are copied into the objects' own,
    where they live; device chains the state holds are made on the device they were saved
    from, or on ``map_location``. Raises StateError naming the problem; then nothing changed.
    Returns True when the state was loaded, False when another world size's was dropped."""
    if not core.is_initialized():
        raise RuntimeError("bps_gc.torch.load_state_dict(): call bps_gc.torch.init() first")
    sd = _checked(sd)
    here = (core.size(), core.rank(), _transport(core.worker()))
    saved = (sd.get("world_size"), sd.get("rank"), _transport(sd["communicator"]))
    if saved != here:
        what = (f"world size {saved[0]} in the state, {here[0]} here" if saved[0] != here[0] else
                f"rank {saved[1]} in the state, {here[1]} here" if saved[1] != here[1] else
                f"saved on {saved[2]}, here {here[2]}")
        if not _drop_setting(drop_rank_state):
            raise StateError(f"bps_gc.torch state: saved by another job ({what}); its per-rank codec "
                             f"state does not apply (set {DROP_SETTING}=1 to start the codecs afresh)")
        print(f"bps_gc: warning: rank {here[1]}: dropping the saved codec state ({what}; "
              f"{DROP_SETTING}): the codecs start afresh", file=sys.stderr, flush=True)
        return False
    before, made = core.state_dict(), dict(_partitions.get(core.worker(), {}))
    device_before = _device_state(None).state_dict()
    core.load_state_dict(_moved(sd["communicator"], map_location))
    try:
        device = _moved(sd["device"], map_location)
        _device_state(device, map_location).load_state_dict(device)
        objects = dict(_live())
        objects_sd = _moved(sd["objects"], map_location)
        parts = _split(objects_sd)
        unknown = sorted(set(parts) - set(objects))
        if unknown:
            raise StateError(f"bps_gc.torch state: it holds {', '.join(unknown)}, which this process did not "
                             f"make (make the same hooks and optimizers, in the same order, before loading)")
        loading, installs = {}, []
        for name, obj in objects.items():
            if hasattr(obj, "codec_state_to_load"):
                loading[name], install = obj.codec_state_to_load(parts.get(name, {}))
                installs.append(install)
            else:
                loading[name] = STATES[name.split(".")[0]](obj)
            if name not in parts and loading.pop(name).state_dict():
                raise StateError(f"bps_gc.torch state: it lacks {name}, which this process made")
        StateGroup(loading).load_state_dict(objects_sd)
    except BaseException:  # the communicator and device chains as they were: nothing half-loaded
        core.load_state_dict(before)
        if core.worker() in _partitions:
            _partitions[core.worker()] = made
        _device_state(None).load_state_dict(device_before)
        raise
    for install in installs:
        install()
    return True


def _device_state(sd, map_location=None):
    """The device chains of bps_gc.torch's push_pull (device.py), keyed
    ``<tensor>@<device>/<partition>/worker|reducer``: those made so far (``sd`` None), or those
    ``sd`` holds, made now on their saved device or ``map_location``."""
    if sd is None:
        made = _partitions.get(core.worker(), {})
        chains = {f"{name}@{device}": parts for (name, device), parts in made.items() if parts}
    else:
        chains = {}
        for where in {key.removeprefix("identity.").split(StateGroup.SEP, 1)[0] for key in sd}:
            name, _, device = where.rpartition("@")
            if core.declaration(name) is None:
                raise StateError(f"bps_gc.torch state: device chains of {name!r}, which this rank did not declare")
            chains[where] = device_partitions(name, torch.empty(0, device=map_location or device))
    return StateGroup({where: StateGroup({str(p): StateGroup({"worker": part.codec, "reducer": part.reducer})
                                          for p, part in enumerate(parts)}) for where, parts in chains.items()})


def _split(flat):
    """{object name: its own flat state} of the ``objects`` part."""
    parts = {}
    for key, value in flat.items():
        marked = key.startswith("identity.")
        name, _, rest = key.removeprefix("identity.").partition(StateGroup.SEP)
        parts.setdefault(name, {})[("identity." if marked else "") + rest] = value
    return parts


# ---------------------------------------------------------------- optimizers' state_dict


_left_out = threading.local()


@contextlib.contextmanager
def codec_state_left_out():
    """Optimizers' ``state_dict()`` without the codec state, within (broadcast_optimizer_state:
    the codec state is per rank)."""
    _left_out.active = True
    try:
        yield
    finally:
        _left_out.active = False


def with_codec_state(sd):
    """A wrapping optimizer's ``state_dict()`` with this rank's codec state under ``"bps_gc"``
    (a communicator that cannot save its state yet: without, and one warning line; none without
    bps_gc.torch.init(), e.g. CHOCO on a communicator of its own)."""
    if getattr(_left_out, "active", False) or not core.is_initialized():
        return sd
    try:
        codec = state_dict()
    except NotImplementedError as e:
        if not getattr(with_codec_state, "warned", False):
            print(f"bps_gc: warning: optimizer.state_dict() holds no codec state: {e}", file=sys.stderr, flush=True)
            with_codec_state.warned = True
        return sd
    return {**sd, KEY: codec}


def load_with_codec_state(sd, load_own):
    """A wrapping optimizer's ``load_state_dict(sd)``: the codec state under "bps_gc" first (a
    refused one leaves the optimizer as it was), then ``load_own`` of the rest."""
    if isinstance(sd, dict) and KEY in sd:
        sd = dict(sd)
        load_state_dict(sd.pop(KEY))
    return load_own(sd)


def save_checkpoint(obj, path):
    """torch.save ``obj`` to ``path`` atomically: a temporary file beside it, flushed, then
    renamed over it, so a crash mid-save leaves the previous checkpoint whole."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path, map_location=None):
    """torch.load(path, weights_only=True), with one clear error for a truncated or corrupt file."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # zip reader, unpickler and weights-only errors alike
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StateError(f"checkpoint {path} is truncated or corrupt ({first})") from None


__all__ = ["load_checkpoint", "load_state_dict", "save_checkpoint", "state_dict"]
