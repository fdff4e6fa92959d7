"""Name -> class tables of the device codecs, and the device chain that ``build_chain`` returns
when it is given a device.

A device implementation registers under the numpy codec's name, with the numpy codec's wire
format and ``reducers``:

    @register_device_compressor("mycodec")
    class MyDeviceCodec(DeviceCodec):            # ctor (params, n, dtype, seed, device, **extra)
        ...

    @register_device_error_feedback("vanilla")   # ctor (inner_device_codec, params)
    @register_device_momentum("nesterov")        # ctor (inner_device_codec, params)

Plugins register theirs the same way from the modules ``BPS_GC_PLUGINS`` names. A chain whose
compressor, error feedback or momentum has no device implementation runs the whole numpy chain
behind a ``HostBridge`` (bridge.py).
"""
from ..chain import build_chain, compressor_inputs
from ..registry import COMPRESSORS, _register
from .base import DeviceCodec, resolve_device
from .bridge import HostBridge

DEVICE_COMPRESSORS = {}
DEVICE_ERROR_FEEDBACKS = {}
DEVICE_MOMENTUMS = {}


def register_device_compressor(name):
    """Class decorator: ``cls(params, n, dtype, seed, device, **extra)`` (a DeviceCodec) becomes
    the device implementation of compressor ``name``; ``extra`` is ``shape`` for a class with
    ``takes_shape`` and ``worker_seed`` for one with ``draws_per_worker`` (as for numpy codecs)."""
    def wrap(cls):
        if not (isinstance(cls, type) and issubclass(cls, DeviceCodec)):
            raise TypeError(f"device compressor {name!r} must subclass "
                            "bps_gc.compress.device.DeviceCodec")
        return _register(DEVICE_COMPRESSORS, "device compressor", name, cls)
    return wrap


def register_device_error_feedback(name):
    """Class decorator: ``cls(inner_device_codec, params)`` becomes error-feedback kind ``name``
    on devices."""
    return lambda cls: _register(DEVICE_ERROR_FEEDBACKS, "device error feedback", name, cls)


def register_device_momentum(name):
    """Class decorator: ``cls(inner_device_codec, params)`` becomes momentum kind ``name`` on
    devices."""
    return lambda cls: _register(DEVICE_MOMENTUMS, "device momentum", name, cls)


def build_device_chain(params, n, dtype, key, role, shape, device, rank=0):
    """The device chain of ``bps_gc.compress.build_chain(..., device=...)``: [momentum ->]
    [error feedback ->] compressor, by the numpy chain's rules (servers never apply momentum;
    seeds and extras from ``compressor_inputs``). ``params`` are validated already."""
    device = resolve_device(device)
    if params.granularity == "entiremodel" and role == "worker":
        raise ValueError("build_chain(device=...): a worker's 'entiremodel' chunk codec only hands "
                         "over the payload cut from the whole-model codec (compress/entire_model.py) "
                         "and has nothing to run on a device; build the whole vector's chain with "
                         "granularity 'layerwise' on the device, or the chunk's without a device")
    cls = DEVICE_COMPRESSORS.get(params.compressor)
    owns_momentum = getattr(COMPRESSORS[params.compressor], "owns_momentum", False) \
        or getattr(cls, "owns_momentum", False)
    momentum = params.momentum if role == "worker" and not owns_momentum else None
    if cls is None or (params.ef and params.ef not in DEVICE_ERROR_FEEDBACKS) \
            or (momentum and momentum not in DEVICE_MOMENTUMS):
        return HostBridge(build_chain(params, n, dtype, key=key, role=role, shape=shape, rank=rank), device)
    seed, extra = compressor_inputs(cls, params, key, shape, rank)
    codec = cls(params, n, dtype, seed, device, **extra)
    if params.ef:
        codec = DEVICE_ERROR_FEEDBACKS[params.ef](codec, params)
    if momentum:
        codec = DEVICE_MOMENTUMS[momentum](codec, params)
    return codec
