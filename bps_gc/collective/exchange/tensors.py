"""The torch side of the exchange's tensors: the dtype the codecs see for a buffer
(docs/ddp_hook.md "Dtypes") and the refusal of a codec that cannot carry it; a call's future and
its CUDA side stream (the exchange's work on a buffer runs on the pipeline's threads and ends in
its future; a CUDA buffer's runs on a side stream that first waits for backward's).

float32 and float64 buffers are compressed in their own dtype (as push_pull compresses a
float64 array in float64); float16 and bfloat16 ones are widened to float32 for the codecs and
the result is rounded back into the buffer; ``fp16: true`` compresses every buffer in float16."""
import contextlib
from typing import Any, NamedTuple

import numpy as np
import torch

TORCH_OF = {np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32,
            np.dtype(np.float64): torch.float64}


def runs_on_device(tensor, mode):
    """Whether ``tensor``'s codecs run as torch operations on its device, by the process's
    BPS_GC_DEVICE_CODECS ``mode`` (auto, torch or numpy: docs/device_codecs.md)."""
    return mode == "torch" or (mode == "auto" and tensor.device.type != "cpu")


def wire_dtype(buffer, fp16):
    """The numpy dtype ``buffer`` is compressed in."""
    if fp16:
        return np.dtype(np.float16)
    return np.dtype(np.float64) if buffer.dtype == torch.float64 else np.dtype(np.float32)


def wire_torch(buffer, fp16):
    return TORCH_OF[wire_dtype(buffer, fp16)]


def built_or_refused(build, params, index, buffer):
    """``build()`` (a buffer's codec chains and reducers); a codec's refusal of the buffer's
    dtype becomes one line naming the bucket, its dtype and the codec."""
    try:
        return build()
    except TypeError as e:
        raise TypeError(f"bps_gc comm_hook: DDP bucket {index} holds {buffer.dtype} gradients, which "
                        f"compressor {params.compressor!r} cannot carry ({e}); train in float32 "
                        f"(model.float()) or choose a codec that carries float64 (docs/ddp_hook.md)") from None


class SideStream(NamedTuple):
    """A CUDA buffer's side stream and the event (recorded on backward's stream) it first waits for."""
    stream: Any
    ready: Any

    def wait_for_backward(self):
        self.stream.wait_event(self.ready)


def pending_future(streams, buffer):
    """(a call's pending future, its SideStream or None). ``streams``: one side stream per CUDA
    device. A CUDA buffer's memory stays DDP's until the side stream is done with it; its
    future carries the device, so whoever waits on it (DDP) waits for the side stream's work,
    not the host."""
    if buffer.device.type == "cpu":
        return torch.futures.Future(), None
    device = buffer.device
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(device))
    buffer.record_stream(stream)
    return torch.futures.Future(devices=[device]), SideStream(stream, ready)


def current(side):
    """The side stream as the current stream (a CUDA buffer's SideStream), or nothing."""
    return contextlib.nullcontext() if side is None else torch.cuda.stream(side.stream)


def value(future):
    """A future's value (DDP reads a failed Python future's exception as its value: a callback
    that raises it marks the chained future failed, with the exception's type and text)."""
    return future.value()


def settle(future, work, *args):
    """The future's result is ``work(*args)``, or what it raised."""
    try:
        result = work(*args)
    except BaseException as e:  # noqa: B036 (the future is its only way out of this thread)
        future.set_exception(e)
        return
    future.set_result(result)
