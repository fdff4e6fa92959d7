"""The `bpslaunch` command."""
import argparse
import os
import sys

from ..config import ConfigError
from .local import run_local
from .machine import run_node, run_worker_ranks, tell_scheduler, validate
from .output import say
from .settings import LauncherSettings

USAGE_ERROR = 2
USAGE = ("%(prog)s [-h] [--local [--workers W] [--servers S] [--local-size L] [--port P] "
         "[--max-restarts N]] [--] [CMD [ARGS...]]")

DESCRIPTION = """\
Start the processes of a bps_gc job on this host and supervise them.

  DMLC_ROLE=scheduler|server  bpslaunch
      runs `python -m bps_gc.node` and exits with its status.
  DMLC_ROLE=worker  bpslaunch CMD [ARGS...]
      runs CMD once per entry of NVIDIA_VISIBLE_DEVICES (unset: once), each with
      BYTEPS_LOCAL_RANK=i and BYTEPS_LOCAL_SIZE=count. CMD runs as given, no shell.
      DMLC_NUM_WORKER counts worker hosts, as in BytePS; the scheduler and servers learn
      each host's local ranks when they join (BPS_GC_HIERARCHY: docs/local_ranks.md).
  bpslaunch --local [--workers W] [--servers S] [--local-size L] [--port P] -- CMD [ARGS...]
      a whole job on 127.0.0.1: a scheduler, S servers and W worker machines of L ranks;
      output lines are labelled [scheduler], [server0], [worker1] ([worker1.0] when L > 1).
      --max-restarts N: when a process fails, stop all of them and start the job again,
      up to N times (torchrun's option); the script resumes from its checkpoint
      (docs/checkpoint.md). Each start sees BPS_GC_RESTART_COUNT=0, 1, ..."""

EPILOG = """\
The job's DMLC_*, BYTEPS_* and BPS_GC_* variables are validated first; a bad one is
reported by name and bpslaunch exits 2. Launcher variables:
  BYTEPS_NUMA_ON         1: bind each local rank to a disjoint share of the CPUs; 0: never;
                         unset: bind where it applies (not in --local). Hosts with fewer CPUs
                         than ranks run unbound.
  BPS_GC_KILL_GRACE      seconds between SIGTERM and SIGKILL when stopping children (5)
  BPS_GC_SHUTDOWN_TIMEOUT  --local: seconds the scheduler/servers get to exit after the
                         workers finish (30)

SIGINT/SIGTERM are forwarded to all children. When one child fails, the others are stopped
and bpslaunch exits with its status (killed by signal N: 128+N); after a forwarded signal N
with no failure, 128+N. Children run in their own process groups with stdin from /dev/null,
die with the launcher (even on SIGKILL) and are always reaped before it exits."""


def build_parser():
    parser = argparse.ArgumentParser(prog="bpslaunch", usage=USAGE, description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--local", action="store_true", help="run a whole job on 127.0.0.1")
    parser.add_argument("--workers", type=_positive, metavar="W", help="--local: worker machines (1)")
    parser.add_argument("--servers", type=_count, metavar="S",
                        help="--local: servers (1); 0: no scheduler or servers, the workers use "
                             "torch.distributed (the collective transport)")
    parser.add_argument("--local-size", type=_positive, metavar="L",
                        help="--local: processes per worker machine (1)")
    parser.add_argument("--port", type=_port, metavar="P",
                        help="--local: scheduler port (default: a free one)")
    parser.add_argument("--max-restarts", type=_count, metavar="N",
                        help="--local: restart the whole job up to N times when a process fails (0)")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD [ARGS...]",
                        help="the training command (workers)")
    return parser


def main(argv=None, environ=None):
    environ = dict(os.environ if environ is None else environ)
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.local:
        for name in ("workers", "servers", "local_size", "port", "max_restarts"):
            if getattr(args, name) is not None:
                parser.error(f"--{name.replace('_', '-')} only goes with --local")
    try:
        settings = LauncherSettings.from_env(environ)
        if args.local:
            if not command:
                fail("--local needs a command: bpslaunch --local [options] -- CMD [ARGS...]")
            sys.exit(run_local(command, args.workers or 1, 1 if args.servers is None else args.servers,
                               args.local_size or 1, args.port, environ, settings,
                               max_restarts=args.max_restarts or 0))
        config = validate(environ)
    except ConfigError as error:
        if not args.local:
            tell_scheduler(environ, error)
        fail(str(error))
    if config.role == "worker":
        if not command:
            fail("DMLC_ROLE=worker needs a command: bpslaunch CMD [ARGS...]")
        sys.exit(run_worker_ranks(command, environ, settings, config.worker_id))
    if command:
        fail(f"DMLC_ROLE={config.role} takes no command (got {' '.join(command)!r}); "
             "bpslaunch starts the node process itself")
    sys.exit(run_node(environ, settings))


def fail(message):
    say(message)
    sys.exit(USAGE_ERROR)


def _positive(text):
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _count(text):
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _port(text):
    value = _integer(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [1, 65535], got {value}")
    return value


def _integer(text):
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


if __name__ == "__main__":
    main()
