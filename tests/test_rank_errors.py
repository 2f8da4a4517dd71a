"""What a user reads when a training job meets a fault: each rank ends with
the fault's own lines (the message in training terms, DETAIL, HINT), not a
traceback per rank; the traceback is there for who asks (SMB2_DEBUG=1).
Real torchrun workers (examples/torch_train.py through AsyncOptimizer) and
real smb2-server processes, one of them killed with SIGKILL (replicas=1)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
# the lines a rank that lost its server may print: the message, DETAIL, HINT and the
# pointer to SMB2_DEBUG, with room for one warning the library logs on the way
MAX_LINES = 5

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def store_steps(servers: str, name: str) -> list[int]:
    ls = subprocess.run([sys.executable, "-m", "smb2.cli", "ls", "--json", "--servers", servers],
                        capture_output=True, text=True, timeout=60)
    rows = json.loads(ls.stdout) if ls.returncode == 0 else []
    return next((r.get("steps") or [] for r in rows if r["name"] == name), [])


def test_a_rank_that_lost_its_server_ends_in_a_few_lines(
        threaded_cluster: Callable[..., contextlib.AbstractContextManager[tuple[Any, Any]]], tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    with threaded_cluster("rank-errors", servers=2) as (loop, cluster):
        servers = ",".join(cluster.addresses)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SMB2_")}
        env["SMB2_SERVERS"] = servers
        # stderr of each rank to a file of its own (torchrun --redirects 2)
        run = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             "--log-dir", str(logs), "--redirects", "2", str(ROOT / "examples" / "torch_train.py"),
             "--epochs", "200", "--name", "lost-server"],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 240
            while not (len(steps := store_steps(servers, "lost-server")) == 2 and min(steps) >= 3):
                assert run.poll() is None, run.communicate()
                assert time.monotonic() < deadline, "the workers never trained"
                time.sleep(0.5)
            loop.run(cluster.kill(1))
            _, torchrun_err = run.communicate(timeout=240)
        finally:
            if run.poll() is None:
                run.kill()
                run.communicate()
    assert run.returncode != 0
    outputs = sorted(logs.rglob("stderr.log"))
    assert len(outputs) == 2, torchrun_err
    for path in outputs:
        lines = path.read_text().splitlines()
        text = "\n".join(lines)
        assert "Traceback" not in text, text
        assert any(line.startswith("smb2: rank ") and " lost memory server " in line for line in lines), text
        assert any(line.startswith("HINT: restart that smb2-server") for line in lines), text
        assert len(lines) <= MAX_LINES, text


# the end of a rank, in a process of its own: the library's hook, a fault in training terms
RAISE = ("from smb2.errors import TransportError\n"
         "from smb2.train.faults import end_ranks_briefly, in_training_terms\n"
         "end_ranks_briefly()\n"
         "raise in_training_terms(TransportError('connection to h:1 lost', server='h:1'), "
         "store='s', rank=3, step=7)\n")


@pytest.mark.parametrize("debug", [False, True])
def test_the_traceback_is_there_for_who_asks(debug: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SMB2_DEBUG"}
    if debug:
        env["SMB2_DEBUG"] = "1"
    run = subprocess.run([sys.executable, "-c", RAISE], capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 1
    assert "rank 3 lost memory server h:1 at step 7 of store 's'" in run.stderr
    assert ("Traceback" in run.stderr) is debug, run.stderr
    if not debug:
        assert len(run.stderr.splitlines()) == 4, run.stderr     # message, DETAIL, HINT, the SMB2_DEBUG pointer


def test_the_cli_says_its_error_in_lines_and_the_traceback_on_asking() -> None:
    """``smb2 ls`` of a server that is not there: the message and HINT; the
    traceback only with SMB2_DEBUG=1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMB2_")}
    args = [sys.executable, "-m", "smb2.cli", "rm", "x", "--servers", "127.0.0.1:1", "--connect-timeout", "5"]
    quiet = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env)
    loud = subprocess.run(args, capture_output=True, text=True, timeout=60, env={**env, "SMB2_DEBUG": "1"})
    assert quiet.returncode == loud.returncode == 1
    assert quiet.stderr.startswith("smb2 rm: ") and "Traceback" not in quiet.stderr, quiet.stderr
    assert len(quiet.stderr.splitlines()) <= 3, quiet.stderr
    assert "Traceback" in loud.stderr and quiet.stderr.strip() in loud.stderr, loud.stderr
