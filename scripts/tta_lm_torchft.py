"""torchft's DiLoCo (PyPI torchft 0.2.0, an opt-in extra: BPS_GC_EXTRAS=torchft
./scripts/setup_env.sh) as a row of scripts/time_to_accuracy.py --task lm, with the settings of
the row "bps_gc DiLoCo H=<H> dense": every rank a replica group of one, the whole model one
fragment, the same inner AdamW (its schedule and clipping), the paper's outer Nesterov SGD,
pseudo-gradients in float32 (torchft quantizes only on CUDA). Rank 0 runs the lighthouse; each
replica its Manager, on its own TCPStore, over torchft's gloo group. The evaluated model is the
global copy torchft keeps (its fragment's original_parameters), as for bps_gc's rows; bytes
are those a rank hands to the Manager's allreduce."""
import contextlib
import os
from datetime import timedelta

ROW = "torchft DiLoCo H={} dense"


def importable():
    """None where torchft imports with its lighthouse, else why not (one line)."""
    try:
        import torchft.local_sgd  # noqa: F401
        from torchft._torchft import LighthouseServer  # noqa: F401
        return None
    except Exception as e:  # noqa: BLE001 (any failure to import is "not importable")
        return f"{type(e).__name__}: {e}".splitlines()[0]


class TorchftDiLoCo:
    """The inner optimizer's stand-in for Run.train: step() and zero_grad() drive torchft's
    DiLoCo through its inner optimizer's hooks; ``running(counter)`` is the context the row
    trains in (the lighthouse, the Manager, torchft's DiLoCo entered; torn down after);
    ``deploy_into(model)`` copies the global copy into an evaluation model."""

    def __init__(self, model, inner, sync_every, rank, size):
        self.model, self.inner, self.sync_every, self.rank, self.size = model, inner, sync_every, rank, size
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
            outer = torch.optim.SGD(self.model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            with DiLoCo(manager, [self.model], self.inner, outer, sync_every=self.sync_every) as self.diloco:
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
            for name, value in self.diloco._fragments[0].original_parameters.items():
                model.get_parameter(name).copy_(value)
