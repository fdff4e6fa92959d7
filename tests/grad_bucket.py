"""A stand-in for DDP's GradBucket (which has no Python constructor), to call a communication
hook outside DDP: on buckets of DDP's sizes with no backward (scripts/bench_hook.py's
"reduction alone") or step by step in tests. Its gradients are keyed by the bucket index and
their position, as a DDP bucket's without parameters (bps_gc.torch.ddp.hook.batch_of)."""


class NamedBucket:
    """DDP's GradBucket's calls: bucket ``index``, its flat ``buffer`` and the gradients of
    ``sizes`` elements back to back in it."""

    def __init__(self, index, buffer, sizes):
        self._index, self._buffer = index, buffer
        self._gradients = list(buffer.split([int(n) for n in sizes]))

    def index(self):
        return self._index

    def buffer(self):
        return self._buffer

    def gradients(self):
        return self._gradients


def GradBucket(index, sizes, buffer):  # noqa: N802 (it stands in for a class)
    """Bucket ``index``: ``buffer`` (flat) holding gradients of ``sizes`` elements back to back."""
    return NamedBucket(index, buffer, sizes)
