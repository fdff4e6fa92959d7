"""DiLoCo on the parameter server with a host's local ranks as one replica
(``DiLoCo(..., replicate="hosts")``, docs/diloco.md "A host as one replica").

The host's local ranks train one replica (the script keeps them identical: DDP on the host's
group, ``bps_gc.torch.host_group()``). At a sync each local rank takes the pseudo-gradient of its
own part only: of each parameter's flat elements, cut into ``local_size`` parts of
ceil(n / local_size) (the last padded with zeros), part i is local rank i's, pushed under
``<name>#part<i>`` declared ``one_per_host`` (PushPullExchange): the same local rank of every
host pushes it, the servers sum one push per host and divide by the hosts (or run ``outer_sgd``
on it). Each host so pushes one copy of the pseudo-gradient, as one replica of one rank would.
When the outer step is due, the host's ranks all-gather their parts' results over the host's
group (torch.distributed, gloo on CPU), so every local rank holds the whole average (or the
servers' update) and takes the same outer step on the whole fragment: the global copies are
the same bits on every rank of every host (each part is one server reply, the same on every
host, and the outer step is the same float32 arithmetic on the same inputs)."""
import torch
import torch.distributed as dist

import bps_gc.core as core

from .exchange import PushPullExchange, interruptible_wait
from .host_group import host_group


def part_name(name, part):
    return f"{name}#part{part}"


class HostPartsExchange:
    """The replica's pseudo-gradients of ``named`` [(name, parameter)], each local rank pushing
    its own part; ``averaged``: the parameter names whose parts go uncompressed (below
    BYTEPS_MIN_COMPRESS_BYTES: the servers sum them, no reducer runs; all parts of a tensor have
    one shape, so they are all compressed or none)."""

    def __init__(self, compression_params, named, reducer=None):
        # a host joining under BPS_GC_ELASTIC makes it once admitted (``host()``): till then a
        # rank may not know its host-mates' addresses, which the admission brings
        self.group = None if core.joining() else host_group(caller="replicate='hosts'")
        self.parts, self.part = core.local_size(), core.local_rank()
        self.hosts = core.size() // self.parts
        self.shapes = {name: tuple(p.shape) for name, p in named}
        self.sizes = {name: -(-p.numel() // self.parts) for name, p in named}  # a part's elements
        stand_ins = [(part_name(name, self.part), torch.empty((), dtype=torch.float32).expand(self.sizes[name]))
                     for name, _ in named]
        self.pushes = PushPullExchange(compression_params, reducer, named_parameters=stand_ins, one_per_host=True)
        self.averaged = {name for name, _ in named if part_name(name, self.part) in self.pushes.averaged}

    def own(self, name, tensor):
        """This rank's part of ``tensor`` (float32, flat, padded with zeros to the part's size)."""
        size = self.sizes[name]
        part = tensor.detach().reshape(-1)[self.part * size:(self.part + 1) * size].float()
        return part if part.numel() == size else torch.cat([part, part.new_zeros(size - part.numel())])

    def start(self, named, copies, ctx):
        """This rank's parts of the pseudo-gradients (global copy - local parameters) of
        [(name, parameter)] pushed and pulled in the background; a HostRound."""
        parts = [(part_name(name, self.part), self.own(name, copy) - self.own(name, p))
                 for (name, p), copy in zip(named, copies)]
        return HostRound(self, [name for name, _ in named], self.pushes(parts, ctx=ctx))

    def whole(self, parts):
        """{name: whole tensor} from this rank's {name: part}: the host's ranks' parts, all-gathered
        over the host's group (every local rank calls it, with the same names in the same order)."""
        names = list(parts)
        mine = torch.cat([parts[name].reshape(-1) for name in names])
        gathered = [torch.empty_like(mine) for _ in range(self.parts)]
        # waited for in slices a Ctrl-C can come between, as the exchange is (exchange.py)
        interruptible_wait(dist.all_gather(gathered, mine, group=self.host(), async_op=True).get_future())
        result, offset = {}, 0
        for name in names:
            size, shape = self.sizes[name], self.shapes[name]
            flat = torch.cat([g[offset:offset + size] for g in gathered])
            result[name] = flat[:torch.Size(shape).numel()].view(shape)
            offset += size
        return result

    def host(self):
        """The host's process group (made at the first use on a joining host)."""
        if self.group is None:
            self.group = host_group(caller="replicate='hosts'")
        return self.group

    def server_values(self, name, attr):
        """The whole of ``attr`` of the servers' state of ``name`` (outer_sgd's global copy), flat:
        each rank fetches its part's, and the host's ranks all-gather them (a collective)."""
        mine = self.pushes.server_values(part_name(name, self.part), attr)
        return self.whole({name: mine})[name].reshape(-1)

    def set_server_values(self, name, attr, tensor):
        """Seed ``attr`` of the servers' state of this rank's part of ``name``."""
        self.pushes.set_server_values(part_name(name, self.part), attr, self.own(name, tensor))


class HostRound:
    """A sync in flight: this rank's parts' future; ``whole()`` waits for it and all-gathers."""

    def __init__(self, exchange, names, future):
        self.exchange, self.names, self.future = exchange, names, future

    def whole(self):
        replies = interruptible_wait(self.future)
        return self.exchange.whole({name: replies[part_name(name, self.exchange.part)] for name in self.names})
