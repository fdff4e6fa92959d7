"""The three roles of a job: scheduler, server and the worker core (framework-agnostic)."""


class NodeFailure(RuntimeError):
    """Another node of the job died or stopped answering; the message names it."""
