"""A communicator's traffic counters, as ``metrics()`` returns them (both transports), and
``Counters``, the live ones that several threads add to.

Counters are bumped from several threads at once (a parameter-server worker's caller thread, codec
pool and I/O thread; the DDP hook's threads): every update goes through ``Counters.add`` under one
lock, so no increment is lost."""
import dataclasses
import threading


@dataclasses.dataclass
class Metrics:
    """Counters since the last ``Worker.metrics()`` (bytes and seconds)."""
    pushed_raw: int = 0
    pushed_wire: int = 0
    pulled_raw: int = 0
    pulled_wire: int = 0
    compress_seconds: float = 0.0
    communicate_seconds: float = 0.0
    wait_seconds: float = 0.0
    messages: int = 0  # push messages sent (a fused bucket counts once)
    shared_bytes: int = 0  # pushed through shared memory to a server on this host (no socket)
    # register_fsdp_hooks' in-host step (shard_compression_params): its reduce-scatter's bytes,
    # apart from the cross-host ones above
    in_host_pushed_raw: int = 0
    in_host_pushed_wire: int = 0
    in_host_pulled_wire: int = 0

    @property
    def ratio(self):
        wire = self.pushed_wire + self.pulled_wire
        return (self.pushed_raw + self.pulled_raw) / wire if wire else 1.0


class Counters:
    """The live Metrics, safe to update from several threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._current = Metrics()

    def add(self, **amounts):
        with self._lock:
            m = self._current
            for name, amount in amounts.items():
                setattr(m, name, getattr(m, name) + amount)

    def take(self):
        """The counters so far; they restart from zero."""
        with self._lock:
            current, self._current = self._current, Metrics()
        return current
