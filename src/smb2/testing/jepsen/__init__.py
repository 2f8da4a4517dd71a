"""A Jepsen-style test of smb2 under faults: a history of concurrent operations, a nemesis, a checker.

Concurrent client processes (each its own :class:`smb2.Client`) issue, against one buffer:

* ``accumulate``: add a known positive int64 increment to one of several counters (one counter
  per stripe, so every server holds some);
* ``fetch_add``: add 1 to one word, whose old values must all differ;
* ``read``: read a counter;
* ``lock_rmw``: take the lock, read a ``[value, token]`` record, write ``[value + 1, token]`` back
  with a *fenced* write, release.  With ``--replicas`` above 1 the lock is a replicated one
  (``client.replicated_lock``), kept on that many servers, and ``--aim-lock`` makes the nemesis's
  first fault a SIGKILL of the lock's server.

Every invocation and its outcome -- ``ok``, ``fail`` (the error proves it was not applied) or
``unknown`` (a timeout, a lost connection: it may or may not have been applied) -- is recorded
with ``time.monotonic()`` timestamps.  Meanwhile a seeded nemesis kills (SIGKILL) and restarts
servers, pauses them (SIGSTOP/SIGCONT) and -- in the netns harness (``--netns``, :mod:`smb2.testing.netns`), where every
server is its own host behind a link -- cuts a server's link.  At the end everything is healed,
and a fresh client reads the final state.

The checker (plain functions over the history: :func:`check`) then asserts:

* every counter's final value == the sum of its acknowledged increments plus a subset of its
  unknown ones (an exact subset-sum check);
* every read of a counter lies between the acknowledged increments completed before it began
  and all increments (acknowledged or unknown) begun before it ended;
* fetch_add results are unique and the final word accounts for every acknowledged one;
* no two lock holders whose fenced writes were acknowledged held the lock at overlapping times,
  their fencing tokens grow with time, and every read inside the lock saw every acknowledged
  write of the holders before it (no lost update).

Usage::

    python -m smb2.testing.jepsen --seed 7 --duration 60 --servers 3 --replicas 2 --nemesis kill,pause
    python -m smb2.testing.jepsen --netns --nemesis kill,pause,partition --duration 120
    python -m smb2.testing.jepsen --replicas 1 --nemesis kill --no-data-dir      # today's replicas=1 picture

Prints the violations (and the seed) and exits 1 if there are any; ``--history FILE`` keeps the
history as JSON lines.

The package: ``history`` (operations and their outcomes), ``workloads`` (the
clients), ``nemesis`` (the faults), ``checker`` (the checks), ``run`` (one run,
local or in the netns harness) and ``__main__`` (the command; ``tools/jepsen.py``
runs it too).
"""

from __future__ import annotations

from .checker import check, check_counters, check_fetch_adds, check_lock, check_reads, report, summary
from .history import FAIL, NEMESES, OK, UNKNOWN, Final, History, Layout, Op
from .nemesis import LocalTarget, Nemesis, NetnsTarget, Target
from .run import Settings, lock_server, run_local, run_netns
from .workloads import Workload

__all__ = ["FAIL", "NEMESES", "OK", "UNKNOWN", "Final", "History", "Layout", "LocalTarget", "Nemesis",
           "NetnsTarget", "Op", "Settings", "Target", "Workload", "check", "check_counters",
           "check_fetch_adds", "check_lock", "check_reads", "lock_server", "report", "run_local", "run_netns",
           "summary"]
