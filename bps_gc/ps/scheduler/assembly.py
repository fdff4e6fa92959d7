"""The scheduler's account of a cluster still assembling: who joined and who has not (for its
WaitLines, wire/waiting.py), and the notice of a worker that trains alone, which ends the
job for the scheduler and servers that were started for it (ps/worker/lone_worker.py)."""

SHOWN = 8  # members named in a waiting line; the rest are counted


def listed(names):
    names = list(names)
    if len(names) > SHOWN:
        return ", ".join(names[:SHOWN]) + f" and {len(names) - SHOWN} more"
    return ", ".join(names) or "nobody"


def assembling(cfg, members, hosts):
    """"waiting for ...: joined ...; missing ..." from the scheduler's ``members`` (Member
    objects) and its WorkerHosts."""
    servers = [m for m in members if m.role == "server"]
    workers = sorted((m for m in members if m.role == "worker"), key=lambda m: m.rank)
    joined = [f"server at {m.host}:{m.port}" for m in servers] + [f"worker {m.rank} at {m.host}" for m in workers]
    missing = []
    if len(servers) < cfg.num_server:
        missing.append(f"{cfg.num_server - len(servers)} of {cfg.num_server} servers (DMLC_NUM_SERVER)")
    expected = hosts.expected_workers()
    if expected is None:
        missing.append(f"the workers of {hosts.num_hosts} hosts (DMLC_NUM_WORKER; none joined yet)")
    elif len(workers) < expected:
        ranks = sorted(set(range(expected)) - {m.rank for m in workers})
        missing.append(f"worker ranks {listed(str(r) for r in ranks)} of {expected}")
    return (f"the scheduler at {cfg.root_uri}:{cfg.root_port} waits for the cluster: "
            f"joined {listed(joined)}; missing {'; '.join(missing)}")


def lone_worker_notice(info, who):
    """What the scheduler tells every node when ``who`` (a worker's registration ``info`` with
    ``alone``) trains without the parameter server; None for any other registration."""
    if not info.get("alone"):
        return None
    return (f"{who} trains alone ({info['alone']}): this job needs no scheduler or server; set "
            f"BYTEPS_FORCE_DISTRIBUTED=1 on the worker to train through them")
