"""``python -m smb2.testing.netns``: run a command on the client host of a namespace cluster,
measure its links (``--probe``), check the harness itself (``--selftest``) or remove what dead
runs left behind (``--cleanup``).  ``tools/netns_cluster.py`` runs this too."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys

from .errors import NetnsError, NotSupported, Terminated
from .hosts import NetnsCluster
from .links import DEFAULT_CAPACITY, DEFAULT_PORT, DEFAULT_RATE, can_run, format_rate, list_netns, parse_rate
from .probe import print_probe, probe
from .supervise import cleanup


def _selftest(args: argparse.Namespace) -> int:
    """2 stand-in servers: connectivity, per-link rate in both directions, aggregate, teardown."""
    n = args.servers if args.servers_given else 2
    rate = parse_rate(args.rate)
    if rate is None:
        print("netns_cluster: --selftest needs a finite --rate", file=sys.stderr)
        return 2
    mb = args.probe_mb if args.probe_mb_given else max(5.0, min(50.0, rate / 8e6 * 0.4))  # ~0.4 s per transfer
    failures: list[str] = []
    cluster = NetnsCluster(servers=n, rate=args.rate, stand_in=True, quiet=args.quiet, mtu=args.mtu,
                           burst=args.burst, latency_ms=args.latency, port=args.port)
    with cluster as c:
        res = probe(c, mb)
    print_probe(res, rate)
    # tbf counts Ethernet+IP+TCP headers (66 B per 1448 B of payload at MTU 1500): ~95.6 % goodput
    lo, hi = 0.80, 1.03
    for s in res["single"]:
        for d in ("write", "read"):
            frac = s[f"{d}_bps"] / rate
            if not lo <= frac <= hi:
                failures.append(f"{s['server']} {d} at {frac:.1%} of the link rate (want {lo:.0%}..{hi:.0%})")
    agg = res["aggregate"]
    for d in ("write", "read"):
        frac = agg[f"{d}_bps"] / (n * rate)
        if frac > hi:
            failures.append(f"aggregate {d} at {frac:.1%} of {n} links: the limit is not applied")
        elif frac < 0.75:
            failures.append(f"aggregate {d} only {frac:.1%} of {n} links (cpu {agg[f'{d}_cpu_busy']:.0%} busy)")
    left = cluster.leftovers()
    ns_left = [x for x in list_netns() if x.startswith(cluster.prefix + "-")]
    if left["netns"] or left["processes"] or ns_left:
        failures.append(f"teardown left {left} {ns_left}")
    if failures:
        for f in failures:
            print(f"netns_cluster: selftest FAILED: {f}", file=sys.stderr)
        return 1
    print(f"netns_cluster: selftest ok ({n} servers at {format_rate(rate)}, {mb:g} MB per transfer; "
          "nothing left behind)",
          file=sys.stderr)
    return 0



def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # the stand-in and the probe by their old sub-command names (scripts that still use them)
    if argv[:1] == ["_standin"]:
        from . import standin
        return standin.main(argv[1:])
    if argv[:1] == ["_probe"]:
        from . import probe as probe_command
        return probe_command.main(argv[1:])

    ap = argparse.ArgumentParser(
        prog="python -m smb2.testing.netns",
        description="Run a command on the client host of an N-server smb2 cluster built from network "
                    "namespaces with rate-limited links (root only). The command sees SMB2_SERVERS.",
        epilog="examples:  netns_cluster.py --servers 4 --rate 1gbit -- python my_client.py\n"
               "           netns_cluster.py --selftest\n"
               "           netns_cluster.py --stand-in --probe --servers 8 --rate 1gbit\n"
               "           netns_cluster.py --cleanup",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--servers", "-n", type=int, default=None, help="number of server hosts (default 4; --selftest: 2)")
    ap.add_argument("--rate", default=DEFAULT_RATE,
                    help="per-server link rate, both directions, tc syntax (default 1gbit; 'none' = unlimited)")
    ap.add_argument("--client-rate", default=None, help="client link rate (default unlimited)")
    ap.add_argument("--burst", type=int, default=None, help="tbf bucket in bytes (default: 2 ms of rate, >= 128 KiB)")
    ap.add_argument("--latency", type=float, default=None, help="tbf queue in ms (default 5)")
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--port", type=int, default=DEFAULT_PORT)
    ap.add_argument("--capacity", default=DEFAULT_CAPACITY,
                    help="passed to every server as --capacity (default %(default)s)")
    ap.add_argument("--server-cmd", default=None,
                    help="server command; {host} {port} {capacity} {index} {smb2_server} are substituted "
                         "(default: this Python's smb2.server with --host {host} --port {port} --capacity "
                         "{capacity} --shm off)")
    ap.add_argument("--stand-in", action="store_true", help="use the built-in stand-in server (TCP sink/source)")
    ap.add_argument("--ready-timeout", type=float, default=30.0, help="seconds to wait for every server's ready line")
    ap.add_argument("--probe", action="store_true", help="instead of a command, measure every link (needs --stand-in)")
    ap.add_argument("--probe-mb", type=float, default=None,
                    help="MB per transfer for --probe (default 50) / --selftest (default: 0.4 s worth)")
    ap.add_argument("--selftest", action="store_true", help="2 stand-in servers: check connectivity, rate and teardown")
    ap.add_argument("--cleanup", action="store_true", help="remove namespaces/processes left by dead runs, then exit")
    ap.add_argument("--all", action="store_true", help="with --cleanup: also of runs that are still alive")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command to run in the client namespace")
    args = ap.parse_args(argv)
    args.servers_given = args.servers is not None
    args.probe_mb_given = args.probe_mb is not None
    if args.probe_mb is None:
        args.probe_mb = 50.0
    if args.servers is None:
        args.servers = 4
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    try:
        parse_rate(args.rate)
        parse_rate(args.client_rate)
    except ValueError as e:
        ap.error(str(e))

    ok, why = can_run()
    if not ok:
        print(f"netns_cluster: cannot build a namespace cluster here: {why}", file=sys.stderr)
        return 2
    if args.cleanup:
        removed = cleanup(all_runs=args.all, quiet=args.quiet)
        if not args.quiet:
            print(f"netns_cluster: cleanup removed {len(removed)} item(s)", file=sys.stderr)
        return 0
    if args.selftest:
        return _selftest(args)
    if args.probe:
        if not args.stand_in and args.server_cmd is None:
            ap.error("--probe speaks the stand-in server's protocol: add --stand-in")
    elif not cmd:
        ap.error("give a command after --, or --probe / --selftest / --cleanup")

    cluster = NetnsCluster(
        servers=args.servers, rate=args.rate, client_rate=args.client_rate, burst=args.burst,
        latency_ms=args.latency, mtu=args.mtu, port=args.port, capacity=args.capacity,
        server_cmd=args.server_cmd, stand_in=args.stand_in, ready_timeout=args.ready_timeout, quiet=args.quiet,
    )
    proc: subprocess.Popen | None = None
    try:
        with cluster as c:
            if args.probe:
                res = probe(c, args.probe_mb)
                print_probe(res, c.rate_bits)
                json.dump(res, sys.stdout)
                print()
                return 0
            c._log(f"running in {c.client_netns}: {shlex.join(cmd)}")
            # the client stays in our process group: Ctrl-C reaches it as it would without us
            proc = c.popen_client(cmd)
            rc = proc.wait()
            c._log(f"client exited with code {rc}")
            return rc
    except KeyboardInterrupt:
        print("netns_cluster: interrupted; torn down", file=sys.stderr)
        return 130
    except Terminated as e:
        print(f"netns_cluster: {e}; torn down", file=sys.stderr)
        return 128 + e.signum
    except NotSupported as e:
        print(f"netns_cluster: cannot build a namespace cluster here: {e}", file=sys.stderr)
        return 2
    except (NetnsError, ValueError) as e:
        print(f"netns_cluster: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
