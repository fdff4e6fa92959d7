"""A stand-in for DDP's GradBucket (which has no Python constructor), to call a communication
hook outside DDP: on buckets of DDP's sizes with no backward (scripts/bench_hook.py's
"reduction alone") or step by step in tests."""
import torch


class GradBucket:
    """Bucket ``index``: ``buffer`` (flat) holding gradients of ``sizes`` elements back to back."""

    def __init__(self, index, sizes, buffer):
        self._index, self._buffer = index, buffer
        self._gradients = list(torch.split(buffer, list(sizes)))

    def index(self):
        return self._index

    def buffer(self):
        return self._buffer

    def gradients(self):
        return self._gradients
