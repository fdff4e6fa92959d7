"""HostBridge: a numpy codec chain behind the device codec interface.

Why it exists: every codec (a plugin's, or one whose device implementation is not written)
must work with device tensors from the first day, with the same payloads and state as on the
host. The bridge copies the tensor to the host, runs the numpy chain there (its error
feedback and momentum state stay on the host) and hands the payload back as a uint8 tensor on
the device; decoding goes the other way. It costs a device-to-host copy of the tensor per
compress (and of the decoded tensor per decode), which is what the device implementations
avoid; on a CPU device the copies are views.
"""
import numpy as np
import torch

from ..registry import COMPRESSORS
from .base import DeviceCodec, host_array


class HostBridge(DeviceCodec):
    """Runs ``codec`` (a numpy codec or chain of n elements of its dtype) for tensors on
    ``device``; bytes and state evolve exactly as the numpy chain's (its state dict is the
    numpy chain's)."""

    state_label = ""

    def state_identity(self):
        return {}

    def state_children(self):
        return (("", self.inner),)

    def __init__(self, codec, device):
        super().__init__(codec.params, codec.n, codec.dtype, None, device)
        self.inner = codec
        self.reducers = tuple(getattr(COMPRESSORS.get(codec.params.compressor), "reducers",
                                      DeviceCodec.reducers))

    def _host(self, x):
        # a CPU tensor is viewed, not copied; the numpy codecs never write their input
        return x.detach().cpu().numpy()

    def _device(self, array):
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def compress(self, x, ctx=None):
        payload = self.inner.compress(self._host(self._input(x)), ctx)
        return self._device(np.asarray(payload, np.uint8).reshape(-1))

    def decompress(self, payload, out=None):
        out = self._output(out)
        decoded = self.inner.decompress(host_array(payload))
        out.copy_(torch.from_numpy(decoded))
        return out

    def _update(self, x, what, apply):
        # the numpy codec updates a host copy (a view on a CPU device) in place: only the
        # positions it touches change, exactly as on the host
        x = self._inplace(x, what)
        host = x.detach().numpy() if x.device.type == "cpu" else x.detach().cpu().numpy()
        apply(host)
        if x.device.type != "cpu":
            x.copy_(torch.from_numpy(host))

    def decompress_add(self, payload, acc):
        self._update(acc, "acc", lambda host: self.inner.decompress_add(host_array(payload), host))

    def residual(self, payload, x):
        self._update(x, "x", lambda host: self.inner.residual(host_array(payload), host))
