"""BPS_GC_TCP_CONGESTION (wire/congestion.py): a node sets the congestion control of its own
TCP data links, on both ends, and leaves everything else to the host's default."""
import json
import os
import shutil
import socket
import sys
import time

import pytest
import zmq

from bps_gc.config import Config, ConfigError, available_congestion_controls
from bps_gc.wire import congestion
from cluster import TESTS, run_local
from conftest import LAUNCH_PYTHONPATH
from tcp_links import own_tcp_connections

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_CONGESTION is Linux's")
AVAILABLE = available_congestion_controls()
SYSTEM = open("/proc/sys/net/ipv4/tcp_congestion_control").read().strip() if AVAILABLE else None
# an algorithm other than the host's default, so that seeing it proves bps_gc set it
OTHER = next((a for a in ("reno", "cubic", "bbr") if a in AVAILABLE and a != SYSTEM), None)
needs_other = pytest.mark.skipif(OTHER is None, reason="the kernel offers no second congestion control")


def wait_for(predicate, seconds=5.0):
    end = time.monotonic() + seconds
    while not predicate() and time.monotonic() < end:
        time.sleep(0.02)
    return predicate()


def connected_pair(ctx, algorithm):
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    threads = [congestion.watch(router, algorithm), congestion.watch(dealer, algorithm)]
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"ping")
    assert router.poll(5000)
    assert router.recv_multipart()[1] == b"ping"
    ends = lambda: {k: v for k, v in own_tcp_connections().items() if port in k}  # noqa: E731
    return router, dealer, ends, threads


@needs_other
def test_both_ends_of_a_link_get_the_algorithm():
    ctx = zmq.Context()
    try:
        router, dealer, ends, threads = connected_pair(ctx, OTHER)
        assert wait_for(lambda: len(ends()) == 2 and set(ends().values()) == {OTHER}), ends()
        dealer.close(linger=0)
        router.close(linger=0)
    finally:
        ctx.term()
    for thread in threads:  # a watcher ends with its socket's context: no thread left behind
        thread.join(5)
        assert not thread.is_alive()


def test_none_leaves_the_host_default():
    ctx = zmq.Context()
    try:
        router, dealer, ends, threads = connected_pair(ctx, None)
        assert threads == [None, None]
        assert len(ends()) == 2 and set(ends().values()) == {SYSTEM}
        dealer.close(linger=0)
        router.close(linger=0)
    finally:
        ctx.term()


def test_a_descriptor_that_is_not_tcp_refuses_quietly():
    a, b = socket.socketpair()
    try:
        assert congestion.set_on_fd(a.fileno(), "cubic") is False
        assert congestion.set_on_fd(1 << 20, "cubic") is False  # not open at all
    finally:
        a.close()
        b.close()


BASE = {"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1",
        "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000", "DMLC_WORKER_ID": "0"}


def test_config_default_system_and_a_bad_name():
    assert Config.from_env(BASE).tcp_congestion == ("cubic" if "cubic" in AVAILABLE else None)
    assert Config.from_env(dict(BASE, BPS_GC_TCP_CONGESTION="system")).tcp_congestion is None
    with pytest.raises(ConfigError) as e:
        Config.from_env(dict(BASE, BPS_GC_TCP_CONGESTION="vegas2"))
    assert str(e.value).startswith("BPS_GC_TCP_CONGESTION: unknown algorithm 'vegas2'")
    for name in AVAILABLE:
        assert name in str(e.value)
        assert Config.from_env(dict(BASE, BPS_GC_TCP_CONGESTION=name)).tcp_congestion == name


@needs_other
@pytest.mark.parametrize("setting", ["other", "system"])
def test_a_job_sets_it_on_both_ends_of_its_worker_to_server_links(tmp_path, setting):
    """A real job over TCP (BPS_GC_LOCAL_IPC=0: no unix sockets), 2 workers and 2 servers: each
    worker's link to each server, on the worker's end (read in the worker) and on the
    server's (through ss, where the host has it)."""
    want = OTHER if setting == "other" else SYSTEM
    env = {"BPS_GC_LOCAL_IPC": "0", "BPS_GC_TCP_CONGESTION": OTHER if setting == "other" else "system"}
    out = tmp_path / "links.json"
    result = run_local([sys.executable, os.path.join(TESTS, "congestion_job.py"), str(out)],
                       workers=2, servers=2, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(2):
        links = json.loads((tmp_path / f"links.json.{rank}").read_text())
        assert len(links["worker_ends"]) == 2 and set(links["worker_ends"].values()) == {want}, links
        if links["server_ends"] is not None:
            assert len(links["server_ends"]) == 2 and set(links["server_ends"].values()) == {want}, links


def allowed_congestion_controls():
    with open("/proc/sys/net/ipv4/tcp_allowed_congestion_control") as f:
        return f.read().split()


RESTRICTED = next((a for a in AVAILABLE if AVAILABLE and a not in allowed_congestion_controls()), None)


def without_net_admin(code, env):
    """Run ``code`` in a Python without CAP_NET_ADMIN (setpriv drops it from the bounding set)."""
    import subprocess
    full = dict(os.environ, **env, PYTHONPATH=LAUNCH_PYTHONPATH)
    return subprocess.run(["setpriv", "--bounding-set=-net_admin", sys.executable, "-c", code], env=full,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None or RESTRICTED is None,
                    reason="needs root with setpriv (to drop CAP_NET_ADMIN) and an algorithm the host does "
                           "not allow everybody")
def test_an_algorithm_this_user_may_not_set_is_refused_by_name_and_the_default_falls_back():
    code = ("import os\nfrom bps_gc.config import Config, ConfigError\n"
            "try:\n    print(Config.from_env(dict(os.environ)).tcp_congestion)\n"
            "except ConfigError as e:\n    print('REFUSED', e)\n")
    refused = without_net_admin(code, dict(BASE, BPS_GC_TCP_CONGESTION=RESTRICTED))
    assert refused.returncode == 0, refused.stderr
    assert refused.stdout.startswith(f"REFUSED BPS_GC_TCP_CONGESTION: this process may not use {RESTRICTED!r}")
    assert "tcp_allowed_congestion_control" in refused.stdout and "'system'" in refused.stdout
    default = without_net_admin(code, BASE)  # unset: cubic only where this user may set it
    want = "cubic" if "cubic" in allowed_congestion_controls() else "None"
    assert default.returncode == 0 and default.stdout.strip() == want, (default.stdout, default.stderr)


def test_looking_at_descriptors_leaves_none_open():
    with open(os.devnull) as not_a_socket:
        before = len(os.listdir("/proc/self/fd"))
        assert congestion.set_on_fd(not_a_socket.fileno(), "cubic") is False
        own_tcp_connections()
        assert len(os.listdir("/proc/self/fd")) == before
