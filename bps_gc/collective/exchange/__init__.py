"""The compressed exchange on torch.distributed, written once for every caller: a process group,
a flat buffer cut into named parts (each part's codec kept and keyed by its name), three stages
(compress each part -> gather every rank's payloads -> reduce, decode, divide) that overlap on
the pipeline's threads, two levels, device tensors and phased codecs (thc, PowerSGD).

    driver.py      the stages' sequence, for every caller (the collective's buckets too)
    jobs.py        what the driver takes: Job, Segment and their tensor kinds, in named fields
    pipeline.py    Pipeline: a caller's flat tensor (codecs.Batch) -> a torch future
    codecs.py      each named part's codec, seeds by name, checkpoints
    two_levels.py  several ranks per host; phased.py: codecs summed in phases
    tensors.py     wire dtypes, futures and CUDA side streams
"""
from .codecs import Batch, bucket_key, name_key
from .driver import Driver, Inline
from .pipeline import Pipeline

__all__ = ["Batch", "Driver", "Inline", "Pipeline", "bucket_key", "name_key"]
