"""The launcher's own environment variables (the job's are in bps_gc.config)."""
import dataclasses
from typing import Optional

from ..config import UNSET, EnvReader


@dataclasses.dataclass(frozen=True)
class LauncherSettings:
    kill_grace: float = 5.0          # BPS_GC_KILL_GRACE: SIGTERM -> SIGKILL delay when stopping children
    shutdown_timeout: float = 30.0   # BPS_GC_SHUTDOWN_TIMEOUT: --local, scheduler/servers' time to exit
    numa: Optional[bool] = None      # BYTEPS_NUMA_ON; None = unset (bind where it applies)

    @classmethod
    def from_env(cls, environ):
        read = EnvReader(environ)
        return cls(kill_grace=read.number("BPS_GC_KILL_GRACE", cls.kill_grace, low=0.0),
                   shutdown_timeout=read.number("BPS_GC_SHUTDOWN_TIMEOUT", cls.shutdown_timeout, low=0.0),
                   numa=read.flag("BYTEPS_NUMA_ON", UNSET))
