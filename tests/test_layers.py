"""Lower layers never import higher ones: config -> transport -> roles -> codecs -> bindings ->
launcher; the codec library and the server never need a framework. ``collective`` sits beside
roles (layer 3) and is the one lower layer that uses torch (torch.distributed carries its bytes);
core reaches it only when the environment asks for it."""
import ast
import os
import subprocess
import sys

import pytest

from conftest import ROOT

PACKAGE = os.path.join(ROOT, "bps_gc")
# layer -> bps_gc subpackages/modules it may import (besides itself)
ALLOWED = {
    "config": set(),
    "transport": {"config"},
    "roles": {"config", "transport"},
    "collective": {"config", "transport", "roles"},
    "compress": set(),
    "launcher": {"config"},
    "core": {"config", "transport", "roles", "compress", "collective"},
    "node": {"config", "transport", "roles", "compress"},
    "bindings": {"config", "core", "compress"},  # algorithms over the communicator (core)
    "torch": {"core", "bindings", "compress", "collective"},
    "mxnet": {"core", "bindings", "compress", "config"},
}
FRAMEWORKS = {"torch", "mxnet", "gluoncv"}


def layer_of(path):
    rel = os.path.relpath(path, PACKAGE)
    return rel.split(os.sep)[0].removesuffix(".py")


def imports(path):
    tree = ast.parse(open(path).read())
    pkg_parts = os.path.relpath(os.path.dirname(path), ROOT).split(os.sep)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = pkg_parts[: len(pkg_parts) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            # "from .. import core": the names may be the modules
            yield from (f"{module}.{alias.name}" for alias in node.names)


def sources():
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                yield os.path.join(folder, name)


@pytest.mark.parametrize("path", [p for p in sources() if layer_of(p) in ALLOWED],
                         ids=lambda p: os.path.relpath(p, ROOT))
def test_no_upward_imports(path):
    layer = layer_of(path)
    for name in imports(path):
        top = name.split(".")[0]
        if top == "bps_gc" and "." in name:
            target = name.split(".")[1]
            assert target == layer or target in ALLOWED[layer], f"{layer} imports bps_gc.{target}"
        if layer == "collective":
            assert top not in FRAMEWORKS - {"torch"}, f"{layer} imports {top}"
        elif layer not in ("torch", "mxnet"):
            assert top not in FRAMEWORKS, f"{layer} imports {top}"
        elif top in FRAMEWORKS:
            assert top == layer, f"bps_gc.{layer} imports {top}"


def test_server_runs_without_frameworks():
    # a server host needs numpy and pyzmq only: importing the node must not pull in a framework
    code = ("import sys, bps_gc.node, bps_gc.compress, bps_gc.core\n"
            "bad = [m for m in ('torch', 'mxnet') if m in sys.modules]\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
