"""Every runnable example and script answers --help (argparse formats every help string: a
stray '%' in one is a crash a user meets first)."""
import functools
import glob
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import LAUNCH_PYTHONPATH, ROOT

SCRIPTS = sorted(p for p in glob.glob(os.path.join(ROOT, "example", "**", "*.py"), recursive=True)
                 + glob.glob(os.path.join(ROOT, "scripts", "*.py"))
                 if "__main__" in open(p).read() and "argparse" in open(p).read())


TORCH_SCRIPTS_ALSO = [os.path.join(ROOT, "example/pytorch/train_cifar10_choco.py")]  # argparse in seed_flags.py


@functools.cache
def help_runs():
    """Every script's ``--help`` run, all in one interpreter (tests/help_runner.py: each as its
    own ``__main__``, the repository's modules imported afresh for each; torch imported once
    instead of once a script: most of this file's time)."""
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "help_runner.py"), *SCRIPTS,
                             *TORCH_SCRIPTS_ALSO], capture_output=True, text=True, timeout=600, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def help_of(script):
    """``script --help``'s exit status, stdout and stderr."""
    return SimpleNamespace(**help_runs()[script])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: os.path.relpath(p, ROOT))
def test_help(script):
    result = help_of(script)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout and "Traceback" not in result.stderr


# every PyTorch script picks its device (docs/gpu.md): --device, besides its seed's own flag
TORCH_SCRIPTS = ["example/pytorch/dgc/train.py", "example/pytorch/train_cifar10_choco.py",
                 "example/pytorch/train_imagenet_nv.py", "example/pytorch/train_cifar100_byteps_gc.py",
                 "example/pytorch/train_cifar10_resnet9.py", "example/pytorch/ddp_quickstart.py",
                 "example/pytorch/benchmark_synthetic.py", "example/demo/mnist_worker.py", "example/pytorch/lm/train.py"]
SEED_DEVICE_FLAGS = {"example/pytorch/dgc/train.py": "--devices", "example/pytorch/train_cifar10_choco.py": "--on_cuda",
                     "example/pytorch/train_cifar100_byteps_gc.py": "--num-gpus"}


@pytest.mark.parametrize("script", TORCH_SCRIPTS)
def test_torch_scripts_offer_a_device(script):
    result = help_of(os.path.join(ROOT, script))
    assert result.returncode == 0, result.stderr[-2000:]
    text = " ".join(result.stdout.split())
    assert "--device" in text and "cuda" in text
    assert SEED_DEVICE_FLAGS.get(script, "--device") in text
