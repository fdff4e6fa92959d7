import importlib.util
import json
import os
import sys
import warnings

import gc_paused_imports
import leftovers
import pytest

gc_paused_imports.install()  # before any test module imports torch: see its docstring

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
sys.path.insert(0, ROOT)
# what a launched process's PYTHONPATH holds: this checkout, and tests/ so that Python runs
# tests/sitecustomize.py at its start (torch imported with the GC paused; the census's record)
LAUNCH_PYTHONPATH = os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [LAUNCH_PYTHONPATH, os.environ.get("PYTHONPATH")]))
# One OpenMP thread in this process and every process it launches, unless a test asks for more:
# the tests' tensors are small, and with one thread per core torch's (and OpenBLAS's) idle threads
# spin on a box whose cores the job's other processes need (a parameter-server restart_job.py
# phase: 7.2-9.7 s of CPU with them, 4.4-4.7 s without). Read once, when torch or numpy loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module", autouse=True)
def no_leftover_processes(request):
    """After each file's tests (and its fixtures' teardown: this one is set up first), no
    process it started may be left running: tests/leftovers.py kills any, and a warning in the
    run's summary names them (a fixture's stderr is shown only when a test fails)."""
    yield
    killed = leftovers.reap_leftovers(request.module.__name__)
    if killed:
        warnings.warn(leftovers.LeftoverProcesses(
            f"{request.module.__name__} left {len(killed)} process(es) running, killed: "
            + "; ".join(command[:120] for command in killed)))


def pytest_configure(config):
    leftovers.become_subreaper()  # orphaned descendants (a killed torchrun's ranks) come to this process


def skip_unless_installed(*modules):
    """Skip the calling test module (or test) where a package is not installed, without importing
    it: pytest.importorskip imports it, in every pytest process that collects the module (MXNet:
    ~1 s of CPU, matplotlib 0.15 s), where only the processes the tests launch use it."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}", allow_module_level=True)


def alive(pid):
    """Whether process ``pid`` still runs (a zombie is gone, just not reaped yet)."""
    try:
        return leftovers.stat_fields(pid)[0] != "Z"
    except OSError:
        return False


def load_script(path, name=None):
    """A script (an example's train.py, the demo, a study script) as a module in this process,
    to call its parse_args or main() where no process is needed; ``name``: its module name
    (default: the file's)."""
    spec = importlib.util.spec_from_file_location(name or os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The suite runs as `pytest -n 2 --dist loadfile --no-loadscope-reorder` (scripts/test.sh): each
# worker takes a whole file at a time, in collection order. xdist's default order (most tests
# first) left the slow files of few tests (training scripts, benchmarks) for the end, one worker
# busy with them while the other sat idle. Here the files come heaviest first, by the seconds
# their tests took in earlier runs (pytest's cache, .pytest_cache/), or, where this checkout has
# none (a fresh clone, CI), by tests/file_seconds.json (scripts/record_test_order.py writes it
# from a cache); files never timed go first.
TEST_SECONDS = "bps_gc/test_seconds"
RAN_SECONDS = {}  # this session's: test id -> setup + call + teardown seconds


def file_of(nodeid):
    return nodeid.split("::", 1)[0]


def recorded_seconds(config):
    # an xdist worker takes the main process's copy: every worker must collect the same order,
    # even if another pytest in this folder rewrites the cache while they collect
    if hasattr(config, "workerinput"):
        return config.workerinput.get(TEST_SECONDS, {})
    return config.cache.get(TEST_SECONDS, {}) if hasattr(config, "cache") else {}


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput[TEST_SECONDS] = recorded_seconds(node.config)


COMMITTED_SECONDS = os.path.join(ROOT, "tests", "file_seconds.json")


def committed_file_seconds():
    try:
        with open(COMMITTED_SECONDS) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def pytest_collection_modifyitems(config, items):
    seconds = recorded_seconds(config)
    by_file = {} if seconds else committed_file_seconds()
    if not seconds and not by_file:
        return
    first_seen, cost = {}, {}
    for item in items:
        path = file_of(item.nodeid)
        first_seen.setdefault(path, len(first_seen))
        if by_file:
            cost[path] = by_file.get(path, float("inf"))
            continue
        known = seconds.get(item.nodeid)
        cost[path] = float("inf") if known is None or cost.get(path) == float("inf") else cost.get(path, 0) + known
    items.sort(key=lambda item: (-cost[file_of(item.nodeid)], first_seen[file_of(item.nodeid)]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    # scripts/suite_census.py: each test's CPU, the pytest process's own and that of every process
    # it waited for (their children too, once waited for: killed ones, which record nothing, included)
    path = os.environ.get("BPS_GC_CENSUS")
    if not path:
        yield
        return
    import resource
    before = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    yield
    after = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    own, waited = (a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime for a, b in zip(after, before))
    with open(path, "a") as f:
        f.write(json.dumps({"pytest_test": item.nodeid, "own_cpu": own, "waited_cpu": waited}) + "\n")


def pytest_runtest_logreport(report):
    RAN_SECONDS[report.nodeid] = RAN_SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    # the main process only (xdist's workers report to it), and only the tests that ran
    if RAN_SECONDS and hasattr(session.config, "cache") and not hasattr(session.config, "workerinput"):
        session.config.cache.set(TEST_SECONDS, {**session.config.cache.get(TEST_SECONDS, {}), **RAN_SECONDS})
