"""torchft's DiLoCo (PyPI torchft 0.2.0, an opt-in extra: BPS_GC_EXTRAS=torchft
./scripts/setup_env.sh) as rows of scripts/time_to_accuracy.py --task lm, with the settings of
bps_gc's dense rows "bps_gc DiLoCo H=<H> dense" and "... F=4 tau=1 dense": every rank a replica
group of one, the same inner AdamW (its schedule and clipping), the paper's outer Nesterov SGD
(one per fragment), pseudo-gradients in float32 (torchft quantizes only on CUDA). Rank 0 runs
the lighthouse; each replica its Manager, on its own TCPStore, over torchft's gloo group.

The fragments are bps_gc.torch.DiLoCo's, exactly: the model's parameters in order, cut by their
count into F contiguous runs (``fragment_parameters``). torchft takes a fragment as a module and
reads and writes it only through its named_parameters(), so each is a ParameterList holding the
model's own Parameter objects: the cut can fall inside a module (a GPT block), as bps_gc's does.

The schedules (scripts/diloco_vs_torchft.py reads both sources): torchft starts fragment j's
allreduce tau steps before inner step (j + 1) H / F and applies it at that step; bps_gc starts it
after that step and applies it tau steps later. Each row runs its own library's phase: with tau =
1 bps_gc's is torchft's one inner step later; with tau = 0 (the F=1 rows) they are the same.
torchft needs H a multiple of F: the F=4 row is there only then. The evaluated model is the
global copy torchft keeps (every fragment's original_parameters), as for bps_gc's rows; bytes
are those a rank hands to the Manager's allreduce. An evaluation after inner step e finds one of
torchft's exchanges in flight only where e + tau is a multiple of H / F (never at the H of
docs/benchmarks.md's runs); bps_gc's rows wait for theirs inside the timed step, torchft's do not."""
import contextlib
import os
from datetime import timedelta

# the name after "torchft DiLoCo H=<H> " -> (fragments, delay tau): bps_gc's dense rows' settings
ROWS = {"dense": (1, 0), "F=4 tau=1 dense": (4, 1)}


def rows(every):
    """{row name: (fragments, delay)} at H = ``every``: those torchft takes (H a multiple of F)."""
    return {f"torchft DiLoCo H={every} {name}": s for name, s in ROWS.items() if every % s[0] == 0}


def refused(every):
    """The names of ROWS torchft refuses at H = ``every``, with why (one phrase), or None."""
    out = [f"{name}: H={every} is not a multiple of {f}" for name, (f, _) in ROWS.items() if every % f]
    return "; ".join(out) or None


def table_line(every):
    """The table's line on torchft's DiLoCo at H = ``every``: what is and is not a row."""
    why, no = importable(), refused(every)
    if why:
        return (f"torchft's DiLoCo: no row: torchft does not import here ({why}); BPS_GC_EXTRAS=torchft "
                "./scripts/setup_env.sh adds it")
    return ("torchft's DiLoCo: its dense rows only (no thc in torchft; its own quantization is CUDA only)"
            + (f"; no row {no} (torchft's rule)" if no else "") + "; F=4: bps_gc's fragments exactly, "
            "each row in its own library's phase (torchft applies a fragment's outer step tau steps sooner)")


def importable():
    """None where torchft imports with its lighthouse, else why not (one line)."""
    try:
        import torchft.local_sgd  # noqa: F401
        from torchft._torchft import LighthouseServer  # noqa: F401
        return None
    except Exception as e:  # noqa: BLE001 (any failure to import is "not importable")
        return f"{type(e).__name__}: {e}".splitlines()[0]


def fragment_parameters(model, fragments):
    """bps_gc.torch.DiLoCo's cut (bps_gc/torch/diloco.py fragment_cut) of the model's trainable
    parameters: [[(name, parameter)] of each fragment]."""
    from bps_gc.torch.diloco import fragment_cut
    return fragment_cut([(name, p) for name, p in model.named_parameters() if p.requires_grad], fragments)


def fragment_modules(parts):
    """Each fragment as the module torchft takes: a ParameterList of the model's own Parameters
    (its names "0", "1", ...: position in the fragment)."""
    import torch
    return [torch.nn.ParameterList([p for _, p in part]) for part in parts]


class TorchftDiLoCo:
    """The inner optimizer's stand-in for Run.train: step() and zero_grad() drive torchft's
    DiLoCo through its inner optimizer's hooks; ``running(counter)`` is the context the row
    trains in (the lighthouse, the Manager, torchft's DiLoCo entered; torn down after);
    ``deploy_into(model)`` copies the global copy into an evaluation model."""

    def __init__(self, model, inner, sync_every, rank, size, fragments=1, delay=0):
        self.model, self.inner, self.sync_every, self.rank, self.size = model, inner, sync_every, rank, size
        self.delay = delay
        self.parts = fragment_parameters(model, fragments)
        self.param_groups = inner.param_groups  # Run.set_lr drives the inner optimizer's schedule
        self.diloco = None

    def step(self):
        self.inner.step()

    def zero_grad(self):
        self.inner.zero_grad()

    @contextlib.contextmanager
    def running(self, counter):
        import torch
        import torch.distributed as dist
        from torchft._torchft import LighthouseServer
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo
        os.environ.setdefault("RUST_LOG", "error")  # the lighthouse logs every quorum otherwise
        # this rank's address on its machine's link (time_to_accuracy.py sets it; loopback otherwise)
        host = os.environ.get("BPS_GC_TTA_HOST", "127.0.0.1")
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=self.size, heartbeat_timeout_ms=1000) \
            if self.rank == 0 else None
        port = [lighthouse.address().rsplit(":", 1)[1] if lighthouse else None]
        dist.broadcast_object_list(port, src=0)
        timeout = timedelta(seconds=120)
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)  # this replica group's
        manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
                          min_replica_size=self.size, use_async_quorum=False, init_sync=False,
                          replica_id=f"replica_{self.rank}", store_addr=host, store_port=store.port, rank=0,
                          world_size=1, hostname=host, timeout=timeout, quorum_timeout=timeout,
                          connect_timeout=timeout,
                          lighthouse_addr=f"http://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{port[0]}")
        allreduce = manager.allreduce

        def counted(tensor, *args, **kwargs):  # the bytes this rank hands to torchft's allreduce
            counter[0] += tensor.numel() * tensor.element_size()
            return allreduce(tensor, *args, **kwargs)
        manager.allreduce = counted
        try:
            manager.start_quorum()  # connected before the timed loop, as bps_gc's group is
            manager.wait_quorum()
            outers = [torch.optim.SGD([p for _, p in part], lr=0.7, momentum=0.9, nesterov=True)
                      for part in self.parts]
            with DiLoCo(manager, fragment_modules(self.parts), self.inner, outers, sync_every=self.sync_every,
                        fragment_sync_delay=self.delay) as self.diloco:
                yield
        finally:
            manager.shutdown(wait=True)
            dist.barrier()  # every replica has left before the lighthouse goes
            if lighthouse:
                lighthouse.shutdown()

    def deploy_into(self, model):
        import torch
        if self.diloco is None:  # before the row starts: the initial weights
            model.load_state_dict(self.model.state_dict())
            return
        with torch.no_grad():
            for part, fragment in zip(self.parts, self.diloco._fragments):
                for i, (name, _) in enumerate(part):
                    model.get_parameter(name).copy_(fragment.original_parameters[str(i)])
