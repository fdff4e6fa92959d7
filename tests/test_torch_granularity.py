"""bps_gc.torch.DistributedOptimizer with DGC and with entire-model granularity on a 2x2 local
cluster: the parameters after every step equal a numpy re-computation (DGC's momentum
correction, sampled selection, masking, fp16 values, local weight decay, dense biases; one
top-k or one onebit scale over the concatenated model), and the bytes pushed per step follow
DGC's warm-up densities."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cluster import run_local
from collective_cluster import bpslaunch_argv, job_env
from conftest import ROOT, skip_unless_installed
from test_codecs2_dgc import plan, select_oracle
from test_codecs2_quantizers import splitmix_state
from test_granularity import signs, topk

M64 = (1 << 64) - 1
EPOCHS = [0, 0, 1, 2]  # set_epoch before each step
PARTITION_ELEMENTS = 64  # BYTEPS_PARTITION_BYTES 256: DGC runs per partition, chunks fit one
DGC = {"compressor": "dgc", "k": 0.1, "warmup_epochs": 2, "fp16_values": True, "momentum": "nesterov",
       "seed": 5}
CONFIGS = [
    {"name": "dgc", "optimizer": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}, "compression_params": DGC},
    {"name": "em-topk", "optimizer": {"lr": 0.1},
     "compression_params": {"compressor": "topk", "k": 0.1, "granularity": "entiremodel"}},
    {"name": "em-onebit", "optimizer": {"lr": 0.1, "momentum": 0.9},
     "compression_params": {"compressor": "onebit", "scaling": True, "ef": "vanilla", "momentum": "nesterov",
                            "granularity": "entiremodel"}},
    # layer-wise top-k whose servers sum the workers' selections (no second top-k on the pull)
    {"name": "lw-topk-lossless", "optimizer": {"lr": 0.1},
     "compression_params": {"compressor": "topk", "k": 0.1, "reducer": "lossless"}},
]


def xorshift_next(state):
    t, s = state
    t ^= (t << 23) & M64
    t ^= t >> 17
    t ^= s ^ (s >> 26)
    state[:] = [s, t]
    return (t + s) & M64


class DgcWorker:
    """One rank's DGC state for one tensor, in numpy."""

    def __init__(self, n):
        self.u, self.v = np.zeros(n, np.float32), np.zeros(n, np.float32)
        self.rng = splitmix_state(DGC["seed"])

    def push(self, g, epoch):
        k, warm = DGC["k"], DGC["warmup_epochs"]
        r = k ** ((epoch + 1) / warm) if epoch < warm else k
        self.u = (self.u + g) * np.float32(0.9)
        self.v = self.v + self.u + g
        stride, samples, _, _ = plan(g.size, r)
        start = xorshift_next(self.rng) % stride if samples != g.size else 0
        idx, _ = select_oracle(self.v, r, start)
        out = np.zeros_like(g)
        out[idx] = self.v[idx].astype(np.float16)
        self.v[idx] = 0
        self.u[idx] = 0
        return out, 6 * idx.size  # fp16 records: 4-byte index, 2-byte value


def replay_dgc(results, names, params, divisor=2):
    """Per partition (PARTITION_ELEMENTS each) of every weight, per rank, DGC as in numpy;
    the pulled sum divided by ``divisor`` (2: torch averages; 1: MXNet pushes scaled gradients)."""
    workers = {n: [[DgcWorker(min(PARTITION_ELEMENTS, params[n].size - s))
                    for s in range(0, params[n].size, PARTITION_ELEMENTS)] for _ in results]
               for n in names if params[n].ndim > 1}
    buffers = {n: np.zeros(params[n].size, np.float32) for n in names}  # wd momentum / dense NAG
    for step, epoch in enumerate(EPOCHS):
        pushed = [0] * len(results)
        for n in names:
            grads = [r[f"dgc/{step}/grad/{n}"].reshape(-1) for r in results]
            x = params[n].reshape(-1)
            if n in workers:
                acc = np.zeros_like(x)
                for rank, g in enumerate(grads):
                    for p, worker in enumerate(workers[n][rank]):
                        part = slice(p * PARTITION_ELEMENTS, (p + 1) * PARTITION_ELEMENTS)
                        sent, nbytes = worker.push(g[part], epoch)
                        acc[part] += sent
                        pushed[rank] += nbytes
                g = acc / np.float32(divisor)
                buffers[n] = buffers[n] * np.float32(0.9) + np.float32(0.01) * x  # local wd
                g = g + buffers[n]
            else:  # a bias: dense, then ordinary (nesterov) momentum SGD with weight decay
                g = (grads[0] + grads[1]) / np.float32(divisor) + np.float32(0.01) * x
                buffers[n] = (buffers[n] + g) * np.float32(0.9)
                g = g + buffers[n]
                pushed = [p + g.nbytes for p in pushed]
            yield step, n, (x - np.float32(0.1) * g).reshape(params[n].shape)
        assert [int(r[f"dgc/{step}/pushed_wire"]) for r in results] == pushed, f"step {step}"


def replay_layerwise_lossless(results, names, params, divisor=2):
    """Top-k per partition of every weight on each rank, the selections summed; biases dense."""
    for step in range(len(EPOCHS)):
        for n in names:
            grads = [r[f"lw-topk-lossless/{step}/grad/{n}"].reshape(-1) for r in results]
            if params[n].ndim > 1:
                acc = np.zeros_like(grads[0])
                for g in grads:
                    for start in range(0, g.size, PARTITION_ELEMENTS):
                        part = slice(start, start + PARTITION_ELEMENTS)
                        acc[part] += topk(g[part], 0.1)
            else:
                acc = grads[0] + grads[1]
            yield step, n, params[n] - np.float32(0.1) * (acc / np.float32(divisor)).reshape(params[n].shape)


def replay_entire(cfg, results, names, params, divisor=2):
    sizes = [params[n].size for n in names]
    m = e = 0
    for step in range(len(EPOCHS)):
        flat = [np.concatenate([r[f"{cfg}/{step}/grad/{n}"].reshape(-1) for n in names]) for r in results]
        if cfg == "em-topk":
            acc = np.zeros_like(flat[0])
            for x in flat:
                acc += topk(x, 0.1)
            assert all(int(r[f"{cfg}/{step}/pushed_wire"]) == 8 * 25 for r in results)  # 25 of 248
        else:  # nesterov momentum and error feedback over the whole vector, then one mean|x|
            acc, m, e = np.zeros_like(flat[0]), [m] * 2 if step == 0 else m, [e] * 2 if step == 0 else e
            for rank, x in enumerate(flat):
                m[rank] = x + np.float32(0.9) * m[rank]
                g = x + np.float32(0.9) * m[rank] + e[rank]
                c = signs(g, np.float32(np.abs(g.astype(np.float64)).mean()))
                e[rank] = g - c
                acc += c
        g = acc / np.float32(divisor)
        for n, part in zip(names, np.split(g, np.cumsum(sizes)[:-1])):
            yield step, n, params[n] - np.float32(0.1) * part.reshape(params[n].shape)


@pytest.mark.parametrize("transport", ["ps", "collective"])
def test_dgc_and_entire_model_through_the_optimizer(transport, tmp_path):
    spec = {"epochs": EPOCHS, "configs": CONFIGS}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {"BYTEPS_MIN_COMPRESS_BYTES": "128", "BYTEPS_PARTITION_BYTES": "256"}
    script = [os.path.join(ROOT, "tests", "torch_granularity_job.py"), str(tmp_path / "spec.json"), str(tmp_path)]
    if transport == "ps":  # 2 workers, 2 servers
        result = run_local([sys.executable, *script], env=env, timeout=240)
    else:  # 2 gloo ranks, no server
        result = subprocess.run(bpslaunch_argv(script, 2), env=job_env(env), capture_output=True, text=True,
                                timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    check_replay([dict(np.load(tmp_path / f"torch{r}.npz")) for r in range(2)], divisor=2)


def check_replay(results, divisor):
    """Every configuration's parameters after every step, on both ranks (shared with MXNet)."""
    for cfg in CONFIGS:
        name = cfg["name"]
        names = sorted(k.split("/", 2)[2] for k in results[0] if k.startswith(f"{name}/init/"))
        params = {n: results[0][f"{name}/init/{n}"] for n in names}
        flags = {n: int(results[0][f"{name}/compressed/{n}"]) for n in names}
        if name == "dgc":  # weights compressed, biases (1-D) dense
            assert flags == {n: int(params[n].ndim > 1) for n in names}
            steps = replay_dgc(results, names, params, divisor)
        elif name == "lw-topk-lossless":
            assert flags == {n: int(params[n].ndim > 1) for n in names}
            steps = replay_layerwise_lossless(results, names, params, divisor)
        else:  # no per-layer declaration: one vector, in chunks
            assert set(flags.values()) == {-1}
            steps = replay_entire(name, results, names, params, divisor)
        for step, n, want in steps:
            for r in range(2):
                got = results[r][f"{name}/{step}/param/{n}"]
                assert np.allclose(got, want, rtol=1e-5, atol=1e-6), \
                    f"{name} step {step} {n} rank {r}: max diff {np.abs(got - want).max()}"
            params[n] = results[0][f"{name}/{step}/param/{n}"]  # follow the run, check each step


def test_the_same_through_the_mxnet_trainer(tmp_path):
    skip_unless_installed("mxnet")  # the launched processes import it
    (tmp_path / "spec.json").write_text(json.dumps({"epochs": EPOCHS, "configs": CONFIGS}))
    env = {"BYTEPS_MIN_COMPRESS_BYTES": "128", "BYTEPS_PARTITION_BYTES": "256", "OMP_NUM_THREADS": "1",
           "MXNET_CPU_WORKER_NTHREADS": "1"}
    result = run_local([sys.executable, os.path.join(ROOT, "tests", "mxnet_granularity_job.py"),
                        str(tmp_path / "spec.json"), str(tmp_path)], env=env, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    # MXNet pushes gradients already divided by batch * size and sums them: divisor 1
    check_replay([dict(np.load(tmp_path / f"torch{r}.npz")) for r in range(2)], divisor=1)
