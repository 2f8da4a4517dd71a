"""``smb2 bench scale --quick``: 64 simulated workers against 2 real servers
in 2 processes; every field of its JSON is filled (its times and CPU
figures are the benchmark's to show, not asserted here).  With ``--agents``
(8 workers over 2 simulated hosts, an ``smb2-agent`` each): what the
servers counted (requests, bytes) and what they hold after each exchange,
which timing cannot change."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from smb2 import bench
from smb2.bench.scale import AGENT_PHASES, PHASES


def test_the_quick_scale_run_fills_its_json(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    run = subprocess.run([sys.executable, "-m", "smb2.bench", "scale", "--quick", "--quiet", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "scale" in bench.BENCHMARKS and "join" in run.stdout
    result = json.loads(out.read_text())
    assert (result["workers"], result["servers"], result["processes"]) == (64, 2, 2)
    assert list(result["phases"]) == list(PHASES)
    for phase, row in result["phases"].items():
        assert row["errors"] == [], (phase, row["errors"])
        assert len(row["server_cpu_s"]) == 2 and all(c >= 0 for c in row["server_cpu_s"])
        assert all(rss > 0 for rss in row["server_rss"]) and row["wall_s"] > 0
    s = result["summary"]
    assert (s["connected"], s["refused"]) == (64, 0)
    assert s["barrier_polls"] >= 64 and s["barrier_full_reads"] == 0
    assert result["phases"]["beat"]["beats"] == 64 * 2
    assert result["phases"]["exchange"]["bytes"] == 64 * 2 * (64 << 10)
    assert set(s["server_cpu_ms_per_worker"]) == set(PHASES) and s["server_rss_max"] > 0
    assert result["round_trip_64B_us"] > 0 and result["server_connections"] and "machine" in result
    assert isinstance(result["loaded_machine"], bool) and len(result["loadavg_before"]) == 3


def test_through_agents_the_servers_see_one_exchange_per_host_and_the_exact_sum(tmp_path: Path) -> None:
    """The same 8 workers exchange directly, then through 2 agents (4 workers
    each): the servers' stat counts about 4 times fewer accumulates and
    payload bytes in and out with agents (at least one forward and one pull
    per host, so never more than 4 times; 2 allows a forward or pull that
    left before every host-mate came), and after each exchange the servers'
    weights moved by the sum of the workers' integer changes exactly."""
    out = tmp_path / "scale.json"
    workers, hosts, model = 8, 2, 64 << 10
    # a gathering bound far above the phase's time: the test counts, it does not time
    run = subprocess.run([sys.executable, "-m", "smb2.bench", "scale", "--quick", "--workers", str(workers),
                          "--agents", str(hosts), "--agent-gather", "2", "--quiet", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "exact sum" in run.stdout
    result = json.loads(out.read_text())
    assert list(result["phases"]) == [*PHASES, *AGENT_PHASES] and result["agents"] == hosts
    for phase, row in result["phases"].items():
        assert row["errors"] == [], (phase, row["errors"])
        assert len(row["agent_cpu_s"]) == hosts and all(c >= 0 for c in row["agent_cpu_s"])
    ph = result["phases"]
    assert (ph["exchange"]["via_agent"], ph["agent"]["via_agent"], ph["exchange_agents"]["via_agent"]) == (
        0, workers, workers)
    direct, agents = result["exchange"]["direct"], result["exchange"]["agents"]
    # each worker's change sums to 2.5 per element: (1 + 2 + 3 + 4) / 4
    for e in (direct, agents):
        assert e["servers_change_exact"] is True
        assert e["servers_change_sum"] == e["expected_change_sum"] == workers * 2.5 * (model // 4)
        assert e["agent_cpu_s"] >= 0 and e["server_cpu_s"] >= 0
    per_host = workers // hosts
    assert direct["server_bytes_in"] == workers * model     # every worker's push, nothing else
    assert agents["server_bytes_in"] >= hosts * model
    for key in ("accumulate_requests", "server_bytes_in", "server_bytes_out"):
        assert agents[key] > 0 and per_host / 2 <= direct[key] / agents[key] <= per_host, (key, direct, agents)
    fewer = result["summary"]["agents_fewer"]["accumulate_requests"]
    assert fewer == pytest.approx(direct["accumulate_requests"] / agents["accumulate_requests"], abs=1e-3)
