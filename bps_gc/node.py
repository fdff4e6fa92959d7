"""``python -m bps_gc.node``: run the scheduler or a server as the environment says.

Exit status 0 after an orderly shutdown, 1 when the job failed, 2 for a bad environment.
"""
import logging
import signal
import sys

from .comm import NodeFailure
from .config import Config, ConfigError
from .ps.membership.membership import JobEnded, abort_job
from .wire.sockets import BindError


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through the role's cleanup (sockets, threads)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--abort"] and len(argv) == 2:
        return abort(argv[1])
    signal.signal(signal.SIGINT, _exit_on_signal)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        cfg = Config.from_env()
    except ConfigError as e:
        print(f"bps_gc.node: {e}", file=sys.stderr)
        return 2
    level = {"TRACE": logging.DEBUG, "FATAL": logging.CRITICAL}.get(cfg.log_level, cfg.log_level)
    logging.basicConfig(level=level, format=f"%(asctime)s {cfg.role} %(levelname)s %(message)s")
    try:
        # each role imports only its own: the codecs and their plugins' entry points are the
        # server's (~0.1 s of CPU that every scheduler process paid)
        if cfg.role == "scheduler":
            from .ps.scheduler.scheduler import Scheduler
            return Scheduler(cfg).run()
        if cfg.role == "server":
            from . import compress
            from .ps.server.server import Server
            try:
                compress.load_plugins()
            except ImportError as e:
                raise abort_job(cfg, "server", -1, str(e)) from None
            return Server(cfg, compress).run()
    except JobEnded as e:  # its only worker trains alone (ps/worker/lone_worker.py)
        print(f"bps_gc.node: {e}; this {cfg.role} exits", file=sys.stderr)
        return 0
    except (BindError, NodeFailure) as e:
        print(f"bps_gc.node: {e}", file=sys.stderr)
        return 1
    print("bps_gc.node: DMLC_ROLE=worker runs your training script (bpslaunch python train.py)",
          file=sys.stderr)
    return 2


def abort(reason):
    """``--abort REASON`` (bpslaunch, when this host has a bad setting): the scheduler stops
    every node naming REASON."""
    try:
        cfg = Config.from_env()
        abort_job(cfg, cfg.role, cfg.rank if cfg.role == "worker" else -1, reason)
    except (ConfigError, NodeFailure, OSError):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
