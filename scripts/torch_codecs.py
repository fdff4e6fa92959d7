"""Straightforward PyTorch CPU versions of the issue-11 codecs, written the way GRACE
(grace_dl/torch/compressor/*) and DGC's reference code (dgc/compression.py) write them: the
yardstick scripts/bench_codecs.py sets beside bps_gc's codecs. ``compress(x)`` returns what
would go on the wire, ``decompress(payload)`` the dense tensor. Not used by bps_gc itself."""
import math

import torch


class TernGrad:
    def __init__(self, n):
        self.n = n

    def compress(self, x):
        abs_x = x.abs()
        scalar = abs_x.max()
        sign = x.sign()
        rnd = torch.empty_like(x).uniform_(0, scalar.item())
        sign[rnd >= abs_x] = 0
        return sign.to(torch.int8), scalar

    def decompress(self, payload):
        t, scalar = payload
        return t.to(torch.float32) * scalar


class QSGD:
    def __init__(self, n, levels=255):
        self.n, self.levels = n, levels

    def compress(self, x):
        norm = x.norm()
        level_float = self.levels / norm * x.abs()
        previous = level_float.floor()
        prob = torch.empty_like(x).uniform_()
        new_level = previous + (prob < (level_float - previous)).to(torch.float32)
        compressed = (new_level * x.sign()).to(torch.int16)
        return compressed.to(torch.int8 if self.levels < 128 else torch.half), norm

    def decompress(self, payload):
        compressed, norm = payload
        return norm / self.levels * compressed.to(torch.float32)


class Threshold:
    def __init__(self, n, threshold=None):
        self.n, self.threshold = n, threshold

    def compress(self, x):
        h = self.threshold if self.threshold is not None else 0.5 * x.abs().max()
        indices = (x.abs() >= h).nonzero().view(-1)
        return indices.to(torch.int32), x[indices]

    def decompress(self, payload):
        indices, values = payload
        out = torch.zeros(self.n)
        out.scatter_(0, indices.long(), values)
        return out


class Sign:
    def __init__(self, n, scaled=False):
        self.n, self.scaled = n, scaled

    def compress(self, x):
        return x >= 0, (x.abs().mean() if self.scaled else None)

    def decompress(self, payload):
        signs, scale = payload
        out = signs.to(torch.float32) * 2 - 1
        return out * scale if scale is not None else out


class DGC:
    """DGC's reference memory (momentum correction, masking) and sparsify, one tensor."""

    def __init__(self, n, ratio=0.001, sample_ratio=0.01, momentum=0.9):
        self.n, self.ratio, self.momentum = n, ratio, momentum
        self.u, self.v = torch.zeros(n), torch.zeros(n)
        pct, cpr = int(math.ceil(n * sample_ratio)), int(math.ceil(2 / ratio))
        if n <= cpr:
            self.stride, self.samples = 1, n
        else:
            self.stride = int(math.ceil(n / max(pct, cpr) / 32)) * 32 + 1
            self.samples = n // self.stride
            while self.samples < max(pct, cpr):
                self.stride -= 8
                self.samples = n // self.stride
        self.top_k_samples = int(math.ceil(self.samples * ratio))
        self.selects = int(math.ceil(n * ratio))

    def compress(self, x):
        self.u.mul_(self.momentum).add_(x)
        self.v.add_(self.u)
        importance = self.v.abs()
        samples = importance if self.samples == self.n else \
            importance[torch.randint(0, self.stride, (1,)).item()::self.stride]
        threshold = torch.min(torch.topk(samples, self.top_k_samples, 0, largest=True, sorted=False)[0])
        indices = torch.ge(importance, threshold).nonzero().view(-1)
        for _ in range(10):
            if indices.numel() > self.selects:
                if indices.numel() > self.selects * 1.3:
                    indices = indices[torch.topk(importance[indices], self.selects, 0, largest=True,
                                                 sorted=False)[1]]
                break
            if indices.numel() < 0.8 * self.selects:
                threshold = threshold * 0.8
                indices = torch.ge(importance, threshold).nonzero().view(-1)
            else:
                break
        indices = indices[: self.selects]
        values = self.v[indices]
        self.v.index_fill_(0, indices, 0)
        self.u.index_fill_(0, indices, 0)
        return values, indices.to(torch.int32)

    def decompress(self, payload):
        values, indices = payload
        out = torch.zeros(self.n)
        out.index_put_([indices.long()], values, accumulate=True)
        return out


class PowerSGD:
    """PyTorch's powerSGD_hook math for one matrix, one worker (the all-reduces are sums)."""

    def __init__(self, n, rank=1):
        self.n = n
        self.cols = math.isqrt(n - 1) + 1 if n > 1 else 1
        self.rows = -(-n // self.cols)
        self.rank = min(rank, self.rows, self.cols)
        self.q = torch.randn(self.cols, self.rank)
        self.error = torch.zeros(n)

    def compress(self, x):
        m = torch.zeros(self.rows * self.cols)
        m[: self.n] = x + self.error
        m = m.view(self.rows, self.cols)
        p = m @ self.q
        p = torch.linalg.qr(p).Q
        q = m.t() @ p
        approx = (p @ q.t()).view(-1)[: self.n]
        self.error = m.view(-1)[: self.n] - approx
        self.q = q
        return p, q

    def decompress(self, payload):
        p, q = payload
        return (p @ q.t()).view(-1)[: self.n]


def reference(name, n, params):
    """The PyTorch version of a bench row's codec."""
    if name == "terngrad":
        return TernGrad(n)
    if name == "qsgd":
        return QSGD(n, params.get("levels", 255))
    if name == "threshold":
        return Threshold(n, params["threshold"])
    if name == "adaptive_threshold":
        return Threshold(n)
    if name in ("sign", "signnorm"):
        return Sign(n, scaled=name == "signnorm")
    if name == "dgc":
        return DGC(n, params["k"], params.get("sample_ratio", 0.01), params.get("mu") or 0.0)
    if name == "powersgd":
        return PowerSGD(n, params.get("rank", 1))
    raise KeyError(name)
