"""The parameter-server worker's codec state: ``Worker.state_dict()`` / ``load_state_dict(sd)``.

A rank's state (docs/checkpoint.md, "On the parameter server") is one flat dict that
``encode_state`` writes:

* ``meta.*``: the transport, world size, rank, local size and hierarchy it was saved with;
* ``worker/<StateGroup of tensor name -> partition -> codec chain>``: this rank's chains;
* ``server/<StateGroup of tensor name -> partition -> reducer>``: the servers' state of the keys
  this rank restores (``restores``): rank 0 in a flat job, the partition's owner on the first
  worker host with two levels, i.e. the rank that pushes the key first in rank order.

State is keyed by tensor name and partition index, not by server, so a job may resume with
another server count (each key's state goes to the server that owns it now); partitions
depend on BYTEPS_PARTITION_BYTES only, and another partition count is refused naming both.
The codec library is ``worker.codecs`` (the parameter server never imports it).
"""
import logging
import os
import sys
import threading

from ...wire.sockets import send
from ...wire.wire import MAX_JSON, Header, Msg, decode_json
from ...comm.phased import phases
from .commands import SendState

log = logging.getLogger("bps_gc.worker")
DROP_RANK_STATE = "BPS_GC_RESUME_DROP_RANK_STATE"
STATE_REPLIES = (Msg.STATE_REPLY, Msg.STATE_ERROR)
WAIT_SECONDS = 0.2


class StateRequest:
    def __init__(self, key, server, payload):
        self.key, self.server, self.payload = key, server, payload
        self.done = threading.Event()
        self.result = self.error = None

    def finish(self, result=None, error=None):
        self.result, self.error = result, error
        self.done.set()


class StateRequests:
    """The state requests a worker's I/O thread has sent and awaits replies to (by key)."""

    def __init__(self, links, rank):
        """``links``: the I/O thread's DEALER socket per server; ``rank``: this worker's."""
        self.links, self.rank = links, rank
        self.pending = {}

    def send(self, request):
        """(I/O thread) STATE_GET (no payload) or STATE_PUT of ``request``."""
        self.pending[request.key] = request
        kind = Msg.STATE_GET if request.payload is None else Msg.STATE_PUT
        send(self.links[request.server], Header(kind, self.rank, key=request.key), request.payload)

    def reply(self, header, payload):
        request = self.pending.pop(header.key, None)
        if request is None:
            return log.warning("dropped an unexpected %s for key %d", header.type.name, header.key)
        if header.type == Msg.STATE_ERROR:
            try:
                message = decode_json(payload or b"{}").get("message", "refused")
            except ValueError:
                message = "refused (an unreadable error)"
            return request.finish(error=message)
        request.finish(result=bytes(payload or b""))


def exchange(worker, requests):
    """Send ``requests`` through the I/O thread and wait for every reply; a refusal raises
    StateError naming it, a failed job its NodeFailure."""
    for request in requests:
        worker.io.post(SendState(request))
    for request in requests:
        while not request.done.wait(WAIT_SECONDS):
            worker.check_alive()
        if request.error is not None:
            raise worker.codecs.StateError(f"server {request.server}: {request.error}")
    return [request.result for request in requests]


def stateful_tensors(worker):
    """The declared tensors whose partitions keep codec state (compressed, placed, not a phase
    buffer), by name."""
    return {name: t for name, t in worker.tensors.items()
            if not t.auxiliary and any(part.codec is not None for part in t.partitions)}


def chain_group(codecs, tensors):
    """The worker chains of ``tensors`` as one StateGroup: name -> partition index -> chain."""
    return codecs.StateGroup({name: codecs.StateGroup({str(p): part.codec for p, part
                                                       in enumerate(t.partitions)})
                              for name, t in tensors.items()})


def restores(worker, tensor):
    """The partitions of ``tensor`` whose server state this rank saves and restores."""
    if phases(tensor) > 1 or worker.cfg.enable_async:  # dense phase sums; async's running
        return []  # sum on the servers is not codec state a checkpoint holds (docs/checkpoint.md)
    if tensor.pushed_by is not None:  # this local rank's own: the first host's pushes first
        return tensor.partitions if worker.rank < worker.local_size else []
    if worker.host is not None and worker.host.carries(tensor):
        return worker.host.owned(tensor) if worker.cfg.worker_id == 0 else []
    return tensor.partitions if worker.rank == 0 else []


def meta(worker):
    return {"meta.transport": "ps", "meta.size": worker.size, "meta.rank": worker.rank,
            "meta.local_size": worker.local_size,
            "meta.hierarchy": "host" if worker.host is not None else "flat"}


def prefixed(prefix, sd):
    return {prefix + k: v for k, v in sd.items()}


def section(sd, prefix):
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def check_idle(worker, doing):
    worker.check_alive()
    busy = [name for name, t in worker.tensors.items() if t.busy]
    if busy:
        raise RuntimeError(f"{doing} while push_pull({busy[0]!r}) is running; wait for it first")


def state_dict(worker):
    """This rank's codec state and the servers' state it restores (module doc)."""
    check_idle(worker, "state_dict()")
    codecs, tensors = worker.codecs, stateful_tensors(worker)
    sd = {**meta(worker), **prefixed("worker/", chain_group(codecs, tensors).state_dict())}
    wanted = [(name, t.partitions.index(part), part) for name, t in tensors.items()
              for part in restores(worker, t)]
    if wanted and worker.io is not None:
        replies = exchange(worker, [StateRequest(part.key, part.server, None) for _, _, part in wanted])
        for (name, p, _), data in zip(wanted, replies):
            sd.update(prefixed("server/", _group_keys(f"{name}/{p}/", codecs.decode_state(data))))
    return sd


def _group_keys(prefix, sd):
    """A member's state dict under ``prefix`` as StateGroup writes it (identity keys first)."""
    return {(f"identity.{prefix}{k[len('identity.'):]}" if k.startswith("identity.")
             else prefix + k): v for k, v in sd.items()}


def _bare(key):
    return key[len("identity."):] if key.startswith("identity.") else key


def _names(sd):
    """The tensor names of a StateGroup-of-groups state dict (keys ``name/p/key``)."""
    return {_bare(k).rsplit("/", 2)[0] for k in sd}


def member(sd, prefix):
    """The state dict of the group member under ``prefix`` (``name/p/``)."""
    out = {}
    for k, v in sd.items():
        if k.startswith("identity." + prefix):
            out["identity." + k[len("identity." + prefix):]] = v
        elif k.startswith(prefix):
            out[k[len(prefix):]] = v
    return out


def load_state_dict(worker, sd):
    """Restore a state saved by ``state_dict`` on this rank: checks everything, then loads this
    rank's chains, then sends each restored key's state to its server (module doc)."""
    codecs = worker.codecs
    StateError = codecs.StateError
    if not hasattr(sd, "items"):
        raise StateError(f"a state dict must be a mapping, got {type(sd).__name__}")
    check_idle(worker, "load_state_dict()")
    keep_rank_state = check_meta(worker, sd)
    tensors = stateful_tensors(worker)
    started = [name for name, t in tensors.items() if any(part.round for part in t.partitions)]
    if started:
        raise StateError(f"load_state_dict() after the first push_pull of {started[0]!r}: "
                         "load the state right after declaring the tensors")
    workers_sd, servers_sd = section(sd, "worker/"), section(sd, "server/")
    check_names(worker, tensors, workers_sd, servers_sd, keep_rank_state)
    # the servers' part, checked here against reducers like theirs before anything is loaded
    todo, dropped = [], 0
    for name, t in tensors.items():
        for part in restores(worker, t):
            p = t.partitions.index(part)
            mine = member(servers_sd, f"{name}/{p}/")
            if not mine:
                if keep_rank_state:
                    raise StateError(f"the state lacks the servers' state of {name!r} partition {p}, "
                                     f"which rank {worker.rank} restores (load each rank's own state)")
                dropped += 1
                continue
            reducer = codecs.make_reducer(t.reducer, t.params, part.n, t.wire_dtype, part.key)
            try:
                reducer.load_state_dict(mine)
            except StateError as e:
                raise StateError(f"the servers' state of {name!r} partition {p}: {e}") from None
            todo.append(StateRequest(part.key, part.server, codecs.encode_state(reducer.state_dict())))
    limit = max(4 * worker.cfg.partition_bytes, MAX_JSON)  # a server takes more (server.py)
    for request in todo:
        if len(request.payload) > limit:
            raise StateError(f"the server state of key {request.key} is {len(request.payload)} "
                             f"bytes, more than a server takes ({limit}: 4 x BYTEPS_PARTITION_BYTES)")
    if keep_rank_state:
        chain_group(codecs, tensors).load_state_dict(workers_sd)
    if todo and worker.io is not None:
        exchange(worker, todo)
    if dropped:
        log.warning("%s: %d partition(s) keep fresh server state (not in this rank's state)",
                    DROP_RANK_STATE, dropped)


def check_meta(worker, sd):
    """The saved job against this one; True to load this rank's chains, False to drop them
    (another job shape with BPS_GC_RESUME_DROP_RANK_STATE=1: one warning line)."""
    StateError = worker.codecs.StateError
    if sd.get("meta.transport") != "ps":
        raise StateError(f"the state was not saved by a parameter-server worker (meta.transport "
                         f"is {sd.get('meta.transport')!r}, here 'ps')")
    here = meta(worker)
    differs = [k for k in ("meta.size", "meta.local_size", "meta.hierarchy") if sd.get(k) != here[k]]
    if not differs:
        if sd.get("meta.rank") != worker.rank:
            raise StateError(f"the state was saved by rank {sd.get('meta.rank')!r}; this is rank "
                             f"{worker.rank} (each rank loads its own state)")
        return True
    what = {"meta.size": "workers", "meta.local_size": "local ranks per host",
            "meta.hierarchy": "hierarchy"}[differs[0]]
    saved, now = sd.get(differs[0]), here[differs[0]]
    if os.environ.get(DROP_RANK_STATE) == "1":
        print(f"bps_gc: warning: the state was saved with {what} {saved}, this job has {now}: "
              f"dropped rank {worker.rank}'s codec state ({DROP_RANK_STATE}=1)", file=sys.stderr,
              flush=True)
        return False
    raise StateError(f"the state was saved by a job with {what} {saved}; this job has {now} "
                     f"(set {DROP_RANK_STATE}=1 to drop each rank's codec state)")


def check_names(worker, tensors, workers_sd, servers_sd, keep_rank_state):
    """Every tensor the state holds is declared here with codec state, with as many
    partitions; every such tensor here is in the state (StateGroup names a missing one)."""
    StateError = worker.codecs.StateError
    names = _names(workers_sd) | _names(servers_sd)
    undeclared = sorted(n for n in names if n not in tensors)
    if undeclared:
        t = worker.tensors.get(undeclared[0])
        why = "is not declared" if t is None else \
            "is declared without a shape (declare it with shape and dtype first)" if t.shape is None \
            else "keeps no codec state here (uncompressed)"
        raise StateError(f"the state holds tensor {undeclared[0]!r}, which {why}"
                         + (f" ({len(undeclared) - 1} more)" if len(undeclared) > 1 else ""))
    if not keep_rank_state:
        return
    absent = sorted(set(tensors) - _names(workers_sd))
    if absent:
        raise StateError(f"the state lacks tensor {absent[0]!r}, which is declared here with "
                         "codec state" + (f" ({len(absent) - 1} more)" if len(absent) > 1 else ""))
    for name, t in tensors.items():
        saved = {_bare(k).rsplit("/", 2)[1] for k in workers_sd if _bare(k).startswith(name + "/")}
        if saved and len(saved) != len(t.partitions):
            raise StateError(f"tensor {name!r} has {len(saved)} partition(s) in the state, "
                             f"{len(t.partitions)} here (BYTEPS_PARTITION_BYTES differs?)")


def server_values(worker, name, attr):
    """The array ``attr`` of the servers' state of tensor ``name`` (each partition's reducer's,
    e.g. ``outer_sgd``'s ``global_copy``), one array per partition, in order: a StateError
    names a key without it. As of the last round each server completed (key_state.py)."""
    parts = _reducer_partitions(worker, name, attr)
    states = _fetch_states(worker, parts)
    missing = [part.key for part, sd in zip(parts, states) if attr not in sd]
    if missing:
        raise worker.codecs.StateError(f"the servers' state of {name!r} holds no {attr!r} (key {missing[0]})")
    return [sd[attr] for sd in states]


def set_server_values(worker, name, attr, flat):
    """Set ``attr`` of the servers' state of ``name`` to the slices of ``flat`` (its partitions'
    elements, in order), keeping the rest of each state; before the key's first round only.
    Only the partitions this rank restores from a checkpoint (``restores``): with two levels
    another local rank declares a partition it owns, perhaps not yet when this asks, so each
    owner sets its own (every rank of the first host calls it, with the same values)."""
    parts = _reducer_partitions(worker, name, attr)
    owned = restores(worker, worker.tensors[name])
    parts = [part for part in parts if part in owned]
    states = _fetch_states(worker, parts)
    for part, sd in zip(parts, states):
        if attr not in sd or sd[attr].shape != (part.n,):
            raise worker.codecs.StateError(f"the servers' state of {name!r} holds no {attr!r} of "
                                           f"{part.n} elements (key {part.key})")
        sd[attr] = flat[part.start:part.stop].astype(sd[attr].dtype)
    exchange(worker, [StateRequest(part.key, part.server, worker.codecs.encode_state(sd))
                      for part, sd in zip(parts, states)])


def _fetch_states(worker, parts):
    """Each partition's server state, decoded, in order."""
    replies = exchange(worker, [StateRequest(part.key, part.server, None) for part in parts])
    return [worker.codecs.decode_state(data) for data in replies]


def _reducer_partitions(worker, name, attr):
    worker.check_alive()
    tensor = worker.tensors.get(name)
    if worker.io is None:
        raise worker.codecs.StateError(f"this worker trains alone: no servers hold the {attr} of {name!r} "
                                       "(BYTEPS_FORCE_DISTRIBUTED=1 sends through the servers)")
    if tensor is None or not tensor.compressed:
        raise worker.codecs.StateError(f"{name!r} is not a compressed tensor on the servers: no reducer "
                                       f"state holds its {attr}")
    if tensor.busy:  # other tensors may run: a state request waits behind its own key's rounds only
        raise RuntimeError(f"the servers' {attr} of {name!r} while its push_pull is running; wait for it first")
    return tensor.partitions
