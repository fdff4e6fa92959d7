"""The framework-agnostic API: one worker per process, numpy arrays in and out.

    import bps_gc.core as bps
    bps.init()
    bps.declare("w", compressor="onebit", scaling=True, ef="vanilla")
    bps.push_pull(grad, "w", average=True, lr=0.1).wait()

The built-in codec library (bps_gc.compress, plus BPS_GC_PLUGINS) is wired in here; the roles
below never import it.
"""
import atexit
import logging

from . import compress
from .config import Config, transport_from_env
from .roles import NodeFailure
from .roles.worker import Worker

_worker = None
__all__ = ["NodeFailure", "barrier", "broadcast", "declare", "init", "is_initialized",
           "local_rank", "local_size", "metrics", "push_pull", "rank", "shutdown", "size",
           "worker"]


def _setup_logging(level):
    logging.basicConfig(level=logging.DEBUG if level == "TRACE" else
                        logging.CRITICAL if level == "FATAL" else getattr(logging, level),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def init(config=None):
    """Join the cluster described by the environment (DMLC_*, BYTEPS_*, BPS_GC_*)."""
    global _worker
    if _worker is not None:
        return _worker
    if config is None and transport_from_env() == "collective":
        from .collective import Collective, collective_config  # needs torch: imported only here
        cfg, local_rank, local_size = collective_config()
        _setup_logging(cfg.log_level)
        compress.load_plugins()
        _worker = Collective(cfg, compress, local_rank, local_size).start()
        atexit.register(shutdown)
        return _worker
    cfg = config or Config.from_env(role="worker")
    _setup_logging(cfg.log_level)
    compress.load_plugins()
    _worker = Worker(cfg, compress).start()
    atexit.register(shutdown)
    return _worker


def worker():
    if _worker is None:
        raise RuntimeError("bps_gc is not initialized: call init() first")
    return _worker


def is_initialized():
    return _worker is not None


def shutdown():
    global _worker
    if _worker is not None:
        _worker.shutdown()
        _worker = None


def rank():
    return worker().rank


def size():
    return worker().size


def local_rank():
    return worker().local_rank


def local_size():
    return worker().local_size


def declare(name, shape=None, dtype=None, **compression):
    return worker().declare(name, shape=shape, dtype=dtype, **compression)


def push_pull(array, name, average=True, priority=0, lr=0.0, out=None):
    return worker().push_pull(array, name, average=average, priority=priority, lr=lr, out=out)


def barrier():
    worker().barrier()


def broadcast(array, root_rank, name):
    return worker().broadcast(array, root_rank, name)


def metrics():
    """Bytes and seconds since the last call (and reset): see roles.worker.Metrics."""
    return worker().step_metrics()
