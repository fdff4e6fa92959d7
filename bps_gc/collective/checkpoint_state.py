"""The communicator's codec state (a part of ``Collective``; docs/checkpoint.md): every
worker chain and reducer of its compressed tensors, keyed ``<tensor name>/<partition>/worker|
reducer/<key>``, by declared name, never by bucket or declaration index. Every rank runs the
server's reducers (coded.py), so a recompress reducer's server chain is saved by every rank.

Saved and loaded between steps: the exchange thread is drained first, so no chain is in use.
A tensor declared without its shape gets its chains at its first push_pull; declare it with
its shape before loading a state that holds it.
"""


class CommunicatorState:
    """``state_dict``/``load_state_dict`` of the declared tensors' chains. ``tensors``: the
    communicator's name -> tensor table (read when called, so later declarations count);
    ``flush``/``drain``: the buckets' and the exchange thread's, run first so no chain is in use."""

    def __init__(self, codecs, tensors, rank, flush, drain):
        self.codecs, self.tensors, self.rank, self.flush, self.drain = codecs, tensors, rank, flush, drain

    def _state_group(self):
        group = self.codecs.StateGroup  # the codec library's (collective never imports it)
        return group({name: group({str(p): group({"worker": part.codec, "reducer": part.reducer})
                                   for p, part in enumerate(tensor.partitions)})
                      for name, tensor in self.tensors.items() if tensor.compressed and tensor.partitions})

    def state_dict(self):
        """The codec state of every compressed tensor of this rank (copies)."""
        self.flush()
        self.drain()
        return self._state_group().state_dict()

    def load_state_dict(self, sd):
        """Restore ``state_dict()``'s result; a StateError names the first problem (a tensor
        the state has and this rank did not declare, another codec setting, ...), and then
        nothing has changed."""
        self.flush()
        self.drain()
        try:
            self._state_group().load_state_dict(sd)
        except self.codecs.StateError as e:
            raise self.codecs.StateError(f"bps_gc communicator (rank {self.rank}): {e}") from None
