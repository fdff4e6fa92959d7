"""One key (tensor partition) on a server: its declaration, receive buffers, rounds and result.

Sync mode: every worker pushes round r once; the round completes when all have pushed. The
result of an uncompressed key is the sum of the pushes in worker-rank order (so it does not
depend on arrival order); a compressed key's reply is made by its reducer (compress.reducers:
recompress, lossless, majority ...) from the pushes in rank order and the round's step
context (the lowest rank's; all workers push the same). Dense results alternate between two
buffers: round r+2 cannot start before every worker has received round r+1, hence
round r, so a reply is never overwritten while a worker can still be reading it.
Async mode: each push is applied to a stored tensor at once and answered with a snapshot.
A float16 or bfloat16 key (wire/half.py) is summed in float32, in the same order, divided by
the round's pushers when its pushes ask (``SERVER_MEAN``), and rounded back once (nearest,
ties to even); its async store is float32.

Shared memory (wire/shm.py): a worker on the server's host may offer, at INIT, a slot it
writes its pushes into; its pushes then carry the SHM flag and no payload, the sum reads the
slot in place, and the reply names the result buffer (the two alternating buffers, kept in the
server's shared arena) instead of carrying it. Each push says where its data is, so a worker
may mix both ways (a fused push carries its data).
"""
import numpy as np

from ...wire.half import HALF, SERVER_MEAN, round_into, to_float32
from ...wire.shm import ShmUnavailable
from ...wire.wire import COMPRESSED_BIT, SHM_BIT, MalformedMessage
from .records import Pusher, TakenRound


class KeyConflict(ValueError):
    """A worker's request conflicts with the key's declaration; sent back as an ERROR."""


class KeyState:
    def __init__(self, key, decl, dtype, workers, codecs, asynchronous, per_host=1, scratch=None):
        """``workers``: the pushers of each round; ``per_host``: worker ranks per pusher (two
        levels: a host's one push; docs/local_ranks.md); ``scratch``: the server's
        compress.Scratch, which every key's reducer takes its in-call buffers from (a sum, a
        decoded push: per engine thread, the largest key's size) instead of keeping its own."""
        self.key, self.decl, self.dtype = key, decl, np.dtype(dtype)
        self.per_host = per_host
        self.n = int(decl["n"])
        self.workers, self.asynchronous = workers, asynchronous
        self.params = codecs.CompressionParams.from_dict(decl.get("params") or {})
        self.compressed = self.params.compressed
        self.reducer_name = codecs.choose_reducer(self.params, decl.get("reducer"))
        self.reducer = codecs.make_reducer(self.reducer_name, self.params, self.n, self.dtype, key) \
            if self.compressed else None
        codecs.use_scratch(self.reducer, scratch)  # no reducer (dense) or no scratch: nothing to hand
        self.max_payload = 8 * self.n + 64 if self.compressed else self.n * self.dtype.itemsize
        self.buffers = [None] * workers
        self.lengths = [0] * workers
        self.identities = [None] * workers
        self.ctxs = [None] * workers  # each push's step context
        self.rounds = [0] * workers  # async replies echo each push's round
        self.pending = [False] * workers
        self.shm_slots = [None] * workers  # read-only views of the slots workers offered
        self.via_shm = [False] * workers  # whether this round's push is in the slot
        self.result_offer = None  # where the results are in the server's arena, if shared
        self.declared = set()
        self.arrived = 0
        self.expected = workers  # pushes that complete a round (BPS_GC_ELASTIC: the members')
        # BPS_GC_ELASTIC (rounds.py): the membership epoch its rounds are summed in, whether the
        # open round is summed again, and the reducer's state before the last round
        self.elastic, self.epoch, self.redo, self.snapshot = False, 0, False, None
        self.round = 0
        self.results = None
        self.half = self.dtype in HALF
        self.store = np.zeros(self.n, np.float32 if self.half else self.dtype) if asynchronous else None
        self.engine = None  # the server engine thread that owns this key (set by the server)

    def slot(self, rank):
        """The pusher a worker rank pushes as."""
        return rank // self.per_host

    def check_declaration(self, decl, dtype, rank):
        """Every worker must declare the key alike; otherwise the offender gets an error."""
        problems = []
        if np.dtype(dtype) != self.dtype:
            problems.append(f"dtype {np.dtype(dtype)} != {self.dtype}")
        if int(decl.get("n", -1)) != self.n:
            problems.append(f"{decl.get('n')} elements != {self.n}")
        if decl.get("name") != self.decl.get("name"):
            problems.append(f"name {decl.get('name')!r} != {self.decl.get('name')!r}")
        if (decl.get("params") or {}) != (self.decl.get("params") or {}):
            problems.append(f"compression {decl.get('params')} != {self.decl.get('params')}")
        if decl.get("pushers") != self.decl.get("pushers"):
            problems.append(f"pushers {decl.get('pushers')!r} != {self.decl.get('pushers')!r}")
        if decl.get("reducer") != self.decl.get("reducer"):
            problems.append(f"reducer {decl.get('reducer')!r} != {self.decl.get('reducer')!r}")
        if problems:
            raise KeyConflict(f"worker {rank} declared key {self.key} ({self.decl.get('name')!r}) "
                            f"differently from the first worker: {'; '.join(problems)}")
        self.declared.add(rank)

    def attach_shm(self, rank, slot, arena):
        """Take worker ``rank``'s shared slot (a uint8 view of one push); returns the offer of
        the result buffers it reads the replies from."""
        if self.compressed or self.asynchronous:
            raise ShmUnavailable("only synchronous uncompressed keys use shared memory")
        if self.result_offer is None:
            nbytes = self.n * self.dtype.itemsize
            self.result_offer, memory = arena.allocate(2 * nbytes)
            self.results = [memory[:nbytes].view(self.dtype), memory[nbytes:].view(self.dtype)]
        self.shm_slots[rank] = slot
        return self.result_offer

    def check_push(self, rank, header):
        """A push's header agrees with the declaration and this round; MalformedMessage if not."""
        if rank not in self.declared:
            raise MalformedMessage(f"worker {rank} pushed key {self.key} without declaring it")
        if self.pending[rank]:
            raise MalformedMessage(f"worker {rank} pushed key {self.key} twice in round {self.round}")
        if header.dtype != self.dtype:
            raise MalformedMessage(f"push of key {self.key} as {header.dtype}, declared {self.dtype}")
        if header.round != self.round and not self.asynchronous:
            raise MalformedMessage(f"push of key {self.key} for round {header.round}, server is at {self.round}")
        if bool(header.flags & COMPRESSED_BIT) != self.compressed:
            raise MalformedMessage(f"push of key {self.key}: compression flag does not match the declaration")
        length = header.length
        if header.flags & SHM_BIT:
            if self.shm_slots[rank] is None or length:
                raise MalformedMessage(f"shared-memory push of key {self.key} from worker {rank}, "
                                       "which offered no slot, or with a payload")
        elif (self.compressed and not 0 <= length <= self.max_payload) or \
                (not self.compressed and length != self.max_payload):
            raise MalformedMessage(f"push of key {self.key} with {length} bytes (limit {self.max_payload})")

    def buffer_for(self, rank, header):
        """Where worker ``rank``'s push payload is received (reused across rounds)."""
        self.check_push(rank, header)
        length = header.length
        buf = self.buffers[rank]
        if buf is None or buf.size < length:
            # dense: exactly one tensor; compressed: grown with headroom as payload sizes vary
            buf = self.buffers[rank] = np.empty(min(self.max_payload, length * 5 // 4 + 64)
                                                if self.compressed else length, np.uint8)
        return memoryview(buf)[:length]

    def arrive(self, rank, identity, header):
        """Record a received push; returns True when the round is complete (or async)."""
        self.pending[rank] = True
        self.identities[rank] = identity
        self.via_shm[rank] = bool(header.flags & SHM_BIT)
        self.lengths[rank] = header.length
        self.ctxs[rank] = header.ctx
        self.rounds[rank] = header.round
        self.arrived += 1
        return self.asynchronous or self.arrived == self.expected

    def take_round(self):
        """Snapshot what the engine needs for this round (a records.TakenRound) and start the next one."""
        ranks = [r for r in range(self.workers) if self.pending[r]]
        job = TakenRound(self, self.round, ranks,
                         [Pusher(self.identities[r], self.rounds[r], self.via_shm[r]) for r in ranks],
                         self.epoch, self.redo)
        self.redo = False
        for r in ranks:
            self.pending[r] = False
        self.arrived = 0
        if not self.asynchronous:
            self.round += 1
        return job

    # ---------------------------------------------------------------- engine side

    def payload(self, rank):
        return self.shm_slots[rank] if self.via_shm[rank] else self.buffers[rank][: self.lengths[rank]]

    def add(self, rank, acc):
        """acc += the decoded push of ``rank`` (sparse codecs touch only their k positions)."""
        if not self.compressed:
            acc += to_float32(self.payload(rank), self.dtype) if self.half else self.payload(rank).view(self.dtype)
            return
        try:
            self.reducer.decoder.decompress_add(self.payload(rank), acc)
        except ValueError as e:
            raise KeyConflict(f"worker {rank} sent a malformed {self.params.compressor} payload "
                            f"for key {self.key}: {e}") from None

    def compute(self, round_, ranks):
        """The bytes every worker of this round receives."""
        if self.asynchronous:
            for r in ranks:
                self.add(r, self.store)
            # the snapshot no later push can change
            return round_into(self.store, np.empty(self.n, self.dtype)) if self.half else self.store.copy()
        if self.compressed:
            try:
                ctx = self.ctxs[ranks[0]]
                if self.elastic and ctx:  # BPS_GC_ELASTIC: the members that pushed (a redo's fewer)
                    ctx = {**ctx, "pushes": len(ranks)}
                return self.reducer.reduce([self.payload(r) for r in ranks], True, ctx)
            except ValueError as e:
                raise KeyConflict(f"key {self.key} ({self.params.compressor}, reducer "
                                f"{self.reducer_name}): a malformed payload: {e}") from None
        if self.results is None:
            self.results = [np.empty(self.n, self.dtype), np.empty(self.n, self.dtype)]
        acc = self.results[round_ % 2]
        if self.half:  # summed in float32 in worker-rank order, rounded once (wire/half.py)
            total = to_float32(self.payload(ranks[0]), self.dtype)
            for r in ranks[1:]:
                self.add(r, total)
            if (self.ctxs[ranks[0]] or {}).get(SERVER_MEAN):  # the lowest rank's context: workers average alike
                total /= np.float32(len(ranks))
            return round_into(total, acc)
        # in worker-rank order: raw pushes are copied then added
        if len(ranks) == 1:
            np.copyto(acc, self.payload(ranks[0]).view(self.dtype))
            rest = []
        else:  # x0 + x1 in one pass (exactly what copying x0 and adding x1 gives)
            np.add(self.payload(ranks[0]).view(self.dtype), self.payload(ranks[1]).view(self.dtype), out=acc)
            rest = ranks[2:]
        for r in rest:
            self.add(r, acc)
        return acc
