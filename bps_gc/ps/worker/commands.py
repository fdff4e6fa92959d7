"""What other threads ask of the worker's I/O thread (io.py): one small record per kind of
command, posted with ``WorkerIO.post`` (or ``queue``) and dispatched by its type."""
from typing import NamedTuple


class SendPush(NamedTuple):
    """Queue ``push`` (push.Push, one partition of one push_pull) for sending."""
    push: object


class StartLocal(NamedTuple):
    """This worker's input for round ``round`` of ``local`` (local.LocalTensor) is in its slot:
    start the host's sum; ``handle`` gets the result, written into ``wire`` (divided by the
    number of workers if ``average``)."""
    local: object
    round: int
    handle: object
    wire: object
    average: bool


class LocalSummed(NamedTuple):
    """This worker's slice of round ``round`` of ``local`` is summed (from the codec pool)."""
    local: object
    round: int


class InitKey(NamedTuple):
    """Declare a partition's ``key`` to its ``server`` (an INIT carrying ``declaration``, the
    JSON the server builds the key from), pushed in ``dtype``."""
    key: int
    server: int
    dtype: object
    declaration: dict

    @classmethod
    def of(cls, tensor, part, **extra):
        """Partition ``part`` of ``tensor`` (a TensorPlan), as it describes it, plus ``extra``."""
        return cls(part.key, part.server, tensor.wire_dtype, dict(tensor.describe(part), **extra))


class SendState(NamedTuple):
    """A checkpoint's request for a key's server state (codec_state.StateRequest)."""
    request: object


class Barrier(NamedTuple):
    """Join the next barrier; ``done`` (a threading.Event) is set once the scheduler completes
    it, or once the I/O thread fails."""
    done: object


class Goodbye(NamedTuple):
    """Say goodbye to the scheduler, waiting up to ``timeout`` seconds; the I/O thread then ends."""
    timeout: float
