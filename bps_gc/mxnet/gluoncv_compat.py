"""Lets ``import gluoncv`` succeed beside torch >= 2 (gluoncv 0.10/0.11 beside our torch 2.13).

gluoncv's ``__init__`` asks ``gluoncv.check._require_pytorch_version('1.4.0', '2.0.0')`` and
treats an ImportError as "no torch: MXNet half only", but a torch outside that range raises
RuntimeError, which nothing catches, so the whole package fails to import although its MXNet
half (``gluoncv.model_zoo`` etc., all BytePS's gluon scripts use) never touches torch.

The narrowest fix: when ``gluoncv.check`` is loaded, wrap that one function so its
RuntimeError becomes the ImportError gluoncv already handles. gluoncv then does exactly what it
does where torch is absent (``gluoncv._found_pytorch`` is False, its MXNet half loads), while
``torch`` itself is never touched: no attribute is patched, not even for a moment, so the rest
of the process sees the real torch. Where torch is not imported yet, its installed version is
read from its package metadata: an MXNet process does not import torch (over a second of CPU)
only for gluoncv to turn it down. Nothing on disk changes. The hook is a meta-path finder
that only answers for ``gluoncv.check``, and removes itself once it has done its work.

Rejected: hiding torch (``sys.modules['torch'] = None``) or faking ``torch.__version__`` while
gluoncv imports. Both change torch for the whole process during that window (another thread's
``import torch`` fails, or reads a wrong version), and only cover the gluoncv modules imported
inside the window, so the import had to be a special call rather than a plain ``import``.
"""
import functools
import importlib.abc
import importlib.metadata
import re
import sys

CHECKED_MODULE = "gluoncv.check"
CHECK_FUNCTION = "_require_pytorch_version"


def _release(version):
    """"2.13.0+cpu" -> (2, 13, 0): the leading numbers, padded to three."""
    numbers = re.match(r"\d+(?:\.\d+)*", version)
    parts = tuple(int(n) for n in numbers.group(0).split(".")) if numbers else ()
    return (parts + (0, 0, 0))[:3]


def _installed_torch_beyond(maximum):
    """The installed torch's version when it is at least ``maximum``, from its metadata (torch is
    not imported); None when it is below, or not installed, or has no readable version."""
    try:
        installed = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    if not re.match(r"\d", installed or ""):
        return None
    return installed if _release(installed) >= _release(maximum) else None


def _unsupported_torch_is_absent(check):
    @functools.wraps(check)
    def require_pytorch_version(*args, **kwargs):
        maximum = args[1] if len(args) > 1 else kwargs.get("max_torch_version", "2.0.0")
        installed = None if "torch" in sys.modules else _installed_torch_beyond(str(maximum))
        if installed:
            raise ImportError(f"gluoncv's torch half is disabled by bps_gc.mxnet: torch {installed} is installed, "
                              f"gluoncv wants < {maximum}")
        try:
            return check(*args, **kwargs)
        except RuntimeError as e:  # "Legacy torch==2.x detected": gluoncv's torch half is out
            raise ImportError(f"gluoncv's torch half is disabled by bps_gc.mxnet: {e}") from e
    require_pytorch_version.bps_gc_wrapped = True
    return require_pytorch_version


def _wrap_check(module):
    check = getattr(module, CHECK_FUNCTION, None)
    if callable(check) and not getattr(check, "bps_gc_wrapped", False):
        setattr(module, CHECK_FUNCTION, _unsupported_torch_is_absent(check))


class _WrappingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):  # get_source, get_code, ...: the real loader's (inspect, pdb)
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _wrap_check(module)


class GluoncvTorchCheckFinder(importlib.abc.MetaPathFinder):
    """Answers only for ``gluoncv.check``: finds it with the other finders and wraps its
    loader; then leaves ``sys.meta_path``."""

    def find_spec(self, fullname, path, target=None):
        if fullname != CHECKED_MODULE:
            return None
        uninstall()  # one module, once; the finders left find it as they would have
        spec = None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec else None
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _WrappingLoader(spec.loader)
        return spec


def install():
    """Put the finder on ``sys.meta_path``; if ``gluoncv.check`` is loaded already (an earlier
    ``import gluoncv`` failed on it, or succeeded), wrap its function in place instead, so that
    a retry of ``import gluoncv`` works too."""
    if CHECKED_MODULE in sys.modules:
        _wrap_check(sys.modules[CHECKED_MODULE])
        return
    if not any(isinstance(f, GluoncvTorchCheckFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, GluoncvTorchCheckFinder())


def uninstall():
    """Take the finder off ``sys.meta_path`` (it does so itself once gluoncv.check is found)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, GluoncvTorchCheckFinder)]
