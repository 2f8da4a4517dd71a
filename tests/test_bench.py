"""``smb2 bench`` / ``python -m smb2.bench``: the dispatch to the TCP and
RDMA benchmarks, and the raw baseline peer both benchmark programs use.
(The benchmarks' figures are for the benchmarks to show, not for tests.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import smb2
from smb2 import bench, cli
from smb2.bench import report
from smb2.bench.common import fmt_size, latencies, pct, start_raw_peer, stop_raw_peer


def test_python_m_smb2_bench_is_smb2_bench() -> None:
    out = subprocess.run([sys.executable, "-m", "smb2.bench", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: smb2 bench NAME")
    listed = [line.split()[0] for line in out.stdout.split("benchmarks:\n")[1].split("\n\n")[0].splitlines()]
    assert listed == list(bench.BENCHMARKS)
    assert {"bandwidth", "lock", "scaleout", "replicas", "repair", "resume", "training", "tta",
            "attacks"} <= set(listed)
    out = subprocess.run([sys.executable, "-m", "smb2.bench", "bandwidth", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "--transport {tcp,rdma,shm,auto}" in out.stdout, out.stderr


def test_every_benchmark_is_a_subcommand_with_its_own_help() -> None:
    for name in bench.BENCHMARKS:
        out = subprocess.run([sys.executable, "-m", "smb2.bench", name, "--help"], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, (name, out.stderr[-2000:])
        assert out.stdout.startswith(f"usage: smb2 bench {name}" if name != "bandwidth" else "usage: smb2 bench"), \
            (name, out.stdout[:200])
        # each has a quick run through its whole path (tests/test_bench_quick.py and its own tests run them)
        assert "--quick" in out.stdout, name
    assert cli.main(["bench", "sideways"]) == 2


def test_each_benchmark_checks_its_own_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    # the TCP benchmark (the default), reached through the smb2 command
    assert cli.main(["bench", "--servers", "0"]) == 2
    assert "--servers must be at least 1" in capsys.readouterr().err
    # --transport rdma goes to the RDMA benchmark, whose --poll the TCP one does not have
    assert bench.main(["--transport", "rdma", "--poll", "sideways"]) == 2
    assert "--poll takes event and/or busy" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--sizes", "3"])     # not a multiple of 4 bytes
    assert "positive multiples of 4 bytes" in capsys.readouterr().err


async def test_the_raw_peer_sinks_sources_and_echoes() -> None:
    peer, raw = await start_raw_peer(1 << 16)
    try:
        src = np.arange(1 << 16, dtype=np.uint8)
        await raw.sink(src.data)
        back = np.zeros_like(src)
        await raw.source(back.data)
        assert np.array_equal(back, src)     # it sank the bytes into the memory it sources from
        times = await latencies(raw.ping, 20)
        assert len(times) == 20 and all(t > 0 for t in times)
        assert pct(times, 0) == min(times) and pct(times, 100) == max(times)
    finally:
        await stop_raw_peer(peer, raw)
    assert peer.returncode is not None


def test_sizes_read_in_binary_units() -> None:
    assert fmt_size(16 << 20) == "16 MiB"
    assert fmt_size(4096, sep="") == "4KiB"
    assert fmt_size(1000) == "1000 B"


def test_the_shm_benchmark_runs_against_np_copyto(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--transport", "shm", "--sizes", "64KiB", "--repeat", "2", "--quick",
                       "--servers", "2", "--json", ""]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0] for line in out.splitlines() if line.strip()}
    assert {"write", "read", "np.copyto", "fetch_add"} <= rows, out
    assert bench.main(["--transport", "shm", "--sizes", "0"]) == 2
    assert "--sizes must be positive" in capsys.readouterr().err


async def test_the_report_writes_the_machine_and_the_round_trip_beside_the_figures(tmp_path: Path) -> None:
    """What every benchmark's JSON says besides its figures, its tables, and its PNG."""
    server = await smb2.start_server("127.0.0.1", 0)
    try:
        rtt = await report.round_trip_us([f"127.0.0.1:{server.address[1]}"], n=20)
    finally:
        await server.close()
    assert 0 < rtt < 1e6
    out = report.write_json(tmp_path / "deep" / "run.json", {"rows": [1]}, round_trip_64B_us=rtt, quiet=True)
    doc = json.loads(out.read_text())
    assert doc["rows"] == [1] and doc["round_trip_64B_us"] == round(rtt, 1)
    assert doc["smb2"] == smb2.__version__ and doc["machine"]["nproc"] == os.cpu_count()
    # a run with no server to ask says so (null), never a made-up zero
    none = json.loads(report.write_json(tmp_path / "none.json", {}, round_trip_64B_us=None, quiet=True).read_text())
    assert none["round_trip_64B_us"] is None and "machine" in none
    assert report.median_round_trip([None, 3.0, 1.0, 2.0]) == 2.0 and report.median_round_trip([None]) is None
    assert report.table(["name", "GB/s"], [["tcp", 1.5], ["shm", 12.25]]).splitlines() == [
        "name   GB/s", "tcp     1.5", "shm   12.25"]
    # number formats per column; a missing value is "-" and keeps its column right-aligned
    assert report.table(["op", "ratio", "share"], [["read", 1.234, 0.5], ["write", None, 0.25]],
                        formats=[None, "{:.2f}x", "{:.0%}"], indent=2).splitlines() == [
        "  op     ratio  share", "  read   1.23x    50%", "  write      -    25%"]
    assert report.target(">=", 1.5, "{:.2f}x", False) == ">= 1.50x NOT met"
    assert report.table(["a", "b"], [[1, "x"]], markdown=True).splitlines() == ["| a | b |", "| --- | --- |",
                                                                                "| 1 | x |"]
    png = tmp_path / "plot.png"
    why = report.plot(png, lambda plt: plt.subplots()[0])
    if importlib.util.find_spec("matplotlib") is None:
        assert why == report.NO_MATPLOTLIB and not png.exists()
    else:
        assert why is None and png.read_bytes()[:4] == b"\x89PNG"


def test_a_progress_line_says_the_count_the_time_elapsed_and_what_is_left(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # the clock is the test's: the line's shape is under test, not the machine's pace
    now = iter([100.0, 130.0, 100.0 + 3 * 1241, 5000.0, 6000.0, 6010.0])
    monkeypatch.setattr(report, "clock", lambda: next(now))
    first = report.progress("demo", 0, 4, "runs of a demo")
    assert first == "[bench demo] 0/4 runs of a demo (0.0 s elapsed)"
    assert capsys.readouterr().err == first + "\n"
    assert report.progress("demo", 1, 4, "run 1", speed="1.50 GB/s", **{"server CPU": None}) == (
        "[bench demo] 1/4 run 1: speed 1.50 GB/s, server CPU - (30.0 s elapsed, about 1m30s left)")
    assert report.progress("demo", 3, 4, "run 3") == "[bench demo] 3/4 run 3 (1h02m elapsed, about 20m41s left)"
    assert report.progress("demo", 4, 4, "run 4") == "[bench demo] 4/4 run 4 (1h21m elapsed)"
    # a new count (the next phase, or the bench run again) starts its own clock
    assert report.progress("demo", 1, 2, "phase two") == "[bench demo] 1/2 phase two (0.0 s elapsed)"
    assert report.progress("demo", 2, 2, "phase two") == "[bench demo] 2/2 phase two (10.0 s elapsed)"
    assert [report.duration(s) for s in (0.04, 59.9, 61, 3599, 3600)] == ["0.0 s", "59.9 s", "1m01s", "59m59s",
                                                                          "1h00m"]
