"""A multi-host smb2 cluster on one machine: every host is a Linux network namespace.

N memory-server hosts and one client host, each its own network namespace with its own
address from 198.18.0.0/15 (the range reserved for benchmarking, RFC 2544), joined by veth
links to one bridge.  Every server's link is rate limited with a ``tc`` token bucket (tbf) in
*both* directions, so that -- as on a real cluster -- each server's NIC, not the shared CPU,
is the bottleneck.  ``smb2-server`` runs in every server namespace; a command (or a Python
function/coroutine) runs in the client namespace with ``SMB2_SERVERS="addr:port,..."``.
Everything is torn down afterwards: on success, on error, on Ctrl-C and on SIGTERM.

Topology (one run, prefix ``smb2-<pid>-<n>``)::

    netns <prefix>-c    eth0 198.18.0.1/24  ── veth ──┐                      (unlimited)
    netns <prefix>-c1.. eth0 198.18.0.2.. (clients=K: more client hosts)
    netns <prefix>-e    eth0 198.18.0.10/24 (etcd=True: the membership service's host)
    netns <prefix>-s0   eth0 198.18.0.11/24 ── veth ──┤  br0 in netns <prefix>-br
    netns <prefix>-s1   eth0 198.18.0.12/24 ── veth ──┤  (ports c, s0, s1, ...)
    ...                                               ┘
    tbf on s<i>'s eth0 (server -> anyone: reads)  and on br's port s<i> (anyone -> server: writes)

Why the bridge lives in its own namespace rather than in the root namespace: then *no*
interface of ours ever exists in the root namespace -- every veth pair is created directly
between the bridge namespace and a host namespace -- so a run cannot collide with the
machine's own interfaces, firewall or sysctls (we switch bridge netfilter off in the bridge
namespace only), two runs cannot collide on link names (only namespace names are global, and
those carry the pid), and deleting the namespaces deletes every link and the bridge with
them: teardown is "kill the processes in our namespaces, delete our namespaces".

Library::

    from smb2.testing.netns import NetnsCluster, can_run
    ok, why = can_run()
    with NetnsCluster(servers=4, rate="1gbit") as c:
        c.servers                                   # ["198.18.0.11:7420", ...]
        c.run_client([sys.executable, "bench.py"])  # CompletedProcess, SMB2_SERVERS set
        p = c.popen_client([...])                   # Popen in the client namespace
        c.run_coroutine(main, c.servers)            # asyncio.run(main(c.servers)) in the client netns

Faults (the Jepsen harness's nemesis, :mod:`smb2.testing.jepsen`)::

    c.signal_server(i, signal.SIGSTOP)             # pause (SIGCONT resumes)
    c.kill_server(i); c.restart_server(i)          # SIGKILL, then the same command again
    c.cut("s0", "c1"); c.heal()                    # drop all traffic between two hosts (blackhole routes)

With ``etcd=True`` a private etcd runs on its own host and every server gets
``--membership c.membership_url`` (the first view, epoch 1 with every server, written before they start).
        await c.run_coroutine_async(main, c.servers)  # same, awaited from a running loop

CLI::

    python -m smb2.testing.netns --servers 4 --rate 1gbit -- python my_client.py
    python -m smb2.testing.netns --selftest          # 2 stand-in servers: connectivity + rate
    python -m smb2.testing.netns --stand-in --probe --servers 8   # measure the links
    python -m smb2.testing.netns --cleanup           # remove leftovers of dead runs

The package, by job: ``links`` (addresses, ``ip``/``tc``, :func:`can_run`), ``hosts``
(:class:`NetnsCluster`), ``supervise`` (child processes, :func:`cleanup`), ``standin`` and
``probe`` (a stand-in server and the client that measures the links), ``__main__`` (the command;
``tools/netns_cluster.py`` runs it too).

Needs root, ``ip`` (iproute2 with ``ip netns``) and ``tc``.  Otherwise the CLI says so in one
line and exits 2; the library raises :class:`NotSupported`; :func:`can_run` tells tests why.
"""

from __future__ import annotations

from .errors import NetnsError, NotSupported, ServerStartError, Terminated
from .hosts import NetnsCluster, default_server_binary, stand_in_server_cmd
from .links import DEFAULT_PORT, DEFAULT_SERVER_CMD, can_run, list_netns, parse_rate
from .supervise import cleanup, die_with_parent

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_SERVER_CMD",
    "NetnsCluster",
    "NetnsError",
    "NotSupported",
    "ServerStartError",
    "Terminated",
    "can_run",
    "cleanup",
    "default_server_binary",
    "die_with_parent",
    "list_netns",
    "parse_rate",
    "stand_in_server_cmd",
]
