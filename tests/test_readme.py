"""The README's quickstart commands, run as written at a reduced size, so the README cannot rot.

Each ```sh block after a ``<!-- quickstart: NAME -->`` marker runs in bash from the repository
root with the venv's ``bin`` first on PATH (``python``, ``bpslaunch``, ``torchrun``). The only
changes are the reductions in ``REDUCED``: a data path pointed at tiny files in the official
format, a free port instead of 1234, and flags appended to a command (argparse keeps the last
value). A ```python block after such a marker is a script, run as the README says (torchrun;
one launch may run it and a variant of it in turn). A README block without an entry here fails,
so a new quickstart gets a test.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from conftest import LAUNCH_PYTHONPATH, ROOT
from test_mxnet_examples import write_cifar

README = os.path.join(ROOT, "README.md")
BIN = os.path.dirname(sys.executable)
TINY_MXNET = "--model cifar_resnet20_v1 --num-epochs 1 --batch-size 16 --save-period 0"


def quickstart_blocks():
    text = open(README).read()
    return dict(re.findall(r"<!-- quickstart: ([\w-]+) -->\n```(?:sh|python)\n(.*?)```", text, re.S))


def commands(block):
    """The block's commands, continuation lines joined."""
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_block(block, tmp_path, env=None, timeout=120):
    script = "set -euo pipefail\n" + block + "\nwait\n"
    # HOME is the test's folder (the quickstarts read ~/data); caches stay where they were, or
    # every process would compile the codec kernels again
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    full_env = dict(os.environ, PATH=BIN + os.pathsep + os.environ["PATH"], PYTHONPATH=LAUNCH_PYTHONPATH, XDG_CACHE_HOME=cache,
                    OMP_NUM_THREADS="1", HOME=str(tmp_path), BPS_GC_JOIN_TIMEOUT="60", **(env or {}))
    for key in [k for k in full_env if k.startswith(("DMLC_", "BYTEPS_"))]:
        del full_env[key]
    # its own session, so a block that hangs takes its background roles with it
    proc = subprocess.Popen(["bash", "-c", script], cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"timed out after {timeout} s\n{script}\n{stdout[-3000:]}\n{stderr[-5000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{script}\n{stdout[-3000:]}\n{stderr[-5000:]}"
    return stdout + stderr


def append_to(block, marker, extra):
    """``extra`` appended to every command that contains ``marker``."""
    return "\n".join(f"{line} {extra}" if marker in line else line for line in commands(block))


def test_every_quickstart_has_a_reduced_run():
    assert sorted(quickstart_blocks()) == sorted(REDUCED)
    assert os.path.getsize(README) < 12_500  # the "at most about 12 KB"


def reduced_mxnet_local(block, tmp_path):
    write_cifar(tmp_path / "data" / "cifar100", train=65, test=33)  # $HOME is tmp_path
    name = "cifar100-2-cpu-onebit.log"  # from the repository root: under out/, not beside README.md
    for stale in (os.path.join(ROOT, name), os.path.join(ROOT, "out", name)):
        if os.path.exists(stale):
            os.remove(stale)
    out = run_block(append_to(block, "train_cifar100_byteps_gc.py", TINY_MXNET), tmp_path)
    assert re.search(r"^\[worker0\] \[Epoch 0\] validation: accuracy=[0-9.]+$", out, re.M), out[-3000:]
    assert re.search(r"traffic per worker: pushed .*ratio", out), out[-3000:]
    assert not os.path.exists(os.path.join(ROOT, name))
    log = open(os.path.join(ROOT, "out", name)).read()
    os.remove(os.path.join(ROOT, "out", name))
    assert re.search(r"^\[Epoch 0\] validation: accuracy=[0-9.]+$", log, re.M), log


def reduced_roles(block, tmp_path):
    block = block.replace("DMLC_PS_ROOT_PORT=1234", f"DMLC_PS_ROOT_PORT={free_port()}")
    out = run_block(append_to(block, "ddp_quickstart.py", "--epochs 1"), tmp_path)
    found = re.search(r"done: 2 workers, api optimizer, .*'onebit'.*, (\d+) bytes raw, (\d+) on the wire", out)
    assert found, out[-3000:]
    # one host of two ranks: two levels, and the printed bytes say they are rank 0's share
    assert "(two levels: this host's 2 ranks sum in shared memory and push once" in out, out[-3000:]
    assert 0 < int(found.group(2)) < int(found.group(1)) / 10  # compressed, through the server


def reduced_pssh(block, tmp_path):
    # what pssh runs on each host, here on one host: launch/config and launch/hosts from the examples
    config = open(os.path.join(ROOT, "launch", "config.example")).read()
    config = config.replace("10.0.0.1", "127.0.0.1").replace("1234", str(free_port()))
    config = config.replace("$HOME/data/cifar100", str(tmp_path / "data"))
    config = re.sub(r'BPS_GC_TRAIN_ARGS:=[^}]*', f"BPS_GC_TRAIN_ARGS:={TINY_MXNET} --log-dir {tmp_path / 'out'}", config)
    (tmp_path / "config").write_text(config)
    (tmp_path / "hosts").write_text("127.0.0.1\n")
    write_cifar(tmp_path / "data", train=65, test=33)
    remote = re.search(r"'(.*)'", commands(block)[0]).group(1).replace("cd bps_gc", f"cd {ROOT}")
    assert commands(block)[0].startswith("pssh ") and remote.endswith("./launch/run.sh onebit")
    env = {"BPS_GC_LAUNCH_CONFIG": str(tmp_path / "config"), "BPS_GC_HOSTS_FILE": str(tmp_path / "hosts"),
           "BPS_GC_LOG_DIR": str(tmp_path / "logs"), "BPS_GC_PYTHON": sys.executable}
    out = run_block(remote, tmp_path, env)
    assert "worker exited with status 0" in out, out[-3000:]
    assert re.search(r"traffic per worker: pushed ", (tmp_path / "logs" / "worker.log").read_text())
    assert re.search(r"traffic per worker: pushed ", (tmp_path / "out" / "cifar100-1-cpu-onebit.log").read_text())


# runs scripts one after the other in one process, each as its __main__, so that one torchrun
# launch (its agent and ranks start once, ~6 s of CPU) serves several; lines are written as
# printed, so a script's lines come out before the next script's marker
IN_TURN = """import runpy, sys
sys.stdout.reconfigure(line_buffering=True)
for path in sys.argv[1:]:
    print("=== " + path.rsplit("/", 1)[-1], flush=True)
    runpy.run_path(path, run_name="__main__")
"""


def reduced_hook(block, tmp_path):
    """The hook's script under torchrun, as written and with torch's own init and teardown
    instead of bps.init() (as the README says to end it: a barrier, then
    destroy_process_group): both print each rank's bytes, the raw ones re-computed here (100
    steps of a 784 x 10 + 10 float32 model, pushed and pulled), and end. One launch runs both
    in each rank, in turn (IN_TURN): the one with torch's teardown first, so the script as
    written runs last and ends the process as it would alone, which exits 0 (bps.init()'s group
    keys the store apart from env://'s: it cannot read the first group's addresses)."""
    without_init, count = re.subn(r"^bps\.init\(\).*$", 'torch.distributed.init_process_group("gloo")', block, flags=re.M)
    assert count == 1
    without_init += "torch.distributed.barrier()\ntorch.distributed.destroy_process_group()\n"
    names = ("without_init", "with_init")
    for name, script in zip(names, (without_init, block)):
        (tmp_path / f"{name}.py").write_text(script)
    (tmp_path / "in_turn.py").write_text(IN_TURN)
    scripts = " ".join(str(tmp_path / f"{name}.py") for name in names)
    out = run_block(f"torchrun --standalone --nproc-per-node 2 {tmp_path / 'in_turn.py'} {scripts}", tmp_path)
    # both ranks printed their lines of the first script before its barrier let either go on
    assert out.count("=== with_init") == 2, out[-3000:]
    first, second = out.split("=== with_init", 1)
    for name, part in zip(names, (first, second)):
        # the two ranks print at once: one may end the other's line, so no line anchors
        found = sorted(re.findall(r"rank (\d): (\d+) bytes raw, (\d+) on the wire", part))
        assert [rank for rank, _, _ in found] == ["0", "1"], f"{name}: {out[-3000:]}"
        for _, raw, wire in found:
            assert int(raw) == 2 * 100 * (784 * 10 + 10) * 4, f"{name}: {out[-3000:]}"
            assert 0 < int(wire) < int(raw) / 10, f"{name}: {out[-3000:]}"  # top 1 %: compressed


def reduced_ddp(block, tmp_path):
    out = run_block(append_to(block, "ddp_quickstart.py", "--epochs 1"), tmp_path)
    done = re.findall(r"done: 2 workers, api (\w+), compression \{'compressor': '(\w+)'", out)
    assert done == [("hook", "topk"), ("optimizer", "onebit"), ("optimizer", "onebit")], out[-3000:]
    accuracies = [float(a) for a in re.findall(r"epoch 0: validation accuracy ([0-9.]+)", out)]
    assert len(accuracies) == 3 and min(accuracies) > 0.5, out[-3000:]  # 10 classes: learning, not chance


def reduced_seeds(block, tmp_path):
    block = block.replace("--nproc-per-node 8", "--nproc-per-node 2")
    out = run_block(append_to(block, "dgc/train.py", "--dry-run"), tmp_path)
    last = [line for line in out.splitlines() if line.startswith("{")]
    assert last, out[-3000:]
    resolved, _ = json.JSONDecoder().raw_decode(last[-1])  # two ranks' lines may run together
    text = json.dumps(resolved)
    assert '"dgc"' in text and "0.063" in text and str(tmp_path / "data") in text, text[:3000]


REDUCED = {"mxnet-local": reduced_mxnet_local, "roles": reduced_roles, "pssh": reduced_pssh,
           "hook": reduced_hook, "ddp": reduced_ddp, "seeds": reduced_seeds}


@pytest.mark.parametrize("name", sorted(REDUCED))
def test_quickstart(name, tmp_path):
    blocks = quickstart_blocks()
    if name not in blocks:
        pytest.fail(f"README has no quickstart block {name!r}")
    assert shutil.which("bash")
    REDUCED[name](blocks[name], tmp_path)
