"""What the server's parts hand each other: a round taken for an engine thread (keys.py ->
server.py), and the replies made for the I/O thread to send (engine, key_state.py)."""
from typing import NamedTuple


class Pusher(NamedTuple):
    """A worker that pushed a round: its socket ``identity``, the ``round`` its push carried
    (an asynchronous reply echoes it) and whether its data was in ``shared`` memory."""
    identity: bytes
    round: int
    shared: bool


class TakenRound(NamedTuple):
    """A round of key ``state`` (keys.KeyState) for its engine to complete: round number
    ``number``, summed over ``ranks`` (the pushers' slots, in order), answered to ``pushers``;
    BPS_GC_ELASTIC: the membership ``epoch`` it is summed in, and whether it is a ``redo``
    of a round summed before (rounds.py)."""
    state: object
    number: int
    ranks: list
    pushers: list
    epoch: int = 0
    redo: bool = False


class Reply(NamedTuple):
    """One message for the I/O thread to send to the worker at ``identity``."""
    identity: bytes
    header: object
    payload: object
