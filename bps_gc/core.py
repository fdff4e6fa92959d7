"""The framework-agnostic API: one worker per process, numpy arrays in and out.

    import bps_gc.core as bps
    bps.init()
    bps.declare("w", compressor="onebit", scaling=True, ef="vanilla")
    bps.push_pull(grad, "w", average=True, ctx={"lr": 0.1, "step": 7, "epoch": 0}).wait()

The facade that picks a transport: the parameter server's Worker (bps_gc.ps) or, with
BPS_GC_TRANSPORT=collective, the torch.distributed Collective (bps_gc.collective); both implement
comm.communicator.Communicator. The built-in codec library (bps_gc.compress, plus BPS_GC_PLUGINS)
is wired in here; the transports never import it. The algorithms and the bindings call these
functions; the torch binding's DDP hook and device chains also reach the collective and the
communicator's interface (comm/) directly (docs/runtime.md, the layer map).
"""
import atexit
import dataclasses
import logging
import os
import sys

from . import compress
from .comm import NodeFailure, exit_threads
from .comm.declaration import Declaration
from .comm.metrics import Counters, Metrics
from .config import DEVICE_CODECS, Config, ConfigError, EnvReader, transport_from_env
from .ps.membership.membership import abort_job
from .ps.worker.worker import Worker

_worker = None
_ended = None  # after shutdown(): why no other job can start in this process (the transport's), else None
_jobs_ended = 0
_hook_traffic = None  # Counters of the DDP hook's buckets (hook_traffic()), or None without a hook
_in_host_traffic = None  # Counters of register_fsdp_hooks' in-host reduce-scatter (in_host_traffic()), or None
__all__ = ["Declaration", "NodeFailure", "barrier", "broadcast", "declaration", "declare",
           "communicator", "device_codecs", "hook_traffic", "in_host_traffic", "init", "is_initialized", "jobs_ended",
           "local_rank", "local_size",
           "load_state_dict", "metrics", "push_pull", "rank", "recv", "reduce", "send", "shutdown", "size",
           "state_dict", "worker"]


def _setup_logging(level):
    logging.basicConfig(level=logging.DEBUG if level == "TRACE" else
                        logging.CRITICAL if level == "FATAL" else getattr(logging, level),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def init(config=None):
    """Join the cluster described by the environment (DMLC_*, BYTEPS_*, BPS_GC_*)."""
    global _worker
    if _worker is not None:
        return _worker
    if _ended is not None:  # else a worker would wait out BPS_GC_JOIN_TIMEOUT for a gone scheduler
        raise RuntimeError(f"bps_gc: init() after shutdown() in one process: {_ended}")
    sys.excepthook = _one_line_for_job_errors
    if config is None and transport_from_env() == "collective":
        from .collective import Collective, collective_config  # needs torch: imported only here
        cfg, local_rank, local_size = collective_config()
        _setup_logging(cfg.log_level)
        compress.load_plugins()
        _worker = Collective(cfg, compress, local_rank, local_size).start()
        atexit.register(_shutdown_at_exit)
        return _worker
    cfg = config or Config.from_env(role="worker")
    _setup_logging(cfg.log_level)
    try:
        compress.load_plugins()
    except ImportError as e:
        raise abort_job(cfg, "worker", cfg.rank, str(e)) from None
    _worker = Worker(cfg, compress).start()
    atexit.register(_shutdown_at_exit)
    return _worker


_abandoned = None  # the name of the uncaught exception the script ends on (the excepthook's)


def _one_line_for_job_errors(kind, error, trace, default=sys.excepthook):
    """A failed job (another node, the cluster) or a bad setting is not a bug in the training
    script: print one line naming the cause instead of a traceback."""
    global _abandoned
    if _worker is not None:
        _abandoned = kind.__name__
        _worker.abandon(_abandoned)
        if not issubclass(kind, (NodeFailure, ConfigError, KeyboardInterrupt)):
            explained = _worker.peer_failure(error)  # a peer's death or exit behind a torch error
            if explained is not None:
                kind, error = type(explained), explained
    if issubclass(kind, (NodeFailure, ConfigError)):
        print(f"bps_gc: {kind.__name__}: {error}", file=sys.stderr, flush=True)
    elif issubclass(kind, KeyboardInterrupt):  # Ctrl-C reaches every rank: one line each
        print("bps_gc: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
    else:
        default(kind, error, trace)


def communicator():
    """This process's Communicator: the parameter-server Worker or the Collective."""
    if _worker is None:
        raise RuntimeError("bps_gc is not initialized: call init() first")
    return _worker


worker = communicator  # the name the bindings and users knew first


def device_codecs():
    """BPS_GC_DEVICE_CODECS (auto, torch or numpy: docs/device_codecs.md) of this process: the
    communicator's, else read from the environment (a bad value raises ConfigError naming it)."""
    if _worker is not None:
        return getattr(_worker.cfg, "device_codecs", "auto")
    return EnvReader(os.environ).choice("BPS_GC_DEVICE_CODECS", DEVICE_CODECS, "auto", lower=True)


def is_initialized():
    return _worker is not None


def _shutdown_at_exit():
    exit_threads.mark_exiting()  # the process ends: a failed rank may bound its own end now
    worker = _worker
    shutdown()  # the collective transport's ranks end here after a failure (collective/after_failure.py)
    torch_dist = sys.modules.get("torch.distributed")
    if worker is not None and _abandoned is not None and torch_dist is not None and torch_dist.is_initialized():
        # a process group of the script's or of its host's (bps_gc.torch.host_group, on the
        # parameter server) may hold a collective pending on a peer that failed or left, with a
        # Python callback that would abort the process at finalization: end as those ranks do
        from .collective.after_failure import end_after_failure, failure_bound
        end_after_failure(worker.rank, failure_bound(worker.cfg), True, _abandoned)


def shutdown():
    global _worker, _ended, _jobs_ended
    if _worker is not None:
        _worker.shutdown()
        _ended = _worker.why_no_job_after_shutdown
        _worker = None
        _jobs_ended += 1


def jobs_ended():
    """How many jobs shutdown() ended in this process: the bindings number each job's objects
    apart (bps_gc/torch/checkpoint.py)."""
    return _jobs_ended


def rank():
    return worker().rank


def size():
    return worker().size


def membership_epoch():
    """BPS_GC_ELASTIC: the membership epoch of the last step (changes between steps only)."""
    return getattr(worker(), "epoch", 0)


def membership():
    """BPS_GC_ELASTIC: the members' ranks of the last step, in order (else every rank)."""
    return list(getattr(worker(), "members", range(size())))


def joining():
    """BPS_GC_ELASTIC: this worker joins a running job (its elastic_start waits to be admitted)."""
    return bool(getattr(worker(), "joining", False))


def elastic_start(params):
    """BPS_GC_ELASTIC: name the parameters (name -> numpy array, updated in place) a joining
    host copies; on a joiner, wait to be admitted, fill them and return its first step (else 0)."""
    start = getattr(worker(), "elastic_start", None)
    return 0 if start is None else start(params)


def local_rank():
    return worker().local_rank


def local_size():
    return worker().local_size


def declare(name, shape=None, dtype=None, reducer=None, **compression):
    """Register ``name`` (the same names in the same order on every worker); returns its
    Declaration. ``reducer``: how the servers combine compressed pushes (compress.reducers)."""
    return worker().declare(name, shape=shape, dtype=dtype, reducer=reducer, **compression)


def declaration(name):
    """The Declaration of ``name``, or None when it was not declared."""
    return worker().declaration(name)


def push_pull(array, name, average=True, priority=0, lr=None, out=None, ctx=None):
    """Sum (or average) ``array`` over all workers; ``ctx`` is the step context (lr, step,
    epoch, per-step codec keys), ``lr`` a shortcut for its learning rate."""
    return worker().push_pull(array, name, average=average, priority=priority, ctx=ctx, out=out, lr=lr)


reduce = push_pull


def send(rank, name, payload):
    return worker().send(rank, name, payload)


def recv(rank, name, timeout=None):
    return worker().recv(rank, name, timeout)


def barrier():
    worker().barrier()


def broadcast(array, root_rank, name):
    return worker().broadcast(array, root_rank, name)


def state_dict():
    """The codec state of this process's communicator: every chain of the declared tensors,
    keyed by tensor name and partition (docs/checkpoint.md)."""
    return worker().state_dict()


def load_state_dict(sd):
    """Restore ``state_dict()``'s result: after declaring, before the first push_pull;
    bps_gc.compress.stateful.StateError names a state that does not fit."""
    worker().load_state_dict(sd)


def metrics():
    """Bytes, messages and seconds since the last call (and reset): see comm.metrics.Metrics.
    The DDP hook's buckets (bps_gc.torch.comm_hook) count too, with or without init()."""
    if _worker is None and _hook_traffic is None and _in_host_traffic is None:
        worker()  # raises "not initialized"
    current = _worker.metrics() if _worker is not None else Metrics()
    if _hook_traffic is not None:
        hooked = _hook_traffic.take()
        for field in dataclasses.fields(Metrics):
            setattr(current, field.name, getattr(current, field.name) + getattr(hooked, field.name))
    if _in_host_traffic is not None:
        in_host = _in_host_traffic.take()
        for field in ("pushed_raw", "pushed_wire", "pulled_wire"):
            setattr(current, f"in_host_{field}", getattr(current, f"in_host_{field}") + getattr(in_host, field))
    return current


def in_host_traffic():
    """The Counters of register_fsdp_hooks' in-host step (its compressed reduce-scatter):
    metrics() reports them apart, as its ``in_host_*`` fields."""
    global _in_host_traffic
    if _in_host_traffic is None:
        _in_host_traffic = Counters()
    return _in_host_traffic


def hook_traffic():
    """The Counters a DDP hook adds its buckets' bytes and seconds to (made by the first hook);
    metrics() reports them, added to the communicator's when init() ran."""
    global _hook_traffic
    if _hook_traffic is None:
        _hook_traffic = Counters()
    return _hook_traffic
