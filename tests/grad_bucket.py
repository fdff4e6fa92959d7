"""A stand-in for DDP's GradBucket (which has no Python constructor), to call a communication
hook outside DDP: on buckets of DDP's sizes with no backward (scripts/bench_hook.py's
"reduction alone") or step by step in tests. It is bps_gc.torch.exchange's NamedBucket without
names: its gradients are keyed by the bucket index and their position."""
from bps_gc.torch.exchange import NamedBucket


def GradBucket(index, sizes, buffer):  # noqa: N802 (it stands in for a class)
    """Bucket ``index``: ``buffer`` (flat) holding gradients of ``sizes`` elements back to back."""
    return NamedBucket(index, buffer, None, [(int(n),) for n in sizes])
