"""Reductions in two phases of plain sums (PowerSGD: the sum of P = M Q, then the sum of
Q = M^T P^; thc: a scale histogram, then packed integer codes), driven here above the
transport, so servers and collectives only ever sum dense float buffers: each phase of a
tensor is one buffer, every partition's phase payload back to back. The parameter server
sums it as an uncompressed auxiliary tensor declared per phase (``phase_names``); the
collective all_reduces it.

Nothing here knows a codec by name: a partition's reducer says how many phases it takes
(``Reducer.phases``), and its codec provides

* ``compress(x, ctx)``: the first phase's payload (bytes of ``phase_dtype``) from the input;
* ``compress_q(summed)``: the second phase's payload from the first phase's sum;
* ``finish(summed, out, workers)``: writes the reduced partition (the sum) from the second sum;
* ``phase_sizes``: the elements of each phase's payload;
* with ``host_first``, ``agree(summed, ctx)``: what ``compress`` and ``compress_q`` learn of the
  step and the first sum, on a rank that does not encode the partition;
* optionally ``phase_dtype``: the payloads' element type (float32 when absent; thc's float64
  words hold more exact integer lanes);
* optionally ``set_summands(workers)``: called first, when the payload's size depends on how
  many pushes the sum adds (thc's lanes).

A reducer with ``host_first`` (thc) has two-level jobs sum each host's gradient (floats, in
shared memory) before its phases: one local rank per partition encodes the host's sum and the
others send zeros, which every sum adds exactly, so each phase sums one push per host and thc's
lanes are sized for H hosts, not H x L ranks (``summands``).
"""
import numpy as np

PHASES = 2  # the one multi-phase shape there is (PowerSGD's)


def phases(tensor):
    """Sum phases one reduce of ``tensor`` takes: 1 for the ordinary push and reply."""
    if not tensor.compressed or not tensor.partitions:
        return 1
    count = tensor.partitions[0].reducer.phases
    if count not in (1, PHASES):
        raise ValueError(f"{tensor.name!r}: reducer {tensor.reducer!r} asks for {count} phases; "
                         f"the communicators drive 1 or {PHASES}")
    return count


def host_first(tensor):
    """Whether two levels sum a host's gradient before ``tensor``'s phases (its reducer says so)."""
    return bool(tensor.partitions) and bool(getattr(tensor.partitions[0].reducer, "host_first", False))


def summands(tensor, ranks, local_size=1):
    """Pushes each phase sum of ``tensor`` adds: one per host where the host sums first."""
    return ranks // local_size if local_size > 1 and host_first(tensor) else ranks


def phase_names(tensor):
    """The auxiliary tensors a parameter-server worker sums the phases of ``tensor`` in."""
    return [f"{tensor.name}|phase{i}" for i in range(PHASES)]


def size_for(tensor, workers):
    """Tell codecs whose phase sizes depend on it how many pushes each sum adds."""
    for part in tensor.partitions:
        if hasattr(part.codec, "set_summands"):
            part.codec.set_summands(workers)


def phase_dtype(tensor):
    """The element type every phase buffer of ``tensor`` is summed in."""
    return np.dtype(getattr(tensor.partitions[0].codec, "phase_dtype", np.float32))


def phase_lengths(tensor, workers=1):
    """Elements (of ``phase_dtype``) of each phase's buffer, for sums of ``workers`` pushes."""
    size_for(tensor, workers)
    return [sum(int(part.codec.phase_sizes[i]) for part in tensor.partitions) for i in range(PHASES)]


class PhasedReduction:
    """One reduce of a two-phase tensor on this worker: ``first()`` and ``second(p_sum)`` are
    the buffers to sum, ``finish(q_sum)`` writes the sum over ``workers`` into ``target``.
    ``source`` and ``target`` are flat arrays of the wire dtype (they may be one array: the input
    is read by ``first`` before ``finish`` writes). ``owns(i)``: whether this rank encodes
    partition i (None: all); the others' phase payloads are zeros (``host_first``)."""

    def __init__(self, tensor, source, target, ctx, workers, owns=None):
        self.parts, self.source, self.target = tensor.partitions, source, target
        self.ctx, self.workers = ctx, workers
        self.owned = [owns is None or bool(owns(i)) for i in range(len(self.parts))]
        self.on_host = owns is not None  # the transport sums the host's input before ``first``
        size_for(tensor, workers)
        self.dtype = phase_dtype(tensor)
        self.bounds = [np.cumsum([0] + [int(part.codec.phase_sizes[i]) for part in self.parts])
                       for i in range(PHASES)]

    def _pieces(self, phase, buffer):
        bounds = self.bounds[phase]
        for i, part in enumerate(self.parts):
            yield part, buffer[bounds[i]:bounds[i + 1]]

    def first(self):
        buffer = np.empty(self.bounds[0][-1], self.dtype)
        for owned, (part, piece) in zip(self.owned, self._pieces(0, buffer)):
            piece[:] = part.codec.compress(self.source[part.start:part.stop], self.ctx).view(self.dtype) \
                if owned else 0
        return buffer

    def second(self, p_sum):
        buffer = np.empty(self.bounds[1][-1], self.dtype)
        for owned, (part, piece), (_, summed) in zip(self.owned, self._pieces(1, buffer), self._pieces(0, p_sum)):
            if owned:
                piece[:] = part.codec.compress_q(summed).view(self.dtype)
            else:  # header included: the owner's push is the host's one; ``agree`` readies finish
                part.codec.agree(summed, self.ctx)
                piece[:] = 0
        return buffer

    def finish(self, q_sum):
        for part, summed in self._pieces(1, q_sum):
            part.codec.finish(summed, self.target[part.start:part.stop], self.workers)
        return self.target
