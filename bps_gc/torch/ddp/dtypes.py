"""The dtype the DDP hook's codecs see for a bucket (docs/ddp_hook.md "Dtypes"), and the
refusal, at the first bucket, of a codec that cannot carry it.

float32 and float64 buckets are compressed in their own dtype (as push_pull compresses a
float64 array in float64); float16 and bfloat16 buckets are widened to float32 for the codecs and
the result is rounded back into the bucket; ``fp16: true`` compresses every bucket in float16."""
import numpy as np
import torch

TORCH_OF = {np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32,
            np.dtype(np.float64): torch.float64}


def wire_dtype(buffer, fp16):
    """The numpy dtype bucket ``buffer`` is compressed in."""
    if fp16:
        return np.dtype(np.float16)
    return np.dtype(np.float64) if buffer.dtype == torch.float64 else np.dtype(np.float32)


def wire_torch(buffer, fp16):
    return TORCH_OF[wire_dtype(buffer, fp16)]


def built_or_refused(build, params, index, buffer):
    """``build()`` (the bucket's codec chains and reducers); a codec's refusal of the bucket's
    dtype becomes one line naming the bucket, its dtype and the codec."""
    try:
        return build()
    except TypeError as e:
        raise TypeError(f"bps_gc comm_hook: DDP bucket {index} holds {buffer.dtype} gradients, which "
                        f"compressor {params.compressor!r} cannot carry ({e}); train in float32 "
                        f"(model.float()) or choose a codec that carries float64 (docs/ddp_hook.md)") from None
