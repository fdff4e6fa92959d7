"""What the parts of ``Collective`` (communicator.py) share: one small object, handed to each
part at construction. Everything else a part keeps to itself."""
import dataclasses
from typing import Any, Dict, List, Optional

from ..comm.metrics import Metrics


@dataclasses.dataclass
class Shared:
    rank: int
    size: int
    # this step's bytes and seconds: added to by every part (the exchange thread too); replaced
    # by Collective.metrics(), so parts read it here each time, never keep it
    counters: Metrics = dataclasses.field(default_factory=Metrics)
    # collectives this rank issued (Lifecycle.issue; TwoLevelReductions.level_wait counts the ones it
    # skips): what a rank that left compares (departure.py)
    issued: int = 0
    # the same on each smaller group (sorted global ranks -> count): the compressed exchange's
    # pipeline's collectives (Lifecycle.issue with a group; a group of every rank counts in ``issued``)
    issued_on: Dict[tuple, int] = dataclasses.field(default_factory=dict)
    # messages sent to / taken from each peer (Messages); Lifecycle publishes them at shutdown
    sent: List[int] = dataclasses.field(default_factory=list)
    received: List[int] = dataclasses.field(default_factory=list)
    # the first failure this rank met (written by Lifecycle's checks and waits); the buckets'
    # exchange and every later wait raise it
    failure: Optional[BaseException] = None
    # liveness.Heartbeat, set by Lifecycle.start; TwoLevelReductions.join_levels and the waits read it
    heartbeat: Any = None
    # levels.HostLevels when two levels run, set by TwoLevelReductions.join_levels; reduce, the buckets'
    # exchange, the plain sum and shutdown read it
    levels: Any = None

    def __post_init__(self):
        self.sent = self.sent or [0] * self.size
        self.received = self.received or [0] * self.size
