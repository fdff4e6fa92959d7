"""Imports torch (and the other big packages) with Python's cyclic garbage collector paused, then
freezes what they made. Every process the tests launch runs this first (tests/sitecustomize.py),
and so does each pytest process (tests/conftest.py).

Why: importing torch allocates millions of objects, which sets off hundreds of collections that
walk all of them again and again, and at exit the interpreter walks them once more. In a process
that builds a torch optimizer (which imports torch._dynamo) that was about half of its CPU: about
2.5 s against 1.3 s with the pause (`python scripts/suite_census.py` counts it per test). The
import itself is unchanged: the same modules run the same code. Frozen objects still go when
their last reference does; only cycles made during the import are never collected, and the
operating system takes them back at exit.
"""
import gc
import sys
from importlib.machinery import PathFinder

HEAVY = frozenset({"torch", "torch._dynamo", "mxnet", "gluoncv", "sympy", "scipy", "sklearn"})


class _GcPausedLoader:
    """The package's own loader, run with the collector paused; the module keeps the real one."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader
        outermost = gc.isenabled()
        gc.disable()
        try:
            self.loader.exec_module(module)
        finally:
            if outermost:
                gc.freeze()  # later collections (and the one at exit) skip what the import made
                gc.enable()


class _HeavyImportFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in HEAVY:
            return None
        spec = PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _GcPausedLoader(spec.loader)
        return spec


def install():
    if not any(finder is _HeavyImportFinder for finder in sys.meta_path):
        sys.meta_path.insert(0, _HeavyImportFinder)
