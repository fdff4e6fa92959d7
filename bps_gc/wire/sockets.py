"""Sending and receiving bps_gc messages on ZeroMQ sockets, and the shared-token check.

ROUTER sockets (scheduler, servers) see [identity, header, payload?]; DEALER sockets (every
node's links) see [header, payload?]. Large payloads are sent without copying and received
straight into caller-provided buffers (``recv_into``), so a 100 MB push costs no allocation.
"""
import errno
import hashlib
import ipaddress
import logging
import socket
import time

import zmq
import zmq.utils.z85

from .wire import HEADER, MAX_JSON, Header, MalformedMessage, Msg

log = logging.getLogger(__name__)
ZERO_COPY_MIN = 64 * 1024  # below this, copying is cheaper than zmq's zero-copy bookkeeping
AUTH_USER = "bps_gc"


CONTROL_MAX_BYTES = HEADER.size + MAX_JSON + 4096  # a bound socket that only takes control messages


class BindError(RuntimeError):
    """A configured address cannot be bound (the port is in use, or the host is not ours)."""


def bind(sock, host, port, max_bytes, what):
    """Bind ``sock`` to host:port (port 0: a free one); returns the port. ``max_bytes`` is the
    largest legal message: ZeroMQ drops a peer that announces a larger frame before allocating
    it, so a bogus length costs nothing."""
    sock.setsockopt(zmq.MAXMSGSIZE, int(max_bytes))
    try:
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{host}")
        warn_if_open(sock, host, port)
        return port
    except zmq.ZMQError as e:
        if e.errno == errno.EADDRINUSE:
            raise BindError(f"{what}: port {port} on {host} is already in use") from None
        raise BindError(f"{what}: cannot bind {host}:{port}: {e.strerror}") from None


_warned_open = []


def warn_if_open(sock, host, port):
    """Warn once per process when a socket listens beyond loopback with no token: anyone who
    reaches the address can join the job, push and pull (docs/settings.md, "Security")."""
    if _warned_open or sock.getsockopt(zmq.MECHANISM) != zmq.NULL or _loopback(host):
        return
    _warned_open.append(host)
    log.warning("listening on %s:%s with no BPS_GC_AUTH_TOKEN: anyone who can reach it can join "
                "this job and read or change its tensors (set BPS_GC_AUTH_TOKEN, and "
                "BPS_GC_ENCRYPT=1 to encrypt; see docs/settings.md)", host, port)


def _loopback(host):
    """Whether every address ``host`` names is a loopback one (127.0.0.0/8, ::1)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def bind_local(sock, host, port):
    """Also bind ``sock`` to a Linux abstract unix socket named after its TCP address, for peers
    on the same host (and network namespace): ZeroMQ's ipc moves a byte with less kernel work
    than TCP loopback. Returns the endpoint, or None where there is none (not Linux, taken)."""
    endpoint = f"ipc://@bps_gc/{host}:{port}"
    try:
        sock.bind(endpoint)
    except zmq.ZMQError:
        return None
    return endpoint


def host_of(address):
    """The host of an address-book address ("host:port", or a bare host)."""
    return address.rpartition(":")[0] or address


def peer_endpoint(entry, own_host):
    """How to reach an address-book entry: its unix socket if it advertised one and runs on
    this node's host, else TCP."""
    local = entry.get("local")
    if local and host_of(entry["address"]) == own_host:
        return local
    return f"tcp://{entry['address']}"


def curve_keys(token):
    """The job's CURVE key pair, derived from the shared token (every node derives the same)."""
    secret = zmq.utils.z85.encode(hashlib.sha256(b"bps_gc-curve:" + token.encode()).digest())
    return zmq.curve_public(secret), secret


class _TokenKey:
    """ZAP callback for CURVE: only the key derived from the token may connect."""

    def __init__(self, public):
        self.public = public

    def callback(self, domain, key):
        return key == self.public


class Auth:
    """Authentication with the job's shared token (BPS_GC_AUTH_TOKEN).

    PLAIN by default: bound sockets require the token through ZeroMQ's ZAP handler, so a peer
    without it cannot complete the handshake: it can neither join the cluster nor push or pull.
    With ``encrypt`` (BPS_GC_ENCRYPT=1) every link uses CURVE instead (encrypted), with the key
    pair derived from the token; a peer without the token has neither the server's public key
    nor an accepted client key.
    """

    def __init__(self, context, token, encrypt=False):
        self.token = token
        self.keys = curve_keys(token) if token and encrypt else None
        self._thread = None
        if token:
            import zmq.auth.thread  # here: it imports asyncio (~12 ms at every process's start)
            self._thread = zmq.auth.thread.ThreadAuthenticator(context, log=log)
            self._thread.start()
            if self.keys:
                self._thread.configure_curve_callback(domain="*", credentials_provider=_TokenKey(self.keys[0]))
            else:
                self._thread.configure_plain(domain="*", passwords={AUTH_USER: token})

    def server(self, sock):
        if self.keys:
            sock.curve_publickey, sock.curve_secretkey = self.keys
            sock.curve_server = True
        elif self.token:
            sock.plain_server = True
        return sock

    def client(self, sock):
        if self.keys:
            sock.curve_publickey, sock.curve_secretkey = self.keys
            sock.curve_serverkey = self.keys[0]
        elif self.token:
            sock.plain_username = AUTH_USER.encode()
            sock.plain_password = self.token.encode()
        return sock

    def stop(self):
        if self._thread:
            self._thread.stop()
            self._thread = None


class DropLog:
    """Rate-limited logging of dropped (malformed or unexpected) messages, one per role: the
    first few are logged, then one line per ``every`` seconds with the count, so a flood of bad
    frames cannot flood the log."""

    def __init__(self, logger, first=20, every=10.0):
        self.log, self.first, self.every = logger, first, every
        self.count = 0
        self.next_at = 0.0

    def __call__(self, what, *args):
        self.count += 1
        now = time.monotonic()
        if self.count <= self.first or now >= self.next_at:
            self.log.warning("dropped %s (%d so far)", what % args if args else what, self.count)
            if self.count >= self.first:
                self.next_at = now + self.every


def send(sock, header, payload=None, identity=None):
    """Send one message; ``payload`` is bytes-like (a numpy array is sent as its memory)."""
    frames = [] if identity is None else [identity]
    header.length = 0 if payload is None else memoryview(payload).nbytes
    frames.append(header.pack())
    if payload is None:
        sock.send_multipart(frames, copy=True)
        return
    frames.append(payload)
    sock.send_multipart(frames, copy=header.length < ZERO_COPY_MIN)


def drain(sock):
    """Discard the rest of a multipart message."""
    while sock.getsockopt(zmq.RCVMORE):
        sock.recv(copy=False)


class Received:
    """A message taken off a socket: its header, the sender identity, and its payload (bytes or
    the caller's buffer), or the reason it was dropped."""

    __slots__ = ("identity", "header", "payload")

    def __init__(self, identity, header, payload):
        self.identity, self.header, self.payload = identity, header, payload


def recv(sock, router, buffer_for=None):
    """Receive one message; raises MalformedMessage (after draining it) if it is not valid.

    ``buffer_for(header)`` may return a writable buffer of exactly ``header.length`` bytes to
    receive the payload into; it returns None to receive into fresh bytes instead, or raises
    MalformedMessage to reject the message.
    """
    identity = None
    try:
        if router:
            identity = sock.recv()
            if not sock.getsockopt(zmq.RCVMORE):
                raise MalformedMessage("message has no header frame")
        raw = sock.recv()
        header = Header.unpack(raw)
        more = sock.getsockopt(zmq.RCVMORE)
        if header.length and not more:  # an empty payload (a sparse codec kept nothing) has an empty frame
            raise MalformedMessage(f"{header}: payload frame missing")
        payload = None
        if more:
            target = buffer_for(header) if buffer_for else None
            if target is None:
                payload = sock.recv()
                if len(payload) != header.length:
                    raise MalformedMessage(f"{header}: payload of {len(payload)} bytes")
            else:
                got = sock.recv_into(target)
                if got != header.length:
                    raise MalformedMessage(f"{header}: payload of {got} bytes")
                payload = target
            if sock.getsockopt(zmq.RCVMORE):
                raise MalformedMessage(f"{header}: extra frames")
        return Received(identity, header, payload)
    except MalformedMessage:
        drain(sock)
        raise
    except Exception as e:  # anything a hostile frame can provoke while parsing
        drain(sock)
        raise MalformedMessage(f"cannot parse message: {e}") from e


__all__ = ["Auth", "BindError", "CONTROL_MAX_BYTES", "DropLog", "Header", "bind", "host_of", "peer_endpoint", "curve_keys", "MalformedMessage", "Msg", "Received", "drain", "recv", "send"]
