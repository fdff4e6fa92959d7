"""scripts/bench_hook.py --timeline: one traced step of the bps_gc hook, printed per bucket, and
the CPU per step of each thread of the rank."""
import os
import threading

TRACED = 5  # --timeline: steps traced per row


def thread_cpu():
    """CPU ns so far of this process's threads (/proc's schedstat), summed by name: a Python
    thread's, else the OS's (torch's and gloo's threads)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    cpu = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            ns = int(open(f"/proc/self/task/{tid}/schedstat").read().split()[0])
            name = names.get(int(tid)) or f"{open(f'/proc/self/task/{tid}/comm').read().strip()} (not Python's)"
        except OSError:  # it ended meanwhile
            continue
        cpu[name] = cpu.get(name, 0) + ns
    return cpu


SPANS = (("compress", "compress start", "compress end"), ("sizes", "all_gather of payload sizes start",
         "all_gather of payload sizes end"), ("payloads", "all_gather of payloads start", "all_gather of payloads end"))


def print_timeline(label, trace):
    """One traced step of ``label`` on rank 0: ms from the step's start per bucket, and the CPU
    ms each of the hook's three threads spent on it (time.thread_time between its stamps)."""
    began = trace["began"]
    ms = lambda t: f"{(t - began) * 1e3:6.1f}"  # noqa: E731
    marks = dict(trace["marks"])
    print(f"\ntimeline, {label}, rank 0, one step (ms from its start; process CPU {trace['cpu_s'] * 1e3:.1f} ms "
          f"in a {(marks['step end'] - began) * 1e3:.1f} ms step): "
          + ", ".join(f"{event} {ms(t).strip()}" for event, t in trace["marks"]))
    print(f"CPU ms per step by thread (mean of {TRACED} steps): " + ", ".join(
        f"{name} {seconds * 1e3:.1f}" for name, seconds in sorted(trace["thread_cpu_s"].items(), key=lambda i: -i[1])
        if seconds >= 5e-5))
    buckets = {}
    for index, event, wall, cpu in trace["stamps"]:
        buckets.setdefault(index, {})[event] = (wall, cpu)
    print(f"{'bucket':>6} {'called':>6} {'return':>6} {'compress':>13} {'exch':>6} {'sizes':>13} {'payloads':>13} "
          f"{'reduce':>6} {'reduced':>7} {'done':>6}   CPU ms: {'compress':>8} {'exchange':>8} {'reduce':>6}")
    for index in sorted(buckets, key=lambda i: buckets[i].get("called", (0,))[0]):
        b = buckets[index]
        at = lambda e: ms(b[e][0]) if e in b else "     -"  # noqa: E731
        spans = [f"{at(start)}-{at(end).strip():>6}" for _, start, end in SPANS]
        cpu = [f"{(b[end][1] - b[start][1]) * 1e3:8.2f}" if start in b and end in b else f"{'-':>8}"
               for start, end in (("compress start", "compress end"), ("exchange start", "exchange end"),
                                  ("reduce start", "completed"))]
        print(f"{index:6d} {at('called')} {at('returned')} {spans[0]} {at('exchange start')} {spans[1]} {spans[2]} "
              f"{at('reduce start')} {at('reduced'):>7} {at('completed')}           {cpu[0]} {cpu[1]} {cpu[2][2:]}")
