"""Sending and receiving bps_gc messages on ZeroMQ sockets, and the shared-token check.

ROUTER sockets (scheduler, servers) see [identity, header, payload?]; DEALER sockets (every
node's links) see [header, payload?]. Large payloads are sent without copying and received
straight into caller-provided buffers (``recv_into``), so a 100 MB push costs no allocation.
"""
import logging

import zmq
import zmq.auth.thread

from .wire import Header, MalformedMessage, Msg

log = logging.getLogger(__name__)
ZERO_COPY_MIN = 64 * 1024  # below this, copying is cheaper than zmq's zero-copy bookkeeping
AUTH_USER = "bps_gc"


class Auth:
    """PLAIN authentication with the job's shared token (BPS_GC_AUTH_TOKEN).

    Bound sockets require it through ZeroMQ's ZAP handler, so a peer without the token cannot
    complete the handshake: it can neither join the cluster nor push or pull.
    """

    def __init__(self, context, token):
        self.token = token
        self._thread = None
        if token:
            self._thread = zmq.auth.thread.ThreadAuthenticator(context, log=log)
            self._thread.start()
            self._thread.configure_plain(domain="*", passwords={AUTH_USER: token})

    def server(self, sock):
        if self.token:
            sock.plain_server = True
        return sock

    def client(self, sock):
        if self.token:
            sock.plain_username = AUTH_USER.encode()
            sock.plain_password = self.token.encode()
        return sock

    def stop(self):
        if self._thread:
            self._thread.stop()
            self._thread = None


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
        if bool(more) != bool(header.length):
            raise MalformedMessage(f"{header}: payload frame {'present' if more else 'missing'}")
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


__all__ = ["Auth", "Header", "MalformedMessage", "Msg", "Received", "drain", "recv", "send"]
