"""gluoncv beside torch >= 2: after ``import bps_gc.mxnet`` gluoncv imports (its own torch
version check would raise), torch still works in the same process, and a BytePS-style
compression test with a gluoncv model passes on a local cluster."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from cluster import TESTS, run_local
from conftest import LAUNCH_PYTHONPATH, ROOT

if importlib.util.find_spec("mxnet") is None or importlib.util.find_spec("gluoncv") is None:
    pytest.skip("needs mxnet and gluoncv", allow_module_level=True)

HAS_TORCH = importlib.util.find_spec("torch") is not None


def run_python(code):
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                            text=True, timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH))
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


@pytest.mark.skipif(not HAS_TORCH, reason="the clash needs torch installed")
def test_gluoncv_then_torch_after_import_bps_gc_mxnet():
    out = run_python("""
        import bps_gc.mxnet as bps
        from gluoncv.model_zoo import get_model
        import torch
        import mxnet as mx
        import gluoncv
        net = get_model("resnet18_v2")
        net.initialize()
        assert net(mx.nd.ones((1, 3, 32, 32))).shape == (1, 1000)
        assert gluoncv._found_mxnet and not gluoncv._found_pytorch  # its torch half is off
        import inspect, gluoncv.check
        assert "def _require_pytorch_version" in inspect.getsource(gluoncv.check)
        assert torch.__version__ >= "2", torch.__version__
        t = torch.arange(4.0, requires_grad=True)
        (t * t).sum().backward()
        assert t.grad.tolist() == [0.0, 2.0, 4.0, 6.0]
        assert torch.nn.functional.relu(torch.tensor([-1.0, 3.0])).tolist() == [0.0, 3.0]
        print("ok", torch.__version__, gluoncv.__version__)
    """)
    assert out.startswith("ok")


@pytest.mark.skipif(not HAS_TORCH, reason="the clash needs torch installed")
def test_torch_imported_first_is_left_alone():
    out = run_python("""
        import sys
        import torch
        import bps_gc.mxnet
        import gluoncv.model_zoo
        assert sys.modules["torch"] is torch
        import torch as again
        assert again is torch and torch.ones(2).sum().item() == 2.0
        assert not any(type(f).__name__ == "GluoncvTorchCheckFinder" for f in sys.meta_path)
        print("ok")
    """)
    assert out.startswith("ok")


@pytest.mark.skipif(not HAS_TORCH, reason="the clash needs torch installed")
def test_a_failed_import_gluoncv_can_be_retried_after_import_bps_gc_mxnet():
    out = run_python("""
        try:
            import gluoncv
            failed = False
        except RuntimeError:  # gluoncv's own torch check
            failed = True
        import bps_gc.mxnet
        from gluoncv.model_zoo import get_model
        import torch
        print("ok", failed, torch.ones(2).sum().item())
    """)
    assert out.startswith("ok")


def test_without_bps_gc_mxnet_gluoncv_still_fails():
    """The fix lives in bps_gc.mxnet's import, not on disk: plain gluoncv is unchanged."""
    if not HAS_TORCH:
        pytest.skip("without torch gluoncv imports anyway")
    result = subprocess.run([sys.executable, "-c", "import gluoncv"], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    if result.returncode == 0:
        pytest.skip("this gluoncv accepts the installed torch")
    assert "torch" in result.stderr


def test_byteps_style_onebit_on_a_local_cluster():
    result = run_local([sys.executable, os.path.join(TESTS, "byteps_style_onebit.py")], workers=2,
                       servers=1, env={"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1",
                                       "BYTEPS_MIN_COMPRESS_BYTES": "4096"}, timeout=150)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"exit {result.returncode}\n{output[-6000:]}"
    for rank in (0, 1):
        assert f"rank {rank}: 65 parameters, 19 compressed, 3 steps as the numpy re-computation" in output
