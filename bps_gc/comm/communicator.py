"""The communicator: the one interface bindings and algorithms call, whatever carries the bytes.

Two implementations: the ZeroMQ parameter server (``ps.worker.worker.Worker``) and torch.distributed
collectives (``bps_gc.collective``). Codecs and reducers are written once above this layer: an
implementation is handed the codec library (``bps_gc.compress``) and never imports it.

Every worker declares the same names in the same order. ``reduce`` sums (or averages) a tensor
over all workers through the tensor's reducer; ``send``/``recv`` move bytes between two workers
with no server in the path. Errors a user can cause (bad names, shapes, parameters) raise at the
call that caused them; a dead peer raises ``NodeFailure`` naming it.
"""
import abc
import dataclasses
from typing import Optional

from .phased import phases


@dataclasses.dataclass(frozen=True)
class Declaration:
    """What ``declare`` decided for a tensor: the public result bindings may rely on."""
    name: str
    shape: Optional[tuple]          # None until the first reduce when declared without a shape
    dtype: Optional[object]         # numpy dtype of the caller's arrays
    params: object                  # compress.CompressionParams
    reducer: str                    # the reducer its reductions use
    compressed: bool                # whether any partition is compressed on the wire
    wire_dtype: Optional[object] = None  # dtype on the wire (float16 with fp16)


class Handle(abc.ABC):
    """An operation in flight: ``wait()`` returns its result (raising its error), ``poll()``
    says whether it is done."""

    @abc.abstractmethod
    def wait(self, timeout=None):
        ...

    @abc.abstractmethod
    def poll(self):
        ...


class Communicator(abc.ABC):
    rank: int
    size: int
    local_rank: int
    local_size: int

    @abc.abstractmethod
    def declare(self, name, shape=None, dtype=None, reducer=None, **compression) -> Declaration:
        """Register ``name`` with its compression and reducer (the codec's default when None).
        Re-declaring it alike returns the same Declaration; differently is a ValueError naming
        the tensor. An unsupported codec/reducer pair is a ValueError naming both."""

    def declaration(self, name) -> Optional[Declaration]:
        """The Declaration of ``name``, None if it was not declared."""
        raise NotImplementedError(f"{type(self).__name__} does not implement declaration()")

    def state_dict(self):
        """The codec state this rank holds for its declared tensors, keyed by tensor name and
        partition, never by bucket or server (docs/checkpoint.md): a flat dict that
        ``compress.state_bytes.encode_state`` writes."""
        raise NotImplementedError(f"{type(self).__name__} does not implement state_dict()")

    def load_state_dict(self, sd):
        """Restore ``state_dict()``'s result after declaring, before the first reduce; a
        ``StateError`` names the first problem, and then nothing was loaded."""
        raise NotImplementedError(f"{type(self).__name__} does not implement load_state_dict()")

    # how ``push_payloads`` answers (bindings that compress themselves: bps_gc.torch's device
    # chains): False, the reduced reply of each partition (a server reduced them); True, every
    # rank's payloads of each partition (the caller runs the reducer, as the collective does)
    gathers_payloads = False

    def partitions(self, name):
        """[(key, start, stop)] of ``name``'s compressed partitions, in order: a binding that
        compresses with its own chains builds them with these keys (the keys seed the codecs)
        and pushes their payloads with ``push_payloads``. Empty when ``name`` is not placed or
        not compressed (sent dense, or nothing leaves this process), and for reducers summed
        in phases (PowerSGD's, comm/phased.py), which the communicator drives itself."""
        tensor = getattr(self, "tensors", {}).get(name)
        if tensor is None or not tensor.compressed or phases(tensor) > 1:
            return []
        return [(part.key, part.start, part.stop) for part in tensor.partitions]

    def push_payloads(self, name, payloads, ctx=None, priority=0) -> Handle:
        """Reduce ``name`` from payloads the caller compressed itself (one uint8 array or
        tensor per partition of ``partitions(name)``); ``wait()`` returns, per partition, what
        ``gathers_payloads`` says, undecoded: the caller decodes where its tensor lives."""
        raise NotImplementedError(f"{type(self).__name__} does not take compressed payloads")

    @abc.abstractmethod
    def reduce(self, array, name, average=True, priority=0, ctx=None, out=None) -> Handle:
        """Sum (or average) ``array`` over all workers into ``out`` (default: in place).
        ``ctx`` is the step context (lr, step, epoch, per-step codec keys) every codec and
        reducer of this round sees, on every worker and server."""

    def push_pull(self, array, name, average=True, priority=0, ctx=None, out=None) -> Handle:
        """BytePS's name for ``reduce``."""
        return self.reduce(array, name, average=average, priority=priority, ctx=ctx, out=out)

    @abc.abstractmethod
    def broadcast(self, array, root_rank, name):
        """Every worker ends with ``root_rank``'s ``array`` (in place); returns it."""

    @abc.abstractmethod
    def barrier(self):
        """Returns once every worker called it."""

    @abc.abstractmethod
    def send(self, rank, name, payload) -> Handle:
        """Send bytes (or a contiguous array's bytes) to worker ``rank`` under ``name``.
        Messages between two workers under one name arrive in order."""

    @abc.abstractmethod
    def recv(self, rank, name, timeout=None):
        """The next message worker ``rank`` sent under ``name``, as a uint8 numpy array."""

    @abc.abstractmethod
    def metrics(self):
        """Bytes and seconds since the last call (and reset them)."""

    @abc.abstractmethod
    def shutdown(self):
        """Leave the job; every worker calling it after the same work ends with status 0."""

    def abandon(self, reason):
        """The training script is ending on an uncaught ``reason`` (an exception's name):
        the shutdown that follows tells the others this rank failed, where it can."""
