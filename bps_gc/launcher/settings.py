"""The launcher's own environment variables (the job's are in bps_gc.config)."""
import dataclasses
from typing import Optional

from ..config import ConfigError


@dataclasses.dataclass(frozen=True)
class LauncherSettings:
    kill_grace: float = 5.0          # BPS_GC_KILL_GRACE: SIGTERM -> SIGKILL delay when stopping children
    shutdown_timeout: float = 30.0   # BPS_GC_SHUTDOWN_TIMEOUT: --local, scheduler/servers' time to exit
    numa: Optional[bool] = None      # BYTEPS_NUMA_ON; None = unset (bind where it applies)

    @classmethod
    def from_env(cls, environ):
        return cls(kill_grace=_seconds(environ, "BPS_GC_KILL_GRACE", cls.kill_grace),
                   shutdown_timeout=_seconds(environ, "BPS_GC_SHUTDOWN_TIMEOUT", cls.shutdown_timeout),
                   numa=_flag(environ, "BYTEPS_NUMA_ON"))


def _seconds(environ, name, default):
    value = environ.get(name, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ConfigError(name, f"must be a number of seconds, got {value!r}") from None
    if not seconds >= 0:  # also rejects nan
        raise ConfigError(name, f"must be >= 0, got {value!r}")
    return seconds


def _flag(environ, name):
    value = environ.get(name, "").strip().lower()
    if not value:
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(name, f"must be 0 or 1, got {value!r}")
