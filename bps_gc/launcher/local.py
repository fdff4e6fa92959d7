"""`bpslaunch --local`: a whole job on 127.0.0.1, for development and tests.

Starts one scheduler and S servers (`python -m bps_gc.node`), and W worker machines that each run
the user's command once per local rank (L). Every child gets DMLC_NUM_WORKER=W,
DMLC_NUM_SERVER=S, DMLC_PS_ROOT_URI=127.0.0.1, DMLC_PS_ROOT_PORT (a free port or --port),
DMLC_NODE_HOST=127.0.0.1, BYTEPS_LOCAL_SIZE=L, PYTHONUNBUFFERED=1 and the rest of our
environment; workers also DMLC_WORKER_ID and BYTEPS_LOCAL_RANK. Each output line is printed
with the child's label: `[scheduler] `, `[server0] `, `[worker1] ` (`[worker1.0] ` when L > 1).

The job succeeds when every worker process exits 0 and the scheduler and servers then exit 0 on
their own within BPS_GC_SHUTDOWN_TIMEOUT seconds (default 30); if they do not, they are stopped
and bpslaunch exits 1. Any failure stops everything, names the process (`bpslaunch: worker1
exited with status 3`) and exits with its status. BYTEPS_NUMA_ON binds workers only when 1.

What the integration test (written once bps_gc.node exists) should check, each bounded by a
subprocess timeout:
  * `bpslaunch --local --workers 2 --servers 2 --local-size 2 -- python train_snippet.py`
    where the snippet joins the cluster, push_pulls a tensor and prints the result: exit 0,
    every worker prints the expected sum, lines carry `[worker0.1] `-style labels, and the
    scheduler/servers exit by themselves (the run takes far less than the shutdown timeout);
  * a worker that exits 3 after init(): launcher exits 3 and names it in stderr, and no process
    of the job is left (scheduler, servers and other workers are gone);
  * a server killed (SIGKILL) mid-job: workers fail with an error naming the dead node within
    the documented heartbeat bound, and the launcher exits non-zero;
  * SIGINT to the launcher: everything stops, exit status non-zero;
  * --port P is used (the scheduler listens there).
"""
import random
import socket
import subprocess
import sys
import time

from ..config import Config
from .machine import NODE_COMMAND
from .numa import plan_cpus
from .output import say, start_labelled_readers
from .supervisor import Supervisor

LOOPBACK = "127.0.0.1"
# Variables that would make local processes collide or advertise something other than loopback.
NOT_INHERITED = ("DMLC_WORKER_ID", "DMLC_INTERFACE", "BPS_GC_PORT", "BYTEPS_LOCAL_RANK")
READER_JOIN_SECONDS = 5.0


LOW_PORTS = 10000  # the scheduler's port is drawn from [LOW_PORTS, the ephemeral range's start)


def ephemeral_start(path="/proc/sys/net/ipv4/ip_local_port_range"):
    """The first port the kernel hands out to sockets that ask for none (0 where unknown)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port(host=LOOPBACK, tries=50):
    """A TCP port nobody listens on right now. Drawn below the kernel's ephemeral range where
    there is room: every outgoing connection and every bind to port 0 takes its port from that
    range, so none of them (a busy machine's, or another job's probe like this one) can take
    the port between this check and the scheduler's bind; it happened in a loaded test run.
    Else, or when no drawn port is free, one the kernel picks."""
    below = range(LOW_PORTS, max(LOW_PORTS, ephemeral_start()))
    for port in random.sample(below, min(tries, len(below))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
                return port
            except OSError:
                continue
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def worker_label(worker_id, local_rank, local_size):
    return f"worker{worker_id}" if local_size == 1 else f"worker{worker_id}.{local_rank}"


def process_env(environ, role, workers, servers, port, local_size, worker_id=None, local_rank=0):
    env = {name: value for name, value in environ.items() if name not in NOT_INHERITED}
    env.update(DMLC_ROLE=role, DMLC_NUM_WORKER=str(workers), DMLC_NUM_SERVER=str(servers),
               DMLC_PS_ROOT_URI=LOOPBACK, DMLC_PS_ROOT_PORT=str(port), DMLC_NODE_HOST=LOOPBACK,
               BYTEPS_LOCAL_SIZE=str(local_size), PYTHONUNBUFFERED="1")
    if role == "worker":
        env.update(DMLC_WORKER_ID=str(worker_id), BYTEPS_LOCAL_RANK=str(local_rank))
        if workers * local_size == 1:
            # a lone worker process would skip the servers this command starts for it
            env.setdefault("BYTEPS_FORCE_DISTRIBUTED", "1")
    return env


def plan_cluster(command, workers, servers, local_size, port, environ, settings,
                 node_command=NODE_COMMAND):
    """[(label, argv, env, cpus)] for every process, each env validated (raises ConfigError)."""
    # no servers: the collective transport, whose rendezvous rank 0 hosts on the same port
    plan = [("scheduler", node_command,
             process_env(environ, "scheduler", workers, servers, port, local_size), None)] if servers else []
    plan += [(f"server{index}", node_command,
              process_env(environ, "server", workers, servers, port, local_size), None)
             for index in range(servers)]
    # Binding is for one process per device on real hosts; here only when asked for.
    cpus = plan_cpus(workers * local_size, settings.numa is True, say)
    for worker_id in range(workers):
        for rank in range(local_size):
            plan.append((worker_label(worker_id, rank, local_size), command,
                         process_env(environ, "worker", workers, servers, port, local_size,
                                     worker_id, rank), cpus[worker_id * local_size + rank]))
    for _, _, env, _ in plan:
        Config.from_env(env)
    return plan


def run_local(command, workers, servers, local_size, port, environ, settings,
              node_command=NODE_COMMAND, max_restarts=0):
    """Run the job; returns the launcher's exit status. Raises ConfigError before starting.
    When a process fails (not after our signal), the whole group is stopped and started again,
    up to ``max_restarts`` times, as torchrun's --max-restarts; each start sees
    BPS_GC_RESTART_COUNT (0 first) and a fresh scheduler port unless ``port`` is given."""
    for attempt in range(max_restarts + 1):
        env = dict(environ, BPS_GC_RESTART_COUNT=str(attempt))
        plan = plan_cluster(command, workers, servers, local_size, port or free_port(), env,
                            settings, node_command)
        status, failed = _run_once(plan, settings)
        if failed is None:
            return status
        if attempt == max_restarts:
            if max_restarts:
                say(f"{failed} failed again after {max_restarts} restart(s) (--max-restarts "
                    f"{max_restarts}); giving up with status {status}")
            return status
        say(f"restarting the job ({attempt + 1} of {max_restarts}) after {failed} failed")
    return status


def _run_once(plan, settings):
    """(exit status, the name of the process that failed or None) of one start of the job."""
    supervisor = Supervisor(settings.kill_grace)
    supervisor.forward_signals()
    readers = []
    try:
        cannot_run = supervisor.start_all(
            plan, lambda child: readers.extend(start_labelled_readers(child.proc, child.name)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if cannot_run is not None:
            return cannot_run, None
        status, failed = _wait_for_job(supervisor, settings.shutdown_timeout)
        return status, failed if supervisor.received is None else None
    finally:
        supervisor.stop_all()
        supervisor.sweep()
        for reader in readers:  # bounded: a pipe held open by an escaped grandchild must not hang us
            reader.join(READER_JOIN_SECONDS)
        sys.stdout.flush()


def _wait_for_job(supervisor, shutdown_timeout):
    """(exit status, name of the failed process or None)."""
    workers = [child for child in supervisor.children if child.name.startswith("worker")]
    workers_done = lambda: not any(child.running for child in workers)  # noqa: E731
    failed = supervisor.wait(until=workers_done)
    if failed is None and supervisor.received is None and workers_done():
        # Workers said goodbye; the scheduler and servers should now exit by themselves.
        failed = supervisor.wait(until=supervisor.all_exited,
                                 deadline=time.monotonic() + shutdown_timeout)
        if failed is None and not supervisor.all_exited():
            names = ", ".join(child.name for child in supervisor.still_running())
            say(f"{names} still running {shutdown_timeout:g} s after the workers finished; "
                "stopping them")
            return 1, None
    if failed is not None and supervisor.received is None:  # dying of our signal is no news
        say(f"{failed.name} exited with status {failed.status}; stopping the job")
    return supervisor.exit_status(failed), None if failed is None else failed.name

