"""`bpslaunch`: starts the processes of a bps_gc job and supervises them.

Layout (one job per file):
  cli.py        argument parsing and the `bpslaunch` entry point
  machine.py    one host of a multi-host job: the scheduler/server node, or a worker's local ranks
  local.py      `bpslaunch --local`: a whole cluster on 127.0.0.1
  supervisor.py children as a group: signal forwarding, failure handling, reaping
  spawn.py      starting one child: own process group, parent-death signal, CPU binding
  numa.py       splitting the host's CPUs between local ranks (BYTEPS_NUMA_ON)
  output.py     labelled copying of child output, and the launcher's own messages
  settings.py   the launcher's own environment variables
"""
