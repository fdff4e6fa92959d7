"""Decentralized averaging over a gossip graph, in numpy: CHOCO-SGD and plain D-PSGD (spec §5).

Node ``i`` owns flat float arrays ``x`` (its model, updated in place: numpy views of a
framework's parameters) and exchanges messages only with its graph neighbours through a
``comm`` that has ``rank()``, ``size()``, ``send(rank, name, payload)`` (returns a handle or
None) and ``recv(rank, name, timeout)`` (uint8 array): the communicator's point-to-point calls,
no server in the path.

CHOCO-SGD keeps, per tensor, the public copy ``xhat`` and ``s = sum_j w_ij xhat_j`` (three
model copies whatever the degree) and per round, after the local step:
``x += gamma (s - xhat)``; ``q = Q(x - xhat)``; send q to the neighbours; ``xhat += q``;
``s += w_ii q + sum_j w_ij q_j``. The neighbours' ``q_j`` are collected at the start of the next
round (``collect``), so the exchange overlaps the next forward and backward pass.

We store ``u = s - xhat`` in place of ``s`` (the same three copies, the same algorithm:
``x += gamma u``; ``u += sum_j w_ij q_j - (1 - w_ii) q``). Kept as ``s``, float32 rounding
errors of the size of the weights pile up in s and every round adds gamma times them to x, so
the average of the x_i drifts steadily; in ``u`` they are of the size of the disagreement
between neighbours and vanish at consensus.

A message is one per neighbour per round, every tensor's payload concatenated:
uint32 count, uint32 payload lengths, the payloads (no pickle).
"""
import json
import threading

import numpy as np

from ..compress import CompressionParams, build_chain
from ..compress.stateful import StateError, Stateful


def pack(payloads):
    lengths = np.array([len(p) for p in payloads], np.uint32)
    head = np.concatenate([np.array([len(payloads)], np.uint32), lengths]).view(np.uint8)
    return np.concatenate([head] + [np.asarray(p, np.uint8).reshape(-1) for p in payloads])


def unpack(message, expected, sender):
    buf = np.asarray(message, np.uint8).reshape(-1)
    if buf.size < 4 or buf[:4].view(np.uint32)[0] != expected:
        raise ValueError(f"gossip message from rank {sender}: expected {expected} tensors; the "
                         "workers declared different models")
    lengths = buf[4:4 + 4 * expected].view(np.uint32).astype(np.int64)
    offsets = (4 + 4 * expected + np.concatenate([[0], np.cumsum(lengths)])).tolist()
    if offsets[-1] != buf.size:
        raise ValueError(f"gossip message from rank {sender}: {buf.size} bytes, the header says "
                         f"{offsets[-1]}")
    return [buf[offsets[k]:offsets[k + 1]] for k in range(expected)]


class RawCodec:
    """The identity Q: the float bytes themselves."""

    def __init__(self, n, dtype):
        self.n, self.dtype = n, np.dtype(dtype)

    def compress(self, x, lr=0.0):
        return np.ascontiguousarray(x, self.dtype).reshape(-1).view(np.uint8).copy()

    def decompress(self, payload, out):
        out[:] = np.asarray(payload, np.uint8).view(self.dtype)
        return out


def codec_for(params, n, dtype, key):
    """Q for one tensor: a bps_gc codec chain, or the identity when nothing is compressed."""
    if params is None or not params.compressed:
        return RawCodec(n, dtype)
    return build_chain(params, n, dtype, key=key, role="worker")


def gossip_params(compression_params):
    params = CompressionParams.from_dict(dict(compression_params or {}))
    if params.ef or params.momentum:
        raise ValueError("CHOCO's Q takes no error feedback or momentum: the compression error "
                         f"stays in x - xhat already (got ef={params.ef!r}, momentum={params.momentum!r})")
    return params


class _Neighbourhood(Stateful):
    """What CHOCO and D-PSGD share; its state is per rank (``rounds``, and CHOCO's copies and
    codec states, keyed by tensor name)."""

    state_attrs = ("rounds",)
    algorithm = None  # "choco" or "dpsgd": a state moves only to the same algorithm

    def state_identity(self):
        # numpy arrays here, torch tensors in bps_gc.torch's variant: the same identity
        models = {n: [int(np.prod(a.shape)), str(a.dtype).removeprefix("torch.")]
                  for n, a in self.x.items()}
        return {"algorithm": self.algorithm, "rank": self.rank, "size": self.size,
                "topology": self.topology.name, "models": json.dumps(models, sort_keys=True)}

    def load_state_dict(self, sd):
        if getattr(self, "pending", False):
            raise StateError(f"{self.tag}: load_state_dict after a gossip round started (its "
                             "messages are in flight); load the state before the first step")
        super().load_state_dict(sd)

    def __init__(self, arrays, topology, comm, tag):
        self.names = list(arrays)
        self.x = {n: arrays[n] for n in self.names}
        for n, a in self.x.items():
            self._check_array(n, a)
        self.comm, self.tag = comm, tag
        self.rank, self.size = comm.rank(), comm.size()
        if topology.size != self.size:
            raise ValueError(f"gossip: the {topology.name} has {topology.size} workers, the job {self.size}")
        self.topology = topology
        self.neighbours = topology.neighbours(self.rank)
        self.w_self = topology.weight(self.rank, self.rank)
        self.bytes_sent = 0
        self.rounds = 0
        # sends run on their own thread: a transport's send may block until the neighbour
        # receives (torch.distributed's gloo does), which it does only at its next step. A
        # daemon thread: a send stuck on a dead neighbour must not keep the process alive
        self._sending, self._send_error = None, []

    def _check_array(self, name, a):
        """The models are flat contiguous arrays (numpy here; torch tensors in bps_gc.torch's
        device variant, which overrides this)."""
        if not (isinstance(a, np.ndarray) and a.ndim == 1 and a.flags.c_contiguous):
            raise ValueError(f"gossip: {name!r} must be a flat contiguous numpy array")

    def _send_all(self, message):
        """Send ``message`` to every neighbour, in ascending rank order (receives go in the same
        order, so that blocking sends cannot wait on each other in a cycle)."""
        def send():
            try:
                for j in self.neighbours:
                    handle = self.comm.send(j, self.tag, message)
                    if handle is not None and hasattr(handle, "wait"):
                        handle.wait()
            except BaseException as e:  # raised in the training thread by _wait_sent
                self._send_error.append(e)
        self._wait_sent()
        self._sending = threading.Thread(target=send, name="bps_gc-gossip-send", daemon=True)
        self._sending.start()
        self.bytes_sent += message.nbytes * len(self.neighbours)

    def _wait_sent(self):
        """Wait for the last sends (raising their error, e.g. a dead neighbour)."""
        if self._sending is not None:
            self._sending.join()
            self._sending = None
        if self._send_error:
            raise self._send_error.pop()

    def _receive(self, j):
        return unpack(self.comm.recv(j, self.tag), len(self.names), j)


class ChocoGossip(_Neighbourhood):
    algorithm = "choco"
    state_attrs = ("rounds", "xhat", "u")

    def state_identity(self):
        return {**super().state_identity(), "gamma": float(self.gamma)}

    def state_children(self):
        return tuple((f"codec.{name}.", codec) for name, codec in self.codecs.items()
                     if isinstance(codec, Stateful))

    def state_dict(self):
        """The state after the neighbours' last messages are in (``collect``, which the next
        step would do first): x-hat, u = s - x-hat, the codecs' states and the round count."""
        self.collect()
        return super().state_dict()

    def __init__(self, arrays, topology, comm, gamma, compression_params=None, tag="choco"):
        super().__init__(arrays, topology, comm, tag)
        if not 0 < gamma <= 1:
            raise ValueError(f"CHOCO: the consensus step size must be in (0, 1], got {gamma}")
        self.gamma = gamma
        params = gossip_params(compression_params)
        self.xhat = {n: self._zeros_like(a) for n, a in self.x.items()}
        self.u = {n: self._zeros_like(a) for n, a in self.x.items()}  # s - xhat
        # a distinct codec seed per tensor and node: random codecs draw independently
        self.codecs = {n: self._codec(params, a, (k + 1) * 65537 + self.rank) for k, (n, a) in enumerate(self.x.items())}
        self._scratch = self._scratch_buffers()
        self.pending = False

    # the three the device variant (torch/choco.py) does on torch tensors instead
    _zeros_like = staticmethod(np.zeros_like)

    @staticmethod
    def _codec(params, a, key):
        return codec_for(params, a.size, a.dtype, key=key)

    def _scratch_buffers(self):
        """Where messages are decoded: one buffer per dtype, as long as the largest array."""
        largest = max((a.size for a in self.x.values()), default=0)
        return {dt: np.empty(largest, dt) for dt in {a.dtype for a in self.x.values()}}

    def _decoded(self, name, payload):
        a = self.x[name]
        return self.codecs[name].decompress(payload, self._scratch[a.dtype][:a.size])

    def _weighted(self, name, payload, w):
        """A neighbour's decoded q_j times its weight ``w``, in the model's dtype."""
        return self.x[name].dtype.type(w) * self._decoded(name, payload)

    def collect(self):
        """Add the neighbours' last q_j into s, i.e. u (blocks until every neighbour's message
        is in), and wait for this node's last sends."""
        if not self.pending:
            return
        for j in self.neighbours:
            w = self.topology.weight(self.rank, j)
            for name, payload in zip(self.names, self._receive(j)):
                self.u[name] += self._weighted(name, payload, w)
        self._wait_sent()
        self.pending = False

    def step(self, lr=0.0):
        """One gossip round after the local step (steps 2-5 of spec §5)."""
        self.collect()
        payloads = []
        for name in self.names:
            x, xhat, u = self.x[name], self.xhat[name], self.u[name]
            dt = x.dtype.type
            x += dt(self.gamma) * u
            payload = self.codecs[name].compress(x - xhat, float(lr))
            q = self._decoded(name, payload)
            xhat += q
            u -= dt(1.0 - self.w_self) * q
            payloads.append(payload)
        self._send_all(pack(payloads))
        self.pending = True
        self.rounds += 1


class DPSGDGossip(_Neighbourhood):
    """Plain D-PSGD: ``x_i <- sum_j w_ij x_j`` with the neighbours' full models, uncompressed."""

    algorithm = "dpsgd"

    def __init__(self, arrays, topology, comm, tag="dpsgd"):
        super().__init__(arrays, topology, comm, tag)

    def collect(self):
        pass

    def step(self, lr=0.0):
        self._send_all(pack([a.view(np.uint8) for a in self.x.values()]))
        mixed = {n: a * a.dtype.type(self.w_self) for n, a in self.x.items()}
        for j in self.neighbours:
            w = self.topology.weight(self.rank, j)
            for name, payload in zip(self.names, self._receive(j)):
                a = self.x[name]
                mixed[name] += a.dtype.type(w) * np.asarray(payload).view(a.dtype)
        self._wait_sent()
        for n, a in self.x.items():
            a[:] = mixed[n]
        self.rounds += 1
