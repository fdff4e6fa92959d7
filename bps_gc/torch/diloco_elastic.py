"""BPS_GC_ELASTIC for DiLoCo on the parameter server (docs/elastic.md,
docs/diloco.md): a worker host joining the running job starts where the members are.

With the outer step on the servers, the servers hold the global copy: the joiner pulls it.
With the outer step on the workers (the default), and for the parameters the servers' outer
step leaves to the workers (sent uncompressed), the donor, a live worker, sends its state as it
is at the join's boundary: each fragment's global copy and the outer optimizer's per-parameter
state (SGD's Nesterov momentum buffers); and, either way, its inner step count. The boundary is
the push of the join's first round group, which a member opens inside ``step()`` at an outer
round (one fragment, no delay: a round is one group), after counting that round's last inner
step, before its outer step: the copies and momentum are those of the round before, and the
joiner, which still has that round's H inner steps to take, starts H steps behind the donor's
count. Its parameters start as the global copy, its inner optimizer and codec state (error
feedback) at zero: its chains were just built.
"""
import numpy as np
import torch

import bps_gc.core as core

STEPS = "diloco.steps"  # the donor's inner step count, inside the round that opened the join's group


class WorkersOuterState:
    """What a joiner copies from the donor, as the function ps/worker/joining.py calls:
    ``state()`` on the donor (the arrays as they are now), ``state(wanted)`` on the joiner (the
    same names, the lazily made momentum buffers made as zeros first, filled in place by the
    caller); ``names``: the parameters whose global copy and outer state the workers hold."""

    def __init__(self, opt, names):
        self.opt, self.names = opt, names
        self.steps = np.zeros(1, dtype=np.int64)

    def tensors(self):
        """name -> tensor in a fixed order: every fragment's copies, then its outer state."""
        out = {}
        for f, fragment in enumerate(self.opt.fragments):
            mine = [(name, copy) for name, copy in zip(fragment.names, fragment.copies) if name in self.names]
            out.update((f"copy.{f}.{name}", copy) for name, copy in mine)
            for name, copy in mine:
                for key, value in sorted(fragment.outer.state.get(copy, {}).items()):
                    if not isinstance(value, torch.Tensor):
                        raise TypeError(f"DiLoCo.elastic_start: outer optimizer state {name}.{key} is a "
                                        f"{type(value).__name__}, not a tensor: a joining host cannot copy it")
                    out[f"outer.{f}.{name}.{key}"] = value
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
        self.steps[0] = self.opt.steps
        mine = {name: t.detach().numpy() for name, t in self.tensors().items()}
        mine[STEPS] = self.steps
        order = [name for name, _, _ in wanted or () if name in mine]
        return {name: mine[name] for name in order + [n for n in mine if n not in order]}


@torch.no_grad()
def join(opt):
    """DiLoCo.elastic_start's work once its settings are checked: 0 on a member; on a joiner,
    admitted at an outer round's boundary, its state set as above; returns the outer rounds
    before its first."""
    named = [name for f in opt.fragments for name in f.names]
    state = WorkersOuterState(opt, opt.exchange.averaged if opt.on_servers else set(named))
    start = core.elastic_start(state)
    if start:  # the donor had counted the round's H inner steps the joiner has still to take
        opt.steps = int(state.steps[0]) - opt.sync_every
    if start and opt.on_servers:
        held = opt.global_parameters()
        for fragment in opt.fragments:
            for name, copy in zip(fragment.names, fragment.copies):
                if name in held:
                    copy.copy_(held[name])
    for fragment in opt.fragments if start else ():
        for (_, p), copy in zip(fragment.named, fragment.copies):
            p.copy_(copy)
    return opt.steps // opt.sync_every if start else 0
