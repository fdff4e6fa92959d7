"""The LM yardstick (example/pytorch/lm, scripts/time_to_accuracy.py --task lm): its data
repeat and refuse a too-small corpus; --precision auto picks bf16 only where the device
computes it; the plain attention (bf16 on a CPU) is causal attention; DDP on two ranks equals
one process on the concatenated batch; a reduced --task lm run gives every row, and runs 2
local ranks per machine, and its HSDP rows (--hsdp) run; train.py resumes bit for bit with a
codec under bf16 autocast, and with --api diloco (whose checks are tests/test_lm_diloco.py's)."""
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

from collective_cluster import bpslaunch_argv, job_env, torchrun_argv
from conftest import ROOT, load_script

sys.path[:0] = [os.path.join(ROOT, "example", "pytorch", "lm"), os.path.join(ROOT, "example", "pytorch")]
from stdlib_text import Corpus, train_batch, val_windows  # noqa: E402

TRAIN = os.path.join(ROOT, "example", "pytorch", "lm", "train.py")
FSDP_JOB = os.path.join(ROOT, "tests", "lm_fsdp_job.py")
INTERRUPT = os.path.join(ROOT, "tests", "interrupted_run.py")
TINY = ["--layers", "1", "--width", "32", "--heads", "2", "--context", "32", "--batch-size", "4", "--val-windows", "8"]
FSDP = [*TINY, "--precision", "fp32", "--steps", "4", "--eval-every", "4", "--api", "fsdp", "--shards", "1"]
HSDP_RUNS = (FSDP, [*FSDP, "--hsdp", "hooks"], [*FSDP, "--compressor", "topk", "--k", "0.01", "--ef", "vanilla"])
DIGEST = ("import sys, hashlib; sys.path.insert(0, 'example/pytorch/lm'); from stdlib_text import *; "
          "c = Corpus(); x, y = train_batch(c.train, 3, 1, 17, 4, 64); v = val_windows(c.val, 8, 64)[0]; "
          "print(c.fingerprint(), hashlib.sha256(x.tobytes() + y.tobytes() + v.tobytes()).hexdigest())")


def test_stdlib_split_and_batches_repeat_in_another_process():
    corpus = Corpus()
    x, y = train_batch(corpus.train, 3, 1, 17, 4, 64)
    here = hashlib.sha256(x.tobytes() + y.tobytes() + val_windows(corpus.val, 8, 64)[0].tobytes()).hexdigest()
    other = subprocess.run([sys.executable, "-c", DIGEST], cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, PYTHONHASHSEED="123"))
    assert other.stdout.split() == [corpus.fingerprint(), here], other.stderr[-2000:]
    assert np.array_equal(x[:, 1:], y[:, :-1])  # targets are the next bytes
    assert not np.array_equal(x, train_batch(corpus.train, 3, 1, 18, 4, 64)[0])  # another step, other windows
    assert len(corpus.val) > 100_000 and len(corpus.train) > 20 * len(corpus.val) // 2


def test_split_is_by_file_path(tmp_path):
    names = [f"m{i}.py" for i in range(60)]
    for i, name in enumerate(names):
        (tmp_path / name).write_bytes(bytes([65 + i % 26]) * (100 + i))
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "skipped.py").write_bytes(b"!" * 500)  # test suites are left out
    corpus = Corpus(str(tmp_path))
    held = [n for n in sorted(names) if zlib.crc32(n.encode()) % 20 == 0]
    assert held, "the fixture should hold out a file"
    expected_val = b"".join((tmp_path / n).read_bytes() + b"\n" for n in held)
    expected_train = b"".join((tmp_path / n).read_bytes() + b"\n" for n in sorted(names) if n not in held)
    assert corpus.val.tobytes() == expected_val and corpus.train.tobytes() == expected_train


def test_too_small_corpus_is_one_line(tmp_path, capsys):
    """train.py's main in this process (the check precedes any launch): a SystemExit whose code,
    its message, Python prints alone (no traceback) and exits 1 with; nothing else printed."""
    (tmp_path / "a.py").write_text("x = 1\n")
    with pytest.raises(SystemExit) as stopped:
        train_module().main(["--corpus", str(tmp_path)])
    message = stopped.value.code
    assert isinstance(message, str) and message.strip().count("\n") == 0 and "too small" in message, message
    assert "Traceback" not in message and capsys.readouterr().err == ""


def test_precision_auto_is_bf16_where_the_device_computes_it():
    from torch_device import BF16_CPU_FLAGS, choose_precision, cpu_flags
    assert choose_precision("auto", "cpu", flags={"avx2", "avx512f", "avx512_bf16"}) == \
        ("bf16", "auto: this CPU computes bf16 natively (avx512_bf16)")
    assert choose_precision("auto", "cpu", flags={"amx_bf16", "amx_tile"})[0] == "bf16"
    assert choose_precision("auto", "cpu", flags={"neon", "bf16"})[0] == "bf16"  # Arm
    name, why = choose_precision("auto", "cpu", flags={"avx2", "avx512f", "avx512_vnni"})
    assert name == "fp32" and "avx512_bf16" in why
    assert [choose_precision("auto", "cuda", cuda_bf16=b)[0] for b in (True, False)] == ["bf16", "fp32"]
    assert choose_precision("fp32", "cpu", flags={"avx512_bf16"})[0] == "fp32"
    assert choose_precision("bf16", "cpu", flags=())[0] == "bf16"
    if os.path.exists("/proc/cpuinfo") and platform.machine() == "x86_64":  # torch's names are Linux's there
        linux = {w for line in open("/proc/cpuinfo") if line.startswith("flags") for w in line.split(":")[1].split()}
        assert {f for f in BF16_CPU_FLAGS if f in cpu_flags()} == {f for f in BF16_CPU_FLAGS if f in linux}


def test_plain_attention_is_causal_attention():
    from gpt import GPT, attention_for, plain_attention
    assert [attention_for("cpu", torch.bfloat16), attention_for("cpu", None), attention_for("cuda", torch.bfloat16)] \
        == ["plain", "sdpa", "sdpa"]
    q, k, v = torch.randn(3, 2, 3, 10, 8, generator=torch.Generator().manual_seed(0))  # batch 2, 3 heads
    a, b, c = (t.double().numpy() for t in (q, k, v))
    scores = a @ b.swapaxes(-1, -2) / np.sqrt(8) + np.triu(np.full((10, 10), -np.inf), 1)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    oracle = (weights / weights.sum(-1, keepdims=True)) @ c
    assert np.allclose(plain_attention(q, k, v).numpy(), oracle, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = plain_attention(q, k, v)
    assert low.dtype == torch.bfloat16 and np.allclose(low.float().numpy(), oracle, atol=5e-2)
    models = []
    for attention in ("sdpa", "plain"):
        torch.manual_seed(0)
        models.append(GPT(1, 32, 2, 16, attention))
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(models[0](x), models[1](x), atol=1e-5)  # the same parameters, the same function


def test_two_ddp_ranks_equal_one_process_on_the_concatenated_batch(lm_launches):
    """tests/lm_ddp_job.py's DDP training (the dense hook) on 2 gloo ranks, a run of the resumed
    launch (bpslaunch --servers 0: the gloo group as torchrun's, without its agent), equals
    one process on the concatenated batch."""
    sys.path.insert(0, os.path.dirname(__file__))
    from lm_ddp_job import BATCH, SHAPE, TEXT
    from gpt import GPT, byte_loss
    steps, tmp_path = DDP_STEPS, lm_launches["root"] / "ddp"
    torch.manual_seed(0)
    model = GPT(**SHAPE)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(steps):
        x, y = (torch.from_numpy(np.concatenate(parts)) for parts in
                zip(*(train_batch(TEXT, 0, rank, step, BATCH, SHAPE["context"]) for rank in range(2))))
        opt.zero_grad()
        byte_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    start = GPT(**SHAPE).state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        assert torch.allclose(ranks[0][name], value, rtol=1e-4, atol=1e-5), name
    assert any(not torch.equal(value, start[name]) for name, value in model.state_dict().items())


def test_reduced_lm_table_has_every_row(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import time_to_accuracy_lm as lm
    import tta_lm_torchft as ft
    torchft = [] if ft.importable() else list(ft.rows(8))  # an opt-in extra: rows where it imports
    result = subprocess.run([sys.executable, "scripts/time_to_accuracy.py", "--task", "lm", "--steps", "8",
                             "--eval-every", "4", *TINY, "--diloco-every", "8", "--cap-factor", "1000",
                             "--slack", "0.1", "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, BPS_GC_HEARTBEAT_TIMEOUT="30"))  # it checks rows, not liveness
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "time_to_accuracy.json").read_text())
    rows = data["rows"]
    diloco = [f"bps_gc DiLoCo H=8 {name}" for name in (*lm.DILOCO, lm.TORCHFT_PHASE[0])]  # [2]: F=4 dense
    assert set(rows) == {lm.LIMIT, *lm.COLLECTIVE[1:], *lm.PS, *diloco, *torchft}
    limit = rows[lm.LIMIT]
    assert limit["steps_to_target"] in (4, 8) and limit["seconds_to_target"] > 0
    assert limit["seconds_to_target"] == pytest.approx(limit["steps_to_target"] * data["compute_seconds_per_step"])
    assert all(r["steps_done"] == 8 and np.isfinite(r["final_val_loss"]) for r in rows.values())
    # DiLoCo's evaluated model is the global copy: with one fragment, unchanged until the outer
    # step at inner step 8, lower after it; Streaming's first fragment takes its step at 2 + tau (torchft's at 2)
    curves, named = data["curves"], diloco + torchft
    assert [curves[n][1][2] == curves[n][0][2] for n in named] == ["F=4" not in n for n in named], curves
    assert all(curves[n][2][2] < curves[n][0][2] for n in named), curves
    # the dense rows are DDP's arithmetic: the reference's final loss, within float tolerance
    assert rows["DDP dense"]["final_val_loss"] == pytest.approx(limit["final_val_loss"], abs=1e-4)
    dense_bytes = rows["DDP dense"]["bytes_per_rank_step"]
    assert rows["DDP bf16 hook"]["bytes_per_rank_step"] == dense_bytes / 2
    assert rows["bps_gc hook topk 1% + EF"]["bytes_per_rank_step"] < dense_bytes / 10
    # dense DiLoCo pushes its float32 pseudo-gradient once every H = 8 inner steps (counted when it
    # starts): stopped // 8 syncs over the row's stopped steps
    stopped = rows[diloco[0]]["stopped_at_step"]
    assert rows[diloco[0]]["bytes_per_rank_step"] == pytest.approx(dense_bytes * (stopped // 8) / stopped)
    assert rows[diloco[1]]["bytes_per_rank_step"] < rows[diloco[0]]["bytes_per_rank_step"] / 4  # thc 4-bit
    from test_lm_diloco import streaming_rows_agree
    streaming_rows_agree(data, diloco[2], diloco[4], torchft[1:], dense_bytes)  # F=4 tau=1 dense: bytes, phases
    if torchft:  # F=1: the same arithmetic as bps_gc's dense DiLoCo, the same bytes
        assert rows[torchft[0]]["final_val_loss"] == pytest.approx(rows[diloco[0]]["final_val_loss"], abs=1e-4)
        ft_stopped = rows[torchft[0]]["stopped_at_step"]
        assert rows[torchft[0]]["bytes_per_rank_step"] == pytest.approx(dense_bytes * (ft_stopped // 8) / ft_stopped)
        assert "torchft's DiLoCo: its dense rows only" in result.stdout
    else:
        assert "torchft's DiLoCo: no row: torchft does not import here" in result.stdout
    assert "the limit (no exchange)" in result.stdout and (tmp_path / "time_to_accuracy.png").stat().st_size > 10_000
    trained = len(rows) - 1  # every row but the limit (the reference's): the progress bar saw each end
    assert re.search(rf"100%\|[^|]*\| {trained}/{trained} ", result.stderr), result.stderr[-1000:]


def test_lm_table_runs_two_local_ranks_per_machine(tmp_path):
    """--local-ranks 2: 2 machines x 2 ranks; DDP dense over the 4 ranks is the reference's
    arithmetic on the 4 ranks' batches, and the parameter server runs its two levels."""
    result = subprocess.run([sys.executable, "scripts/time_to_accuracy.py", "--task", "lm", "--steps", "4",
                             "--eval-every", "4", *TINY, "--local-ranks", "2", "--rows", "DDP dense,PS thc",
                             "--cap-factor", "1000", "--slack", "0.1", "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, BPS_GC_HEARTBEAT_TIMEOUT="30"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "2 machines x 2 ranks" in result.stdout
    data = json.loads((tmp_path / "time_to_accuracy.json").read_text())
    rows = data["rows"]
    assert data["local_ranks"] == 2 and set(rows) == {"the limit (no exchange)", "DDP dense", "bps_gc PS thc 4-bit"}
    assert rows["DDP dense"]["final_val_loss"] == pytest.approx(rows["the limit (no exchange)"]["final_val_loss"], abs=1e-4)
    assert all(r["steps_done"] == 4 and np.isfinite(r["final_val_loss"]) for r in rows.values())


def test_lm_hsdp_rows_run_and_print(tmp_path):
    """--hsdp --local-ranks 2: the GPT sharded over each machine's 2 ranks; the limit, native
    HSDP and register_fsdp_hooks with thc, PowerSGD and top-k + EF train and print; native's
    bytes are the rank's padded gradient shards (each parameter's rows split in 2, padded)."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import time_to_accuracy_hsdp as hsdp
    from gpt import GPT
    result = subprocess.run([sys.executable, "scripts/time_to_accuracy.py", "--task", "lm", "--hsdp", "--steps", "4",
                             "--eval-every", "4", *TINY, "--local-ranks", "2", "--cap-factor", "1000",
                             "--slack", "0.1", "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, BPS_GC_HEARTBEAT_TIMEOUT="30"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "2 machines x 2 ranks, HSDP" in result.stdout
    rows = json.loads((tmp_path / "time_to_accuracy.json").read_text())["rows"]
    assert set(rows) == {hsdp.LIMIT, hsdp.NATIVE, *hsdp.HOOKS}
    assert all(name in result.stdout for name in rows)
    assert all(r["steps_done"] == 4 and np.isfinite(r["final_val_loss"]) for r in rows.values())
    assert rows[hsdp.NATIVE]["seconds_to_target"] > 0 and rows[hsdp.NATIVE]["vs_native"] == 1.0
    model = GPT(1, 32, 2, 32)
    native = sum(4 * -(-p.shape[0] // 2) * p[0].numel() for p in model.parameters())
    assert rows[hsdp.NATIVE]["bytes_per_rank_step"] == native and rows[hsdp.LIMIT]["bytes_per_rank_step"] == 0
    codecs = [rows[name]["bytes_per_rank_step"] for name in hsdp.HOOKS]  # thc, PowerSGD r4, top-k 1%
    assert 0 < codecs[0] < native / 4 and 0 < codecs[1] < native / 2 and 0 < codecs[2] < native / 10, codecs


DDP_STEPS = 4  # lm_ddp_job's steps (test_two_ddp_ranks_equal_one_process_on_the_concatenated_batch)
OPTIMIZER_API = [*TINY, "--api", "optimizer", "--compressor", "onebit", "--ef", "vanilla", "--steps", "4",
                 "--eval-every", "2"]  # test_optimizer_api_under_bpslaunch_on_either_transport


def lm_fsdp_launch(root, runs, launcher=torchrun_argv, **env):
    """tests/lm_fsdp_job.py on 2 ranks: train.py with top-k + EF under bf16 autocast (plain
    attention on the CPU: the arithmetic with the most casts), checkpointing into root/topk, then
    --api diloco into root/diloco, then ``runs`` (groups of flags); rank 0's output of each run."""
    from test_lm_diloco import DILOCO
    flags = [*TINY, "--precision", "bf16", "--steps", "6", "--eval-every", "2", "--compressor", "topk",
             "--k", "0.05", "--ef", "vanilla", "--checkpoint", str(root / "topk")]
    diloco = [*DILOCO, "--fragments", "2", "--delay", "1", "--steps", "6", "--eval-every", "2",
              "--checkpoint", str(root / "diloco")]
    # DiLoCo second: its exchange's name, which keys its codec state, is the process's first (exchange.0)
    argv = [*([INTERRUPT] if env else []), FSDP_JOB, *flags, *(w for run in (diloco, *runs) for w in ("+", *run))]
    result = subprocess.run(launcher(argv, 2), env=job_env(env), cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # bpslaunch labels its workers' lines ([worker0] ...); torchrun passes them as printed
    return re.sub(r"^\[worker\d+\] ", "", result.stdout, flags=re.M).split("=== run ")[1:]


@pytest.fixture(scope="module")
def lm_launches(tmp_path_factory):
    """The checkpoint test's two launches, whose processes the module's other torch.distributed
    runs share (each launch costs seconds of CPU): the straight one under torchrun, which also runs
    HSDP_RUNS and leaves each checkpointed run's first checkpoint (step 2) where the resumed one
    starts from it: what a run interrupted there would have left (tests/interrupted_run.py's
    COPY_TO); the resumed one under bpslaunch --servers 0 (the same gloo ranks, without
    torchrun's agent: ~1.7 s of CPU), which then runs train.py --api optimizer (into
    root/optimizer) and lm_ddp_job's DDP training (into root/ddp)."""
    root = tmp_path_factory.mktemp("lm")
    (root / "ddp").mkdir()
    # each rank's 1st and 4th saves of rank<r>.pth: top-k's and DiLoCo's at step 2
    from test_lm_diloco import diloco_sharded_run
    straight = lm_fsdp_launch(root / "straight", (*HSDP_RUNS, diloco_sharded_run()), INTERRUPT_AFTER="rank:1,4",
                              COPY_TO=str(root / "resumed"), COPY_ROOT=str(root / "straight"))
    resumed = lm_fsdp_launch(root / "resumed", ([*OPTIMIZER_API, "--checkpoint", str(root / "optimizer")],
                                                ["--lm-ddp-job", str(root / "ddp"), str(DDP_STEPS)]),
                             launcher=bpslaunch_argv)
    return {"root": root, "straight": straight, "resumed": resumed}


def test_checkpoint_resume_is_bit_for_bit_with_a_codec(lm_launches):
    """train.py with top-k + EF, then --api diloco (diloco_resumes), then --api fsdp
    (hsdp_runs_agree), in the straight launch; the resumed launch (another launcher, the same
    transport) resumes the first two from their step-2 checkpoints: train.py resumes across the
    two launchers, bit for bit."""
    from test_lm_diloco import diloco_resumes, diloco_sharded_equals_unsharded
    tmp_path = lm_launches["root"]
    straight, diloco_straight, *hsdp, diloco_sharded = lm_launches["straight"]
    resumed, diloco_resumed = lm_launches["resumed"][:2]
    hsdp_runs_agree(hsdp)
    diloco_sharded_equals_unsharded(diloco_sharded, diloco_straight)
    assert "precision: bf16 autocast" in straight and "attention plain" in straight
    assert "resumed from" in resumed and "at step 2" in resumed
    diloco_resumes(tmp_path / "straight" / "diloco", tmp_path / "resumed" / "diloco", diloco_straight, diloco_resumed)

    assert final(straight) == final(resumed)
    for rank in range(2):
        a = torch.load(tmp_path / "straight" / "topk" / f"rank{rank}.pth")
        b = torch.load(tmp_path / "resumed" / "topk" / f"rank{rank}.pth")
        assert a["epoch"] == b["epoch"] == 6
        flat_a, flat_b = (flat({"model": c["model"], "adamw": c["optimizer"], "bps_gc": c["bps_gc"]}) for c in (a, b))
        assert set(flat_a) == set(flat_b) and any("ef.error" in k for k in flat_a)  # the codec's residuals
        for key, value in flat_a.items():
            assert torch.equal(value, flat_b[key]) if torch.is_tensor(value) else value == flat_b[key], key


def final(out):
    """val_loss and bpb of train.py's final line (tokens per second differ)."""
    return [line for line in out.splitlines() if line.startswith("final:")][0].split()[1:3]


def hsdp_runs_agree(outputs):
    """train.py --api fsdp (HSDP_RUNS, on 2 ranks: a (2 replicas, 1 shard) mesh): native HSDP
    and the dense hooks end on the same final line; the hooks print what they handed the
    exchange: dense, the whole float32 model (a shard is all of it), top-k 1% + EF under a tenth."""
    from gpt import GPT
    native, dense, topk = outputs
    assert "native HSDP on the (replicas, shards) mesh (2, 1)" in native and "exchange:" not in native, native
    assert "hooks HSDP on the (replicas, shards) mesh (2, 1)" in dense and "compression none" in dense, dense
    assert final(native) == final(dense), (native, dense)
    sent = [int(re.search(r"^exchange: (\d+) bytes per step", out, re.M).group(1)) for out in (dense, topk)]
    model_bytes = 4 * sum(p.numel() for p in GPT(1, 32, 2, 32).parameters())
    assert sent[0] == model_bytes and 0 < sent[1] < model_bytes / 10, (sent, model_bytes)
    assert "'compressor': 'topk'" in topk and final(topk) != final(dense), topk


@pytest.mark.parametrize("servers", [1, 0], ids=["parameter-server", "collective"])
def test_optimizer_api_under_bpslaunch_on_either_transport(tmp_path, servers, request):
    """train.py --api optimizer (DistributedOptimizer, onebit + EF) under bpslaunch, on the
    parameter server and on torch.distributed (--servers 0: a run of the resumed launch of
    lm_launches): it trains, ends with its final line, and the two ranks' parameters are identical."""
    if servers:
        from cluster import run_local
        argv = [sys.executable, TRAIN, *OPTIMIZER_API, "--checkpoint", str(tmp_path)]
        result = run_local(argv, workers=2, servers=servers, timeout=120, env={"OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        out = result.stdout
    else:
        launches = request.getfixturevalue("lm_launches")
        out, tmp_path = launches["resumed"][2], launches["root"] / "optimizer"
    assert "api optimizer" in out and "final: val_loss=" in out, out[-2000:]
    saved = [torch.load(tmp_path / f"rank{rank}.pth") for rank in range(2)]
    assert [c["epoch"] for c in saved] == [4, 4]
    assert all(torch.equal(value, saved[1]["model"][name]) for name, value in saved[0]["model"].items())


def flat(tree, prefix=""):
    """{dotted key: leaf} of nested dicts and lists."""
    if isinstance(tree, (list, tuple)):
        tree = dict(enumerate(tree))
    if not isinstance(tree, dict):
        return {prefix: tree}
    return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}{key}.").items()}


def test_thc_takes_ef_vanilla_as_its_own_feedback(capsys):
    """train.py's own example (--compressor thc --bits 4 --ef vanilla) asks thc's feedback
    rather than being refused for 'ef'; another --ef is one line naming it."""
    train = train_module()
    parser = train.build_parser()
    args = parser.parse_args(["--compressor", "thc", "--bits", "4", "--ef", "vanilla"])
    assert train.codec_params(args, parser) == {"compressor": "thc", "bits": 4, "feedback": True}
    args = parser.parse_args(["--compressor", "thc", "--bits", "2"])
    assert train.codec_params(args, parser) == {"compressor": "thc", "bits": 2}
    args = parser.parse_args(["--compressor", "thc", "--ef", "nesterov"])
    with pytest.raises(SystemExit) as stopped:
        train.codec_params(args, parser)
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"{parser.prog}: error: --ef nesterov: thc takes --ef vanilla")


def train_module():
    return load_script(TRAIN, "lm_train")


@pytest.mark.parametrize("flags, message", [
    (["--diloco-warm-steps", "-5", "--diloco-warm-every", "5"], "--diloco-warm-steps must be >= 0, got -5"),
    (["--diloco-warm-steps", "150", "--diloco-warm-every", "0"], "--diloco-warm-every must divide --diloco-warm-steps "
                                                                  "(150) and be above the F=4 tau=1 row's delay 1, got 0"),
    (["--diloco-warm-steps", "150", "--diloco-warm-every", "7"], "(150) and be above the F=4 tau=1 row's delay 1, got 7"),
    (["--diloco-warm-steps", "150"], "and be above the F=4 tau=1 row's delay 1, got None"),
    (["--diloco-warm-every", "5"], "--diloco-warm-every 5 needs --diloco-warm-steps W > 0"),
    (["--diloco-every", "4"], "--diloco-every must be >= 8"),
    (["--diloco-outer-lr", "0"], "--diloco-outer-lr must be > 0, got 0.0"),
])
def test_bad_diloco_flags_are_one_line(capsys, flags, message):
    """scripts/time_to_accuracy.py --task lm's DiLoCo flags (scripts/tta_lm_diloco.py), refused at
    the call, one line."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import time_to_accuracy
    with pytest.raises(SystemExit) as stopped:
        time_to_accuracy.parse_args(["--task", "lm", *flags])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].startswith(f"{os.path.basename(sys.argv[0])}: error: --diloco"), err


def test_diloco_warm_flags_name_the_rows_and_reach_diloco():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import time_to_accuracy
    import time_to_accuracy_lm as lm
    import bps_gc.torch as bps
    args = time_to_accuracy.parse_args(["--task", "lm", "--diloco-warm-steps", "150", "--diloco-warm-every", "5",
                                        "--diloco-outer-lr", "1.0"])
    rows = lm.diloco_rows(args)
    named = [f"bps_gc DiLoCo H=50 warm 150/5 outer lr 1 {name}" for name in (*lm.DILOCO, lm.TORCHFT_PHASE[0])]
    assert list(rows) == named
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))  # 4 tensors: F = 4
    opt = lm.make_diloco(bps, model, torch.optim.SGD(model.parameters(), lr=0.1), args, rows[named[3]])  # thc
    assert (opt.sync_every, opt.warm_steps, opt.warm_every, opt.delay, len(opt.fragments), opt.steps) == \
        (50, 150, 5, 1, 4, 0)
    assert lm.make_diloco(bps, model, torch.optim.SGD(model.parameters(), lr=0.1), args, rows[named[4]]).steps == 1
    assert {(g["lr"], g["momentum"], g["nesterov"]) for f in opt.fragments for g in f.outer.param_groups} == {(1.0, 0.9, True)}
    plain = time_to_accuracy.parse_args(["--task", "lm"])
    assert list(lm.diloco_rows(plain))[0] == "bps_gc DiLoCo H=50 dense"
    opt = lm.make_diloco(bps, model, torch.optim.SGD(model.parameters(), lr=0.1), plain, rows[list(rows)[0]])
    assert opt.warm_steps == 0 and {g["lr"] for f in opt.fragments for g in f.outer.param_groups} == {0.7}
