"""The hosts: :class:`NetnsCluster` builds the namespaces and their links, starts a server on
every server host (and etcd on its own), runs clients on the client hosts, injects faults
(signals, cut links) and tears everything down, whatever happens."""

from __future__ import annotations

import asyncio
import atexit
import collections
import ipaddress
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from smb2.testing.launch import READY

from .errors import NetnsError, NotSupported, ServerStartError, Terminated
from .links import (
    BENCH_RANGE,
    CLIENT_ADDR,
    DEFAULT_CAPACITY,
    DEFAULT_PORT,
    DEFAULT_RATE,
    DEFAULT_SERVER_CMD,
    ETCD_ADDR,
    ETCD_PORTS,
    FIRST_SERVER_HOST,
    MAX_CLIENTS,
    MAX_SERVERS,
    NAME_PREFIX,
    NETNS_DIR,
    SUBNET,
    can_run,
    enter_netns,
    format_rate,
    next_run,
    parse_rate,
    run_tool,
    tbf_params,
)
from .supervise import die_with_parent, kill_netns_processes, terminate


def default_server_binary() -> str | None:
    """The ``smb2-server`` to run: the one beside this interpreter (its environment's), else one on PATH."""
    cand = Path(sys.executable).parent / "smb2-server"
    if cand.exists():
        return str(cand)
    return shutil.which("smb2-server")


def stand_in_server_cmd() -> list[str]:
    """The stand-in server's command (:mod:`smb2.testing.netns.standin`: a TCP sink and source
    that prints the same ready line); ``--selftest``/``--stand-in`` run it."""
    return [sys.executable, "-m", "smb2.testing.netns.standin",
            "--host", "{host}", "--port", "{port}", "--capacity", "{capacity}"]



# ---------------------------------------------------------------------------------------------
# The cluster


class _Server:
    def __init__(self, index: int, netns: str, addr: str, port: int):
        self.index = index
        self.netns = netns
        self.addr = addr
        self.port = port
        self.proc: subprocess.Popen | None = None
        self.ready = threading.Event()
        self.stdout_tail: collections.deque[bytes] = collections.deque(maxlen=50)
        self.reader: threading.Thread | None = None
        self.stderr_path: Path | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.addr}:{self.port}"

    def stderr_tail(self, limit: int = 2000) -> str:
        try:
            data = self.stderr_path.read_bytes() if self.stderr_path else b""
        except OSError:
            data = b""
        text = data[-limit:].decode(errors="replace").strip()
        return text or "(empty)"


class NetnsCluster:
    """N server hosts + 1 client host as network namespaces with rate-limited links.

    Parameters
    ----------
    servers:       number of memory-server hosts (1..243).
    rate:          per-server link rate, both directions (tc syntax: "1gbit", "200mbit"; None = unlimited).
    client_rate:   client link rate (default None = unlimited; the client link is never the bottleneck).
    burst, latency_ms: tbf bucket size in bytes / queue in ms (default: see :func:`tbf_params`).
    mtu:           link MTU (default 1500; veth still uses 64 KiB TSO super-packets).
    port:          server port (default 7420).
    capacity:      passed to the server as ``--capacity`` (default 512 MiB in bytes).
    server_cmd:    argv list or shell-like string; ``{host} {port} {capacity} {index} {smb2_server}``
                   are substituted.  Default: :data:`DEFAULT_SERVER_CMD` (this interpreter's server, as
                   :func:`smb2.testing.launch.server_command` builds it, with ``--shm off``).
    stand_in:      use the stand-in server built into this file instead of smb2-server.
    server_env:    extra environment for the servers.
    ready_timeout: seconds to wait for every server's ready line.
    start_servers: False builds only the network (no server processes; ``servers`` still lists endpoints).
    quiet:         no progress lines on stderr.
    handle_signals: while up, turn SIGTERM/SIGHUP in the main thread into :class:`Terminated` so
                   ``with`` blocks unwind and tear down (only if no other handler is installed).
    die_with_parent: servers and clients get SIGKILL if the thread that started them dies
                   (PR_SET_PDEATHSIG), so even a SIGKILLed harness leaves no process running (its
                   namespaces stay until ``cleanup()`` / ``--cleanup``).
                   Start the cluster from a thread that outlives it (normally the main thread).
    """

    def __init__(
        self,
        servers: int = 4,
        rate: str | int | None = DEFAULT_RATE,
        *,
        client_rate: str | int | None = None,
        burst: int | None = None,
        latency_ms: float | None = None,
        mtu: int = 1500,
        port: int = DEFAULT_PORT,
        capacity: str | int = DEFAULT_CAPACITY,
        server_cmd: Sequence[str] | str | None = None,
        stand_in: bool = False,
        server_env: Mapping[str, str] | None = None,
        ready_timeout: float = 30.0,
        start_servers: bool = True,
        quiet: bool = False,
        handle_signals: bool = True,
        die_with_parent: bool = True,
        clients: int = 1,
        etcd: bool = False,
    ):
        if not 1 <= servers <= MAX_SERVERS:
            raise ValueError(f"servers must be 1..{MAX_SERVERS}, not {servers}")
        if not 1 <= clients <= MAX_CLIENTS:
            raise ValueError(f"clients must be 1..{MAX_CLIENTS}, not {clients}")
        self.n = servers
        self.rate_bits = parse_rate(rate)
        self.client_rate_bits = parse_rate(client_rate)
        self._burst = burst
        self._latency_ms = latency_ms
        self.mtu = int(mtu)
        self.port = int(port)
        self.capacity = str(capacity)
        if stand_in:
            server_cmd = stand_in_server_cmd()
        elif server_cmd is None:
            server_cmd = list(DEFAULT_SERVER_CMD)
        elif isinstance(server_cmd, str):
            server_cmd = shlex.split(server_cmd)
        self._server_cmd_template = list(server_cmd)
        self.server_env = dict(server_env or {})
        self.ready_timeout = float(ready_timeout)
        self.start_servers = start_servers
        self.quiet = quiet
        self.handle_signals = handle_signals
        self.die_with_parent = die_with_parent

        self.prefix = f"{NAME_PREFIX}{os.getpid()}-{next_run()}"
        self.bridge_netns = f"{self.prefix}-br"
        self.client_netns = f"{self.prefix}-c"
        self.client_addr = CLIENT_ADDR
        # host name -> (netns, address): "c", "c1", ..., "e", "s0", ... (what cut() takes)
        self.hosts: dict[str, tuple[str, str]] = {"c": (self.client_netns, CLIENT_ADDR)}
        for k in range(1, clients):
            self.hosts[f"c{k}"] = (f"{self.prefix}-c{k}", str(SUBNET[1 + k]))
        self.etcd = etcd
        if etcd:
            self.hosts["e"] = (f"{self.prefix}-e", ETCD_ADDR)
        self._cuts: set[tuple[str, str]] = set()
        self._servers = [
            _Server(i, f"{self.prefix}-s{i}", str(SUBNET[FIRST_SERVER_HOST + i]), self.port) for i in range(servers)
        ]
        for s in self._servers:
            assert ipaddress.IPv4Address(s.addr) in BENCH_RANGE
            self.hosts[f"s{s.index}"] = (s.netns, s.addr)
        self._created_netns: list[str] = []
        self._clients: list[subprocess.Popen] = []
        self._logdir: Path | None = None
        self._started = False
        self._closed = False
        self._close_lock = threading.Lock()
        self._old_handlers: dict[int, Any] = {}
        self.setup_seconds: float | None = None

    # -- public properties ------------------------------------------------------------------

    @property
    def servers(self) -> list[str]:
        """``["198.18.0.11:7420", ...]`` -- what ``SMB2_SERVERS`` holds, comma-joined."""
        return [s.endpoint for s in self._servers]

    @property
    def server_addrs(self) -> list[str]:
        return [s.addr for s in self._servers]

    @property
    def server_netns(self) -> list[str]:
        return [s.netns for s in self._servers]

    @property
    def client_hosts(self) -> list[str]:
        """The client hosts' names, for ``popen_client(host=...)``: ["c", "c1", ...]."""
        return [h for h in self.hosts if h.startswith("c")]

    @property
    def membership_url(self) -> str | None:
        """The servers' ``--membership`` (None without ``etcd=True``)."""
        return f"etcd://{ETCD_ADDR}:{ETCD_PORTS[0]}/{self.prefix}" if self.etcd else None

    @property
    def netns_names(self) -> list[str]:
        """Every namespace this cluster owns (bridge, clients, etcd, servers)."""
        return [self.bridge_netns, *(netns for netns, _ in self.hosts.values())]

    @property
    def env(self) -> dict[str, str]:
        """``{"SMB2_SERVERS": "addr:port,..."}``."""
        return {"SMB2_SERVERS": ",".join(self.servers)}

    def server_process(self, i: int) -> subprocess.Popen | None:
        """The Popen of server ``i`` (e.g. to kill it in a failure test)."""
        return self._servers[i].proc

    def exec_prefix(self, netns: str | None = None) -> list[str]:
        """``["ip", "netns", "exec", <netns>]`` (default: the client's) to prepend to a command."""
        return ["ip", "netns", "exec", netns or self.client_netns]

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> NetnsCluster:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _log(self, msg: str) -> None:
        if not self.quiet:
            print(f"netns_cluster: {msg}", file=sys.stderr, flush=True)

    def start(self) -> NetnsCluster:
        """Build the network, start the servers and wait until every one is ready.
        On any failure (or Ctrl-C) everything created so far is removed before re-raising."""
        if self._started:
            raise NetnsError("cluster already started")
        ok, why = can_run()
        if not ok:
            raise NotSupported(why)
        self._started = True
        t0 = time.monotonic()
        self._install_signal_handlers()
        atexit.register(self.close)
        try:
            cmd = self._server_argv(0)  # resolve the command before building anything
            self._build_network()
            if self.etcd:
                self._start_etcd()
            if self.start_servers:
                self._start_servers(cmd)
        except BaseException:
            self.close()
            raise
        self.setup_seconds = time.monotonic() - t0
        self._log(f"up in {self.setup_seconds:.2f}s: SMB2_SERVERS={','.join(self.servers)}")
        return self

    def _server_argv(self, i: int) -> list[str]:
        s = self._servers[i]
        binary = ""
        if any("{smb2_server}" in a for a in self._server_cmd_template):
            binary = default_server_binary() or ""
            if not binary:
                raise NetnsError(
                    f"smb2-server not found (neither beside {sys.executable} nor on PATH); "
                    "build the project first, or pass server_cmd= / --server-cmd, or stand_in=True / --stand-in"
                )
        fields = dict(host=s.addr, port=s.port, capacity=self.capacity, index=i, smb2_server=binary)
        try:
            argv = [a.format(**fields) for a in self._server_cmd_template]
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"bad server command template {self._server_cmd_template!r}: {e!r}") from None
        if self.membership_url is not None:
            argv += ["--membership", self.membership_url]
        return argv

    def _netns_add(self, name: str) -> None:
        if (NETNS_DIR / name).exists():
            raise NetnsError(f"network namespace {name} already exists (leftover? run --cleanup)")
        run_tool(["ip", "netns", "add", name])
        self._created_netns.append(name)

    def _batch(self, tool: str, netns: str, lines: list[str]) -> None:
        # one process per namespace and tool instead of one per command: setup stays well under a
        # second even for many servers
        run_tool([tool, "-n", netns, "-batch", "-"], input="\n".join(lines) + "\n")

    def _tbf(self, dev: str, rate_bits: int) -> str:
        burst, latency = tbf_params(rate_bits, self._burst, self._latency_ms)
        return f"qdisc replace dev {dev} root tbf rate {rate_bits}bit burst {burst} latency {latency:g}ms"

    def _build_network(self) -> None:
        hosts = [(name, netns, addr, None if name.startswith("s") or name == "e" else self.client_rate_bits)
                 for name, (netns, addr) in self.hosts.items() if not name.startswith("s")] + [
            (f"s{s.index}", s.netns, s.addr, self.rate_bits) for s in self._servers
        ]
        self._log(
            f"creating namespaces {self.prefix}-{{br,c,s0..s{self.n - 1}}}: bridge br0, client {self.client_addr} "
            f"({format_rate(self.client_rate_bits)}), {self.n} server(s) "
            f"{self._servers[0].addr}..{self._servers[-1].addr} port {self.port}"
        )
        for name in self.netns_names:
            self._netns_add(name)

        # bridge namespace: the bridge, one veth per host (peer created straight in the host netns)
        br = [
            "link set lo up",
            f"link add br0 mtu {self.mtu} type bridge forward_delay 0 stp_state 0",
            "link set br0 up",
        ]
        for port, netns, _addr, _rate in hosts:
            br += [
                f"link add {port} mtu {self.mtu} type veth peer name eth0 mtu {self.mtu} netns {netns}",
                f"link set {port} master br0",
                f"link set {port} up",
            ]
        self._batch("ip", self.bridge_netns, br)
        # bridged frames need no netfilter; these sysctls are per network namespace (best effort)
        run_tool(["ip", "netns", "exec", self.bridge_netns, "sysctl", "-q", "-w",
              "net.bridge.bridge-nf-call-iptables=0", "net.bridge.bridge-nf-call-ip6tables=0",
              "net.bridge.bridge-nf-call-arptables=0"], check=False)

        # host namespaces: address, links up; tbf on both ends of each limited link
        br_tc: list[str] = []
        for port, netns, addr, rate in hosts:
            self._batch("ip", netns, ["link set lo up", f"addr add {addr}/{SUBNET.prefixlen} dev eth0",
                                      "link set eth0 up"])
            if rate is not None:
                self._batch("tc", netns, [self._tbf("eth0", rate)])  # host -> network (server: reads)
                br_tc.append(self._tbf(port, rate))  # network -> host (server: writes)
        if br_tc:
            self._batch("tc", self.bridge_netns, br_tc)
        if self.rate_bits is not None:
            burst, latency = tbf_params(self.rate_bits, self._burst, self._latency_ms)
            self._log(
                f"server links: tbf {format_rate(self.rate_bits)} in both directions "
                f"(burst {burst} B, latency {latency:g} ms, mtu {self.mtu})"
            )
        else:
            self._log("server links: unlimited")

    def _spawn_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = dict(stdin=subprocess.DEVNULL, start_new_session=True)
        if self.die_with_parent:
            kw["preexec_fn"] = die_with_parent
        return kw

    def _start_servers(self, argv0: list[str]) -> None:
        self._logdir = self._logdir or Path(tempfile.mkdtemp(prefix=f"{self.prefix}-logs-"))
        env = dict(os.environ)
        env.update(self.server_env)
        self._log(f"starting {self.n} server(s): {shlex.join(argv0)}")
        for s in self._servers:
            self._spawn_server(s, env)
        self._wait_ready(self._servers)
        self._log(f"{self.n} server(s) ready")

    def _spawn_server(self, s: _Server, env: Mapping[str, str]) -> None:
        assert self._logdir is not None
        argv = self._server_argv(s.index)
        s.stderr_path = self._logdir / f"s{s.index}.stderr"
        s.ready = threading.Event()
        with open(s.stderr_path, "ab") as err:
            s.proc = subprocess.Popen(
                self.exec_prefix(s.netns) + argv, stdout=subprocess.PIPE, stderr=err, env=dict(env),
                **self._spawn_kwargs(),
            )
        s.reader = threading.Thread(target=_drain_stdout, args=(s,), name=f"{s.netns}-stdout", daemon=True)
        s.reader.start()

    def _wait_ready(self, servers: list[_Server]) -> None:
        deadline = time.monotonic() + self.ready_timeout
        for s in servers:
            while not s.ready.wait(0.05):
                rc = s.proc.poll() if s.proc else None
                if rc is not None:
                    if s.reader is not None:
                        s.reader.join(1)  # the ready line may still be in the pipe
                    if s.ready.is_set():
                        break
                    raise ServerStartError(
                        f"server s{s.index} ({s.endpoint}, netns {s.netns}) exited with code {rc} before printing "
                        f"'smb2-server listening on HOST:PORT'; stderr: {s.stderr_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"server s{s.index} ({s.endpoint}, netns {s.netns}) did not print "
                        f"'smb2-server listening on HOST:PORT' within {self.ready_timeout:g}s; "
                        f"stdout: {b''.join(s.stdout_tail).decode(errors='replace').strip() or '(empty)'}; "
                        f"stderr: {s.stderr_tail()}"
                    )
        for s in servers:
            rc = s.proc.poll() if s.proc else None
            if rc is not None:
                raise ServerStartError(
                    f"server s{s.index} ({s.endpoint}, netns {s.netns}) exited with code {rc} right after "
                    f"starting; stderr: {s.stderr_tail()}"
                )

    # -- faults ---------------------------------------------------------------------------------

    def signal_server(self, i: int, sig: int) -> None:
        """Send ``sig`` to server ``i`` (SIGSTOP pauses it, SIGCONT resumes it)."""
        p = self._servers[i].proc
        if p is not None and p.poll() is None:
            p.send_signal(sig)

    def kill_server(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Stop server ``i`` with ``sig`` (default SIGKILL) and wait for it to exit."""
        p = self._servers[i].proc
        if p is not None and p.poll() is None:
            p.send_signal(sig)
            if sig not in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
                p.kill()
            p.wait(10)

    def restart_server(self, i: int) -> None:
        """Start server ``i`` again with its command (after ``kill_server``), wait until ready."""
        self._check_up()
        s = self._servers[i]
        if s.proc is not None and s.proc.poll() is None:
            self.kill_server(i, signal.SIGTERM)
        env = dict(os.environ)
        env.update(self.server_env)
        self._spawn_server(s, env)
        self._wait_ready([s])

    def cut(self, a: str, b: str) -> None:
        """Drop every packet between hosts ``a`` and ``b`` ("c", "c1", "e", "s0", ...): a blackhole
        route to the other on each side (a partition; :meth:`heal` ends it)."""
        if a == b or (min(a, b), max(a, b)) in self._cuts:
            return
        (na, aa), (nb, ab) = self.hosts[a], self.hosts[b]
        run_tool(["ip", "-n", na, "route", "add", "blackhole", f"{ab}/32"])
        run_tool(["ip", "-n", nb, "route", "add", "blackhole", f"{aa}/32"])
        self._cuts.add((min(a, b), max(a, b)))

    def heal(self) -> None:
        """End every partition :meth:`cut` made."""
        for a, b in sorted(self._cuts):
            (na, aa), (nb, ab) = self.hosts[a], self.hosts[b]
            run_tool(["ip", "-n", na, "route", "del", "blackhole", f"{ab}/32"], check=False)
            run_tool(["ip", "-n", nb, "route", "del", "blackhole", f"{aa}/32"], check=False)
        self._cuts.clear()

    # -- the membership service (etcd=True) -------------------------------------------------------

    def _start_etcd(self) -> None:
        """etcd on host "e"; the first view (every server a member) written before any server starts."""
        from smb2.membership import NO_VIEW, MembershipError, open_membership
        from smb2.testing.etcd import LocalEtcd

        self._logdir = self._logdir or Path(tempfile.mkdtemp(prefix=f"{self.prefix}-logs-"))
        netns, addr = self.hosts["e"]
        etcd = LocalEtcd(addr, data_dir=str(self._logdir), client_port=ETCD_PORTS[0], peer_port=ETCD_PORTS[1])
        with open(self._logdir / "etcd.log", "ab") as out:
            self._clients.append(subprocess.Popen(self.exec_prefix(netns) + etcd.command(), stdout=out, stderr=out,
                                                  **self._spawn_kwargs()))
        url = self.membership_url
        assert url is not None

        async def seed() -> None:
            deadline = time.monotonic() + self.ready_timeout
            async with open_membership(url) as m:
                while True:
                    try:
                        await m.change(NO_VIEW, members=self.servers)
                        return
                    except MembershipError:
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.1)

        self.run_coroutine(seed)
        self._log(f"etcd on {addr}:{ETCD_PORTS[0]}: {url}, epoch 1")

    def _install_signal_handlers(self) -> None:
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: Any) -> None:
            raise Terminated(signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                if signal.getsignal(sig) in (signal.SIG_DFL, None):
                    self._old_handlers[sig] = signal.signal(sig, handler)
            except (ValueError, OSError):
                pass

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old_handlers.items():
            try:
                signal.signal(sig, old)
            except (ValueError, OSError):
                pass
        self._old_handlers.clear()

    def close(self) -> None:
        """Stop every process and delete every namespace (with it every link and the bridge).
        Idempotent; safe to call from ``finally``, atexit, or after a failed start."""
        with self._close_lock:
            if self._closed or not self._started:
                return
            self._closed = True
        # A second Ctrl-C during teardown must not leave things half-removed; nor may a second
        # SIGTERM/SIGHUP (`timeout` and `kill -- -PGID` send one to the process AND one to its
        # group, so the second lands while the first is unwinding through this teardown): they are
        # held back and the first of them is raised once everything is gone.
        held: dict[int, Any] = {}
        pending: list[int] = []
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                try:
                    held[sig] = signal.signal(sig, lambda signum, frame: pending.append(signum))
                except (ValueError, OSError):
                    pass
        try:
            self._teardown()
        finally:
            for signum, old in held.items():
                signal.signal(signum, old)
            self._restore_signal_handlers()
            try:
                atexit.unregister(self.close)
            except Exception:
                pass
        terminations = [s for s in pending if s != signal.SIGINT]
        if terminations and sys.exc_info()[0] is None:
            raise Terminated(terminations[0])

    def _teardown(self) -> None:
        t0 = time.monotonic()
        if self._created_netns:
            self._log(f"tearing down {self.prefix}")
        problems: list[str] = []
        procs = [p for p in self._clients + [s.proc for s in self._servers if s.proc] if p.poll() is None]
        for p in procs:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 3.0
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                try:
                    p.wait(2)
                except subprocess.TimeoutExpired:
                    problems.append(f"pid {p.pid} survived SIGKILL")
        for p in self._clients + [s.proc for s in self._servers if s.proc]:
            for f in (p.stdout, p.stderr, p.stdin):
                if f is not None:
                    try:
                        f.close()
                    except OSError:
                        pass
        # anything else still running inside our namespaces (children of servers, clients started
        # by hand with exec_prefix(), ...)
        for name in reversed(self._created_netns):
            left = kill_netns_processes(name, grace=1.0)
            if left:
                problems.append(f"SIGKILLed {left} in {name}")
        for name in reversed(self._created_netns):
            r = run_tool(["ip", "netns", "del", name], check=False)
            if r.returncode != 0 and (NETNS_DIR / name).exists():
                problems.append(f"ip netns del {name}: {r.stderr.strip()}")
        for s in self._servers:
            if s.reader is not None:
                s.reader.join(1)
        if self._logdir is not None:
            shutil.rmtree(self._logdir, ignore_errors=True)
        left_ns = [n for n in self._created_netns if (NETNS_DIR / n).exists()]
        if left_ns:
            problems.append(f"namespaces still present: {left_ns}")
        self._created_netns = [n for n in self._created_netns if n in left_ns]
        for msg in problems:
            print(f"netns_cluster: teardown: {msg}", file=sys.stderr, flush=True)
        self._log(f"torn down in {time.monotonic() - t0:.2f}s" + (" (with problems, see above)" if problems else ""))

    # -- running things in the client namespace ---------------------------------------------

    def _client_env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        e = dict(os.environ)
        e.update(self.env)
        if env:
            e.update(env)
        return e

    def _check_up(self) -> None:
        if not self._started or self._closed:
            raise NetnsError("cluster is not running (use `with NetnsCluster(...) as c:` or c.start())")

    def popen_client(
        self, cmd: Sequence[str], *, env: Mapping[str, str] | None = None, host: str = "c", **popen_kwargs: Any
    ) -> subprocess.Popen:
        """Start ``cmd`` in the client namespace (``host``: another client host, "c1", ...) with
        ``SMB2_SERVERS`` set (plus ``env``).
        The process is terminated at teardown if still running (and, with ``die_with_parent``,
        killed if this thread dies)."""
        self._check_up()
        if self.die_with_parent:
            popen_kwargs.setdefault("preexec_fn", die_with_parent)
        p = subprocess.Popen(self.exec_prefix(self.hosts[host][0]) + list(cmd), env=self._client_env(env),
                             **popen_kwargs)
        self._clients.append(p)
        return p

    def run_client(
        self, cmd: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None,
        check: bool = False, **run_kwargs: Any,
    ) -> subprocess.CompletedProcess:
        """Run ``cmd`` in the client namespace to completion (``subprocess.run`` semantics:
        ``capture_output=True, text=True`` etc. pass through).  Its exit code is ``.returncode``."""
        self._check_up()
        if run_kwargs.pop("capture_output", False):
            run_kwargs["stdout"] = run_kwargs["stderr"] = subprocess.PIPE
        p = self.popen_client(cmd, env=env, **run_kwargs)
        try:
            out, err = p.communicate(timeout=timeout)
        except BaseException:
            terminate(p)
            raise
        finally:
            if p in self._clients and p.poll() is not None:
                self._clients.remove(p)
        r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if check:
            r.check_returncode()
        return r

    async def start_client_async(
        self, cmd: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> asyncio.subprocess.Process:
        """``asyncio.create_subprocess_exec`` of ``cmd`` in the client namespace."""
        self._check_up()
        return await asyncio.create_subprocess_exec(*self.exec_prefix(), *cmd, env=self._client_env(env), **kwargs)

    async def run_client_async(
        self, cmd: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None, **kwargs: Any
    ) -> int:
        """Run ``cmd`` in the client namespace from a running event loop; returns its exit code.
        On timeout/cancellation the process is terminated and the exception propagates."""
        p = await self.start_client_async(cmd, env=env, **kwargs)
        try:
            return await asyncio.wait_for(p.wait(), timeout)
        except BaseException:
            if p.returncode is None:
                p.terminate()
                try:
                    await asyncio.wait_for(p.wait(), 3)
                except BaseException:
                    p.kill()
            raise

    def call_in_client(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn(*args, **kwargs)`` in a fresh thread whose network namespace is the client's
        and return its result (exceptions propagate).  Every socket that thread creates -- e.g.
        by a ``smb2.connect()`` inside ``fn`` -- lives on the client host.  In-process: no
        subprocess, objects go in and out directly.  Only the network namespace changes; the
        process's files, mounts and environment are shared, so ``SMB2_SERVERS`` is *not* set
        here: pass ``c.servers`` explicitly (e.g. ``smb2.connect(c.servers)``)."""
        self._check_up()
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                enter_netns(self.client_netns)
                box["value"] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                box["error"] = e

        t = threading.Thread(target=target, name=f"{self.client_netns}-call", daemon=True)
        t.start()
        t.join()
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def run_coroutine(
        self, coro_fn: Callable[..., Any], *args: Any, runner: Callable[[Any], Any] = asyncio.run, **kwargs: Any
    ) -> Any:
        """``runner(coro_fn(*args, **kwargs))`` (default ``asyncio.run``; pass ``uvloop.run`` for
        uvloop) on a new event loop in a thread in the client namespace; returns the result.

        For anything measured, pass ``runner=uvloop.run``: on Python 3.11 the stdlib loop's socket
        transport copies every unsent write payload into one growing bytearray, which made smb2
        writes over 8 rate-limited links CPU-bound at 4.9x one server (1.4 client CPU-s/GB)
        where uvloop reaches 7.5x at 0.2 CPU-s/GB (tools/bench_scaleout.py --loop asyncio)."""
        return self.call_in_client(lambda: runner(coro_fn(*args, **kwargs)))

    async def run_coroutine_async(
        self, coro_fn: Callable[..., Any], *args: Any, runner: Callable[[Any], Any] = asyncio.run, **kwargs: Any
    ) -> Any:
        """Await ``coro_fn(*args, **kwargs)`` run on its own loop in the client namespace, from
        a running loop of the caller (which stays in its own namespace and keeps running)."""
        self._check_up()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def done(ok: bool, value: Any) -> None:
            if not fut.done():
                fut.set_result(value) if ok else fut.set_exception(value)

        def target() -> None:
            try:
                enter_netns(self.client_netns)
                v = runner(coro_fn(*args, **kwargs))
                loop.call_soon_threadsafe(done, True, v)
            except BaseException as e:  # noqa: BLE001
                try:
                    loop.call_soon_threadsafe(done, False, e)
                except RuntimeError:
                    pass  # caller's loop is gone

        threading.Thread(target=target, name=f"{self.client_netns}-async", daemon=True).start()
        return await fut

    def leftovers(self) -> dict[str, list]:
        """What of this cluster still exists (empty lists after a clean teardown): namespaces,
        live server/client processes."""
        ns = [n for n in self.netns_names if (NETNS_DIR / n).exists()]
        procs = [p.pid for p in self._clients + [s.proc for s in self._servers if s.proc] if p.poll() is None]
        return {"netns": ns, "processes": procs}



def _drain_stdout(s: _Server) -> None:
    """Read a server's stdout for its whole life (so it can never block on a full pipe); set
    ``ready`` on the ``smb2-server listening on HOST:PORT`` line."""
    assert s.proc is not None and s.proc.stdout is not None
    try:
        for line in s.proc.stdout:
            s.stdout_tail.append(line)
            if not s.ready.is_set() and READY.search(line):
                s.ready.set()
    except (OSError, ValueError):
        pass
