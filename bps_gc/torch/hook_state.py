"""The DDP hook's per-bucket state, in named fields (as torch's PowerSGDState): what it keeps
for a bucket index across steps (BucketState) and what one call hands its three threads (BucketJob)."""
import dataclasses
from typing import Any


@dataclasses.dataclass
class BucketState:
    """What the hook keeps for DDP bucket ``index`` across steps; made again when the bucket's
    ``sizes``, ``device`` or ``dtype`` change (DDP regroups after the first step)."""
    sizes: list  # the numel of each gradient of the bucket
    device: Any  # the bucket's torch.device
    dtype: Any  # the bucket's torch dtype (its codecs' wire dtype follows it: hook_dtypes.py)
    parts: list  # [(worker chain, reducer)], one per gradient
    on_device: bool  # device chains and reducers (BPS_GC_DEVICE_CODECS), else numpy ones
    steps: int = 0  # how many times the bucket was reduced: the step context's ``step``


@dataclasses.dataclass(frozen=True)
class BucketJob:
    """One call's bucket, as the compressing, exchanging and reducing threads take it."""
    group: Any  # the process group its collectives run on (the hook's own, or DDP's with two levels)
    index: int  # DDP's bucket index
    buffer: Any  # the bucket's flat gradient tensor, written with the average
    parts: list  # BucketState.parts
    ctx: dict  # the step context (lr, step)
    on_device: bool  # BucketState.on_device
    levels: Any  # the HostLevels it reduces through, or None (flat)
