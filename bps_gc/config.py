"""The job's settings, read once from the DMLC_* / BYTEPS_* / BPS_GC_* environment.

Every variable is validated here; a missing or malformed one raises ConfigError naming it (the
launcher turns that into a message and exit status 2). See the README for the full table.
"""
import dataclasses
import os
from typing import Optional

ROLES = ("scheduler", "server", "worker")
HIERARCHIES = ("auto", "flat", "host")  # BPS_GC_HIERARCHY (docs/local_ranks.md)
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
# BPS_GC_DEVICE_CODECS: which codec chains bps_gc.torch runs (docs/device_codecs.md)
DEVICE_CODECS = ("auto", "torch", "numpy")


UNSET = "unset"  # the default of an optional flag or number: unset gives None


class SettingError(ValueError):
    """A bad setting (an environment variable, a compression parameter: ``name``); the message
    opens with what it is (``label``, by default the name) and says what is wrong."""

    def __init__(self, name, message, label=None):
        super().__init__(f"{name if label is None else label}: {message}")
        self.name = name


class ConfigError(SettingError):
    """A bad environment variable; the message names it (``variable``)."""

    variable = property(lambda self: self.name)


@dataclasses.dataclass(frozen=True)
class Config:
    role: str
    num_worker: int
    num_server: int
    root_uri: str
    root_port: int
    worker_id: Optional[int] = None
    node_host: Optional[str] = None
    interface: Optional[str] = None
    port: int = 0  # where this server listens; 0 picks a free port
    local_rank: int = 0
    local_size: int = 1
    force_distributed: bool = False
    partition_bytes: int = 4_096_000
    # BPS_GC_DENSE_PARTITION_BYTES: uncompressed partitions are at most this (and partition_bytes);
    # None (unset): DENSE_PARTITION_BYTES when the job spans hosts, else partition_bytes
    dense_partition_bytes: Optional[int] = None
    min_compress_bytes: int = 65_536
    threadpool_size: int = 4
    server_engine_threads: int = 2
    enable_async: bool = False
    log_level: str = "WARNING"
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 5.0
    join_timeout: float = 300.0
    auth_token: Optional[str] = None
    encrypt: bool = False  # BPS_GC_ENCRYPT: CURVE on every link, keys derived from the token
    local_ipc: bool = True  # BPS_GC_LOCAL_IPC: servers also listen on a unix socket for same-host workers
    shm: bool = True  # BPS_GC_SHM: dense partitions to a server on the same host go through shared memory
    local_reduce: bool = False  # BPS_GC_LOCAL_REDUCE: workers all on one host sum dense tensors in shared memory
    inflight_bytes: int = 64 << 20  # BPS_GC_INFLIGHT_BYTES: a worker's push window
    stall_timeout: float = 60.0  # BPS_GC_STALL_TIMEOUT: a server warns about a round this old
    peer_max_bytes: int = 256 << 20  # BPS_GC_PEER_MAX_BYTES: largest worker-to-worker message
    fusion_bytes: int = 1 << 20  # BPS_GC_FUSION_BYTES: small dense pushes share messages up to this
    bucket_bytes: int = 25 << 20  # BPS_GC_BUCKET_BYTES: the collective transport's buckets (DDP's size)
    tcp_congestion: Optional[str] = None  # BPS_GC_TCP_CONGESTION: of this node's TCP data links; None: the host's
    # BPS_GC_HIERARCHY (workers): "host" sums a host's local ranks in shared memory and pushes
    # once per host; "flat" pushes from every rank; "auto" (unset): host when BYTEPS_LOCAL_SIZE > 1
    hierarchy: str = "auto"
    # BPS_GC_DEVICE_CODECS: "auto" (torch chains for tensors off the CPU), "torch" (for every
    # tensor), "numpy" (host copy + numpy chains)
    device_codecs: str = "auto"
    # BPS_GC_ELASTIC (every role): a dead worker host opens a new membership epoch instead of
    # stopping the job (docs/elastic.md); BPS_GC_MIN_WORKERS: below this
    # many worker hosts the job stops
    elastic: bool = False
    min_workers: int = 1

    @property
    def rank(self):
        """Global rank of a worker process."""
        return self.worker_id * self.local_size + self.local_rank

    @property
    def size(self):
        """Worker processes in the job."""
        return self.num_worker * self.local_size

    @property
    def distributed(self):
        return self.num_worker > 1 or self.force_distributed

    @classmethod
    def from_env(cls, environ=None, role=None):
        env = os.environ if environ is None else environ
        read = EnvReader(env)
        role = role or read.choice("DMLC_ROLE", ROLES)
        if role not in ROLES:
            raise ConfigError("DMLC_ROLE", f"unknown role {role!r}; allowed: {', '.join(ROLES)}")
        cpus = os.cpu_count() or 1
        local_size = read.integer("BYTEPS_LOCAL_SIZE", 1, low=1)
        num_worker = read.integer("DMLC_NUM_WORKER", None, low=1)
        cfg = cls(
            role=role,
            num_worker=num_worker,
            num_server=read.integer("DMLC_NUM_SERVER", None, low=0),  # 0: collective transport
            root_uri=read.text("DMLC_PS_ROOT_URI", None),
            root_port=read.integer("DMLC_PS_ROOT_PORT", None, low=1, high=65535),
            worker_id=read.integer("DMLC_WORKER_ID", None, low=0, high=num_worker - 1)
            if role == "worker" else None,
            node_host=read.text("DMLC_NODE_HOST", ""),
            interface=read.text("DMLC_INTERFACE", ""),
            port=read.integer("BPS_GC_PORT", 0, low=0, high=65535),
            local_rank=read.integer("BYTEPS_LOCAL_RANK", 0, low=0, high=local_size - 1),
            local_size=local_size,
            force_distributed=read.flag("BYTEPS_FORCE_DISTRIBUTED", False),
            partition_bytes=read.integer("BYTEPS_PARTITION_BYTES", 4_096_000, low=8),
            dense_partition_bytes=read.integer("BPS_GC_DENSE_PARTITION_BYTES", UNSET, low=8),
            min_compress_bytes=read.integer("BYTEPS_MIN_COMPRESS_BYTES", 65_536, low=0),
            threadpool_size=read.integer("BYTEPS_THREADPOOL_SIZE", min(4, cpus), low=1),
            server_engine_threads=read.integer("BYTEPS_SERVER_ENGINE_THREAD", min(2, cpus), low=1),
            enable_async=read.flag("BYTEPS_ENABLE_ASYNC", False),
            log_level=read.choice("BYTEPS_LOG_LEVEL", LOG_LEVELS, "WARNING", upper=True),
            heartbeat_interval=read.number("BPS_GC_HEARTBEAT_INTERVAL", 0.5, low=0.01),
            heartbeat_timeout=read.number("BPS_GC_HEARTBEAT_TIMEOUT", 5.0, low=0.05),
            join_timeout=read.number("BPS_GC_JOIN_TIMEOUT", 300.0, low=0.1),
            auth_token=read.text("BPS_GC_AUTH_TOKEN", "") or None,
            encrypt=read.flag("BPS_GC_ENCRYPT", False),
            local_ipc=read.flag("BPS_GC_LOCAL_IPC", True),
            shm=read.flag("BPS_GC_SHM", True),
            local_reduce=read.flag("BPS_GC_LOCAL_REDUCE", False),
            inflight_bytes=read.integer("BPS_GC_INFLIGHT_BYTES", 64 << 20, low=1),
            stall_timeout=read.number("BPS_GC_STALL_TIMEOUT", 60.0, low=0.01),
            peer_max_bytes=read.integer("BPS_GC_PEER_MAX_BYTES", 256 << 20, low=1),
            fusion_bytes=read.integer("BPS_GC_FUSION_BYTES", 1 << 20, low=0),
            bucket_bytes=read.integer("BPS_GC_BUCKET_BYTES", 25 << 20, low=1),
            tcp_congestion=tcp_congestion(read),
            hierarchy=read.choice("BPS_GC_HIERARCHY", HIERARCHIES, "auto"),
            device_codecs=read.choice("BPS_GC_DEVICE_CODECS", DEVICE_CODECS, "auto", lower=True),
            elastic=read.flag("BPS_GC_ELASTIC", False),
            min_workers=read.integer("BPS_GC_MIN_WORKERS", 1, low=1, high=num_worker),
        )
        if cfg.encrypt and not cfg.auth_token:
            raise ConfigError("BPS_GC_ENCRYPT", "needs BPS_GC_AUTH_TOKEN (the keys are derived from it)")
        if cfg.heartbeat_timeout <= cfg.heartbeat_interval:
            raise ConfigError("BPS_GC_HEARTBEAT_TIMEOUT", f"must exceed BPS_GC_HEARTBEAT_INTERVAL "
                              f"({cfg.heartbeat_interval}), got {cfg.heartbeat_timeout}")
        if cfg.elastic:
            cfg = elastic_settings(cfg)
        return dataclasses.replace(cfg, node_host=cfg.node_host or None, interface=cfg.interface or None)

    def agreement(self):
        """The settings every node of a job must share, by variable (checked at REGISTER)."""
        return {"DMLC_NUM_WORKER": self.num_worker, "DMLC_NUM_SERVER": self.num_server,
                "BYTEPS_PARTITION_BYTES": self.partition_bytes,
                "BPS_GC_DENSE_PARTITION_BYTES": self.dense_partition_bytes or "unset",
                "BPS_GC_LOCAL_REDUCE": int(self.local_reduce), "BPS_GC_ELASTIC": int(self.elastic),
                "BPS_GC_MIN_WORKERS": self.min_workers}

    def to_env(self):
        """The variables that reproduce this config (for child processes)."""
        env = {"DMLC_ROLE": self.role, "DMLC_NUM_WORKER": str(self.num_worker),
               "DMLC_NUM_SERVER": str(self.num_server), "DMLC_PS_ROOT_URI": self.root_uri,
               "DMLC_PS_ROOT_PORT": str(self.root_port)}
        if self.worker_id is not None:
            env["DMLC_WORKER_ID"] = str(self.worker_id)
        return env


def elastic_settings(cfg):
    """What BPS_GC_ELASTIC runs with: a host's local ranks each push for themselves unless
    BPS_GC_HIERARCHY=host is asked for ("auto" means flat: one push per rank; host: the host's
    shared-memory sum, one push per host), and every push alone on the socket (no fusion, no
    shared memory with the servers, no push window), so that a round a dead host took part in
    can be summed again from the pushes the servers still hold (docs/elastic.md)."""
    if cfg.enable_async:
        raise ConfigError("BPS_GC_ELASTIC", "needs synchronous rounds; unset BYTEPS_ENABLE_ASYNC")
    return dataclasses.replace(cfg, shm=False, fusion_bytes=0, inflight_bytes=1 << 62, local_reduce=False,
                               hierarchy="flat" if cfg.local_size > 1 and cfg.hierarchy != "host" else cfg.hierarchy)


TRANSPORTS = ("ps", "collective")
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR")


def transport_from_env(environ=None):
    """"ps" (ZeroMQ parameter server) or "collective" (torch.distributed): BPS_GC_TRANSPORT if
    set; else collective under torchrun (RANK, WORLD_SIZE, MASTER_ADDR and no DMLC_NUM_WORKER)
    or with DMLC_NUM_SERVER=0 (``bpslaunch --servers 0``); else ps."""
    env = os.environ if environ is None else environ
    read = EnvReader(env)
    chosen = read.choice("BPS_GC_TRANSPORT", TRANSPORTS, "", upper=False)
    if chosen:
        return chosen
    if "DMLC_NUM_WORKER" not in env and all(env.get(name) for name in TORCHRUN_VARIABLES):
        return "collective"
    return "collective" if env.get("DMLC_NUM_SERVER", "").strip() == "0" else "ps"


TCP_AVAILABLE = "/proc/sys/net/ipv4/tcp_available_congestion_control"
DEFAULT_TCP_CONGESTION = "cubic"  # loss-based: why, in wire/congestion.py


def available_congestion_controls():
    """The TCP congestion controls this kernel has (empty where it cannot tell: not Linux)."""
    try:
        with open(TCP_AVAILABLE) as f:
            return tuple(f.read().split())
    except OSError:
        return ()


def congestion_refusal(name):
    """Why this process may not set ``name`` on its sockets (None: it may). Linux lets a
    process without CAP_NET_ADMIN use only the algorithms the host allows everybody
    (net.ipv4.tcp_allowed_congestion_control)."""
    import socket
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except (OSError, AttributeError) as e:
        return str(e)
    return None


def tcp_congestion(read):
    """BPS_GC_TCP_CONGESTION: unset gives cubic where this process may use it (else the host's
    default); "system" keeps the host's default (None); any other value must be one of the
    kernel's algorithms that this process may set."""
    value = read.text("BPS_GC_TCP_CONGESTION", "")
    available = available_congestion_controls()
    if not value:
        usable = DEFAULT_TCP_CONGESTION in available and congestion_refusal(DEFAULT_TCP_CONGESTION) is None
        return DEFAULT_TCP_CONGESTION if usable else None
    if value == "system":
        return None
    if value not in available:
        have = ", ".join(available) or "none (not Linux?)"
        raise ConfigError("BPS_GC_TCP_CONGESTION", f"unknown algorithm {value!r}; this kernel has: {have}; "
                          f"or 'system' for the host's default")
    refusal = congestion_refusal(value)
    if refusal is not None:
        raise ConfigError("BPS_GC_TCP_CONGESTION", f"this process may not use {value!r} ({refusal}): without "
                          f"CAP_NET_ADMIN only net.ipv4.tcp_allowed_congestion_control's algorithms; "
                          f"or 'system' for the host's default")
    return value


class EnvReader:
    """The one parser of environment variables: every DMLC_* / BYTEPS_* / BPS_GC_* number,
    flag and choice is read through it (also the launcher's own, launcher/settings.py), so a
    bad value is always a ConfigError naming the variable."""

    MISSING = object()

    def __init__(self, env):
        self.env = env

    def raw(self, name, default):
        value = self.env.get(name)
        if value is None or value.strip() == "":
            if default is None:
                raise ConfigError(name, "is required but not set")
            return self.MISSING
        return value.strip()

    def text(self, name, default):
        value = self.raw(name, default)
        return default if value is self.MISSING else value

    def integer(self, name, default, low=None, high=None):
        return self.numeric(name, default, int, "an integer", low, high)

    def number(self, name, default, low):
        return self.numeric(name, default, float, "a number", low, None)

    def numeric(self, name, default, convert, kind, low, high):
        value = self.raw(name, default)
        if value is self.MISSING:
            return None if default is UNSET else default
        try:
            number = convert(value)
        except ValueError:
            raise ConfigError(name, f"must be {kind}, got {value!r}") from None
        if not ((low is None or number >= low) and (high is None or number <= high)):  # NaN fails too
            bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise ConfigError(name, f"must be {bounds}, got {value!r}")
        return number

    def flag(self, name, default):
        """``default`` is returned when unset; pass UNSET to tell unset from 0 (it gives None)."""
        value = self.raw(name, default)
        if value is self.MISSING:
            return None if default is UNSET else default
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(name, f"must be 0 or 1, got {value!r}")

    def choice(self, name, allowed, default=None, upper=False, lower=False):
        value = self.raw(name, default)
        if value is self.MISSING:
            return default
        if upper:
            value = value.upper()
        elif lower:
            value = value.lower()
        if value not in allowed:
            raise ConfigError(name, f"unknown value {value!r}; allowed: {', '.join(allowed)}")
        return value


