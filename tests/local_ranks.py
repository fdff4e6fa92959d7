"""Worker hosts with several local ranks, as BytePS's recipe runs them: each host a network
namespace (scripts/netns.py), one ``bpslaunch`` per role with the recipe's environment
(NVIDIA_VISIBLE_DEVICES on the workers only, DMLC_NUM_WORKER = hosts, no BYTEPS_LOCAL_SIZE),
and the numpy model of what two levels return (HostModel)."""
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from bps_gc.compress import CompressionParams, build_chain
from bps_gc.compress.registry import COMPRESSORS
from bps_gc.launcher.local import free_port
from conftest import LAUNCH_PYTHONPATH, ROOT
from multihost import INTERVAL, LAUNCH, TIMEOUT, Job
from reference import gradient, partitions, step_ctx

TESTS = os.path.join(ROOT, "tests")
# variables of this process that would change the job (the recipe sets none of them)
NOT_INHERITED = ("BYTEPS_LOCAL_SIZE", "BYTEPS_LOCAL_RANK", "NVIDIA_VISIBLE_DEVICES", "DMLC_WORKER_ID",
                 "DMLC_ROLE", "DMLC_NODE_HOST", "DMLC_INTERFACE", "BPS_GC_HIERARCHY", "BPS_GC_LOCAL_REDUCE")


@pytest.fixture(scope="module")
def machines():
    """Three namespaces on a switch (fast links: these tests check results, not speed)."""
    net = switched_machines(3, "l")
    if isinstance(net, str):
        pytest.skip(f"network namespaces: {net}")
    yield net
    net.__exit__(None, None, None)


@pytest.fixture(scope="module")
def machines_or_loopback():
    """Two namespaces on a switch, or None where there are none (the launch runs on loopback
    then, so that the test still runs, with its hosts on one address)."""
    net = switched_machines(2, "f")
    yield None if isinstance(net, str) else net
    if not isinstance(net, str):
        net.__exit__(None, None, None)


def switched_machines(count, tag):
    """``count`` namespaces on a 10 Gbit/s switch, entered, or why there are none (a str)."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from netns import NetnsUnavailable, SwitchedMachines
    try:
        net = SwitchedMachines("10gbit", count, tag=f"{os.getpid() % 100000}{tag}")
        net.__enter__()
    except NetnsUnavailable as e:
        return str(e)
    return net


class HostsJob(Job):
    """``hosts`` worker hosts of ``local_sizes[h]`` ranks (NVIDIA_VISIBLE_DEVICES), ``servers``
    servers spread over the machines, the scheduler on machine 0; ``command``: the worker's."""

    def __init__(self, net, hosts, local_sizes, servers, command, env=None, worker_env=None):
        self.port = free_port()
        base = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
        base.update(PYTHONPATH=LAUNCH_PYTHONPATH, DMLC_NUM_WORKER=str(hosts),
                    DMLC_NUM_SERVER=str(servers), DMLC_PS_ROOT_URI=net.addr[0],
                    DMLC_PS_ROOT_PORT=str(self.port), PYTHONUNBUFFERED="1",
                    BPS_GC_HEARTBEAT_INTERVAL=str(INTERVAL), BPS_GC_HEARTBEAT_TIMEOUT=str(TIMEOUT),
                    BPS_GC_KILL_GRACE="2")
        base.update(env or {})
        plan = {"scheduler": (0, [], dict(base, DMLC_ROLE="scheduler"))}
        for s in range(servers):
            plan[f"server{s}"] = (s % hosts, [], dict(base, DMLC_ROLE="server"))
        for h in range(hosts):
            devices = ",".join(str(d) for d in range(local_sizes[h]))
            plan[f"worker{h}"] = (h, command, dict(base, DMLC_ROLE="worker", DMLC_WORKER_ID=str(h),
                                                   NVIDIA_VISIBLE_DEVICES=devices, **(worker_env or {})))
        self.started = time.monotonic()
        self.launchers, self.output = {}, {}
        for name, (machine, cmd, env_) in plan.items():
            self.launchers[name] = subprocess.Popen(net.command(machine, [*LAUNCH, *cmd]), env=env_,
                                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self.output[name] = []
            threading.Thread(target=self.collect, args=(name,), daemon=True).start()


def run_spec(net, spec, tmp_path, hosts, local_size, servers, env=None, bound=90, worker_env=None):
    """Run tests/cluster_job.py with ``spec`` on every rank; returns each rank's results."""
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    job_env = {"BYTEPS_PARTITION_BYTES": str(spec["partition_bytes"]),
               "BPS_GC_DENSE_PARTITION_BYTES": str(spec["partition_bytes"]),
               "BYTEPS_MIN_COMPRESS_BYTES": str(spec["min_compress_bytes"]), **(env or {})}
    job = HostsJob(net, hosts, [local_size] * hosts, servers,
                   [sys.executable, os.path.join(TESTS, "cluster_job.py"), str(spec_path), str(tmp_path)],
                   env=job_env, worker_env=worker_env)
    statuses, _ = job.wait_all(bound)
    assert set(statuses.values()) == {0}, job.report(statuses)
    return [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(hosts * local_size)]


class HostModel:
    """What two levels return for one declared tensor (the ``index``-th): each host's ranks
    summed in local-rank order in the tensor's dtype, the sum cast to the wire dtype and
    compressed once per host by that host's chain, the servers' reduction of the hosts' pushes
    in host order (recompress, lossless, majority, or the dense sum), the result cast back and
    divided by the number of ranks when averaged (a vote is not)."""

    def __init__(self, params, shape, dtype, index, hosts, local_size, partition_bytes, min_compress_bytes,
                 average=True, reducer=None):
        self.params = CompressionParams.from_dict(params or {})
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.wire = np.dtype(np.float16) if self.params.fp16 else self.dtype
        self.size = int(np.prod(shape))
        self.hosts, self.local_size, self.average = hosts, local_size, average
        self.reducer = reducer or (COMPRESSORS[self.params.compressor].reducers[0]
                                   if self.params.compressed else "sum")
        self.compressed = self.params.compressed and self.size * self.dtype.itemsize >= min_compress_bytes
        self.parts = partitions(self.size, self.wire, partition_bytes)
        self.chains = {p: ([build_chain(self.params, stop - start, self.wire, key=index << 16 | p, role="worker")
                            for _ in range(hosts)],
                           build_chain(self.params, stop - start, self.wire, key=index << 16 | p, role="server"))
                       for p, start, stop in self.parts if self.compressed}

    def host_sum(self, inputs):
        flat = [np.asarray(x, self.dtype).reshape(-1) for x in inputs]
        if len(flat) == 1:
            return flat[0].copy()
        acc = flat[0] + flat[1]
        for x in flat[2:]:
            acc += x
        return acc

    def step(self, inputs, ctx):
        L = self.local_size
        sums = [self.host_sum(inputs[h * L:(h + 1) * L]).astype(self.wire) for h in range(self.hosts)]
        result = np.empty(self.size, self.wire)
        divide = self.average
        for p, start, stop in self.parts:
            if self.compressed:
                worker_chains, server_chain = self.chains[p]
                decoded = [worker_chains[h].decompress(worker_chains[h].compress(sums[h][start:stop], ctx))
                           for h in range(self.hosts)]
                acc = np.zeros(stop - start, self.wire)
                for d in decoded:
                    acc += d
                if self.reducer == "recompress":
                    acc = server_chain.decompress(server_chain.compress(acc, ctx))
                elif self.reducer == "majority":
                    votes = sum(np.sign(d).astype(np.int64) for d in decoded)
                    acc = np.where(votes < 0, -1, 1).astype(self.wire)
                    divide = False
            else:
                acc = sums[0][start:stop].copy()
                for s in sums[1:]:
                    acc += s[start:stop]
            result[start:stop] = acc
        result = result.astype(self.dtype)
        if divide:
            result /= self.dtype.type(self.hosts * L)
        return result.reshape(self.shape)


def expected_results(spec, hosts, local_size):
    out = {}
    for index, t in enumerate(spec["tensors"]):
        model = HostModel(t.get("params"), t["shape"], t["dtype"], index, hosts, local_size,
                          spec["partition_bytes"], spec["min_compress_bytes"], t.get("average", True),
                          t.get("reducer"))
        for step in range(spec["steps"]):
            inputs = [gradient(r, step, t) for r in range(hosts * local_size)]
            out[f"{t['name']}/{step}"] = model.step(inputs, step_ctx(spec, step))
    return out
