"""The futures and CUDA side streams of the DDP hook's buckets (hook.py): a bucket's work runs
on the hook's threads and ends in its future; a CUDA bucket's runs on a side stream that first
waits for backward's."""
import contextlib

import torch


def on_side_stream(streams, buffer):
    """A CUDA bucket: (its future, (side stream, event)), the stream one of ``streams`` (one per
    device). The event, recorded now on backward's stream, is what the side stream waits for
    before its work on the bucket; the future carries the device, so whoever waits on it (DDP)
    waits for the side stream's work, not the host."""
    device = buffer.device
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(device))
    buffer.record_stream(stream)  # its memory stays DDP's until the side stream is done with it
    return torch.futures.Future(devices=[device]), (stream, ready)


def current(stream):
    """The side stream as the current stream (a CUDA bucket's ``(stream, event)``), or nothing."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream[0])


def raiser(error):
    def raise_it():
        raise error
    return raise_it


def value(future):
    return future.value()


def settle(future, work):
    """The future's result is ``work()``, or what it raised."""
    try:
        result = work()
    except BaseException as e:  # noqa: B036 (the future is its only way out of this thread)
        future.set_exception(e)
        return
    future.set_result(result)
