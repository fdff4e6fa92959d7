"""The communicator: the one interface bindings and algorithms call, whatever carries the bytes.

Two implementations: the ZeroMQ parameter server (``ps.worker.worker.Worker``) and torch.distributed
collectives (``bps_gc.collective``). Codecs and reducers are written once above this layer: an
implementation is handed the codec library (``bps_gc.compress``) and never imports it.

Every worker declares the same names in the same order. ``reduce`` sums (or averages) a tensor
over all workers through the tensor's reducer; ``send``/``recv`` move bytes between two workers
with no server in the path. Errors a user can cause (bad names, shapes, parameters) raise at the
call that caused them; a dead peer raises ``NodeFailure`` naming it.
"""
import abc
import re

from .declaration import Declaration
from .phased import phases
from .placement import DtypeRefused, declare_tensor, resolve_reduce_call


# gloo's socket errors: a collective issued beside bps_gc (FSDP2's) failing on a peer's closed
# socket, which ``peer_failure`` explains
PEER_GONE = re.compile(r"Connection (closed|reset) by peer|Broken pipe|IoException")


class Handle(abc.ABC):
    """An operation in flight: ``wait()`` returns its result (raising its error), ``poll()``
    says whether it is done."""

    @abc.abstractmethod
    def wait(self, timeout=None):
        ...

    @abc.abstractmethod
    def poll(self):
        ...

    def end_group(self):
        """BPS_GC_ELASTIC on the parameter server (docs/elastic.md): the round group this
        operation belongs to ends now, on the calling thread, as its wait would end it; a
        transport without round groups does nothing."""


class Communicator(abc.ABC):
    """What a transport implements. It keeps ``tensors`` (name -> placement.TensorPlan, in
    declaration order), ``codecs`` (the codec library, bps_gc.compress) and ``_place(tensor,
    shape, dtype, late)``, which cuts a tensor into partitions (``late``: its shape came with
    its first reduce); the openings of ``declare`` and ``reduce`` are written here, once."""
    rank: int
    size: int
    local_rank: int
    local_size: int
    tensors: dict
    codecs: object
    _scratch = None  # the partitions' codecs' shared in-call buffers, made by the first _build_codec

    def check_alive(self):
        """Raise the job's failure (a NodeFailure naming the node), or that it was shut down."""
        raise NotImplementedError(f"{type(self).__name__} does not implement check_alive()")

    def declare(self, name, shape=None, dtype=None, reducer=None, one_per_host=False, **compression) -> Declaration:
        """Register ``name`` with its compression and reducer (the codec's default when None).
        Every worker declares the same names in the same order. With ``shape`` (and ``dtype``,
        default float32) its partitions are placed now, else at its first reduce. Re-declaring it
        alike returns the same Declaration; differently is a ValueError naming the tensor. An
        unsupported codec/reducer pair is a ValueError naming both. ``one_per_host``: the tensor
        is this local rank's own (its FSDP shard), pushed by the same local rank of every host
        and reduced over the hosts alone (``averaged_over``); the host's other local ranks
        declare their own tensors in its place, alike in number, order and shape."""
        self.check_alive()
        if one_per_host and not self.pushes_one_per_host:
            raise ValueError(f"declare({name!r}, one_per_host=True): a tensor pushed by one local rank per host "
                             f"is the parameter server's; {type(self).__name__} reduces over every rank")
        tensor, shape, dtype = declare_tensor(self.tensors, self.codecs, name, shape, dtype, reducer, compression,
                                              self.local_rank if one_per_host else None)
        if shape is not None:
            try:
                self._place(tensor, shape, dtype, late=False)
            except DtypeRefused:  # its dtype refused before anything was placed: not declared, so that
                if tensor.shape is None:  # declaring it again is refused again (every rank alike)
                    del self.tensors[name]
                raise
        return tensor.declaration()

    def declaration(self, name):
        """The Declaration of ``name``, None if it was not declared."""
        tensor = self.tensors.get(name)
        return None if tensor is None else tensor.declaration()

    @abc.abstractmethod
    def _place(self, tensor, shape, dtype, late):
        """Cut ``tensor`` into partitions with their codecs (``_build_codec``)."""

    def _build_codec(self, tensor, n, dtype, key):
        """(worker chain, reducer) of a compressed partition: the reducer decodes the servers'
        replies, or, where every rank reduces every rank's payloads, runs the server's reduction.
        The chain draws this rank's own random numbers (``rank``: thc's rounding). Every
        partition's codecs take their in-call buffers (a sum, a decoded payload) from one
        compress.Scratch kept across calls, per thread (docs/runtime.md "What a server's keys
        hold": the collective's ranks reduce as servers do), instead of keeping their own."""
        if self._scratch is None:
            self._scratch = self.codecs.Scratch(kept=True)
        chain = self.codecs.build_chain(tensor.params, n, dtype, key=key, role="worker", shape=tensor.shape,
                                        rank=self.rank)
        reducer = self.codecs.make_reducer(tensor.reducer, tensor.params, n, dtype, key)
        for codec in (chain, reducer):
            self.codecs.use_scratch(codec, self._scratch)
        return chain, reducer

    def _open_reduce(self, array, name, ctx, out, lr):
        """The checks and step context every reduce starts with: (tensor, array, out, ctx), the
        tensor placed on its first use, ``ctx`` a copy with ``lr`` set."""
        self.check_alive()
        given, ctx = ctx, self.codecs.step_context(ctx)
        if ctx is given:  # a copy: the caller may reuse its dict (else step_context made a new one)
            ctx = dict(ctx)
        if lr is not None:
            ctx["lr"] = float(lr)
        tensor, array, out, place = resolve_reduce_call(self.tensors, name, array, out)
        if place:
            self._place(tensor, array.shape, array.dtype, late=True)
        return tensor, array, out, ctx

    def state_dict(self):
        """The codec state this rank holds for its declared tensors, keyed by tensor name and
        partition, never by bucket or server (docs/checkpoint.md): a flat dict that
        ``compress.state_bytes.encode_state`` writes."""
        raise NotImplementedError(f"{type(self).__name__} does not implement state_dict()")

    def load_state_dict(self, sd):
        """Restore ``state_dict()``'s result after declaring, before the first reduce; a
        ``StateError`` names the first problem, and then nothing was loaded."""
        raise NotImplementedError(f"{type(self).__name__} does not implement load_state_dict()")

    def server_values(self, name, attr):
        """The flat array ``attr`` of the servers' reducer state of ``name`` (DiLoCo's global
        copy, reducer ``outer_sgd``'s ``global_copy``), fetched from where the servers keep it."""
        raise NotImplementedError(f"{type(self).__name__} has no servers holding reducer state")

    def set_server_values(self, name, attr, flat):
        """Seed ``attr`` of the servers' reducer state of ``name`` with ``flat``, before its
        first reduce: the partitions this rank restores from a checkpoint (with two levels each
        owner its own: every rank of the first host calls it)."""
        raise NotImplementedError(f"{type(self).__name__} has no servers holding reducer state")

    # how ``push_payloads`` answers (bindings that compress themselves: bps_gc.torch's device
    # chains): False, the reduced reply of each partition (a server reduced them); True, every
    # rank's payloads of each partition (the caller runs the reducer, as the collective does)
    gathers_payloads = False

    def partitions(self, name):
        """[(key, start, stop)] of ``name``'s compressed partitions, in order: a binding that
        compresses with its own chains builds them with these keys (the keys seed the codecs)
        and pushes their payloads with ``push_payloads``. Empty when ``name`` is not placed or
        not compressed (sent dense, or nothing leaves this process), and for reducers summed
        in phases (PowerSGD's, comm/phased.py), which the communicator drives itself."""
        tensor = getattr(self, "tensors", {}).get(name)
        if tensor is None or not tensor.compressed or phases(tensor) > 1:
            return []
        return [(part.key, part.start, part.stop) for part in tensor.partitions]

    def push_payloads(self, name, payloads, ctx=None, priority=0) -> Handle:
        """Reduce ``name`` from payloads the caller compressed itself (one uint8 array or
        tensor per partition of ``partitions(name)``); ``wait()`` returns, per partition, what
        ``gathers_payloads`` says, undecoded: the caller decodes where its tensor lives."""
        raise NotImplementedError(f"{type(self).__name__} does not take compressed payloads")

    @abc.abstractmethod
    def reduce(self, array, name, average=True, priority=0, ctx=None, out=None, lr=None) -> Handle:
        """Sum (or average) ``array`` over all workers into ``out`` (default: in place), through
        ``name``'s codec and reducer. ``ctx`` is the step context (lr, step, epoch, per-step codec
        keys) every codec and reducer of this round sees, on every worker and server; ``lr`` sets
        its learning rate (error feedback rescales by it). Returns at once; ``wait()`` gives the
        result. One reduce of a name at a time."""

    def push_pull(self, array, name, average=True, priority=0, ctx=None, out=None, lr=None) -> Handle:
        """BytePS's name for ``reduce``."""
        return self.reduce(array, name, average=average, priority=priority, ctx=ctx, out=out, lr=lr)

    @abc.abstractmethod
    def all_reduce(self, array, average=False):
        """A plain in-place sum (or average) of ``array`` over all workers, now: no codec, no
        declaration (PowerSGD's phases, local SGD's model difference). Returns ``array``."""

    def drain(self):
        """Returns once every reduce this rank started has gone out: after it, the caller may
        issue its own collectives on the same links. A transport whose reductions never share
        a channel with the caller's needs nothing here."""
        self.check_alive()

    # whether ``wait(work, what)`` watches torch.distributed works issued beside this
    # communicator (a DDP hook's): only a communicator on torch.distributed does
    watches_works = False

    def issue(self, work, group=None):
        """Count a torch.distributed collective issued beside this communicator on ``group``
        (None: every rank's), before ``wait``: what a departed peer is compared with. Returns
        ``work``. A communicator that does not watch works counts nothing."""
        return work

    def wait(self, work, what, *, group=None):
        """Wait for a torch.distributed ``work`` issued beside this communicator, watching the
        job's liveness: a dead or departed peer (of ``group``, where ``issue`` counted it)
        raises NodeFailure naming it (``what`` names the work, or is a function making the name)."""
        raise NotImplementedError(f"{type(self).__name__} does not watch torch.distributed works")

    # whether reductions run on torch.distributed process groups, so that a binding may average
    # named tensors over any group of ranks (bps_gc.torch's CompressedExchange); False: every
    # reduce spans all workers, by declared name (the parameter server's push and pull)
    reduces_on_process_groups = False

    # whether servers run declared reducers and keep their state (``server_values``): the
    # parameter server with servers to reach; not torch.distributed, nor a worker alone
    runs_server_reducers = False

    # whether ``declare`` takes ``one_per_host``: tensors that one local rank of each host pushes
    # alone, summed over the hosts (the parameter server: its servers count one push per host)
    pushes_one_per_host = False

    def averaged_over(self, tensor, size=None):
        """How many pushes an average of ``tensor`` (its placement.TensorPlan) divides by: every
        worker's, or, for a tensor declared ``one_per_host``, the hosts'; ``size``: the workers
        (BPS_GC_ELASTIC: a round group's members), else this communicator's."""
        size = self.size if size is None else size
        return size // self.local_size if tensor.pushed_by is not None else size

    # whether ``reduce_tensor`` sums uncompressed torch tensors where they live
    sums_tensors_on_device = False
    # whether every server sums float16 and bfloat16 pushes in float32 and averages them
    # (wire/half.py: dense tensors the servers sum as pushed, FSDP's shards among them)
    sums_half = False

    def reduce_tensor(self, tensor, name, average=True) -> Handle:
        """Sum (or average) an uncompressed torch tensor over all workers in place, on its device."""
        raise NotImplementedError(f"{type(self).__name__} sums dense tensors on the host")

    @abc.abstractmethod
    def broadcast(self, array, root_rank, name):
        """Every worker ends with ``root_rank``'s ``array`` (in place); returns it."""

    @abc.abstractmethod
    def barrier(self):
        """Returns once every worker called it, and every declaration made before it is in
        place where it is kept (the servers): after it any worker may ask for a key's state."""

    @abc.abstractmethod
    def send(self, rank, name, payload) -> Handle:
        """Send bytes (or a contiguous array's bytes) to worker ``rank`` under ``name``.
        Messages between two workers under one name arrive in order."""

    @abc.abstractmethod
    def recv(self, rank, name, timeout=None):
        """The next message worker ``rank`` sent under ``name``, as a uint8 numpy array."""

    @abc.abstractmethod
    def metrics(self):
        """Bytes and seconds since the last call (and reset them)."""

    @abc.abstractmethod
    def shutdown(self):
        """Leave the job; every worker calling it after the same work ends with status 0."""

    # why no job can start in this process after ``shutdown`` (core.init refuses, naming it), or
    # None where one can: the parameter server's scheduler ends the job once its workers left
    why_no_job_after_shutdown = ("the parameter server's scheduler ended the job when its workers shut down: start "
                                 "the next job in a new process")

    def abandon(self, reason):
        """The training script is ending on an uncaught ``reason`` (an exception's name):
        the shutdown that follows tells the others this rank failed, where it can."""

    def peer_failure(self, error):
        """The job failure (a NodeFailure) behind ``error``, an exception raised outside bps_gc
        (a collective of FSDP2's own failing on a peer's closed socket), when this communicator
        can name the peer that died or left; else None."""
        return None
