"""Bound sockets take no message larger than the largest legal one (ZMQ_MAXMSGSIZE), a bogus
INIT cannot make a server allocate, and CURVE encryption (BPS_GC_ENCRYPT=1) keeps a peer
without the token out."""
import socket
import struct
import sys
import textwrap
import time

from cluster import run_local
from multihost import Job

# ZMTP 3.0 by hand (NULL mechanism), so the test itself never holds the gigabyte it announces
GREETING = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\x00" + b"\0" * 31
READY = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"


def announce_a_gigabyte(host, port):
    """Seconds until the peer closes the connection after a 1 GiB frame is announced (None if
    it is still open after 3 s, i.e. it is receiving it)."""
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(GREETING)
        s.recv(64)
        s.sendall(b"\x04" + bytes([len(READY)]) + READY)
        s.sendall(b"\x02" + struct.pack(">Q", 1 << 30) + b"\0" * 65536)
        s.settimeout(3)
        started = time.monotonic()
        try:
            while s.recv(65536):
                pass
        except socket.timeout:
            return None
        except ConnectionResetError:
            pass
        return time.monotonic() - started


PROBE = textwrap.dedent("""
    import json, os, sys, numpy as np, zmq, bps_gc.core as bps
    sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
    from test_faults_limits import announce_a_gigabyte
    from bps_gc.wire.wire import HEADER, MAGIC, Msg
    w = bps.init()
    bps.declare("g", shape=(1000,), dtype=np.float32)
    bps.barrier()
    if w.rank == 0:
        server = w.membership.book["servers"][0]["address"].rsplit(":", 1)
        peer = w.membership.book["workers"][1]["address"].rsplit(":", 1)
        root = (os.environ["DMLC_PS_ROOT_URI"], int(os.environ["DMLC_PS_ROOT_PORT"]))
        for what, (host, port) in [("scheduler", root), ("server", server), ("peer", peer)]:
            print("CLOSED", what, announce_a_gigabyte(host, int(port)) is not None, flush=True)
        # an INIT as a peer with the right identity (and token) could send it
        from bps_gc.ps.worker.commands import InitKey
        w.io.post(InitKey(77, 0, np.dtype(np.float32), {"name": "bogus", "n": 10**12, "params": {}}))
    bps.barrier()
    print("SUM", bps.push_pull(np.ones(1000, np.float32), "g", average=False).wait()[0], flush=True)
    bps.shutdown()
""")


def test_a_gigabyte_frame_is_refused_and_a_bogus_init_is_dropped():
    result = run_local([sys.executable, "-c", PROBE], workers=2, servers=1, timeout=90,
                       env={"BYTEPS_PARTITION_BYTES": "65536"})
    assert result.returncode == 0, result.stderr[-3000:]
    check_probe(result.stdout, result.stdout + result.stderr)


def test_multihost_a_gigabyte_frame_is_refused_and_a_bogus_init_is_dropped():
    job = Job(2, PROBE, env={"BYTEPS_PARTITION_BYTES": "65536"})
    statuses, _ = job.wait_all(90)
    assert all(s == 0 for s in statuses.values()), job.report(statuses)
    check_probe(job.text("worker0") + job.text("worker1"), job.text("server0"))


def check_probe(workers, server):
    for what in ("scheduler", "server", "peer"):
        assert f"CLOSED {what} True" in workers, workers
    assert "INIT of key 77 with n=1000000000000 (at most 16384)" in server
    assert workers.count("SUM 2.0") == 2


ENCRYPTED = textwrap.dedent("""
    import numpy as np, bps_gc.core as bps
    bps.init()
    bps.declare("g", shape=(100000,), dtype=np.float32)
    bps.declare("c", shape=(100000,), dtype=np.float32, compressor="onebit", ef="vanilla")
    out = bps.push_pull(np.ones(100000, np.float32), "g", average=False).wait()
    bps.push_pull(np.ones(100000, np.float32), "c", average=False, lr=0.1).wait()
    w = bps.worker()
    w.peers.send((w.rank + 1) % w.size, "hello", np.arange(5, dtype=np.uint8))
    assert list(w.peers.recv((w.rank - 1) % w.size, "hello")) == [0, 1, 2, 3, 4]
    print("SUM", float(out[0]), flush=True)
    bps.shutdown()
""")


def test_cluster_runs_encrypted_and_refuses_a_peer_without_the_token():
    env = {"BPS_GC_AUTH_TOKEN": "s3cret", "BPS_GC_ENCRYPT": "1"}
    result = run_local([sys.executable, "-c", ENCRYPTED], workers=2, servers=2, timeout=90, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("SUM 2.0") == 2
    started = time.monotonic()
    refused = run_local([sys.executable, "-c", ENCRYPTED], workers=1, servers=1, timeout=60,
                        env=dict(env, BPS_GC_JOIN_TIMEOUT="3", BYTEPS_FORCE_DISTRIBUTED="1"),
                        worker_env={"BPS_GC_ENCRYPT": "0", "BPS_GC_AUTH_TOKEN": "guess"})
    assert refused.returncode != 0 and "SUM" not in refused.stdout
    assert "could not join the cluster" in refused.stderr or "did not assemble" in refused.stderr, refused.stderr
    print(f"encrypted cluster: peer without the token refused, job ended after "
          f"{time.monotonic() - started:.2f} s", file=sys.stderr)


def test_multihost_cluster_runs_encrypted():
    job = Job(2, ENCRYPTED, servers=2, env={"BPS_GC_AUTH_TOKEN": "s3cret", "BPS_GC_ENCRYPT": "1"})
    statuses, elapsed = job.wait_all(60)
    assert all(s == 0 for s in statuses.values()), job.report(statuses)
    assert all("SUM 2.0" in job.text(f"worker{w}") for w in range(2))
