"""What register_fsdp_hooks costs on one rank, per codec (tests/fsdp_job.py's "bytes" models,
scripts/fsdp_bytes.py's table), in bytes:

* ``native``: what native HSDP's replicate all_reduce hands the wire per step on this rank:
  the reduce-scatter outputs of the step (each FSDP module's padded shard gradients back to
  back, in the reduce dtype), which native HSDP all-reduces over the replicate group and the
  hooks receive instead; counted from the tensors the hooks get;
* ``wire`` and ``pulled``: what ``bps_gc.torch.metrics()`` counts this rank pushing and pulling
  per step (pushed_wire: its payloads, or each phase's summed words for thc and PowerSGD);
* ``state``: the arrays of the hooks' codec state, what ``bps_gc.torch.state_dict()`` saves
  (error-feedback residuals, PowerSGD's Q, generator states);
* ``held``: every array the exchange holds between steps (reachable from it through bps_gc
  objects: the codecs' state, any scratch buffer kept for the next step, the shards' stand-in
  tensors), each buffer once;
* ``alive``: the bytes of numpy's allocations made during the steps and still alive after
  them (tracemalloc's numpy domain: whatever holds them, codecs or not; torch's are not
  counted);
* ``shard``: this rank's parameter shard (its local parameters' bytes)."""
import gc
import tracemalloc

import numpy as np
import torch
from torch.distributed.fsdp import FSDPModule

import bps_gc.torch as bps
from held_bytes import array_bytes, held_bytes  # noqa: F401 (array_bytes: fsdp_job.py's)

THC = {"compressor": "thc", "bits": 4, "feedback": True}  # 4-bit, its error feedback a state to carry
# the codecs whose bytes and memory are counted (tests/test_fsdp.py, scripts/fsdp_bytes.py): None
# is the dense hook, which hands the wire what native HSDP does
CODECS = {"dense": None, "thc 4-bit": THC, "onebit+EF": {"compressor": "onebit", "scaling": True, "ef": "vanilla"},
          "PowerSGD r4": {"compressor": "powersgd", "rank": 4},
          "topk 1%+EF": {"compressor": "topk", "k": 0.01, "ef": "vanilla"}}
EF = ("thc 4-bit", "onebit+EF", "PowerSGD r4", "topk 1%+EF")  # the codecs with error feedback


def bytes_and_memory(model, exchange, train, steps):
    """Train ``train(range(steps))`` (the hooks on ``model``, ``exchange`` theirs) and count."""
    handed = count_reduce_outputs(model)
    bps.metrics()  # restart the counters: the job's other models moved bytes too
    gc.collect()
    start_tracing_once()
    tracemalloc.clear_traces()  # from here on, the steps' allocations
    train(range(steps))
    exchange.hook.pipeline.idle()  # its threads let go of the last call just after its future is done
    gc.collect()
    alive = sum(t.size for t in tracemalloc.take_snapshot().traces if t.domain == NUMPY_DOMAIN)
    traffic = bps.metrics()
    local = [p.to_local() for p in model.parameters()]
    return {"native": handed[0] / steps, "wire": traffic.pushed_wire / steps, "pulled": traffic.pulled_wire / steps,
            "state": array_bytes(exchange.hook.codec_state().state_dict().values()), "held": held_bytes([exchange]),
            "alive": alive, "shard": sum(t.numel() * t.element_size() for t in local)}


NUMPY_DOMAIN = 389047  # numpy's tracemalloc domain for array data (numpy/_core/include: NPY_TRACE_DOMAIN)


def start_tracing_once():
    """tracemalloc on for the rest of the process, never stopped: tracemalloc.stop() frees the
    traceback buffer that a thread waiting for the GIL inside tracemalloc's allocation hook (a
    gloo or torch thread) then writes into, and the rank dies of SIGSEGV (python/cpython#128679,
    fixed in 3.12.9 and 3.13.2, not in 3.11): test_fsdp's launch did, just after stop()."""
    if not tracemalloc.is_tracing():
        tracemalloc.start()


def count_reduce_outputs(model):
    """Wrap every module's hook to add its reduce-scatter output's bytes to the list's item."""
    handed = [0]
    for module in (m for m in model.modules() if isinstance(m, FSDPModule)):
        param_groups = module._get_fsdp_state()._fsdp_param_groups
        if not param_groups:
            continue
        inner = param_groups[0]._all_reduce_hook

        def counting(reduce_output, inner=inner):
            handed[0] += reduce_output.numel() * reduce_output.element_size()
            inner(reduce_output)
        module.set_all_reduce_hook(counting)
    return handed


def table(arrays):
    """The lines of the table of one rank's saved arrays (``bytes/<codec>/<count>``)."""
    lines = [f"{'codec':12} {'bytes/step':>10} {'native/it':>9} {'state B':>8} {'state/shard':>11} "
             f"{'held B':>8} {'held/shard':>10} {'alive/shard':>11}"]
    for name in CODECS:
        got = {k: float(arrays[f"bytes/{name}/{k}"]) for k in ("native", "wire", "state", "held", "alive", "shard")}
        lines.append(f"{name:12} {got['wire']:>10.0f} {got['native'] / got['wire']:>9.2f} {got['state']:>8.0f} "
                     f"{got['state'] / got['shard']:>11.3f} {got['held']:>8.0f} {got['held'] / got['shard']:>10.3f} "
                     f"{got['alive'] / got['shard']:>11.3f}")
    return lines


def run_fsdp_job(spec, ranks=4):
    """One torchrun of tests/fsdp_job.py with ``spec`` on ``ranks`` gloo ranks (the (2, 2) mesh
    at 4) in a temporary folder: every rank's saved arrays (scripts/fsdp_bytes.py,
    scripts/fsdp_inhost_bytes.py). Exits naming the job's error if it fails."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    tests = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as out:
        path = os.path.join(out, "spec.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(tests), tests]), OMP_NUM_THREADS="1")
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(ranks), os.path.join(tests, "fsdp_job.py"), path, out], env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"fsdp_job.py failed:\n{done.stderr[-4000:]}")
        return [dict(np.load(os.path.join(out, f"rank{r}.npz"))) for r in range(ranks)]
