"""Reductions in two phases of plain sums (PowerSGD: the sum of P = M Q, then the sum of
Q = M^T P^; thc: a scale histogram, then packed integer codes), driven here above the
transport, so servers and collectives only ever sum dense buffers: each phase of a
tensor is one buffer, every partition's phase payload back to back. The parameter server
sums it as an uncompressed auxiliary tensor declared per phase (``phase_names``); the
collective all_reduces it.

Nothing here knows a codec by name: a partition's reducer says how many phases it takes
(``Reducer.phases``), and its codec provides

* ``compress(x, ctx)``: the first phase's payload (bytes of ``phase_dtype``) from the input;
* ``compress_q(summed)``: the second phase's payload from the first phase's sum;
* ``finish(summed, out, workers)``: writes the reduced partition (the sum) from the second sum;
* ``phase_sizes``: the elements of each phase's payload;
* optionally ``phase_dtype``: the payloads' element type (float32 when absent; thc's words,
  float64 or int64, hold exact integer lanes);
* optionally ``set_summands(workers, carrier)``: called first, when the payload's size depends
  on how many pushes the sum adds (thc's lanes) and on the element type the transport sums
  them in (``carrier``: None for the codec's own; torch.distributed passes int64, the parameter
  server int64 when every server adds it, else float64: ps/membership/membership.py
  ``phase_words``).

A reducer with ``host_first`` (thc) runs its phases inside two levels, as a single-phase codec
runs its push and pull: each partition's owner local rank sums it over the host (floats, in
shared memory), encodes that sum, and sums its own partitions' phase buffers with the owners of
the other hosts; then the host copies the decoded sums out. Each phase sum adds one push per
host, so thc's lanes are sized for H hosts, not H x L ranks (``set_summands``).
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


def phase_names(tensor):
    """The auxiliary tensors a parameter-server worker sums the phases of ``tensor`` in."""
    return [f"{tensor.name}|phase{i}" for i in range(PHASES)]


def owner_phase_names(tensor, local_rank):
    """The parameter server's phase tensors of ``tensor``'s partitions owned by ``local_rank``
    (two levels, ``host_first``: ps/worker/host.py)."""
    return [f"{name}|owner{local_rank}" for name in phase_names(tensor)]


def size_for(tensor, workers, carrier=None):
    """Tell codecs whose phase sizes depend on it how many pushes each sum adds, and in what."""
    for part in tensor.partitions:
        if hasattr(part.codec, "set_summands"):
            part.codec.set_summands(workers, carrier)


def phase_dtype(tensor):
    """The element type every phase buffer of ``tensor`` is summed in."""
    return np.dtype(getattr(tensor.partitions[0].codec, "phase_dtype", np.float32))


def phase_lengths(tensor, workers=1, carrier=None):
    """Elements (of ``phase_dtype``) of each phase's buffer, for sums of ``workers`` pushes."""
    size_for(tensor, workers, carrier)
    return [sum(int(part.codec.phase_sizes[i]) for part in tensor.partitions) for i in range(PHASES)]


def fused_sums(buffers, sum_in_place):
    """``buffers`` summed over the job: their concatenation per element type (PowerSGD's float32,
    thc's float64 or int64) goes to ``sum_in_place(array)`` once; the sums, in order."""
    sums = [None] * len(buffers)
    for dtype in dict.fromkeys(b.dtype for b in buffers):
        picked = [i for i, b in enumerate(buffers) if b.dtype == dtype]
        fused = np.concatenate([buffers[i] for i in picked])
        sum_in_place(fused)
        for i, summed in zip(picked, np.split(fused, np.cumsum([buffers[i].size for i in picked])[:-1])):
            sums[i] = summed
    return sums


def run_phases(reductions, sum_in_place):
    """Both phases of ``reductions`` (PhasedReduction), each phase one ``fused_sums``, then each
    one's ``finish``."""
    p_sums = fused_sums([r.first() for r in reductions], sum_in_place)
    q_sums = fused_sums([r.second(p) for r, p in zip(reductions, p_sums)], sum_in_place)
    for reduction, q_sum in zip(reductions, q_sums):
        reduction.finish(q_sum)


class PhasedReduction:
    """One reduce of a two-phase tensor on this worker: ``first()`` and ``second(p_sum)`` are
    the buffers to sum, ``finish(q_sum)`` writes the sum over ``workers`` into ``target``.
    ``source`` and ``target`` are flat arrays of the wire dtype (they may be one array: the input
    is read by ``first`` before ``finish`` writes). ``parts``: the partitions this rank
    encodes, when not all of ``tensor``'s (two levels: a host's owner; ``start`` and ``stop``
    index ``source`` and ``target``). ``carrier``: the element type the transport sums the
    phases in, when not the codec's own (``set_summands``)."""

    def __init__(self, tensor, source, target, ctx, workers, parts=None, carrier=None):
        self.parts = tensor.partitions if parts is None else parts
        self.source, self.target, self.ctx, self.workers = source, target, ctx, workers
        size_for(tensor, workers, carrier)
        self.dtype = phase_dtype(tensor)
        self.bounds = [np.cumsum([0] + [int(part.codec.phase_sizes[i]) for part in self.parts])
                       for i in range(PHASES)]

    def _pieces(self, phase, buffer):
        bounds = self.bounds[phase]
        for i, part in enumerate(self.parts):
            yield part, buffer[bounds[i]:bounds[i + 1]]

    def first(self):
        buffer = np.empty(self.bounds[0][-1], self.dtype)
        for part, piece in self._pieces(0, buffer):
            piece[:] = part.codec.compress(self.source[part.start:part.stop], self.ctx).view(self.dtype)
        return buffer

    def second(self, p_sum):
        buffer = np.empty(self.bounds[1][-1], self.dtype)
        for (part, piece), (_, summed) in zip(self._pieces(1, buffer), self._pieces(0, p_sum)):
            piece[:] = part.codec.compress_q(summed).view(self.dtype)
        return buffer

    def finish(self, q_sum):
        for part, summed in self._pieces(1, q_sum):
            part.codec.finish(summed, self.target[part.start:part.stop], self.workers)
        return self.target
