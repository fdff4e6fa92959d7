"""TCP congestion control on bps_gc's own data links (BPS_GC_TCP_CONGESTION, cubic by default).

Why: with servers co-located, each machine's NIC carries six flows at once with 4 machines
(its worker's pushes and its server's replies, to each of the 3 others), and each machine's
port receives as many. Under BBR, which paces at the bandwidth it estimated and does not back
off on loss, such flows overrun a shaped port's queue and lose packets; loss-based cubic shares
them with far fewer losses (docs/runtime.md, "Co-located servers on a shared link"). So a
node sets the algorithm on its own TCP connections and leaves the host's default to
everything else. Unix-socket links (a server on the same host) have none.

ZeroMQ opens its TCP sockets itself, so a socket monitor reports each connection (its file
descriptor) as it is made, and a small thread sets the option on a duplicate of that
descriptor. A connection's first bytes may go out before that; the option applies from then
on. A descriptor that is not TCP any more (closed and reused meanwhile) refuses the option,
which is ignored. Config.from_env has already checked that this process may set it.
"""
import logging
import os
import socket
import threading

import zmq

log = logging.getLogger(__name__)
EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED


def set_on_fd(fd, algorithm):
    """Set TCP_CONGESTION on descriptor ``fd`` (through a duplicate); True if it took."""
    try:
        copy = os.dup(fd)
    except OSError:
        return False
    try:
        dup = socket.socket(fileno=copy)
    except OSError:  # not a socket (any more)
        os.close(copy)
        return False
    try:
        dup.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, algorithm.encode())
        return True
    except OSError:
        return False
    finally:
        dup.close()


def watch(sock, algorithm):
    """Set ``algorithm`` on every TCP connection ``sock`` makes or accepts from now on.
    None or "" leaves them alone. Returns the watching thread (None when there is none)."""
    if not algorithm:
        return None
    # zmq.utils.monitor imports asyncio (and ssl), ~30 ms of every node's start for a setting few
    # jobs use: imported here, where one is set, so that its thread starts reading at once
    import zmq.utils.monitor  # noqa: F401
    try:
        monitor = sock.get_monitor_socket(EVENTS)
    except zmq.ZMQError as e:  # the links still work, on the host's default
        log.warning("TCP congestion control %s not set on this socket's links: %s", algorithm, e)
        return None
    thread = threading.Thread(target=_apply, args=(monitor, algorithm),
                              name="bps_gc-congestion", daemon=True)
    thread.start()
    return thread


def _apply(monitor, algorithm):
    # Ends when the watched socket closes (MONITOR_STOPPED) or its context terminates.
    from zmq.utils.monitor import recv_monitor_message  # imported by watch(), before its links open
    try:
        while True:
            event = recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                return
            if event["event"] & EVENTS and not set_on_fd(event["value"], algorithm):
                log.debug("TCP_CONGESTION=%s not set on %s", algorithm, event["endpoint"])
    except zmq.ZMQError:
        pass
    finally:
        monitor.close(linger=0)
