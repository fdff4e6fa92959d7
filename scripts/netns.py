"""Two network namespaces joined by a shaped veth pair, for benchmarks (root only).

    with ShapedLink("1gbit") as link:          # raises NetnsUnavailable if it cannot be made
        link.command("srv", ["python", ...])   # ["ip", "netns", "exec", <srv ns>, "python", ...]

The "srv" side gets 10.213.0.1/24, the "wrk" side 10.213.0.2/24. Each veth end has a root tbf
qdisc (rate, burst, latency 50ms), so traffic is shaped in both directions: what the workers
send (pushes) and what the server sends (pulls) each get ``rate``. Loopback is brought up in
both namespaces. The namespaces (and with them the veth pair) are always deleted on exit.
"""
import os
import re
import subprocess

SRV_ADDR = "10.213.0.1"
WRK_ADDR = "10.213.0.2"
PREFIX = 24
LATENCY = "50ms"
UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
IP_TIMEOUT = 20


class NetnsUnavailable(RuntimeError):
    """Namespaces or tc cannot be used here (not root, no CAP_NET_ADMIN, no iproute2...)."""


def parse_rate(text):
    """'1gbit' / '100mbit' / '500kbit' -> bits per second."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)bit\s*", text.lower())
    if not m:
        raise ValueError(f"rate must look like 1gbit, 100mbit or 500kbit, got {text!r}")
    bits = float(m.group(1)) * UNITS[m.group(2)]
    if bits <= 0:
        raise ValueError(f"rate must be positive, got {text!r}")
    return int(bits)


def tbf_burst(rate_bits):
    """Bucket size in bytes: 4 ms of traffic (enough for a 250 Hz timer), at least 32 KiB."""
    return max(32 * 1024, int(rate_bits / 8 * 0.004))


def _ip(*args, check=True):
    try:
        proc = subprocess.run(list(args), stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=IP_TIMEOUT)
    except FileNotFoundError as e:
        raise NetnsUnavailable(f"{args[0]} not found: {e}") from None
    except subprocess.TimeoutExpired:
        raise NetnsUnavailable(f"{' '.join(args)} timed out") from None
    if check and proc.returncode != 0:
        raise NetnsUnavailable(f"`{' '.join(args)}` failed ({proc.returncode}): "
                               f"{(proc.stderr or proc.stdout).strip()}")
    return proc


class _Created:
    """A context manager over ``create()`` and ``delete()``: whatever was made is deleted, also
    when creating fails half-way."""

    def __enter__(self):
        try:
            self.create()
        except BaseException:
            self.delete()
            raise
        return self

    def __exit__(self, *exc):
        self.delete()
        return False


class ShapedLink(_Created):
    def __init__(self, rate, tag=None):
        self.rate = rate
        self.rate_bits = parse_rate(rate)
        tag = str(os.getpid() if tag is None else tag)
        self.ns = {"srv": f"bpsgc-srv-{tag}", "wrk": f"bpsgc-wrk-{tag}"}
        self.veth = {"srv": f"bgs{tag}"[:15], "wrk": f"bgw{tag}"[:15]}
        self.addr = {"srv": SRV_ADDR, "wrk": WRK_ADDR}
        self.burst = tbf_burst(self.rate_bits)
        self.created = []

    def create(self):
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root (this process is not root)")
        for side in ("srv", "wrk"):
            _ip("ip", "netns", "add", self.ns[side])
            self.created.append(self.ns[side])
        _ip("ip", "link", "add", self.veth["srv"], "type", "veth", "peer", "name", self.veth["wrk"])
        for side in ("srv", "wrk"):
            ns, dev = self.ns[side], self.veth[side]
            _ip("ip", "link", "set", dev, "netns", ns)
            _ip("ip", "-n", ns, "addr", "add", f"{self.addr[side]}/{PREFIX}", "dev", dev)
            _ip("ip", "-n", ns, "link", "set", dev, "up")
            _ip("ip", "-n", ns, "link", "set", "lo", "up")
            _ip("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                "rate", self.rate, "burst", str(self.burst), "latency", LATENCY)

    def delete(self):
        """Delete what was created (the veth pair goes with its namespaces); never raises."""
        # a veth left in the root namespace (creation failed half-way) must go too
        steps = [("ip", "link", "del", self.veth["srv"])] if self._in_root() else []
        steps += [("ip", "netns", "del", ns) for ns in reversed(self.created)]
        for step in steps:
            try:
                _ip(*step, check=False)
            except NetnsUnavailable:
                pass
        self.created = []

    def _in_root(self):
        try:
            return _ip("ip", "link", "show", self.veth["srv"], check=False).returncode == 0
        except NetnsUnavailable:
            return False

    def command(self, side, argv):
        return ["ip", "netns", "exec", self.ns[side], *argv]

    def qdisc_stats(self, side):
        proc = _ip("ip", "netns", "exec", self.ns[side], "tc", "-s", "qdisc", "show", "dev",
                   self.veth[side], check=False)
        return proc.stdout.strip()

    def describe(self):
        return (f"veth {self.veth['srv']} ({self.ns['srv']}, {SRV_ADDR}) <-> {self.veth['wrk']} "
                f"({self.ns['wrk']}, {WRK_ADDR}); each end: tbf rate {self.rate} burst "
                f"{self.burst} B latency {LATENCY}")


class SwitchedMachines(_Created):
    """``machines`` namespaces, each a "machine" with one NIC, joined by a bridge (the switch)
    in a hub namespace: machine i has 10.213.0.(i+1)/24 on its veth. Each NIC is shaped in both
    directions (tbf on the machine's end: what it sends; on the hub's end: what it receives),
    so every machine has ``rate`` up and ``rate`` down, as on a switched network. Processes of
    one machine talk to each other over that namespace's loopback, unshaped.

        with SwitchedMachines("1gbit", 4) as net:
            net.command(2, ["python", ...])    # runs on machine 2 (address net.addr[2])

    ``congestion``: every machine's default TCP congestion control (the namespace's sysctl;
    None keeps what a new namespace inherits). It is what programs that do not choose their
    own (gloo, ps-lite) run with.
    """

    def __init__(self, rate, machines, tag=None, congestion=None):
        if not 1 <= machines <= 200:
            raise ValueError(f"machines must be in [1, 200], got {machines}")
        self.rate = rate
        self.rate_bits = parse_rate(rate)
        self.burst = tbf_burst(self.rate_bits)
        tag = str(os.getpid() if tag is None else tag)[-7:]
        self.hub = f"bpsgc-hub-{tag}"
        self.ns = [f"bpsgc-m{i}-{tag}" for i in range(machines)]
        self.veth = [f"bm{tag}x{i}" for i in range(machines)]       # the machine's NIC
        self.hub_veth = [f"bh{tag}x{i}" for i in range(machines)]   # its switch port
        self.addr = [f"10.213.0.{i + 1}" for i in range(machines)]
        self.congestion = congestion
        self.created = []

    def _shape(self, ns, dev):
        _ip("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
            "rate", self.rate, "burst", str(self.burst), "latency", LATENCY)

    def create(self):
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root (this process is not root)")
        _ip("ip", "netns", "add", self.hub)
        self.created.append(self.hub)
        _ip("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("ip", "-n", self.hub, "link", "set", "br0", "up")
        for i, ns in enumerate(self.ns):
            _ip("ip", "netns", "add", ns)
            self.created.append(ns)
            dev, port = self.veth[i], self.hub_veth[i]
            _ip("ip", "link", "add", dev, "type", "veth", "peer", "name", port)
            _ip("ip", "link", "set", dev, "netns", ns)
            _ip("ip", "link", "set", port, "netns", self.hub)
            _ip("ip", "-n", self.hub, "link", "set", port, "master", "br0")
            _ip("ip", "-n", self.hub, "link", "set", port, "up")
            _ip("ip", "-n", ns, "addr", "add", f"{self.addr[i]}/{PREFIX}", "dev", dev)
            _ip("ip", "-n", ns, "link", "set", dev, "up")
            _ip("ip", "-n", ns, "link", "set", "lo", "up")
            self._shape(ns, dev)
            self._shape(self.hub, port)
            if self.congestion:
                self._set_default_congestion(ns)

    def delete(self):
        """Delete the namespaces (their veths go with them); never raises."""
        for i, dev in enumerate(self.veth):  # a pair left in the root namespace half-way
            try:
                if _ip("ip", "link", "show", dev, check=False).returncode == 0:
                    _ip("ip", "link", "del", dev, check=False)
            except NetnsUnavailable:
                pass
        for ns in reversed(self.created):
            try:
                _ip("ip", "netns", "del", ns, check=False)
            except NetnsUnavailable:
                pass
        self.created = []

    def command(self, machine, argv):
        return ["ip", "netns", "exec", self.ns[machine], *argv]

    def qdisc_stats(self, machine):
        return _ip("ip", "netns", "exec", self.ns[machine], "tc", "-s", "qdisc", "show", "dev",
                   self.veth[machine], check=False).stdout.strip()

    def _set_default_congestion(self, ns):
        # Linux lets a namespace other than the first default only to an algorithm the first
        # one allows for everybody; this script does not widen that list for the whole host.
        allowed = "/proc/sys/net/ipv4/tcp_allowed_congestion_control"
        try:
            with open(allowed) as f:
                permitted = f.read().split()
        except OSError:
            permitted = None
        if permitted is not None and self.congestion not in permitted:
            raise NetnsUnavailable(
                f"a namespace's default TCP congestion control must be one the host allows "
                f"everybody ({allowed}: {' '.join(permitted)}); to allow {self.congestion}: "
                f"sysctl -w net.ipv4.tcp_allowed_congestion_control=\"{' '.join(permitted)} {self.congestion}\"")
        _ip("ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"net.ipv4.tcp_congestion_control={self.congestion}")

    def default_congestion(self, machine=0):
        """The TCP congestion control a program on ``machine`` gets unless it picks its own."""
        return _ip("ip", "netns", "exec", self.ns[machine], "sysctl", "-n",
                   "net.ipv4.tcp_congestion_control", check=False).stdout.strip() or None

    def describe(self):
        return (f"{len(self.ns)} machines ({', '.join(self.addr)}) on a bridge in {self.hub}; "
                f"each NIC: tbf rate {self.rate} burst {self.burst} B latency {LATENCY}, "
                f"both directions; TCP congestion control by default: {self.default_congestion()}")
