"""How a declared tensor is cut into partitions (keys) and spread over the servers.

Key = declaration index << 16 | partition index; a tensor that one local rank of each host
pushes alone (``pushed_by``: its own FSDP shard) has keys of that local rank's own range
(``key_base``), since each local rank declares its own shards under the same indices.

Partitions hold BYTEPS_PARTITION_BYTES of the wire dtype, uncompressed ones at most
BPS_GC_DENSE_PARTITION_BYTES (``dense_bytes``): a server answers a partition only once every
worker's push of it is in, so the last partitions' replies are a tail in which the links are
partly idle, and smaller ones shorten it (and place more evenly); codecs keep the partitions
they are defined over. Servers are chosen greedily
by bytes in declaration order, which every worker shares, so all agree without talking; a
tensor declared without its shape is placed by key (round-robin) when its first push_pull
reveals the size.

A zero-size tensor has no partitions: its push_pull completes at once on every worker.
"""
import numpy as np

from ..wire.bfloat16 import BFLOAT16
from ..wire.sockets import host_of
from .declaration import Declaration

MAX_PARTITIONS = 1 << 16
PUSHED_BY_KEYS = 1 << 56  # keys of tensors pushed by one local rank per host: ``key_base``
DENSE_PARTITION_BYTES = 1_024_000  # uncompressed partitions of a job that spans hosts (unless set)


def dense_partition_bytes(cfg, book):
    """BPS_GC_DENSE_PARTITION_BYTES if set; else 1 MB when the job's nodes are on more than one
    host, where the shorter tail pays; on one host, where no link has a tail and dense
    partitions go through shared memory, BYTEPS_PARTITION_BYTES (fewer partitions, less
    per-partition work). Every worker decides alike: they share the address book."""
    if cfg.dense_partition_bytes is not None:
        return cfg.dense_partition_bytes
    hosts = {host_of(entry["address"]) for entry in book["servers"] + book["workers"]}
    return DENSE_PARTITION_BYTES if len(hosts) > 1 else cfg.partition_bytes


class Partition:
    """``codec``/``reducer``: the worker's chain and the reducer decoding the pull (None for
    uncompressed partitions, which the server sums)."""

    __slots__ = ("key", "start", "stop", "server", "codec", "reducer", "round")

    def __init__(self, key, start, stop, server, codec, reducer):
        self.key, self.start, self.stop, self.server = key, start, stop, server
        self.codec, self.reducer = codec, reducer
        self.round = 0

    @property
    def n(self):
        return self.stop - self.start


class TensorPlan:
    """A declared tensor: its compression and, once the size is known, its partitions."""

    def __init__(self, name, index, params, reducer, pushed_by=None):
        self.name, self.index, self.params, self.reducer = name, index, params, reducer
        # the one local rank of each host that pushes it (its own shard; the servers count one
        # push per host), or None: every rank reduces it
        self.pushed_by = pushed_by
        self.shape = self.dtype = self.wire_dtype = None
        self.partitions = []
        self.compressed = False
        self.busy = False
        self.auxiliary = False  # a phase buffer of another tensor (comm/phased.py): no raw bytes
        self.local = False  # summed by the workers in shared memory (ps/worker/local.py)

    def declaration(self):
        return Declaration(self.name, self.shape, self.dtype, self.params, self.reducer,
                           self.compressed, self.wire_dtype)

    def key_base(self):
        """What its keys add to ``index << 16 | partition``: 0, or, for a tensor pushed by one
        local rank per host, a range of that local rank's own (the host's other local ranks
        declare other tensors, their own shards, under the same indices)."""
        return 0 if self.pushed_by is None else PUSHED_BY_KEYS | self.pushed_by << 48

    def check_redeclaration(self, params, reducer, shape, dtype, pushed_by=None):
        """Declaring a name again must repeat what it was declared with."""
        problems = []
        if pushed_by != self.pushed_by:
            problems.append(f"pushed_by {pushed_by!r} != {self.pushed_by!r}")
        if params != self.params:
            problems.append(f"compression {params.to_dict()} != {self.params.to_dict()}")
        if reducer != self.reducer:
            problems.append(f"reducer {reducer!r} != {self.reducer!r}")
        if shape is not None and self.shape is not None and tuple(shape) != self.shape:
            problems.append(f"shape {tuple(shape)} != {self.shape}")
        if dtype is not None and self.dtype is not None and dtype != self.dtype:
            problems.append(f"dtype {dtype} != {self.dtype}")
        if problems:
            raise ValueError(f"declare: tensor {self.name!r} was declared before differently: "
                             f"{'; '.join(problems)}")

    @property
    def size(self):
        return int(np.prod(self.shape)) if self.shape is not None else None

    def describe(self, partition):
        params = self.params.to_dict() if self.compressed else {}
        decl = {"name": f"{self.name}#{partition.key & (MAX_PARTITIONS - 1)}", "n": partition.n,
                "params": params}
        if self.compressed:
            decl["reducer"] = self.reducer
        return decl


class Placement:
    """Cuts tensors into partitions and assigns each to a server, identically on all workers."""

    def __init__(self, num_servers, partition_bytes, min_compress_bytes, dense_bytes=None):
        self.num_servers = num_servers
        self.partition_bytes = partition_bytes
        self.dense_bytes = partition_bytes if dense_bytes is None else min(partition_bytes, dense_bytes)
        self.min_compress_bytes = min_compress_bytes
        self.load = [0] * num_servers

    def plan(self, tensor, shape, dtype, build_codec, balanced):
        dtype = np.dtype(dtype)
        tensor.shape, tensor.dtype = tuple(int(s) for s in shape), dtype
        tensor.wire_dtype = np.dtype(np.float16) if tensor.params.fp16 else dtype
        size = tensor.size
        # a codec that saves no bytes (identity: chosen for its reducer) is compressed at any size
        tensor.compressed = tensor.params.compressed and (size * dtype.itemsize >= self.min_compress_bytes
                                                      or not tensor.params.raw_when_small)
        limit = self.partition_bytes if tensor.compressed else self.dense_bytes
        per = max(1, limit // tensor.wire_dtype.itemsize)
        count = -(-size // per)
        if count > MAX_PARTITIONS:
            raise ValueError(f"tensor {tensor.name!r} needs {count} partitions; raise BYTEPS_PARTITION_BYTES"
                             + ("" if tensor.compressed else " and BPS_GC_DENSE_PARTITION_BYTES"))
        for p in range(count):
            key = tensor.key_base() | tensor.index << 16 | p
            start, stop = p * per, min(size, (p + 1) * per)
            if balanced:
                server = min(range(self.num_servers), key=lambda s: (self.load[s], s))
            else:
                server = (tensor.index + p) % self.num_servers
            self.load[server] += (stop - start) * tensor.wire_dtype.itemsize
            codec, reducer = build_codec(tensor, stop - start, tensor.wire_dtype, key) \
                if tensor.compressed else (None, None)
            tensor.partitions.append(Partition(key, start, stop, server, codec, reducer))
        return tensor


def declare_tensor(tensors, codecs, name, shape, dtype, reducer, compression, pushed_by=None):
    """The checks of ``declare`` that every communicator shares. Returns (tensor, shape, dtype):
    shape and dtype normalized, or None when the tensor waits for its first push_pull; an
    earlier declaration is returned as is after checking it says the same. ``pushed_by``: this
    rank's local rank for a tensor that it alone pushes on its host (``one_per_host``), or None."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"declare: name must be a non-empty string, got {name!r}")
    if pushed_by is not None and not 0 <= pushed_by < 256:  # its keys' range (TensorPlan.key_base)
        raise ValueError(f"declare({name!r}, one_per_host=True): local rank {pushed_by}; at most 256 local ranks")
    params = codecs.CompressionParams.from_dict(compression)
    reducer_name = codecs.choose_reducer(params, reducer)
    shape = None if shape is None else tuple(int(s) for s in (shape if np.ndim(shape) else (shape,)))
    dtype = None if shape is None and dtype is None else np.dtype(dtype or np.float32)
    existing = tensors.get(name)
    if existing is not None:
        existing.check_redeclaration(params, reducer_name, shape, dtype, pushed_by)
        return existing, None, None
    tensor = TensorPlan(name, len(tensors), params, reducer_name, pushed_by)
    tensors[name] = tensor
    return tensor, shape, dtype


class DtypeRefused(TypeError):
    """check_dtype's refusal: a binding that can offer its own way around it (torch's bfloat16:
    autocast, the DDP hook) catches this, not any TypeError by its text."""


def check_dtype(tensor, dtype, pushed_as_is=False):
    """``pushed_as_is``: whether every rank's own push of ``tensor`` would reach the parameter
    servers as it is (no host sums it first), so that a bfloat16 one may be every rank's."""
    if tensor.auxiliary and dtype == np.int64:  # thc's words on servers that add int64 (comm/phased.py)
        return
    if dtype == BFLOAT16:  # the servers sum it (wire/bfloat16.py); no codec, no sum in shared memory
        if tensor.params.compressed or tensor.params.fp16 or tensor.pushed_by is None and not pushed_as_is:
            raise DtypeRefused(f"{tensor.name!r}: bfloat16 is pushed dense, as one local rank's own tensor "
                            "(one_per_host, an FSDP shard) or, on the parameter server with no host's sum "
                            "(BPS_GC_LOCAL_REDUCE, two levels), every worker's; declare it float32 to "
                            "compress it or sum it on the host")
        return
    if dtype not in (np.float32, np.float64, np.float16):
        raise DtypeRefused(f"{tensor.name!r}: dtype {dtype} is not supported (float16/32/64)")


def resolve_reduce_call(tensors, name, array, out):
    """The checks of ``push_pull`` every communicator shares: returns (tensor, array, out,
    place), ``place`` True when the tensor still needs its partitions (first use)."""
    tensor = tensors.get(name)
    if tensor is None:
        raise KeyError(f"push_pull: {name!r} was not declared; call declare({name!r}, ...) first")
    array = np.asarray(array)
    out = array if out is None else out
    if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"push_pull({name!r}): the output must be a writable C-contiguous numpy array")
    if out.shape != array.shape:
        raise ValueError(f"push_pull({name!r}): out has shape {out.shape}, input {array.shape}")
    if tensor.shape is not None and (tuple(array.shape) != tensor.shape or array.dtype != tensor.dtype):
        raise ValueError(f"push_pull({name!r}): got {array.shape} {array.dtype}, but it was first "
                         f"used as {tensor.shape} {tensor.dtype}")
    return tensor, array, out, tensor.shape is None


def partition_owner(index, p, local_size):
    """The local rank that sums, compresses and sends partition ``p`` of the tensor declared
    ``index``-th (both transports' two levels: the same owner keeps the same codec state)."""
    return (index + p) % local_size
