"""BPS_GC_ELASTIC for DiLoCo on the parameter server (docs/elastic.md,
docs/diloco.md): a worker host joining the running job starts where the members are.

Each fragment's exchange is one round group (PushPullExchange ends the group as it posts), so
a join's boundary is the push of the exchange a member starts inside ``step()``, at inner
step s, after counting s, before that exchange's outer step. There the donor, a live worker,
sends its state as it is: each fragment's global copy (with the servers' outer step too: the
servers' copy already has an exchange in flight applied), the outer optimizer's per-parameter
state of the parameters whose outer step the workers take (SGD's Nesterov momentum buffers;
with the servers' outer step the servers keep the rest), the average and due step of any
exchange still in flight (with ``delay``: a member waits for it before it starts another, so
it is a finished average, kept for its due step as a checkpoint keeps it), and s. The joiner
starts at the inner step after the exchange before that one (the schedule's previous start;
with one fragment and no warm phase, s - H), so its first window runs up to s, where its
first push is the join's; an exchange in flight is applied at its due step as on the members.
Its parameters start as the global copies, its inner optimizer and codec state (error
feedback) at zero: its chains were just built.

A warm phase: under BPS_GC_ELASTIC each warm step's exchanges (every fragment's) go as one call,
one round group, so a join falls between steps, never inside one (a group each let it fall
between two fragments' pushes of one step); the joiner starts a warm interval before (H0; after
the warm phase as above), and a warm exchange in flight is landed and applied as plain
averaging, by its due step, as on the members.

A host as one replica (replicate="hosts", diloco_hosts.py): the state above is the whole
replica's, the same on every local rank of a host (the exchange in flight all-gathered, before
the join's push: no collective runs in it); each joining local rank takes it from its
counterpart on the donor's host (ps/worker/joining.py ``donor_of``), which also has the rounds
of its parts' keys.
"""
import numpy as np
import torch

import bps_gc.core as core

STEPS = "diloco.steps"  # the donor's inner step count, at the exchange that opened the join's group


class WorkersOuterState:
    """What a joiner copies from the donor, as the function ps/worker/joining.py calls:
    ``state()`` on the donor (the arrays as they are now), ``state(wanted)`` on the joiner (the
    same names, made first where the joiner lacks them: the lazily made momentum buffers as
    zeros, the exchanges in flight in ``landing``; filled in place by the caller); ``names``:
    the parameters whose outer state the workers hold."""

    def __init__(self, opt, names):
        self.opt, self.names = opt, names
        self.steps = np.zeros(1, dtype=np.int64)
        self.landing = {}  # the joiner: name -> the buffer of an exchange in flight (averages, due)

    def tensors(self):
        """name -> tensor in a fixed order: every fragment's copies, its outer state, its exchange
        in flight (the average per parameter, then the due step)."""
        out = {}
        for f, fragment in enumerate(self.opt.fragments):
            out.update((f"copy.{f}.{name}", copy) for name, copy in zip(fragment.names, fragment.copies))
            for name, copy in zip(fragment.names, fragment.copies):
                if name not in self.names:  # its outer state is the servers'
                    continue
                for key, value in sorted(fragment.outer.state.get(copy, {}).items()):
                    if not isinstance(value, torch.Tensor):
                        raise TypeError(f"DiLoCo.elastic_start: outer optimizer state {name}.{key} is a "
                                        f"{type(value).__name__}, not a tensor: a joining host cannot copy it")
                    out[f"outer.{f}.{name}.{key}"] = value
            flight = fragment.in_flight()  # {} when none (the donor's average waited for already)
            if flight:
                out.update((f"inflight.{f}.{name}", a) for name, a in zip(fragment.names, flight["averaged"]))
                out[f"due.{f}"] = torch.tensor([flight["due"]], dtype=torch.int64)
        return out

    def __call__(self, wanted=None):
        if wanted is not None:  # the joiner: make the state torch creates at the first outer step
            for name, dtype, shape in wanted:
                if name.startswith("outer."):
                    _, f, rest = name.split(".", 2)
                    pname, key = rest.rsplit(".", 1)
                    fragment = self.opt.fragments[int(f)]
                    copy = dict(zip(fragment.names, fragment.copies)).get(pname)
                    if copy is not None and key not in fragment.outer.state[copy]:
                        fragment.outer.state[copy][key] = torch.zeros(shape, dtype=getattr(torch, dtype))
                elif name.startswith(("inflight.", "due.")):
                    self.landing[name] = torch.zeros(shape, dtype=getattr(torch, dtype))
        self.steps[0] = self.opt.steps
        mine = {name: t.detach().numpy() for name, t in {**self.tensors(), **self.landing}.items()}
        mine[STEPS] = self.steps
        order = [name for name, _, _ in wanted or () if name in mine]
        return {name: mine[name] for name in order + [n for n in mine if n not in order]}

    def land(self):
        """The joiner: the donor's exchanges in flight, each to be applied at its due step."""
        for f, fragment in enumerate(self.opt.fragments):
            if f"due.{f}" in self.landing:
                fragment.land({"due": int(self.landing[f"due.{f}"][0]),
                               "averaged": [self.landing[f"inflight.{f}.{name}"] for name in fragment.names]})


def previous_start(opt, steps):
    """The last inner step before ``steps`` after which some fragment's exchange started (0: none)."""
    return next((t for t in range(steps - 1, 0, -1) if any(opt.turn_now(f, t) for f in opt.fragments)), 0)


def started_by(opt, steps):
    """How many exchanges (one fragment's each) started after inner steps 1..``steps``: every
    fragment's each H0 in the warm phase; after it, fragment f's at its turn mod H from W."""
    warm = min(steps, opt.warm_steps) // opt.warm_every * len(opt.fragments) if opt.warm_steps else 0
    after = max(0, steps - opt.warm_steps)
    return warm + sum(after // opt.sync_every if f.turn == 0 else max(0, (after - f.turn) // opt.sync_every + 1)
                      for f in opt.fragments)


@torch.no_grad()
def join(opt):
    """DiLoCo.elastic_start's work once its settings are checked: 0 on a member; on a joiner,
    admitted at an exchange's boundary, its state set as above; returns the exchanges started
    before its first."""
    state = WorkersOuterState(opt, opt.exchange.averaged if opt.on_servers else
                              {name for f in opt.fragments for name in f.names})
    if not core.elastic_start(state):
        return 0
    state.land()
    opt.steps = previous_start(opt, int(state.steps[0]))
    for fragment in opt.fragments:
        for (_, p), copy in zip(fragment.named, fragment.copies):
            p.copy_(copy)
    return started_by(opt, opt.steps)
