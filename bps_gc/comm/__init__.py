"""The communication interface every transport implements and every algorithm calls: the
communicator and its Declaration, the partition plan and owner rule, the host-sum order, the
phased reduction, the traffic counters and ``NodeFailure`` (framework-agnostic)."""


class NodeFailure(RuntimeError):
    """Another node of the job died or stopped answering; the message names it."""
