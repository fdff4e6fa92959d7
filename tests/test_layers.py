"""The layer map of docs/runtime.md, enforced: lower layers never import higher ones. Bottom-up:
config -> wire -> compress -> comm -> {ps, collective} -> core -> algorithms -> {torch, mxnet};
node (the PS roles' entry) sits beside core, the launcher imports only config. ps/ and collective/
are siblings that never import each other; no import circle among bps_gc's modules, counting the
imports inside functions. The codec library and the server never need a framework: ``collective``
(torch.distributed carries its bytes) and ``compress/device`` (codec chains over torch tensors)
are the only lower parts that import torch; core reaches the collective only when the environment
asks for it, ``build_chain`` reaches compress/device only when it is given a device."""
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
    # the codec library: numpy (and torch in compress/device); below it only config's SettingError
    # and wire's json_object (a setting named in an error, a JSON object read), written once
    "compress": {"config", "wire"},
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


def imports(path, root=ROOT):
    """Every name a module imports, at load or inside a function."""
    tree = ast.parse(open(path).read())
    pkg_parts = os.path.relpath(os.path.dirname(path), root).split(os.sep)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = pkg_parts[: len(pkg_parts) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            # "from .. import core": the names may be the modules
            yield from (f"{module}.{alias.name}" for alias in node.names)


def sources(package=PACKAGE):
    for folder, _, files in os.walk(package):
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


def modules_loaded(imports, after="", watched=()):
    """Which of ``watched`` a fresh interpreter has loaded once it ran ``imports`` (and ``after``):
    what importing them costs every process that does, seen from outside this one."""
    code = f"import sys\nimport {imports}\n{after}\nprint(' '.join(m for m in {tuple(watched)!r} if m in sys.modules))\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_numpy_chain_imports_no_torch():
    after = ("chain = c.build_chain({'compressor': 'topk', 'k': 3, 'ef': 'vanilla'}, 100, np.float32)\n"
             "chain.decompress(chain.compress(np.ones(100, np.float32), 0.1))")
    assert modules_loaded("numpy as np, bps_gc.compress as c", after, ("torch", "bps_gc.compress.device")) == []


def test_server_runs_without_frameworks():
    # a server host needs numpy and pyzmq only: importing the node must not pull in a framework
    assert modules_loaded("bps_gc.node, bps_gc.compress, bps_gc.core", watched=("torch", "mxnet")) == []


def test_torch_binding_leaves_sharding_modules_unloaded():
    # every launched rank imports bps_gc.torch: DTensor and FSDP2 cost about 1 s of CPU where
    # nothing else loads sympy, and 0.2-0.4 s in a rank whose optimizer brings torch._dynamo
    # (and sympy with it), so only the ranks that shard a model load them
    heavy = ("sympy", "torch.distributed.tensor", "torch.distributed.fsdp", "torch._dynamo")
    assert modules_loaded("bps_gc.torch", watched=heavy) == []
    assert modules_loaded("bps_gc.torch, torch.distributed.fsdp", watched=heavy[:2]) == list(heavy[:2])  # seen


def module_name(path, root=ROOT):
    rel = os.path.relpath(path, root).removesuffix(".py").split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def import_graph(package=PACKAGE, root=ROOT):
    """Module -> the package's modules it imports, at load or inside a function (a deferred import
    still runs back: it only hides the circle from whoever reads the top of the file). A name
    imported from a package counts as the package's __init__ unless it is a submodule; a package's
    __init__ importing its own submodules is how packages work, not a circle."""
    modules = {module_name(p, root): p for p in sources(package)}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in imports(path, root):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                targets.add(imported)
        graph[name] = targets
    return graph


def import_circle(graph):
    """The first circle of ``graph`` found, as [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                circle = visit(target)
                if circle:
                    return circle
        stack.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            circle = visit(module)
            if circle:
                return circle
    return None


def test_no_import_circle():
    circle = import_circle(import_graph())
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_import_circle_through_a_function_is_found(tmp_path):
    # the checker itself: two modules of a package written here, one importing the other at load,
    # the other importing back inside a function
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from . import first\n")
    (package / "first.py").write_text("from .second import helper\n")
    (package / "second.py").write_text("def helper():\n    from .first import helper as again\n"
                                        "    return again\n")
    graph = import_graph(str(package), str(tmp_path))
    assert graph == {"pkg": {"pkg.first"}, "pkg.first": {"pkg.second"}, "pkg.second": {"pkg.first"}}
    assert import_circle(graph) == ["pkg.first", "pkg.second", "pkg.first"]
    (package / "second.py").write_text("def helper():\n    return helper\n")
    assert import_circle(import_graph(str(package), str(tmp_path))) is None


def test_ps_and_collective_never_import_each_other():
    for path in sources():
        layer = layer_of(path)
        if layer in ("ps", "collective"):
            other = {"ps": "collective", "collective": "ps"}[layer]
            for name in imports(path):  # function-level imports too
                assert not name.startswith(f"bps_gc.{other}"), f"{path} imports {name}"
