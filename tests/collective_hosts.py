"""torch.distributed jobs of several hosts x several local ranks: each host a network namespace
(scripts/netns.py, through local_ranks.py's ``machines``), started per host either by one
``bpslaunch`` (DMLC_NUM_SERVER=0, NVIDIA_VISIBLE_DEVICES naming L devices, DMLC_WORKER_ID = the
host) or by one ``torchrun`` agent (--nnodes H --node-rank h --nproc-per-node L, static
rendezvous at host 0). The workers run tests/cluster_job.py (or any command); and the numpy
model of PowerSGD's two phases summed over every rank."""
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

from bps_gc.compress import build_chain
from bps_gc.launcher.local import free_port
from conftest import LAUNCH_PYTHONPATH, ROOT
from local_ranks import NOT_INHERITED
from multihost import INTERVAL, LAUNCH, TIMEOUT, Job
from reference import gradient, partitions, step_ctx

TESTS = os.path.join(ROOT, "tests")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


class CollectiveHostsJob(Job):
    """``hosts`` x ``local_size`` ranks running ``command``, one launcher per host."""

    def __init__(self, net, hosts, local_size, command, launcher="bpslaunch", env=None):
        self.port = free_port()
        base = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
        # DMLC_PS_ROOT_PORT marks the job's processes for Job.leftovers(), under torchrun too
        base.update(PYTHONPATH=LAUNCH_PYTHONPATH, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                    DMLC_PS_ROOT_PORT=str(self.port), BPS_GC_HEARTBEAT_INTERVAL=str(INTERVAL),
                    BPS_GC_HEARTBEAT_TIMEOUT=str(TIMEOUT), BPS_GC_KILL_GRACE="2")
        base.update(env or {})  # the caller's settings win (a longer heartbeat timeout, ...)
        self.started = time.monotonic()
        self.launchers, self.output = {}, {}
        for h in range(hosts):
            if launcher == "bpslaunch":
                argv = [*LAUNCH, *command]
                host_env = dict(base, DMLC_ROLE="worker", DMLC_NUM_WORKER=str(hosts), DMLC_NUM_SERVER="0",
                                DMLC_WORKER_ID=str(h), DMLC_PS_ROOT_URI=net.addr[0],
                                NVIDIA_VISIBLE_DEVICES=",".join(map(str, range(local_size))))
            else:
                argv = [*TORCHRUN, "--nnodes", str(hosts), "--node-rank", str(h), "--nproc-per-node",
                        str(local_size), "--master-addr", net.addr[0], "--master-port", str(self.port),
                        *command[command[0] == sys.executable:]]  # torchrun starts python itself
                host_env = base
            name = f"worker{h}"
            host_env = dict(host_env, GLOO_SOCKET_IFNAME=net.veth[h])  # else gloo picks loopback
            self.launchers[name] = subprocess.Popen(net.command(h, argv), env=host_env, cwd=ROOT,
                                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self.output[name] = []
            threading.Thread(target=self.collect, args=(name,), daemon=True).start()


def run_spec(net, spec, tmp_path, hosts, local_size, launcher, env=None, bound=120, script="cluster_job.py"):
    """tests/``script`` (cluster_job.py's arguments) with ``spec`` on every rank; each rank's
    results, in rank order."""
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    job_env = {"BYTEPS_PARTITION_BYTES": str(spec["partition_bytes"]),
               "BYTEPS_MIN_COMPRESS_BYTES": str(spec["min_compress_bytes"]), **(env or {})}
    job = CollectiveHostsJob(net, hosts, local_size,
                             [sys.executable, os.path.join(TESTS, script), str(spec_path), str(tmp_path)],
                             launcher, job_env)
    statuses, _ = job.wait_all(bound)
    assert set(statuses.values()) == {0}, job.report(statuses)
    return [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(hosts * local_size)]


def powersgd_expected(spec, tensor, index, ranks):
    """Every rank compresses its own gradient with its partitions' chains (keys index << 16 | p);
    both phases are plain sums over all ranks (float64 here: the transport adds in another
    order); the result is the sum over ``ranks``, averaged."""
    size = int(np.prod(tensor["shape"]))
    parts = partitions(size, np.float32, spec["partition_bytes"])
    chains = {(r, p): build_chain(tensor["params"], stop - start, np.float32, key=index << 16 | p, role="worker",
                                  shape=tuple(tensor["shape"]))
              for r in range(ranks) for p, start, stop in parts}
    out = {}
    for step in range(spec["steps"]):
        ctx = step_ctx(spec, step)
        inputs = [gradient(r, step, tensor).astype(np.float32).reshape(-1) for r in range(ranks)]
        result = np.empty(size, np.float32)
        for p, start, stop in parts:
            def summed(payloads):
                return np.sum([np.frombuffer(x.tobytes(), np.float32) for x in payloads], axis=0,
                              dtype=np.float64).astype(np.float32).view(np.uint8)
            p_sum = summed([chains[r, p].compress(inputs[r][start:stop], ctx) for r in range(ranks)])
            q_sum = summed([chains[r, p].compress_q(p_sum) for r in range(ranks)])
            finished = [chains[r, p].finish(q_sum, workers=ranks) for r in range(ranks)]
            result[start:stop] = finished[0]
        out[f"{tensor['name']}/{step}"] = (result / np.float32(ranks)).reshape(tensor["shape"])
    return out
