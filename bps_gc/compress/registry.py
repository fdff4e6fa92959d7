"""Name -> class tables for compressors, error-feedback kinds and momentum kinds, and plugins.

A plugin is a module that registers classes with the decorators below. It is imported on every
worker *and* server (the server recompresses), from ``BPS_GC_PLUGINS`` (comma-separated module
names) and from the ``bps_gc.plugins`` entry-point group of installed packages.
"""
import importlib
import os
from importlib import metadata

from .base import Codec
COMPRESSORS = {}
ERROR_FEEDBACKS = {}
MOMENTUMS = {}
OPTIONS = {}  # compressor name -> {extra parameter key: converter}
PLUGIN_ENV = "BPS_GC_PLUGINS"
ENTRY_POINT_GROUP = "bps_gc.plugins"
_loaded = set()
_entry_points_scanned = False  # scanning installed packages costs milliseconds: once is enough


def _register(table, kind, name, cls):
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name must be a non-empty string, got {name!r}")
    if table.get(name, cls) is not cls:
        raise ValueError(f"{kind} {name!r} is already registered by {table[name].__module__}")
    table[name] = cls
    return cls


def register_compressor(name, options=None):
    """Class decorator: ``cls(params, n, dtype, seed)`` becomes compressor ``name`` (a class
    with ``takes_shape`` also gets ``shape=``, one with ``draws_per_worker`` ``worker_seed=``:
    chain.compressor_inputs).

    ``options`` maps extra ``compression_params`` keys this compressor accepts to converters
    (e.g. ``{"alpha": float}``); they reach the codec as ``params.options[key]``.
    """
    def wrap(cls):
        if not (isinstance(cls, type) and issubclass(cls, Codec)):
            raise TypeError(f"compressor {name!r} must subclass bps_gc.compress.Codec")
        OPTIONS[name] = dict(options or {})
        return _register(COMPRESSORS, "compressor", name, cls)
    return wrap


def register_error_feedback(name):
    """Class decorator: ``cls(inner_codec, params)`` becomes error-feedback kind ``name``."""
    return lambda cls: _register(ERROR_FEEDBACKS, "error feedback", name, cls)


def register_momentum(name):
    """Class decorator: ``cls(inner_codec, params)`` becomes momentum kind ``name``."""
    return lambda cls: _register(MOMENTUMS, "momentum", name, cls)


def load_plugins():
    """Import the plugin modules named by the environment and entry points (once each)."""
    names = [m.strip() for m in os.environ.get(PLUGIN_ENV, "").split(",") if m.strip()]
    for module in names:
        if module not in _loaded:
            try:
                importlib.import_module(module)
            except Exception as e:
                raise ImportError(f"{PLUGIN_ENV}: cannot import plugin module {module!r}: {e}") from e
            _loaded.add(module)
    global _entry_points_scanned
    if _entry_points_scanned:
        return
    _entry_points_scanned = True
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.value not in _loaded:
            ep.load()
            _loaded.add(ep.value)
