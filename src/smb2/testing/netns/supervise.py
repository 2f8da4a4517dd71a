"""Process supervision: children that die with this process, stopping a child, the
processes of a namespace, and :func:`cleanup` of what dead runs left behind."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .links import LOGDIR_RE, NAME_PREFIX, NAME_RE, list_netns, run_tool


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True



def netns_pids(name: str) -> list[int]:
    r = run_tool(["ip", "netns", "pids", name], check=False)
    return [int(x) for x in r.stdout.split() if x.isdigit()]


def kill_netns_processes(name: str, grace: float = 2.0) -> list[int]:
    """SIGTERM every process in netns ``name``, SIGKILL what is left after ``grace`` seconds."""
    me = {os.getpid(), os.getppid()}
    pids = [p for p in netns_pids(name) if p not in me]
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if pid_alive(p) and p in netns_pids(name)]
        if pids:
            time.sleep(0.05)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids



def die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass



def terminate(p: subprocess.Popen, grace: float = 3.0) -> None:
    if p.poll() is not None:
        return
    try:
        p.terminate()
        p.wait(grace)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    except ProcessLookupError:
        pass


def cleanup(all_runs: bool = False, quiet: bool = False) -> list[str]:
    """Remove namespaces (and the processes in them) and log dirs left behind by runs whose
    process is dead (``all_runs=True``: of every run, also live ones).  Returns what was removed."""
    removed: list[str] = []
    for name in list_netns():
        m = NAME_RE.match(name)
        if not m:
            continue
        pid = int(m.group(1))
        if not all_runs and (pid == os.getpid() or pid_alive(pid)):
            continue
        killed = kill_netns_processes(name, grace=1.0)
        run_tool(["ip", "netns", "del", name], check=False)
        removed.append(name)
        if not quiet:
            extra = f" (killed {len(killed)} process(es) that ignored SIGTERM)" if killed else ""
            print(f"netns_cluster: removed netns {name}{extra}", file=sys.stderr)
    tmp = Path(tempfile.gettempdir())
    for d in tmp.glob(f"{NAME_PREFIX}*-logs-*"):
        m = LOGDIR_RE.match(d.name)
        if m and (all_runs or not pid_alive(int(m.group(1)))) and int(m.group(1)) != os.getpid():
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    return removed
