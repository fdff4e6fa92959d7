"""The interface of a device codec: the numpy ``Codec`` contract over torch tensors that stay on
one device (``torch.device``: "cuda:0", "cpu", ...).

``compress(x, ctx)`` takes a tensor of ``n`` elements on the codec's device and returns the
payload as a 1-D uint8 tensor there, in the numpy codec's wire format (docs/codecs.md), so a
numpy codec decodes it and the other way round. ``decompress(payload, out=None)`` returns the
``n`` decoded elements on the device; ``payload`` may also be a numpy array, bytes or a uint8
tensor elsewhere (it is moved to the device first).

The operations run on the caller's current CUDA stream, in its order. A codec object keeps its
state and scratch tensors across calls: one partition's calls must not overlap (run them in
order on one stream, or synchronize between streams).
"""
import numpy as np
import torch

from ..base import DTYPES
from ..stateful import Stateful, codec_identity

TORCH_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
                np.dtype(np.float16): torch.float16}


def resolve_device(device):
    """A torch.device with an index where the kind has one ("cuda" -> the current CUDA device),
    so that tensors' devices compare equal to it."""
    if device is None:
        raise ValueError("a device codec needs a device (torch.device or a string like 'cuda:0')")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"not a torch device: {device!r} ({e})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device}: CUDA is not available in this process")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def torch_dtype(dtype):
    """The torch dtype of a numpy partition dtype (float32, float64 or float16)."""
    dtype = np.dtype(dtype)
    if dtype not in TORCH_DTYPES:
        raise TypeError(f"unsupported dtype {dtype}; supported: {', '.join(str(d) for d in DTYPES)}")
    return TORCH_DTYPES[dtype]


def shared_tensor(scratch, slot, n, dtype, device):
    """The first ``n`` elements of a compress.Scratch's tensor for ``slot`` (contents undefined)."""
    return scratch.take_made((slot, dtype, device), n, lambda size: torch.empty(size, dtype=dtype, device=device))


class DeviceCodec(Stateful):
    """Compresses one partition of ``n`` elements of numpy ``dtype`` held on ``device``.

    Subclasses implement ``compress`` and ``decompress``; ``decompress_add`` and ``residual``
    default to a decode into a scratch tensor. ``reducers`` must equal the numpy codec's (the
    server that sums the pushes runs the numpy codec).
    """

    reducers = ("recompress", "lossless")
    state_label = "codec."  # the numpy codec's keys, so that states move between the two

    def state_identity(self):
        return codec_identity(self)

    def __init__(self, params, n, dtype, seed, device, **extra):
        dtype = np.dtype(dtype)
        self.torch_dtype = torch_dtype(dtype)
        if int(n) < 1:
            raise ValueError(f"{type(self).__name__}: partition must have >= 1 element, got {n}")
        self.params, self.n, self.dtype, self.seed = params, int(n), dtype, seed
        self.device = resolve_device(device)
        self._scratch = None
        self.scratch = None  # or a compress.Scratch shared with other partitions' codecs

    def compress(self, x, ctx=None):
        raise NotImplementedError

    def decompress(self, payload, out=None):
        raise NotImplementedError

    def decompress_add(self, payload, acc):
        """acc += decompress(payload), in place."""
        acc = self._inplace(acc, "acc")
        acc += self.decompress(payload, self._scratch_tensor())

    def residual(self, payload, x):
        """x -= decompress(payload), in place (error feedback's ``e = g - D(c)``)."""
        x = self._inplace(x, "x")
        x -= self.decompress(payload, self._scratch_tensor())

    # helpers for subclasses --------------------------------------------------------------

    def _where(self):
        return f"{type(self).__name__} ({self.n} x {self.dtype} on {self.device})"

    def _check_tensor(self, x, what):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self._where()}: {what} must be a torch.Tensor, got {type(x).__name__}")
        if x.device != self.device:
            raise ValueError(f"{self._where()}: {what} is on {x.device}, expected {self.device}")
        if x.dtype != self.torch_dtype or x.numel() != self.n:
            raise ValueError(f"{self._where()}: {what} must hold {self.n} elements of "
                             f"{self.torch_dtype}, got {x.numel()} of {x.dtype}")

    def _input(self, x):
        """x as a flat contiguous tensor (a view where x is contiguous)."""
        self._check_tensor(x, "input")
        return x.reshape(-1)

    def _inplace(self, x, what):
        """A flat view of a tensor written in place (it must be contiguous, or writes are lost)."""
        self._check_tensor(x, what)
        if not x.is_contiguous():
            raise ValueError(f"{self._where()}: {what} must be contiguous to be updated in place")
        return x.view(-1)

    def _output(self, out):
        if out is None:
            return torch.empty(self.n, dtype=self.torch_dtype, device=self.device)
        return self._inplace(out, "out")

    def _scratch_tensor(self):
        """Where decompress_add and residual decode a payload: a shared scratch's, else its own."""
        if self.scratch is not None:
            return shared_tensor(self.scratch, "decoded", self.n, self.torch_dtype, self.device)
        if self._scratch is None:
            self._scratch = torch.empty(self.n, dtype=self.torch_dtype, device=self.device)
        return self._scratch

    def _payload(self, payload, size=None):
        """The payload as a flat uint8 tensor on the device (from a tensor, numpy array or bytes)."""
        if isinstance(payload, torch.Tensor):
            if payload.dtype != torch.uint8:
                raise TypeError(f"{self._where()}: payload must be a uint8 tensor, got {payload.dtype}")
            buf = payload.reshape(-1).to(self.device)
        elif isinstance(payload, (np.ndarray, bytes, bytearray, memoryview)):
            arr = np.ascontiguousarray(host_array(payload))
            if not arr.flags.writeable:  # torch refuses to alias read-only memory (a warning)
                arr = arr.copy()
            buf = torch.from_numpy(arr).to(self.device)
        else:
            raise TypeError(f"{self._where()}: payload must be a uint8 tensor, numpy array or "
                            f"bytes, got {type(payload).__name__}")
        if size is not None and buf.numel() != size:
            raise ValueError(f"{self._where()}: payload of {buf.numel()} bytes, expected {size}")
        return buf


def host_array(payload):
    """A device payload (or any payload) as a numpy uint8 array, for the numpy codecs."""
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8:
            raise TypeError(f"a payload must be a uint8 tensor, got {payload.dtype}")
        return payload.detach().reshape(-1).cpu().numpy().view(np.uint8)
    if isinstance(payload, np.ndarray):
        return payload.reshape(-1).view(np.uint8)
    return np.frombuffer(payload, np.uint8)
