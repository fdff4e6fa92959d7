"""A server's same-host endpoint (wire/sockets.py bind_local, peer_endpoint): a worker on
the server's host reaches it over the unix socket, any other over TCP."""
import sys

import pytest
import zmq

from bps_gc.wire.sockets import bind, bind_local, peer_endpoint

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract unix sockets are Linux's")


def test_same_host_worker_reaches_the_server_over_its_unix_socket():
    ctx = zmq.Context()
    try:
        router = ctx.socket(zmq.ROUTER)
        port = bind(router, "127.0.0.1", 0, 1 << 20, "test server")
        local = bind_local(router, "127.0.0.1", port)
        assert local == f"ipc://@bps_gc/127.0.0.1:{port}"
        entry = {"address": f"127.0.0.1:{port}", "local": local}
        assert peer_endpoint(entry, "127.0.0.1") == local
        assert peer_endpoint(entry, "10.0.0.2") == f"tcp://127.0.0.1:{port}"
        assert peer_endpoint({"address": f"127.0.0.1:{port}"}, "127.0.0.1") == f"tcp://127.0.0.1:{port}"
        for endpoint in (local, f"tcp://127.0.0.1:{port}"):
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(endpoint)
            dealer.send(endpoint.encode())
            assert router.poll(5000)
            identity, payload = router.recv_multipart()
            assert payload == endpoint.encode()
            dealer.close(linger=0)
        other = ctx.socket(zmq.ROUTER)  # the name is taken while the first server lives
        assert bind_local(other, "127.0.0.1", port) is None
        other.close(linger=0)
        router.close(linger=0)
    finally:
        ctx.term()
