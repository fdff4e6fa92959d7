"""One host of a multi-host job: the scheduler/server node process, or a worker's local ranks."""
import subprocess
import sys

from ..config import Config, ConfigError
from .numa import plan_cpus
from .output import say
from .supervisor import Supervisor

NODE_COMMAND = [sys.executable, "-m", "bps_gc.node"]
NO_DEVICE_LIST = ("", "all", "none", "void")  # container-runtime words: one process, as BytePS


def visible_device_count(value):
    """Local ranks for NVIDIA_VISIBLE_DEVICES: one per comma-separated entry, at least one."""
    value = (value or "").strip()
    if value.lower() in NO_DEVICE_LIST:
        return 1
    return max(1, len([entry for entry in value.split(",") if entry.strip()]))


def rank_env(environ, local_rank, local_size):
    env = dict(environ)
    env["BYTEPS_LOCAL_RANK"] = str(local_rank)
    env["BYTEPS_LOCAL_SIZE"] = str(local_size)
    return env


def validate(environ):
    """The config this host's processes will see (raises ConfigError)."""
    if environ.get("DMLC_ROLE", "").strip() == "worker":
        environ = rank_env(environ, 0, visible_device_count(environ.get("NVIDIA_VISIBLE_DEVICES")))
    return Config.from_env(environ)


def tell_scheduler(environ, error, timeout=10.0):
    """This host cannot start because of a bad setting: ask the scheduler to stop every node
    now, naming it, instead of letting them wait out the join timeout for this one. Possible
    only when the setting is not one that locates the scheduler; best effort otherwise."""
    env = {k: v for k, v in environ.items() if k != error.variable}
    try:
        if validate(env).role == "scheduler":
            return
    except ConfigError:
        return
    if env.get("DMLC_ROLE", "").strip() == "worker":
        env = rank_env(env, 0, 1)
    try:
        subprocess.run(NODE_COMMAND + ["--abort", str(error)], env=env, timeout=timeout,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pass


def run_node(environ, settings, node_command=NODE_COMMAND):
    """Scheduler or server: run the node process and exit with its status."""
    return supervise([(Config.from_env(environ).role, node_command, dict(environ), None)], settings)


def run_worker_ranks(command, environ, settings, worker_id):
    """Worker: one process of `command` per visible device, with BYTEPS_LOCAL_RANK/SIZE;
    ``worker_id``: DMLC_WORKER_ID (each rank is named by its job rank too, as the scheduler's logs do)."""
    local_size = visible_device_count(environ.get("NVIDIA_VISIBLE_DEVICES"))
    cpus = plan_cpus(local_size, settings.numa, say)
    first = worker_id * local_size
    return supervise([(f"local rank {rank} (worker {first + rank})", command, rank_env(environ, rank, local_size),
                       cpus[rank]) for rank in range(local_size)], settings)


def supervise(plan, settings):
    """Start (name, argv, env, cpus) children; stop all when one fails; return the exit status."""
    supervisor = Supervisor(settings.kill_grace)
    supervisor.forward_signals()
    try:
        cannot_run = supervisor.start_all(plan)
        if cannot_run is not None:
            return cannot_run
        failed = supervisor.wait(until=supervisor.all_exited)
        # after a forwarded signal, children dying of it is no news
        if failed is not None and len(plan) > 1 and supervisor.received is None:
            say(f"{failed.name} exited with status {failed.status}; stopping the others")
        return supervisor.exit_status(failed)
    finally:
        supervisor.stop_all()
        supervisor.sweep()
