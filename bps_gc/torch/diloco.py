"""DiLoCo (Douillard et al., 2023) and Streaming DiLoCo's fragments (2025) over the job's
transport (torch/exchange.py: the compressed exchange on torch.distributed, push_pull through the
servers on the parameter server), the outer step on the servers by default on the parameter
server (``outer_step``, diloco_servers.py), else on the workers:

    opt = bps_gc.torch.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=4e-4), sync_every=50,
                              compression_params={"compressor": "thc", "bits": 4})
    for batch in data:
        loss(model, batch).backward()
        opt.step()
        opt.zero_grad()

Each replica takes ``sync_every`` (H) inner steps alone. Then, for each fragment whose turn it
is, the replicas average its pseudo-gradient (global copy - local parameters, in float32)
through the exchange, with any codec (error feedback carries across outer steps), the outer
optimizer (SGD, lr 0.7, momentum 0.9, Nesterov, as in the paper) steps the global copy with it
as its gradient, and the local parameters become ``alpha * local + (1 - alpha) * global``.
With ``fragments=F`` the parameters are cut into F contiguous fragments, in order, and
fragment f syncs at inner steps ``(f + 1) * H // F`` mod H, so the F exchanges are staggered
over the H steps (Streaming DiLoCo). On torch.distributed a replica may be several ranks:
``replicate`` is the process group the pseudo-gradients are averaged over (default: every
rank); on the parameter server every worker is a replica (a group is refused), or with
``replicate="hosts"`` every host, its local ranks each pushing their own part (diloco_hosts.py).
A model sharded with FSDP2 inside each replica (on either transport): diloco_sharded.py.

A warm phase (``warm_steps=W, warm_every=H0``, docs/diloco.md "A warm phase"): for the first W
inner steps, every H0 steps the whole model's pseudo-gradients go through the same exchange and
codec, and the global copy takes them with lr 1 and no momentum (it becomes the replicas'
average; the local parameters restart from it, whatever alpha); the outer optimizer is untouched,
so it starts afresh at the switch. DiLoCo's schedule then counts from W: fragment f syncs at
inner steps W + (f + 1) * H // F mod H (scripts/diloco_quality.py's --warm-start/--warm-every).
"""
import torch

import bps_gc.core as core

from .diloco_elastic import join as elastic_join
from .diloco_servers import (PLAIN_AVERAGE, SERVERS_GLOBAL, check_servers_step, default_outer_step, server_settings,
                             servers_codec)
from .diloco_hosts import HostPartsExchange
from .diloco_sharded import HostShardsExchange, local, pseudo_gradients, shard_names
from .dtensors import is_dtensor
from .exchange import interruptible_wait, named_exchange


class DiLoCo:
    def __init__(self, model, inner_optimizer, sync_every, outer_optimizer=None, fragments=1, alpha=0.0,
                 compression_params=None, replicate=None, delay=0, outer_step=None, warm_steps=0,
                 warm_every=None):
        """``outer_optimizer(params) -> torch.optim.Optimizer`` builds a fragment's outer
        optimizer over its global copies (default: SGD, lr 0.7, momentum 0.9, Nesterov);
        ``delay`` (tau): the inner steps a fragment's exchange runs in the background before
        its outer step is applied (Streaming DiLoCo's overlap; below H / fragments);
        ``outer_step``: "workers", "servers" (the parameter server's servers take the outer
        SGD step and keep the global copy and momentum: compress/outer.py; the outer optimizer
        must be plain torch.optim.SGD, the codec one that decodes and adds (dense
        pseudo-gradients go through the exact ``identity`` codec, the dense push's bytes); a
        compressed parameter sent raw, below BYTEPS_MIN_COMPRESS_BYTES, takes its outer step
        on the workers), or None (default): "servers" on the parameter server where they can
        take it, else "workers" (torch.distributed, another outer optimizer or codec, a lone
        worker: ``default_outer_step``);
        ``warm_steps`` (W), ``warm_every`` (H0): a warm phase of plain averaging every H0 inner
        steps for the first W (a multiple of H0; each applied ``delay`` steps later, so H0 >
        delay); 0: none; ``replicate``: a process group (torch.distributed), or "hosts" (the
        parameter server: a host's local ranks are one replica, diloco_hosts.py)."""
        if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
            raise ValueError(f"DiLoCo: sync_every must be a whole number of inner steps >= 1, got {sync_every!r}")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(f"DiLoCo: inner_optimizer must be a torch.optim.Optimizer, got "
                            f"{type(inner_optimizer).__name__}")
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if not isinstance(fragments, int) or not 1 <= fragments <= min(len(named), sync_every):
            raise ValueError(f"DiLoCo: fragments must be between 1 and min(parameters {len(named)}, sync_every "
                             f"{sync_every}), got {fragments!r}")
        if not isinstance(delay, int) or isinstance(delay, bool) or not 0 <= delay < sync_every / fragments:
            raise ValueError(f"DiLoCo: delay must be a whole number of inner steps below sync_every / fragments "
                             f"({sync_every} / {fragments}), got {delay!r}")
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"DiLoCo: alpha must be in [0, 1), got {alpha!r}")
        check_warm_phase(warm_steps, warm_every, delay)
        if isinstance(replicate, str) and replicate != "hosts":
            raise ValueError(f"DiLoCo: replicate must be a process group or 'hosts', got {replicate!r}")
        if replicate == "hosts" and (not core.is_initialized() or core.communicator().reduces_on_process_groups):
            raise ValueError("DiLoCo: replicate='hosts' makes each host of the parameter server one replica "
                             "(BPS_GC_TRANSPORT=ps, after bps_gc.torch.init()); on torch.distributed pass the "
                             "replica's process group")
        if outer_step not in (None, "workers", "servers"):
            raise ValueError(f"DiLoCo: outer_step must be 'workers', 'servers' or None (the transport's default), "
                             f"got {outer_step!r}")
        named = shard_names(named, replicate)  # FSDP2's DTensors: each rank's local shard, named by it
        self.inner, self.sync_every, self.alpha, self.replicate = inner_optimizer, sync_every, alpha, replicate
        self.hosts = replicate == "hosts"
        self.delay, self.warm_steps, self.warm_every = delay, warm_steps, warm_every
        make_outer = outer_optimizer or (lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True))
        self.fragments = []
        for f, part in enumerate(fragment_cut(named, fragments)):
            copies = [local(p).detach().float().clone() for _, p in part]
            outer = make_outer(copies)
            if not isinstance(outer, torch.optim.Optimizer):
                raise TypeError(f"DiLoCo: outer_optimizer must return a torch.optim.Optimizer, got "
                                f"{type(outer).__name__}")
            self.fragments.append(Fragment(part, copies, outer, (f + 1) * sync_every // fragments % sync_every))
        outers = [f.outer for f in self.fragments]
        if outer_step == "servers":  # refused here, before anything is declared
            check_servers_step(outers, compression_params)
        self.outer_step = outer_step or default_outer_step(outers, compression_params)
        self.on_servers = self.outer_step == "servers"
        if self.on_servers:  # dense: every element exactly, decoded by the servers' outer_sgd
            compression_params = servers_codec(compression_params)
        # each pseudo-gradient's codec is kept by its parameter and saved under its name; the
        # exchange is the job's transport's (collective: CompressedExchange, on ``replicate``;
        # parameter server: PushPullExchange, over every worker; HostPartsExchange over the hosts)
        reducer = "outer_sgd" if self.on_servers else None
        try:
            if self.hosts:  # a host's replica sharded over its local ranks: each pushes its own shards
                sharded = any(is_dtensor(p) for _, p in named)
                self.exchange = (HostShardsExchange if sharded else HostPartsExchange)(compression_params, named,
                                                                                      reducer)
            else:
                self.exchange = named_exchange(compression_params, [(name, local(p)) for name, p in named], replicate,
                                               reducer=reducer, on_servers=self.on_servers)
        except ValueError as e:
            raise ValueError(f"DiLoCo: {e}") from None
        self.steps = 0  # inner steps taken
        self.elastic = False  # elastic_start was called
        if self.on_servers and not core.joining():  # a joiner pulls the servers' copy (elastic_start)
            self.seed_servers()

    def held_on_servers(self):
        """[(name, global copy)] of the parameters whose global copy the servers hold too
        (outer_step="servers", sent compressed: reducer ``outer_sgd`` keeps it)."""
        if not self.on_servers:
            return []
        return [(name, copy) for f in self.fragments for name, copy in zip(f.names, f.copies)
                if name not in self.exchange.averaged]

    @torch.no_grad()
    def seed_servers(self):
        """The servers' global copies start as worker 0's initial parameters; every worker then
        fetches them and refuses, in one line, initial parameters that are not the same bits.
        Host 0's local ranks seed: each the partitions it owns with two levels (ps/worker/
        codec_state.py), with replicate="hosts" its own parts."""
        held = self.held_on_servers()
        if core.rank() < core.local_size():
            try:
                for name, copy in held:
                    self.exchange.set_server_values(name, SERVERS_GLOBAL, copy)
            except ValueError as e:  # e.g. a lone worker: no servers
                raise ValueError(f"DiLoCo: outer_step='servers': {e}") from None
        core.barrier()  # worker 0's seeds are in place
        for name, copy in held:
            if self.exchange.server_values(name, SERVERS_GLOBAL).numpy().tobytes() != copy.numpy().tobytes():
                raise ValueError(f"DiLoCo: worker {core.rank()}'s initial {name} differs from worker 0's: every "
                                 "replica must start from the same parameters (build the model from one seed)")

    def global_parameters(self):
        """{name: float32 tensor}: the global copy as the servers hold it now (outer_step=
        "servers"), fetched from them: what a worker that joins would pull. It is the state after
        the last outer round the servers completed (``wait()`` first for the rounds in flight);
        parameters sent uncompressed keep their global copy on the workers only, and are absent."""
        if not self.on_servers:
            raise ValueError("DiLoCo: the global parameters are on the servers with outer_step='servers' only; "
                             "this one keeps them on the workers (its fragments' copies)")
        return {name: self.exchange.server_values(name, SERVERS_GLOBAL).view_as(copy)
                for name, copy in self.held_on_servers()}

    def elastic_start(self):
        """BPS_GC_ELASTIC (docs/elastic.md): call once on every worker, after making this and
        before the first step; 0 on a member. A host joining the running job waits to be
        admitted at a fragment's exchange (a round group), takes from a live worker each
        fragment's global copy, outer state and exchange in flight, and the step count, sets its
        parameters to the global copies, starts after the exchange before that one
        (diloco_elastic.py), and returns the exchanges started before its first; its inner
        optimizer and codec state start at zero. With replicate="hosts" each local rank of a
        joining host takes them from its counterpart on a live host (the whole replica's)."""
        if isinstance(self.exchange, HostShardsExchange):
            raise ValueError("DiLoCo: elastic_start: a model sharded with FSDP2 takes no elastic membership "
                             "(BPS_GC_ELASTIC): a joining host's ranks would each need their shard's state")
        self.elastic = True
        return elastic_join(self)

    @property
    def param_groups(self):
        return self.inner.param_groups  # LR schedulers drive the inner optimizer

    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """One inner step; then, for every fragment whose exchange started ``delay`` steps ago,
        its outer step, and for every fragment whose turn it is, its exchange starts (finished
        at once with delay 0)."""
        loss = self.inner.step(closure)
        self.steps += 1
        together = self.elastic and self.steps <= self.warm_steps  # a warm step: one round group
        for fragment in self.fragments:
            self.finish_if_due(fragment)  # first: the warm phase's last may be due at a first turn
            if self.turn_now(fragment) and not together:
                self.start_sync(fragment)
                self.finish_if_due(fragment)
        if together and self.turn_now(self.fragments[0]):  # every fragment's, one call (diloco_elastic.py)
            self.start_sync(*self.fragments)
            for fragment in self.fragments:
                self.finish_if_due(fragment)
        return loss

    def turn_now(self, fragment, steps=None):
        """Whether ``fragment``'s exchange starts after this inner step (or inner step ``steps``):
        in the warm phase every fragment's, every ``warm_every`` steps; after it, at the
        fragment's turn counted from it."""
        steps = self.steps if steps is None else steps
        if steps <= self.warm_steps:
            return steps % self.warm_every == 0
        return (steps - self.warm_steps) % self.sync_every == fragment.turn

    def warm(self, fragment):
        """Whether ``fragment``'s exchange in flight started in the warm phase (plain averaging)."""
        return fragment.due - self.delay <= self.warm_steps

    def finish_if_due(self, fragment):
        if fragment.pending is not None and self.steps == fragment.due:
            self.finish_sync(fragment)

    @torch.no_grad()
    def start_sync(self, fragment, *more):
        """The fragment's pseudo-gradient (with ``more`` fragments': one exchange, a warm step's
        under BPS_GC_ELASTIC), averaged over the replicas in the background."""
        if self.elastic:  # any other exchange in flight is waited for before a join's boundary can
            self.wait()  # come (diloco_elastic.py): the donor sends its average, kept for its due step
        settings = {}
        if self.on_servers:  # the outer optimizer's settings now (a scheduler may change its lr)
            settings = PLAIN_AVERAGE if self.steps <= self.warm_steps else server_settings(fragment.outer)
            # the servers divide the sum by the replicas: a host's one push per part, or each worker's
            settings = {**settings, "outer_workers": core.size() // core.local_size() if self.hosts else core.size()}
        fragments = (fragment, *more)  # each keeps the one future: its average holds every name
        named = [pair for f in fragments for pair in f.named]
        copies = [copy for f in fragments for copy in f.copies]
        if self.hosts:  # each local rank its own part or its own shards only (diloco_hosts.py, diloco_sharded.py)
            pending = self.exchange.start(named, copies, ctx=settings)
        else:
            pseudo = pseudo_gradients(named, copies)
            pending = self.exchange(pseudo, ctx=settings) if self.on_servers else \
                self.exchange(pseudo, group=self.replicate)  # None: every rank
        for f in fragments:
            f.pending, f.due = pending, self.steps + self.delay

    @torch.no_grad()
    def finish_sync(self, fragment):
        """The outer step with the averaged pseudo-gradient; the local parameters reset."""
        warm, averaged = self.warm(fragment), fragment.averaged()
        for copy, name in zip(fragment.copies, fragment.names):
            if self.on_servers and name not in self.exchange.averaged:
                copy += averaged[name]  # the servers' outer update, the same bits on every worker
            elif warm:  # plain averaging: torch's SGD with lr 1 and no momentum (copy - mean)
                copy -= averaged[name]
            else:  # the average: the outer step is taken here (SGD skips the copies without one)
                copy.grad = averaged[name]
        if not warm:
            fragment.outer.step()
            fragment.outer.zero_grad(set_to_none=True)
        alpha = 0.0 if warm else self.alpha  # the warm phase's replicas restart from the average
        for (_, p), copy in zip(fragment.named, fragment.copies):
            p = local(p)  # a DTensor's shard: its own storage
            p.copy_(copy if alpha == 0.0 else alpha * p.float() + (1 - alpha) * copy)
        fragment.pending = fragment.due = None

    def wait(self):
        """Wait for every exchange in flight; each average is kept for its due step, as a
        checkpoint keeps it. Call it before the job shuts down (bps_gc.torch.shutdown(),
        destroy_process_group()) while an exchange may still run: a gloo collective still
        pending when the process exits can abort it."""
        for fragment in self.fragments:
            if fragment.pending is not None:
                fragment.averaged()

    def state_dict(self):
        """The inner optimizer's state, each fragment's global copy and outer state, the step
        count, where the outer step runs (the codec state, and the servers' outer momentum, is
        bps_gc.torch.state_dict()'s)."""
        return {"inner": self.inner.state_dict(), "steps": self.steps, "sync_every": self.sync_every,
                "outer_step": self.outer_step, "warm": [self.warm_steps, self.warm_every],
                "fragments": [{"copies": [c.clone() for c in f.copies], "outer": f.outer.state_dict(),
                               **f.in_flight()} for f in self.fragments]}

    def load_state_dict(self, sd):
        if sd.get("sync_every") != self.sync_every or len(sd.get("fragments", ())) != len(self.fragments):
            raise ValueError(f"DiLoCo: the checkpoint was made with sync_every={sd.get('sync_every')} and "
                             f"{len(sd.get('fragments', ()))} fragments; this one has sync_every={self.sync_every} "
                             f"and {len(self.fragments)}")
        warm = list(sd.get("warm", (0, None)))  # a checkpoint from before the warm phase: none
        if warm != [self.warm_steps, self.warm_every]:
            raise ValueError(f"DiLoCo: the checkpoint was made with warm_steps={warm[0]}, warm_every={warm[1]}; "
                             f"this one has warm_steps={self.warm_steps}, warm_every={self.warm_every}")
        saved = sd.get("outer_step", "workers")
        if saved != self.outer_step:  # the outer state is elsewhere
            raise ValueError(f"DiLoCo: the checkpoint was made with outer_step={saved!r}; this one has "
                             f"outer_step={self.outer_step!r} (make it with outer_step={saved!r} to resume it)")
        self.inner.load_state_dict(sd["inner"])
        self.steps = int(sd["steps"])
        with torch.no_grad():
            for fragment, saved in zip(self.fragments, sd["fragments"]):
                for copy, value in zip(fragment.copies, saved["copies"]):
                    copy.copy_(value)
                fragment.outer.load_state_dict(saved["outer"])
                fragment.land(saved)


def fragment_cut(named, fragments):
    """Streaming DiLoCo's fragments of ``named`` [(name, parameter)], in order: ``fragments``
    contiguous runs, by count (fragment f holds numbers n f // F to n (f + 1) // F - 1 of the n)."""
    cuts = [len(named) * f // fragments for f in range(fragments + 1)]
    return [named[cuts[f]:cuts[f + 1]] for f in range(fragments)]


def check_warm_phase(warm_steps, warm_every, delay):
    """A ValueError naming what is wrong with the warm phase's settings."""
    def whole(v):
        return isinstance(v, int) and not isinstance(v, bool)
    if not whole(warm_steps) or warm_steps < 0:
        raise ValueError(f"DiLoCo: warm_steps must be a whole number of inner steps >= 0, got {warm_steps!r}")
    if not warm_steps:
        if warm_every is not None:
            raise ValueError(f"DiLoCo: warm_every={warm_every!r} needs warm_steps > 0 (the warm phase's length)")
        return
    if not whole(warm_every) or warm_every < 1 or warm_steps % warm_every:
        raise ValueError(f"DiLoCo: warm_every must be a whole number of inner steps >= 1 that divides warm_steps "
                         f"({warm_steps}), got {warm_every!r}")
    if warm_every <= delay:
        raise ValueError(f"DiLoCo: warm_every ({warm_every}) must exceed delay ({delay}): a warm exchange is "
                         "applied delay steps after it starts, before the next")


class Fragment:
    """A contiguous run of the model's parameters that syncs together: ``named`` [(name,
    parameter)], their float32 global ``copies``, the ``outer`` optimizer over those, the
    ``turn``: the inner step (mod H) after which its exchange starts; while one runs,
    ``pending`` (its future) and ``due`` (the step its outer step waits for)."""

    def __init__(self, named, copies, outer, turn):
        self.named, self.copies, self.outer, self.turn = named, copies, outer, turn
        self.names = [name for name, _ in named]
        self.pending = self.due = None

    def averaged(self):
        """{name: averaged pseudo-gradient} of the exchange in flight (waited for)."""
        if hasattr(self.pending, "whole"):  # a host replica's parts: all-gathered on the host (diloco_hosts.py)
            result = self.pending.whole()
        else:
            result = interruptible_wait(self.pending) if hasattr(self.pending, "wait") else self.pending
        self.pending = result
        return result

    def in_flight(self):
        """What a checkpoint keeps of an exchange in flight: its average (waited for) and due step."""
        if self.pending is None:
            return {}
        averaged = self.averaged()
        return {"due": self.due, "averaged": [averaged[name].clone() for name in self.names]}

    def land(self, saved):
        """An exchange that was in flight when ``saved`` was made, finished: applied at its due step."""
        self.pending = None if "due" not in saved else dict(zip(self.names, saved["averaged"]))
        self.due = saved.get("due")
