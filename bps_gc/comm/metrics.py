"""A communicator's traffic counters, as ``metrics()`` returns them (both transports)."""
import dataclasses


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

    @property
    def ratio(self):
        wire = self.pushed_wire + self.pulled_wire
        return (self.pushed_raw + self.pulled_raw) / wire if wire else 1.0
