"""The layer map of docs/runtime.md, enforced: lower layers never import higher ones. Bottom-up:
config -> wire -> compress -> comm -> {ps, collective} -> core -> algorithms -> {torch, mxnet};
node (the PS roles' entry) sits beside core, the launcher imports only config. ps/ and collective/
are siblings that never import each other; no import circle among bps_gc's modules. The codec
library and the server never need a framework: ``collective`` (torch.distributed carries its bytes)
and ``compress/device`` (codec chains over torch tensors) are the only lower parts that import
torch; core reaches the collective only when the environment asks for it, ``build_chain`` reaches
compress/device only when it is given a device."""
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
    "wire": {"config"},
    "compress": set(),  # the codec library stands alone (numpy, and torch in compress/device)
    "comm": {"config", "wire", "compress"},  # the interface every transport implements
    "ps": {"config", "wire", "compress", "comm"},  # the parameter server
    "collective": {"config", "wire", "compress", "comm"},  # torch.distributed
    "core": {"config", "wire", "compress", "comm", "ps", "collective"},  # picks a transport
    "node": {"config", "wire", "compress", "comm", "ps"},  # python -m bps_gc.node
    "algorithms": {"config", "compress", "comm", "core"},  # algorithms over the communicator
    "torch": {"core", "algorithms", "compress", "comm", "collective"},
    "mxnet": {"core", "algorithms", "compress", "comm", "config"},
    "launcher": {"config"},
}
FRAMEWORKS = {"torch", "mxnet", "gluoncv"}
DEVICE_CODECS = os.path.join(PACKAGE, "compress", "device")


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
        if layer == "collective" or path.startswith(DEVICE_CODECS + os.sep):
            assert top not in FRAMEWORKS - {"torch"}, f"{layer} imports {top}"
        elif layer not in ("torch", "mxnet"):
            assert top not in FRAMEWORKS, f"{layer} imports {top}"
        elif top in FRAMEWORKS:
            assert top == layer, f"bps_gc.{layer} imports {top}"


def module_level_imports(path):
    """The names imported by a module's top-level statements (not inside functions)."""
    tree = ast.parse(open(path).read())
    top = ast.Module(body=[n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))],
                     type_ignores=[])
    pkg_parts = os.path.relpath(os.path.dirname(path), ROOT).split(os.sep)
    for node in top.body:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        else:
            base = pkg_parts[: len(pkg_parts) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)


@pytest.mark.parametrize("path", [p for p in sources() if layer_of(p) == "compress"
                                  and not p.startswith(DEVICE_CODECS + os.sep)],
                         ids=lambda p: os.path.relpath(p, ROOT))
def test_compress_reaches_device_codecs_only_on_demand(path):
    # compress/device imports torch: build_chain loads it by name when given a device (and the
    # package registers its chains), never when a module of compress loads
    for name in module_level_imports(path):
        assert not name.startswith("bps_gc.compress.device"), f"{path} imports {name} at load"


def test_numpy_chain_imports_no_torch():
    code = ("import sys, numpy as np, bps_gc.compress as c\n"
            "chain = c.build_chain({'compressor': 'topk', 'k': 3, 'ef': 'vanilla'}, 100, np.float32)\n"
            "chain.decompress(chain.compress(np.ones(100, np.float32), 0.1))\n"
            "assert 'torch' not in sys.modules and 'bps_gc.compress.device' not in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_server_runs_without_frameworks():
    # a server host needs numpy and pyzmq only: importing the node must not pull in a framework
    code = ("import sys, bps_gc.node, bps_gc.compress, bps_gc.core\n"
            "bad = [m for m in ('torch', 'mxnet') if m in sys.modules]\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def module_name(path):
    rel = os.path.relpath(path, ROOT).removesuffix(".py").split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def load_time_graph():
    """bps_gc module -> the bps_gc modules its top-level statements import (a name imported from
    a package counts as the package's __init__ unless it is a submodule)."""
    modules = {module_name(p): p for p in sources()}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in module_level_imports(path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def test_no_import_circle():
    # a package's __init__ importing its own submodules is how packages work, not a circle
    graph = load_time_graph()
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == "open":
                circle = stack[stack.index(target):] + [target]
                pytest.fail("import circle: " + " -> ".join(circle))
            if target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module)


def test_ps_and_collective_never_import_each_other():
    for path in sources():
        layer = layer_of(path)
        if layer in ("ps", "collective"):
            other = {"ps": "collective", "collective": "ps"}[layer]
            for name in imports(path):  # function-level imports too
                assert not name.startswith(f"bps_gc.{other}"), f"{path} imports {name}"
