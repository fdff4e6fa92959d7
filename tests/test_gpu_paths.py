"""Training where the gradient lives (issue 32), the parts a CPU box checks: which device a rank
takes (--device and the seeds' flags, decided from given device counts), which backend its ranks
use (NCCL refuses two ranks on one GPU), float16/bfloat16 gradients through the comm hook
(numpy re-computation) and the optimizer's clear refusal of bfloat16, mixed precision with
DistributedOptimizer (an independent re-computation of autocast + loss scaling, an overflowing
step skipped on every rank), DGC's ResNet-20 with 2 ranks on one host on both transports (ranks
bit-identical, loss falling), and the synthetic benchmark's suite at tiny size. The same checks
on a GPU: scripts/gpu_checks.sh."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from collective_cluster import TESTS, bpslaunch_argv, job_env
from conftest import ROOT

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(ROOT, "example", "pytorch"))
import torch_device as td  # noqa: E402
from test_collective_hook import expected_buckets  # noqa: E402

from bps_gc.collective.backend_choice import NCCL, backend_for_devices  # noqa: E402

NO_CUDA = "needs CUDA (torch.cuda.is_available() is False here): scripts/gpu_checks.sh runs it on a GPU"


@pytest.mark.parametrize("requested, local_rank, cuda, count, expected", [
    ("auto", 3, True, 2, ("cuda:1", None)),  # LOCAL_RANK % device_count
    ("auto", 1, True, 1, ("cuda:0", None)),  # two ranks share the one GPU
    ("auto", 0, False, 0, ("cpu", None)),
    ("cuda", 5, True, 8, ("cuda:5", None)),
    ("cpu", 0, True, 8, ("cpu", None)),
    ("cuda:1", 0, True, 2, ("cuda:1", None)),
])
def test_device_choice(requested, local_rank, cuda, count, expected):
    assert td.choose_device(requested, local_rank, cuda, count) == expected


@pytest.mark.parametrize("requested", ["cuda", "cuda:3"])
def test_cuda_asked_where_there_is_none_is_a_note_and_the_cpu(requested):
    device, note = td.choose_device(requested, 0, False, 0)
    assert device == "cpu" and "no CUDA device" in note and requested in note


def test_a_gpu_the_host_lacks_is_one_line():
    with pytest.raises(td.DeviceError) as e:
        td.choose_device("cuda:2", 0, True, 2)
    assert str(e.value) == "device cuda:2: this host has 2 CUDA device(s), cuda:0 to cuda:1"


def test_device_words_and_bytepss_num_gpus():
    import argparse
    assert [td.parse_device(w) for w in ("AUTO", "cpu", "gpu", "cuda:7")] == ["auto", "cpu", "cuda", "cuda:7"]
    for bad in ("tpu", "cuda:x", "cuda:"):
        with pytest.raises(argparse.ArgumentTypeError, match="want auto, cpu, cuda or cuda:N"):
            td.parse_device(bad)
    assert td.from_num_gpus(None, "auto") == ("auto", None)
    assert td.from_num_gpus(0, "auto") == ("cpu", None)
    assert td.from_num_gpus(1, "auto") == ("cuda", None)
    word, note = td.from_num_gpus(8, "auto")
    assert word == "cuda" and "one GPU per worker process" in note
    assert td.local_rank_from_env({"LOCAL_RANK": "3"}) == 3
    assert td.local_rank_from_env({"BYTEPS_LOCAL_RANK": "2"}) == 2 and td.local_rank_from_env({}) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this box has CUDA: the CPU fallback is not what runs")
def test_pick_device_on_this_cpu_box():
    device, lines = td.pick_device("cuda", local_rank=1)
    assert device.type == "cpu" and lines == ["note: cuda asked for, but this host has no CUDA device: training "
                                              "on the CPU", "device: cpu (asked: cuda)"]
    batch = (torch.ones(2), torch.zeros(2))
    assert td.moved(td.pinned(batch, device), device) is batch  # nothing to pin or copy on the CPU


@pytest.mark.parametrize("cuda, nccl, count, local, backend, why", [
    (False, True, 0, 2, "gloo", "no CUDA device"),
    (True, True, 1, 1, NCCL, "NCCL for CUDA tensors"),
    (True, True, 8, 8, NCCL, "NCCL for CUDA tensors"),
    (True, True, 1, 2, "gloo", "2 local ranks share 1 GPU(s) and NCCL refuses two ranks on one device"),
    (True, True, 4, 8, "gloo", "8 local ranks share 4 GPU(s)"),
    (True, False, 2, 2, "gloo", "this torch has no NCCL"),
])
def test_backend_for_devices(cuda, nccl, count, local, backend, why):
    chosen, reason = backend_for_devices(cuda, nccl, count, local)
    assert chosen == backend and why in reason


def run_job(spec, tmp_path, timeout=240):
    """tests/low_precision_job.py with ``spec`` on 2 ranks under bpslaunch --servers 0 (torch.distributed
    without torchrun's agent: ~1.2 s of CPU a launch)."""
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    result = subprocess.run(bpslaunch_argv([os.path.join(TESTS, "low_precision_job.py"), str(tmp_path / "spec.json"),
                                            str(tmp_path)], 2), env=job_env(), capture_output=True, text=True,
                            timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


HOOK_CASES = {"onebit-ef": ({"compressor": "onebit", "scaling": True, "ef": "vanilla"}, "recompress"),
              "topk-ef": ({"compressor": "topk", "k": 0.1, "ef": "vanilla"}, "lossless")}
AMP = {"steps": 4, "init_scale": 256.0, "inf_step": 1,
       "cases": {"dense": None, "onebit": {"compressor": "onebit", "scaling": True, "ef": "vanilla"}}}


@pytest.fixture(scope="module")
def low_precision(tmp_path_factory):
    """One launch for the two tests below: the hook's float16/bfloat16 buckets, then mixed
    precision with DistributedOptimizer."""
    out = tmp_path_factory.mktemp("low_precision")
    run_job({"hook": {"cases": HOOK_CASES}, "amp": AMP}, out)
    return out


def test_hook_takes_low_precision_buckets(low_precision):
    """A float16/bfloat16 bucket's result is the float32 numpy re-computation (codecs and their
    error feedback in float32) on its values, rounded to the bucket's dtype."""
    tmp_path = low_precision
    for case, (params, reducer) in HOOK_CASES.items():
        for dtype in ("float16", "bfloat16"):
            saved = [np.load(tmp_path / f"hook{r}_{case}_{dtype}.npz") for r in range(2)]
            count = len(saved[0]["index"])
            calls = [[(s["index"][i], s[f"sizes{i}"], s[f"in{i}"]) for i in range(count)] for s in saved]
            expected = expected_buckets(params, calls, 2, 0.1, reducer)
            for rank, s in enumerate(saved):
                assert set(s["dtype"]) == {f"torch.{dtype}"}
                for i, value in enumerate(expected):
                    rounded = torch.from_numpy(value.astype(np.float32)).to(getattr(torch, dtype)).float().numpy()
                    assert np.array_equal(s[f"out{i}"], rounded), f"{case} {dtype} rank {rank} call {i}"
            message = str(saved[0]["optimizer_bfloat16"])
            assert "torch.bfloat16 is not supported" in message and "autocast" in message and "comm_hook" in message


def amp_oracle(steps, init_scale, inf_step, lr=0.1):
    """Autocast float16 + loss scaling re-computed in one process: each rank's gradient of the
    scaled loss, averaged, unscaled; a non-finite average skips the step and halves the scale."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    scale, out = init_scale, []
    for step in range(steps):
        grads = []
        for rank in range(2):
            g = torch.Generator().manual_seed(100 * rank + step)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            if rank == 1 and step == inf_step:
                x[0, 0] = float("inf")
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x), y)
            (loss.float() * scale).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        pushed = grads[0][0] / scale  # rank 0's first weight gradient, unscaled: what its codec gets
        mean = [(a + b) / 2 for a, b in zip(*grads)]
        if all(torch.isfinite(m).all() for m in mean):
            with torch.no_grad():
                for p, m in zip(model.parameters(), mean):
                    p -= lr * (m / scale)
        else:
            scale /= 2
        out.append((scale, [p.detach().clone() for p in model.parameters()], pushed))
    return out


def same_steps(ranks):
    """Whether the ranks agree on every step's parameters and scale (each pushed its own gradient)."""
    def agreed(rank):
        return [{k: v for k, v in step.items() if k != "pushed"} for step in rank["steps"]]
    return agreed(ranks[0]) == agreed(ranks[1])


def test_mixed_precision_with_distributed_optimizer(low_precision):
    """Dense: every step against the re-computation; onebit + error feedback: the inf step is
    skipped on both ranks and training goes on finite (the codec keeps its residual through a
    non-finite round: docs/codecs.md)."""
    tmp_path = low_precision
    ranks = [json.loads((tmp_path / f"amp{r}_dense.json").read_text()) for r in range(2)]
    assert same_steps(ranks)  # the same parameters and scale on both ranks, every step
    assert ranks[0]["precision"] == "mixed precision: autocast float16 on cpu, gradient scaler"
    expected = amp_oracle(AMP["steps"], AMP["init_scale"], AMP["inf_step"])
    for step, (got, (scale, params, pushed)) in enumerate(zip(ranks[0]["steps"], expected)):
        assert got["scale"] == scale and got["grad_dtype"] == "torch.float32", step
        # the codec sees the true gradient (1/scale applied before the push), not the scaled one
        np.testing.assert_allclose(np.array(got["pushed"]), pushed.numpy(), rtol=1e-6, atol=1e-9)
        for p, q in zip(got["params"], params):
            np.testing.assert_allclose(np.array(p), q.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"step {step}")
    assert ranks[0]["steps"][1]["params"] == ranks[0]["steps"][0]["params"]  # the overflowing step: skipped
    assert ranks[0]["steps"][2]["params"] != ranks[0]["steps"][1]["params"]

    ranks = [json.loads((tmp_path / f"amp{r}_onebit.json").read_text()) for r in range(2)]
    assert same_steps(ranks)
    steps = ranks[0]["steps"]
    assert [s["scale"] for s in steps] == [256.0, 128.0, 128.0, 128.0]
    assert steps[1]["params"] == steps[0]["params"] and steps[3]["params"] != steps[2]["params"]
    assert all(np.isfinite(np.array(p)).all() for p in steps[3]["params"])


def test_gpu_checks_cpu_dry_run(tmp_path):
    """scripts/gpu_checks.sh's steps on the CPU at tiny size: the tests collect, the device codecs
    run, the synthetic suite runs every row with 1 rank and 2 ranks, DGC's ResNet-20 trains on 2
    ranks on one host on both transports with the ranks bit-identical and the loss falling, and
    the summary table names every check."""
    out = tmp_path / "gpu"
    result = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_checks.sh"), "--cpu-dry-run", str(out)],
                            env=job_env({"PYTHON": sys.executable, "BYTEPS_MIN_COMPRESS_BYTES": "0"}),
                            capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    assert "tests collected" in (out / "tests_chains.txt").read_text()
    assert "test_gpu_paths.py::test_cuda_device_and_batches" in (out / "tests_cuda.txt").read_text()
    assert json.loads((out / "bench_device_codecs_cuda.json").read_text())["rows"]

    rows = json.loads((out / "dgc" / "dgc_shared_gpu.json").read_text())
    assert [r["transport"] for r in rows] == ["collective", "ps"]
    for r in rows:  # 80 images, 2 ranks, batch 8: 5 steps per epoch, 2 epochs
        assert r["identical"] and r["loss_fell"] and r["steps"] == 10, r
        assert r["device"] == "device: cpu (asked: cpu)"

    import benchmark_rows
    for ranks in (1, 2):
        report = json.loads((out / f"synthetic_{ranks}rank.json").read_text())
        assert report["ranks"] == ranks and report["device"] == "device: cpu (asked: cpu)" and report["gpu"] is None
        got = {r["row"]: r for r in report["results"]}
        assert list(got) == list(benchmark_rows.ROWS)
        for name, r in got.items():
            assert r["images_per_sec_per_gpu"] > 0 and r["ms_per_step"] > 0, r
            assert (r["codec_ms_per_step"] is not None) == (name not in ("DDP no communication", "DDP allreduce"))
            assert r["transport"] == ("ps" if name == benchmark_rows.PS_ROW else "collective")
        # the codec time covers every gradient: DDP's one bucket of the MLP's 6 for the hook,
        # the optimizer's 6 tensors (one partition each; no size floor here)
        hook = got["bps_gc hook topk 1%+EF"]
        assert hook["gradients"] == 6 and hook["buckets"] == 1 and got[benchmark_rows.PS_ROW]["gradients"] == 6
    table = (out / "summary.md").read_text()
    assert table == result.stdout[result.stdout.index("# scripts/gpu_checks.sh summary"):]
    for check in ("pytest tests_chains", "synthetic benchmark, 2 rank(s)", "2r bps_gc hook DGC 0.1%",
                  "DGC ResNet-20 2 ranks, collective", "DGC ResNet-20 2 ranks, ps"):
        assert any(line.startswith("|") and line.split("|")[1].strip() == check and "| ok |" in line
                   for line in table.splitlines()), check
    assert "onebit scaling compress_gbps >= 500 GB/s (25M)" in table  # not run at 64K on the CPU


def test_benchmark_suite_rejects_an_unknown_row(capsys, monkeypatch):
    """The suite's driver (no launcher's variables set) refuses the row in argparse's one line,
    exit 2, before it launches anything: run through main() in this process (the check is
    about the flag, not about processes)."""
    import benchmark_synthetic
    for name in ("DMLC_NUM_WORKER", "WORLD_SIZE"):  # set: a rank under a launcher, not the driver
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as e:
        benchmark_synthetic.main(["--rows", "DDP allreduce,nope"])
    stderr = capsys.readouterr().err
    assert e.value.code == 2 and "--rows: unknown nope" in stderr and "Traceback" not in stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_device_and_batches():
    device, lines = td.pick_device("auto", local_rank=torch.cuda.device_count())  # wraps around to cuda:0
    assert device == torch.device("cuda:0") and lines[-1].startswith("device: cuda:0 (")
    x, y = td.moved(td.pinned((torch.ones(4, 3), torch.arange(4)), device), device)
    assert x.device == device and y.device == device and torch.equal(y.cpu(), torch.arange(4))
