"""What the torch.distributed transport can and cannot protect.

It cannot authenticate or encrypt: torch's TCPStore and gloo's/NCCL's links take no token. So a
job that sets BPS_GC_AUTH_TOKEN or BPS_GC_ENCRYPT is refused at start rather than run open while
the user believes it protected. What it can do is listen no wider than the address the user
gave: the store bps_gc hosts is bound to the rendezvous address (torch's own TCPStore binds
every interface whatever host name it is given).
"""
import errno
import logging
import os
import socket

from ..config import ConfigError, EnvReader

log = logging.getLogger(__name__)


def refuse_security_settings(environ=None):
    """Raise ConfigError (one line) when the environment asks for authentication or encryption."""
    read = EnvReader(os.environ if environ is None else environ)
    asked = [name for name, value in (("BPS_GC_AUTH_TOKEN", read.text("BPS_GC_AUTH_TOKEN", "")),
                                      ("BPS_GC_ENCRYPT", read.flag("BPS_GC_ENCRYPT", False)))
             if value]
    if asked:
        raise ConfigError(asked[0], "the torch.distributed transport cannot authenticate or encrypt "
                                    "(its TCPStore and gloo/NCCL links take no token); unset it, or "
                                    "run the parameter server (BPS_GC_TRANSPORT=ps, bpslaunch), which can")


def store_listener(host, port):
    """A listening socket's file descriptor bound to host:port only, for TCPStore's
    ``master_listen_fd`` (the store then takes the descriptor over); None where this host does
    not hold that address (e.g. a name that resolves to a NAT'd one): torch then binds every
    interface, as docs/settings.md says."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror:
        return None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch sets its own
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRNOTAVAIL:
            log.warning("the rendezvous address %s is not one of this host's: the store listens on "
                        "every interface (torch's TCPStore's own way)", host)
            return None
        raise
    return sock.detach()
