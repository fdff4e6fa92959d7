"""Saving and restoring the state a codec chain, reducer or algorithm keeps between steps.

One mechanism for every class: a class names its state attributes (``state_attrs``), its
settings (``state_identity``) and the objects whose state follows its own (``state_children``,
each under a key prefix); ``Stateful.state_dict``/``load_state_dict`` do the rest. A state dict
is flat: ``str -> numpy array`` (``torch.Tensor`` on its device for a device chain's tensors; a
``torch.Generator``'s state as a CPU uint8 tensor) or a plain int, float or str. Keys:

* ``identity.<label><setting>``: what the state belongs to (codec name and settings, element
  count, dtype, generator kind); loading into an object whose identity differs fails naming the
  setting and both values;
* ``<label><attribute>`` (``ef.error``, ``momentum.momentum``, ``codec.rng_state``, ...), and
  ``<label><attribute>.<name>`` for an attribute holding a dict of arrays (CHOCO's copies).

``load_state_dict`` checks every key, shape and dtype before it assigns anything (nothing is
half-loaded) and copies arrays into the existing ones in place (a native kernel may hold their
address). torch is never imported here: a device object's values are torch objects already.
"""
import json
import sys
from collections.abc import Mapping

import numpy as np

IDENTITY = "identity."
SCALARS = (int, float, str)


class StateError(ValueError):
    """A state dict that does not fit the object it is loaded into."""


class Stateful:
    """Mixin: ``state_dict()`` and ``load_state_dict(sd)`` from the declarations below."""

    state_label = ""   # prefix of this object's keys, e.g. "ef." (its children's do not get it)
    state_attrs = ()   # attributes that carry state from one step to the next

    def state_identity(self):
        """Settings a state is valid for: {name: int | float | str}."""
        return {}

    def state_children(self):
        """(key prefix, Stateful) pairs whose state is saved with this object's."""
        return ()

    def state_dict(self):
        """This object's state (copies): see the module doc."""
        sd = {IDENTITY + k: v for k, v in identity(self).items()}
        for key, (_, _, value) in _setters(self).items():
            sd[key] = _snapshot(value)
        return sd

    def load_state_dict(self, sd):
        """Restore ``sd`` (from ``state_dict`` of an object of the same settings, numpy or
        device); a StateError names the first problem, and then nothing has changed."""
        load(self, sd)


def _walk(obj, prefix=""):
    """(key prefix with the object's label, object) for obj and its children, depth first."""
    yield prefix + obj.state_label, obj
    for child_prefix, child in obj.state_children():
        yield from _walk(child, prefix + child_prefix)


def identity(obj):
    """The identity of obj and its children: {key without "identity.": int | float | str}."""
    out = {}
    for prefix, o in _walk(obj):
        out.update({prefix + k: _plain(v) for k, v in o.state_identity().items()})
    return out


def _setters(obj):
    """key -> (container, attribute or dict key, current value)."""
    out = {}
    for prefix, o in _walk(obj):
        for attr in o.state_attrs:
            value = getattr(o, attr)
            if isinstance(value, dict):
                out.update({f"{prefix}{attr}.{name}": (value, name, item)
                            for name, item in value.items()})
            elif value is not None:
                out[prefix + attr] = (o, attr, value)
    return out


def _plain(v):
    if isinstance(v, (bool, np.bool_)):
        return int(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        return float(v)
    if not isinstance(v, SCALARS):
        raise TypeError(f"state identity values must be int, float or str, got {type(v).__name__}")
    return v


def _is_tensor(v):
    return type(v).__module__.startswith("torch") and hasattr(v, "detach")


def _is_generator(v):
    return hasattr(v, "get_state") and hasattr(v, "set_state")


def _snapshot(v):
    if isinstance(v, np.random.Generator):  # a plugin's; its state as JSON (ints of any size)
        return json.dumps(v.bit_generator.state, sort_keys=True)
    if isinstance(v, np.ndarray):
        return v.copy()
    if _is_tensor(v):
        return v.detach().clone()
    if _is_generator(v):
        return v.get_state()
    return _plain(v)


def as_numpy(v):
    """An array-like state value (numpy array or torch tensor anywhere) as a numpy array."""
    if isinstance(v, np.ndarray):
        return v
    if _is_tensor(v):
        return v.detach().cpu().numpy()
    return None


def _describe(v):
    a = as_numpy(v)
    if a is not None:
        return f"an array of shape {tuple(a.shape)} and dtype {a.dtype}"
    return f"{type(v).__name__} {v!r}"


def _check_identity(obj, sd):
    want = identity(obj)
    saved = {k[len(IDENTITY):]: v for k, v in sd.items() if k.startswith(IDENTITY)}
    for key in sorted(set(want) | set(saved), key=lambda k: (k.count("."), k)):  # outer first
        mine, theirs = want.get(key), saved.get(key)
        if mine == theirs:
            continue
        if key.endswith("params") and isinstance(mine, str) and isinstance(theirs, str):
            _diff_params(key, json.loads(mine), _json(theirs, key))
        raise StateError(f"the state does not fit this {type(obj).__name__}: setting {key!r} "
                         f"is {_show(theirs)} in the state, {_show(mine)} here")


def _json(text, key):
    try:
        return json.loads(text)
    except ValueError:
        raise StateError(f"state key {IDENTITY}{key!r} is not the JSON of settings") from None


def _diff_params(key, mine, theirs):
    for name in sorted(set(mine) | set(theirs)):
        if mine.get(name) != theirs.get(name):
            raise StateError(f"the state was saved with another codec setting ({key}): {name!r} "
                             f"is {_show(theirs.get(name))} in the state, {_show(mine.get(name))} here")


def _show(v):
    return "absent" if v is None else repr(v)


def _converted(key, current, value):
    """``value`` checked against the slot's current value and made ready to assign."""
    if isinstance(current, np.random.Generator):
        kind = current.bit_generator.state["bit_generator"]
        try:
            state = json.loads(value) if isinstance(value, str) else None
            ok = isinstance(state, dict) and state.get("bit_generator") == kind
        except ValueError:
            ok = False
        if not ok:
            raise StateError(f"state key {key!r}: expected the JSON state of a {kind} generator, "
                             f"got {_describe(value)[:80]}")
        return state
    if _is_generator(current):
        target = current.get_state()
        got = as_numpy(value)
        if got is None or got.dtype != np.uint8 or got.shape != tuple(target.shape):
            raise StateError(f"state key {key!r}: expected a generator state of {target.numel()} "
                             f"uint8 bytes, got {_describe(value)}")
        return sys.modules["torch"].from_numpy(np.array(got, np.uint8))
    if isinstance(current, np.ndarray) or _is_tensor(current):
        got = as_numpy(value)
        want = current if isinstance(current, np.ndarray) else \
            current.detach().new_empty(0).cpu().numpy()
        if got is None or got.dtype != want.dtype or got.shape != tuple(current.shape):
            raise StateError(f"state key {key!r}: expected an array of shape "
                             f"{tuple(current.shape)} and dtype {want.dtype}, got {_describe(value)}")
        if isinstance(current, np.ndarray):
            return got
        return value if _is_tensor(value) else sys.modules["torch"].from_numpy(np.array(got))
    kind = type(_plain(current))
    accepted = {int: (int, np.integer), float: (int, float, np.integer, np.floating), str: (str,)}
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, accepted[kind]):
        raise StateError(f"state key {key!r}: expected {kind.__name__}, got {_describe(value)}")
    return kind(value)


def load(obj, sd):
    if not isinstance(sd, Mapping):
        raise StateError(f"a state dict must be a mapping, got {type(sd).__name__}")
    _check_identity(obj, sd)
    setters = _setters(obj)
    state_keys = {k for k in sd if not k.startswith(IDENTITY)}
    missing = sorted(set(setters) - state_keys)
    if missing:
        raise StateError(f"the state lacks key {missing[0]!r} (truncated, or saved by an older "
                         f"version){f' and {len(missing) - 1} more' if len(missing) > 1 else ''}")
    extra = sorted(state_keys - set(setters))
    if extra:
        raise StateError(f"the state has key {extra[0]!r}, which this {type(obj).__name__} "
                         "does not keep")
    ready = {key: _converted(key, current, sd[key]) for key, (_, _, current) in setters.items()}
    for key, (owner, name, current) in setters.items():  # everything checked: assign
        value = ready[key]
        if isinstance(current, np.ndarray):
            np.copyto(current, value)
        elif _is_tensor(current):
            current.copy_(value)
        elif _is_generator(current):
            current.set_state(value)
        elif isinstance(current, np.random.Generator):
            current.bit_generator.state = value
        elif isinstance(owner, dict):
            owner[name] = value
        else:
            setattr(owner, name, value)


def codec_identity(codec, **extra):
    """The identity of a compressor level (numpy and device codecs alike): its name and every
    setting of the chain, element count and dtype, and ``extra`` (e.g. the generator kind)."""
    return {"name": codec.params.compressor, "params": codec.params.to_json().decode(),
            "n": codec.n, "dtype": str(codec.dtype), **extra}


class StateGroup(Stateful):
    """Many named objects (a binding's chains, by tensor name) saved as one flat state, keys
    ``<name>/<key>``: loading checks every object's part before it assigns any, and names the
    objects the state has and this group lacks (and the other way round)."""

    SEP = "/"

    def __init__(self, objects):
        self.objects = dict(objects)

    def state_children(self):
        return tuple((f"{name}{self.SEP}", obj) for name, obj in self.objects.items())

    def load_state_dict(self, sd):
        if not isinstance(sd, Mapping):
            raise StateError(f"a state dict must be a mapping, got {type(sd).__name__}")
        self._check_members({k[len(IDENTITY):] if k.startswith(IDENTITY) else k for k in sd}, "")
        super().load_state_dict(sd)

    def _check_members(self, keys, prefix):
        """Every name of this group (and of the groups in it) has keys, and only those."""
        keys = {k[len(prefix):] for k in keys if k.startswith(prefix)}
        theirs = set()
        for key in keys:
            name = next((n for n in self.objects if key.startswith(n + self.SEP)), None)
            theirs.add(name if name is not None else key.split(self.SEP, 1)[0])
        unknown = sorted(n for n in theirs if n not in self.objects)
        if unknown:
            raise StateError(f"the state holds {len(unknown)} object(s) not here, e.g. "
                             f"{prefix + unknown[0]!r}")
        absent = sorted(set(self.objects) - theirs)
        if absent:
            raise StateError(f"the state lacks {len(absent)} object(s) here, e.g. "
                             f"{prefix + absent[0]!r}")
        for name, obj in self.objects.items():
            if isinstance(obj, StateGroup):
                obj._check_members(keys, name + self.SEP)
