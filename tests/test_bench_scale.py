"""``smb2 bench scale --quick``: 64 simulated workers against 2 real servers
in 2 processes; every field of its JSON is filled (its times and CPU
figures are the benchmark's to show, not asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from smb2 import bench
from smb2.bench.scale import PHASES


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
