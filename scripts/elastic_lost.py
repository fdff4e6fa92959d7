"""Time lost per death in the elastic chaos loop (scripts/chaos_elastic.py; issue 41's target:
"at most the heartbeat timeout plus one round").

The loop stamps every ``STEP`` line with the time (time.monotonic) it read it from a worker, and
every death with the moment it sent SIGKILL. For one death, on the hosts that survive it:

  * ``round``: the median time between a survivor's consecutive steps over its last
    ROUNDS steps before the kill (one normal round);
  * ``resumed``: when the last survivor printed step ``from_group``, the first step of the
    new epoch (the first round completed without the dead host);
  * ``stall = resumed - kill``;
  * ``lost = stall - (from_group - at) * round``, where ``at`` is the highest step any
    survivor had completed at the kill: the steps at+1 .. from_group were done in the stall,
    and undisturbed they would have taken one round each (usually from_group = at + 1, so
    lost = stall minus one round);
  * ``bound = heartbeat timeout + round``; the death is within the target if lost <= bound.

Where the time goes (``commit``: from the kill to when the loop read the scheduler's commit
line): detection is the heartbeat timeout counted from the dead host's last heartbeat, which
came up to one heartbeat interval before the kill (the scheduler polls no longer than the next
deadline; before it did, detection waited for the next burst of heartbeats, up to an interval
late); EPOCH_PREPARE, each survivor's EPOCH_REPORT and EPOCH_COMMIT take a few milliseconds,
and the REDO of rounds summed with the dead host's push plus the first new round a few more
(``stall - commit``).
"""
import os
import statistics

ROUNDS = 20


def load():
    """The box's load average over 1, 5 and 15 minutes (it is shared: numbers are read beside it)."""
    return [round(x, 2) for x in os.getloadavg()]


def stamps_before(stamps, t):
    return [(when, step) for when, step in stamps if when <= t]


def measure(death, stamps, heartbeat_timeout):
    """The row's time lost (see the module's docstring), from ``death``: kill (time),
    survivors (their node names), from_group; ``stamps``: node -> [(time, step)]. A survivor
    that died before from_group does not count; None where no survivor has a normal round
    before the kill or none reached from_group."""
    kill, first = death["kill"], death["from_group"]
    before = {n: stamps_before(stamps.get(n, []), kill) for n in death["survivors"]}
    last = [s[-ROUNDS - 1:] for s in before.values()]
    gaps = [b[0] - a[0] for s in last for a, b in zip(s, s[1:]) if b[1] == a[1] + 1]
    done = [s[-1][1] for s in before.values() if s]
    resumed = [t for t in (next((t for t, step in stamps.get(n, []) if step >= first), None)
                           for n in death["survivors"]) if t is not None]  # None: it died before
    if not gaps or not done or not resumed:
        return None
    round_s, at = statistics.median(gaps), max(done)
    stall = max(resumed) - kill
    lost = stall - max(first - at, 0) * round_s
    bound = heartbeat_timeout + round_s
    return {"round_s": round(round_s, 4), "stall_s": round(stall, 3), "lost_s": round(lost, 3),
            "bound_s": round(bound, 3), "within": lost <= bound,
            "commit_s": None if death.get("committed") is None else round(death["committed"] - kill, 3)}


def summary(rows):
    """Median and max time lost, and how many deaths within the bound, over rows measured."""
    lost = [r["lost"] for r in rows if r.get("lost")]
    if not lost:
        return None
    seconds = [m["lost_s"] for m in lost]
    return {"deaths": len(lost), "median_lost_s": round(statistics.median(seconds), 3),
            "max_lost_s": max(seconds), "within": sum(m["within"] for m in lost),
            "median_stall_s": round(statistics.median(m["stall_s"] for m in lost), 3),
            "median_commit_s": round(statistics.median(m["commit_s"] for m in lost if m["commit_s"] is not None), 3)
            if any(m["commit_s"] is not None for m in lost) else None,
            "median_round_s": round(statistics.median(m["round_s"] for m in lost), 4),
            "median_bound_s": round(statistics.median(m["bound_s"] for m in lost), 3)}


def cells(row):
    m = row.get("lost")
    if not m:
        return f"{'':>7} {'':>7} {'':>7} {'':>7} {'':>6}"
    return (f"{m['commit_s'] if m['commit_s'] is not None else '':>7} {m['stall_s']:>7} {m['lost_s']:>7} "
            f"{m['bound_s']:>7} {'yes' if m['within'] else 'NO':>6}")


HEADER = f"{'commit':>7} {'stall':>7} {'lost':>7} {'bound':>7} {'within':>6}"


def line(s, heartbeat_timeout):
    if not s:
        return "time lost per death: none measured"
    return (f"time lost per death (stall minus the rounds it held, s): median {s['median_lost_s']}, max "
            f"{s['max_lost_s']}; {s['within']} of {s['deaths']} deaths within the bound (heartbeat timeout "
            f"{heartbeat_timeout:g} s + one round, median round {s['median_round_s']} s); median stall "
            f"{s['median_stall_s']} s, median kill-to-commit {s['median_commit_s']} s")
