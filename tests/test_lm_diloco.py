"""train.py --api diloco (bps_gc.torch.DiLoCo, example/pytorch/lm/lm_diloco.py): on the
parameter server with the outer step on the servers (a launch of its own), its bad flags (no
launch), the LM yardstick's torchft fragments (in this process), and the checks of its
torch.distributed runs, which ride on test_lm.py's resume launches
(test_checkpoint_resume_is_bit_for_bit_with_a_codec: diloco_resumes) and on its reduced table
(test_reduced_lm_table_has_every_row: streaming_rows_agree)."""
import os
import re
import sys

import pytest
import torch

from conftest import ROOT
from test_lm import TINY, TRAIN, final, flat, train_module

ONEBIT_EF = ["--compressor", "onebit", "--onebit-scaling", "--ef", "vanilla"]
DILOCO = [*TINY, "--precision", "fp32", "--api", "diloco", "--sync-every", "4", *ONEBIT_EF]


def onebit_bytes(named):
    """onebit's payload of these parameters (compress/onebit.py's format): a bit an element in
    32-bit words, then a float32 scale, per tensor."""
    return sum(4 * -(-p.numel() // 32) + 4 for _, p in named)


def diloco_resumes(straight_folder, resumed_folder, straight, resumed):
    """train.py --api diloco on torch.distributed (whose exchange compresses every tensor),
    onebit + EF, H = 4, two fragments, tau = 1: interrupted after step 2 with fragment 0's
    exchange in flight, resumed, it ends as the straight run, bit for bit (model, DiLoCo's state
    with the exchange in flight at step 6, the codec's residuals); the two ranks' global copies
    are the same bits and their local parameters not (replicas); bytes (rank 0's bps.metrics())
    are onebit's payloads of the syncs started: fragment 0 at steps 2 and 6, fragment 1 at 4;
    resumed after 2, one whole model in H steps."""
    from gpt import GPT
    named = list(GPT(1, 32, 2, 32).named_parameters())
    first, second = onebit_bytes(named[:len(named) // 2]), onebit_bytes(named[len(named) // 2:])
    assert "api diloco (H=4, 2 fragments, delay 1, alpha 0.0, outer SGD lr 0.7 momentum 0.9 nesterov on the " \
           "workers)" in straight, straight
    assert f"(bps.metrics(): {2 * first + second} bytes in 6 inner steps)" in straight, straight
    assert f"exchange: {(first + second) / 4:.1f} bytes per inner step" in resumed and "at step 2" in resumed
    assert final(straight) == final(resumed)
    saved = {run: [torch.load(folder / f"rank{rank}.pth") for rank in range(2)]
             for run, folder in (("straight", straight_folder), ("resumed", resumed_folder))}
    for a, b in zip(saved["straight"], saved["resumed"]):
        assert a["epoch"] == b["epoch"] == 6 and a["optimizer"]["fragments"][0]["due"] == 7  # in flight
        flat_a, flat_b = (flat({"model": c["model"], "diloco": c["optimizer"], "bps_gc": c["bps_gc"]}) for c in (a, b))
        assert set(flat_a) == set(flat_b) and any("ef.error" in k for k in flat_a)
        for key, value in flat_a.items():
            assert torch.equal(value, flat_b[key]) if torch.is_tensor(value) else value == flat_b[key], key
    ranks = saved["straight"]
    copies = [[c for f in r["optimizer"]["fragments"] for c in f["copies"]] for r in ranks]
    assert all(torch.equal(a, b) for a, b in zip(*copies)) and len(copies[0]) == len(named)
    assert not all(torch.equal(value, ranks[1]["model"][name]) for name, value in ranks[0]["model"].items())


def test_diloco_api_on_the_parameter_server(tmp_path):
    """train.py --api diloco under bpslaunch --servers 1, onebit + EF (every tensor compressed),
    the outer step on the servers (DiLoCo's default there: no --outer-step): after the sync at step 4 = H both workers' parameters are
    their global copy, the same bits; the servers hold the outer momentum (worker 0's
    bps.state_dict()); the bytes are onebit's payload of the whole model, once in H inner steps."""
    from cluster import run_local
    from gpt import GPT
    argv = [sys.executable, TRAIN, *DILOCO, "--steps", "4", "--eval-every", "4",
            "--checkpoint", str(tmp_path)]
    result = run_local(argv, workers=2, servers=1, timeout=120,
                       env={"OMP_NUM_THREADS": "1", "BYTEPS_MIN_COMPRESS_BYTES": "0"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "on the servers)" in result.stdout and "final: val_loss=" in result.stdout
    payload = onebit_bytes(GPT(1, 32, 2, 32).named_parameters())
    assert f"(bps.metrics(): {payload} bytes in 4 inner steps)" in result.stdout, result.stdout
    saved = [torch.load(tmp_path / f"rank{rank}.pth") for rank in range(2)]
    start = GPT(1, 32, 2, 32).state_dict()
    for c in saved:
        copies = dict(zip(c["model"], c["optimizer"]["fragments"][0]["copies"]))
        assert all(torch.equal(value, copies[name]) for name, value in c["model"].items())
        assert all(torch.equal(value, saved[0]["model"][name]) for name, value in c["model"].items())
    momentum = [v for k, v in flat(saved[0]["bps_gc"]).items() if k.endswith("/momentum.")]  # worker 0 saves the servers'
    assert len(momentum) == len(start) and any(v.abs().sum() > 0 for v in momentum)
    assert not all(torch.equal(value, start[name]) for name, value in saved[0]["model"].items())


@pytest.mark.parametrize("flags, message", [
    (["--fragments", "2"], "--fragments is --api diloco's (got --api hook)"),
    (["--api", "optimizer", "--sync-every", "8", "--outer-lr", "1"], "--sync-every, --outer-lr are --api diloco's"),
    (["--api", "diloco", "--sync-every", "8", "--fragments", "4", "--delay", "2"],
     "--delay must be >= 0 and below --sync-every / --fragments (8 / 4), got 2"),
    (["--api", "diloco", "--fragments", "0"], "--fragments must be between 1 and --sync-every (50), got 0"),
    (["--api", "diloco", "--alpha", "1"], "--alpha must be in [0, 1), got 1.0"),
    (["--api", "diloco", "--compressor", "onebit", "--compress-momentum", "nesterov"],
     "--compress-momentum moves the optimizer's momentum into the codec chain: not with --api diloco"),
    (["--shards", "2"], "--shards is --api fsdp's and --api diloco's (got --api hook)"),
    (["--api", "diloco", "--shards", "2", "--hsdp", "native"], "--hsdp is --api fsdp's: with --api diloco --shards"),
    (["--api", "diloco", "--shards", "0"], "--shards must be >= 1, got 0"),
    (["--api", "diloco", "--shards", "2", "--checkpoint", "x"], "--checkpoint is not supported with --shards"),
])
def test_bad_diloco_api_flags_are_one_line(capsys, flags, message):
    """train.py --api diloco's flags: one line, before any launch (the parser's error, status 2)."""
    with pytest.raises(SystemExit) as stopped:
        train_module().main(flags)
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and ": error: " in err[0], err


# the yardstick's GPT (2 layers: 28 tensors) as bps_gc.torch.DiLoCo(fragments=4) cuts it, read off the
# parameters' order (gpt.py: the embeddings, each block's ln1, ln2, attn.qkv, attn.proj, mlp.0, mlp.2, ln)
YARDSTICK_FRAGMENTS = [
    ["tokens.weight", "positions.weight", *(f"blocks.0.{m}" for m in ("ln1.weight", "ln1.bias", "ln2.weight",
                                                                        "ln2.bias", "attn.qkv.weight"))],
    [f"blocks.0.{m}" for m in ("attn.qkv.bias", "attn.proj.weight", "attn.proj.bias", "mlp.0.weight", "mlp.0.bias",
                               "mlp.2.weight", "mlp.2.bias")],
    [f"blocks.1.{m}" for m in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "attn.qkv.weight", "attn.qkv.bias",
                               "attn.proj.weight")],
    [*(f"blocks.1.{m}" for m in ("attn.proj.bias", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias")),
     "ln.weight", "ln.bias"]]


def streamed_bytes(stopped, tau):
    """Dense F=4 DiLoCo's bytes per inner step at H = 8 on TINY's GPT over ``stopped`` inner
    steps: fragment k % 4's float32 (the cut tested below) starts after inner step 2 (k + 1) - tau
    (bps_gc's phase: tau = 0, its start; torchft's: tau = 1 step sooner)."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from tta_lm_torchft import fragment_parameters
    from gpt import GPT
    sizes = [4 * sum(p.numel() for _, p in part) for part in fragment_parameters(GPT(1, 32, 2, 32), 4)]
    return sum(sizes[k % 4] for k in range(stopped) if 2 * (k + 1) - tau <= stopped) / stopped


def streaming_rows_agree(data, ours, ours_in_torchfts_phase, torchft, dense_bytes):
    """test_lm.py's reduced table (H = 8, TINY's GPT): the dense F = 4 tau = 1 rows' bytes are their
    fragments' (the cut tested below) on each row's schedule, the four fragments the whole model;
    where torchft imports (``torchft``: its F = 4 row), bps_gc's row in torchft's phase equals
    torchft's at every evaluation (1e-4)."""
    rows, curves = data["rows"], data["curves"]
    assert streamed_bytes(8, 0) * 8 == dense_bytes
    for row, tau in ((ours, 0), (ours_in_torchfts_phase, 1), *((name, 1) for name in torchft)):
        assert rows[row]["bytes_per_rank_step"] == pytest.approx(streamed_bytes(rows[row]["stopped_at_step"], tau)), row
    for name in torchft:
        assert [c[2] for c in curves[ours_in_torchfts_phase]] == pytest.approx([c[2] for c in curves[name]], abs=1e-4)


def test_torchft_rows_fragments_are_bps_gcs_cut():
    """scripts/tta_lm_torchft.py's fragments for torchft's F=4 row (no torchft needed: the cut is
    plain torch): the yardstick's GPT and the test's 1-layer one cut into the tensors bps_gc.torch.
    DiLoCo(fragments=4)'s fragments hold, in order (the 2-layer cut written out above; by count,
    n / 4 tensors each for the 1-layer's 16), as modules whose parameters are the model's own
    Parameter objects (torchft writes a fragment's global copy into them); torchft's F=4 row is
    a row only where H is a multiple of 4 (torchft refuses others), the F=1 row at every H."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import tta_lm_torchft as ft
    from gpt import GPT
    from bps_gc.torch import DiLoCo
    for layers, want in ((2, YARDSTICK_FRAGMENTS), (1, None)):
        model = GPT(layers, 32, 2, 32)
        names = [name for name, _ in model.named_parameters()]
        want = want or [names[4 * f:4 * f + 4] for f in range(4)]
        parts = ft.fragment_parameters(model, 4)
        assert [[name for name, _ in part] for part in parts] == want and sum(want, []) == names
        ours = DiLoCo(model, torch.optim.AdamW(model.parameters()), 8, fragments=4, delay=1)
        assert [f.names for f in ours.fragments] == want
        for part, module in zip(parts, ft.fragment_modules(parts)):
            assert [id(p) for p in module.parameters()] == [id(model.get_parameter(name)) for name, _ in part]
    assert list(ft.rows(8)) == ["torchft DiLoCo H=8 dense", "torchft DiLoCo H=8 F=4 tau=1 dense"]
    assert list(ft.rows(25)) == ["torchft DiLoCo H=25 dense"] and ft.refused(8) is None
    assert ft.refused(25) == "F=4 tau=1 dense: H=25 is not a multiple of 4"


def diloco_sharded_run():
    """The straight launch's --api diloco run (lm_fsdp_launch) with the model sharded by FSDP2
    inside each replica, --shards 1 on its 2 ranks, without its --checkpoint (refused there)."""
    return [*DILOCO, "--fragments", "2", "--delay", "1", "--steps", "6", "--eval-every", "2", "--shards", "1"]


def diloco_sharded_equals_unsharded(sharded, unsharded):
    """train.py --api diloco --shards 1: the parameters are DTensors (fully_shard on mesh["shard"]),
    DiLoCo averages their shards over mesh["replicate"] and the evaluation swaps the global copy
    into the shards; a one-rank shard is the whole tensor, so the run ends on the unsharded run's
    final line and bytes, bit for bit."""
    assert "FSDP2 inside each replica, the (replicas, shards) mesh (2, 1)" in sharded, sharded
    assert final(sharded) == final(unsharded), (sharded, unsharded)
    sent = [re.search(r"^exchange: .*$", out, re.M).group(0) for out in (sharded, unsharded)]
    assert sent[0] == sent[1], sent
    evals = [re.findall(r"val_loss=(\S+)", out) for out in (sharded, unsharded)]
    assert evals[0] == evals[1] and len(evals[0]) == 4, evals  # every evaluation, not the last alone
