"""``smb2 bench NAME --quick`` of every benchmark whose quick run has no test
module of its own (scale's, tta's and agents' have theirs, and replicas-netns's
failover phase is in test_netns.py): it runs to the end and its JSON holds
the benchmark's figures, each present, finite and of the right kind (a rate
above zero, as many runs as asked, a ratio), and the machine and the
64-byte round trip beside them.  Never how fast: the quick runs' figures
are bookkeeping, not results, and this suite runs on busy machines.  Each
skips where what it needs is missing: etcd (the replicated ones), network
namespaces (scaleout, replicas-netns), torch (resume)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import smb2
import smb2.testing.netns as netns_cluster
from smb2.bench.accumulate import KINDS
from smb2.bench.attacks import ATTACKS
from smb2.bench.lock import SHM_KINDS
from smb2.testing.etcd import etcd_binary


def have_etcd() -> bool:
    try:
        etcd_binary()
    except smb2.Smb2Error:
        return False
    return True


needs_etcd = pytest.mark.skipif(not have_etcd(), reason="needs etcd (tools/host_deps.sh installs etcd-server)")


def quick(name: str, tmp_path: Path, *args: str, timeout: float = 110) -> dict[str, Any]:
    """``smb2 bench NAME --quick`` with ``args``: its JSON, after checking that
    it exited 0, marked itself quick and said where and on what it ran."""
    out = tmp_path / "out.json"
    run = subprocess.run([sys.executable, "-m", "smb2.bench", name, "--quick", "--json", str(out), *args],
                         capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, f"{name} --quick failed (exit {run.returncode}):\n{run.stdout[-2000:]}\n" \
                                f"{run.stderr[-3000:]}"
    result = json.loads(out.read_text())
    # where the benchmark records it: beside its figures, or in its config or settings
    assert True in (result.get("quick"), result.get("config", {}).get("quick"), result.get("settings", {}).get("quick"))
    assert result["machine"]["nproc"] == os.cpu_count() and result["smb2"] == smb2.__version__
    assert positive(result["round_trip_64B_us"])
    return result


def positive(x: Any) -> bool:
    """A finite number above zero (a rate, a time, a ratio)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def nonnegative(x: Any) -> bool:
    """A finite number, zero or more (CPU time, which a tick can round to zero)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


@pytest.mark.slow
def test_lock_and_the_server_s_work_per_acquisition(tmp_path: Path) -> None:
    r = quick("lock", tmp_path, "--png", str(tmp_path / "lock.png"))
    assert r["args"]["rounds"] == 1 and r["args"]["procs"] == [2]
    unc = r["uncontended"]["summary"]
    assert set(unc) == {"raw", "read64", "park", "poll", "spin", "futex"}
    for kind, v in unc.items():
        assert positive(v["p50_us"]) and v["p99_us"] >= v["p50_us"], (kind, v)
        assert positive(v["ratio_p50_vs_raw"]) and positive(v["ratio_p50_vs_read64"]), (kind, v)
    assert unc["raw"]["ratio_p50_vs_raw"] == 1.0
    runs = r["contended"]["runs"]
    kinds = ("park", "poll", "spin", *SHM_KINDS)
    rows = {(x["kind"], x["cs"]): x for x in runs}
    assert set(rows) == {(k, cs) for k in kinds for cs in ("empty", "rmw")} and len(runs) == len(rows)
    for (kind, cs), row in rows.items():
        assert len(row["counts"]) == 2 and min(row["counts"]) > 0, row
        assert positive(row["per_s"]) and positive(row["rtt_us"]), row
        if kind in ("futex", "futex_anycpu", "shmpoll"):
            # over shm the lock costs the server nothing (the rmw section's
            # read and write are copies in the client too)
            assert row["server_ops_per_acq"] == 0, row
            continue
        if kind == "mixed":
            # one shm and one TCP worker: the TCP one's acquire and release,
            # and the shm one's releases through the server while it waits
            assert 0 < row["server_ops_per_acq"], row
            continue
        # the parked path costs the server exactly its acquire and release
        # (plus the read and write of the rmw section), never a poll; each
        # worker may finish one acquisition after the window, uncounted
        least = 2.0 if cs == "empty" else 4.0
        total = sum(row["counts"])
        assert least <= row["server_ops_per_acq"], row
        if kind == "park":
            assert row["server_ops_per_acq"] <= least * (total + 2) / total, row
    summary = r["contended"]["summary"]
    assert [(s["cs"], s["procs"]) for s in summary] == [("empty", 2), ("rmw", 2)]
    for s in summary:
        assert positive(s["park_vs_spin"]) and positive(s["poll_vs_spin"]), s
        assert all(positive(s[f"{k}_vs_park"]) for k in SHM_KINDS), s
    assert "target: park p50" in r["table"] and "shm clients (same run" in r["table"]


@pytest.mark.slow
@needs_etcd
def test_replicated_lock(tmp_path: Path) -> None:
    r = quick("replicated-lock", tmp_path)
    assert (r["rounds"], r["n"]) == (1, 10)
    assert set(r["median_us"]) == {"rtt64", "lock", "replicated_lock"}
    assert all(positive(v) for v in r["median_us"].values()), r["median_us"]
    assert all(len(v) == 1 for v in r["samples_us"].values()), r["samples_us"]
    assert positive(r["replicated_over_plain"])
    assert r["round_trip_64B_us"] == round(r["median_us"]["rtt64"], 1)
    [kill] = r["failover"]
    # the waiter holds the lock only after the holder released it
    assert positive(kill["kept_s"]) and kill["handed_on_s"] >= kill["kept_s"], kill
    assert kill["server"] in (0, 1, 2)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_scaleout(tmp_path: Path) -> None:
    ok, why = netns_cluster.can_run()
    if not ok:
        pytest.skip(f"no network namespaces here: {why}")
    r = quick("scaleout", tmp_path, "--quiet", "--png", str(tmp_path / "scaleout.png"), timeout=190)
    assert r["params"]["servers"] == [1, 2] and r["params"]["rounds"] == 1
    ops = ("write", "read", "raw-write", "raw-read")
    assert set(r["summary"]) == {f"{op}/{n}" for op in ops for n in (1, 2)}
    assert len(r["samples"]) == len(ops) * 2
    for key, row in r["summary"].items():
        assert row["rounds"] == 1 and positive(row["GBps_median"]), (key, row)
        assert positive(row["speedup"]) and positive(row["efficiency"]), (key, row)
        assert positive(row["rtt_us_median"]) and nonnegative(row["client_cpu_s_per_GB"]), (key, row)
        if not key.startswith("raw-"):
            assert positive(row["vs_raw"]), (key, row)
    assert r["summary"]["write/1"]["speedup"] == 1.0
    assert set(r["training_samples_per_s"]) == {"1", "2"}
    assert all(positive(v) for v in r["training_samples_per_s"].values()), r["training_samples_per_s"]


@pytest.mark.slow
@needs_etcd
def test_replicas(tmp_path: Path) -> None:
    r = quick("replicas", tmp_path)
    assert (r["turns"], r["repeat"]) == (1, 1)
    figures = {"rtt_64B_us", "fetch_add_us", "write_64MiB_MBps", "read_64MiB_MBps"}
    for key in ("this r1", "this r2", "this r2 / this r1"):
        assert set(r[key]) == figures and all(positive(v) for v in r[key].values()), (key, r[key])
    assert set(r["this r1 / this r1"].values()) == {1.0}
    assert r["round_trip_64B_us"] == round(r["this r1"]["rtt_64B_us"], 1)


@pytest.mark.slow
@needs_etcd
def test_repair(tmp_path: Path) -> None:
    r = quick("repair", tmp_path)
    rejoin, replace = r["rows"]
    assert rejoin["mode"].startswith("rejoin") and replace["mode"].startswith("replace")
    for row in (rejoin, replace):
        assert row["copies_equal_data"] is True, row
        assert positive(row["repair_s_median"]) and row["repair_s_worst"] >= row["repair_s_median"], row
        assert positive(row["bytes_copied"]) and positive(row["implied_MiB_per_s"]), row
        assert positive(row["rtt_64B_us_median"]), row
    # --load beside the replacement: its write rate during the repair (which a quick one may end
    # within a few writes) against as long after it
    assert nonnegative(replace["load_write_MB_per_s_during_repair"])
    assert positive(replace["load_write_MB_per_s_after_repair"])
    assert nonnegative(replace["load_during_over_after"])
    assert "load_rtt_64B_us_during_repair" in replace and positive(replace["load_rtt_64B_us_after_repair"])


@pytest.mark.slow
def test_resume(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    r = quick("resume", tmp_path)
    base, saving = r["rows"]
    assert base["every_s"] is None and base["saves"] == 0 and base["median_ratio"] == 1.0
    # a save is due every 5 ms, and a round's steps take longer than that
    assert saving["every_s"] == 0.005 and saving["saves"] >= 1, saving
    for row in (base, saving):
        assert positive(row["median_ms"]) and positive(row["mean_ms"]) and positive(row["state_mb"]), row
        assert row["round"] == 0 and positive(row["rtt_us"]), row
    assert positive(r["summary"]["median_ratio"]) and positive(r["summary"]["mean_ratio"])


@pytest.mark.slow
def test_classifier_runs_ddp_and_the_default_on_the_same_seeds(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn", reason="the digits data set needs scikit-learn")
    from smb2.bench.classifier import WITHIN_POINTS
    r = quick("classifier", tmp_path, "--seeds", "2")
    runs = r["runs"]
    # each seed's pair, in turns: ddp first for seed 0, the default first for seed 1
    assert [(x["seed"], x["system"]) for x in runs] == [(0, "ddp"), (0, "default"), (1, "default"), (1, "ddp")]
    for x in runs:
        assert x["optimizer"] == "adamw" and x["rule"] == ("ddp" if x["system"] == "ddp" else "allreduce"), x
        assert len(x["ranks_accuracy"]) == r["workers"] == 2 and x["accuracy"] == x["ranks_accuracy"][0]
        # an epoch of digits learns far beyond chance (10 %), whichever system averaged the gradients
        assert x["accuracy"] > 30 and x["steps"] == runs[0]["steps"] > 0 and positive(x["seconds"]), x
        if x["system"] == "default":
            assert len(set(x["ranks_accuracy"])) == 1, x      # every rank holds the shared model
    (row,) = r["summary"]
    assert row["optimizer"] == "adamw" and row["seeds"] == 2
    ddp = sorted(x["accuracy"] for x in runs if x["system"] == "ddp")
    default = sorted(x["accuracy"] for x in runs if x["system"] == "default")
    assert row["ddp_runs"] == ddp and row["default_runs"] == default
    assert row["difference_of_medians"] == round(sum(default) / 2 - sum(ddp) / 2, 2)
    assert row["within"] == (abs(row["difference_of_medians"]) <= WITHIN_POINTS)


def test_classifier_without_the_example_scripts_says_where_they_are(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "smb2.bench", "classifier", "--quick", "--examples", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert f"torch_train_ddp.py, torch_train.py are not in {tmp_path}" in run.stderr, run.stderr
    assert "run from a source checkout, or pass --examples DIR" in run.stderr, run.stderr


@pytest.mark.slow
def test_accumulate(tmp_path: Path) -> None:
    r = quick("accumulate", tmp_path)
    assert [run["threads"] for run in r["runs"]] == [1, 2] and r["size"] == 1 << 20
    summary = r["summary"]
    assert [row["threads"] for row in summary] == [1, 2]
    for row in summary:
        for kind in KINDS:
            assert positive(row[f"{kind}_GBps"]) and positive(row[f"{kind}_kernel_GBps"]), row
            assert nonnegative(row[f"{kind}_cpu_s_per_GB"]) and nonnegative(row[f"{kind}_loop_cpu_s_per_GB"]), row
            assert positive(row[f"{kind}_vs_first"]), row
        assert positive(row["write_GBps"]) and nonnegative(row["write_cpu_s_per_GB"]), row
        assert positive(row["round_trip_64B_us"]), row
    assert all(summary[0][f"{kind}_vs_first"] == 1.0 for kind in KINDS)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_training(tmp_path: Path) -> None:
    r = quick("training", tmp_path, "--png", str(tmp_path / "training.png"), timeout=290)
    assert r["steps"] == 2
    rows = {(x["system"], x["rule"], x["workers"]): x for x in r["rows"]}
    systems = [("smb2", "accumulate")]
    if importlib.util.find_spec("torch") is not None:
        systems += [("gloo all-reduce", "sync"), ("torch DDP", "sync"), ("AsyncOptimizer", "delta/s1")]
    assert set(rows) == {(s, rule, w) for s, rule in systems for w in (1, 2)} and len(r["rows"]) == len(rows)
    for (system, _, workers), row in rows.items():
        assert positive(row["samples_per_s"]) and positive(row["samples"]), row
        assert positive(row["rtt_us"]) and math.isfinite(row["comm_fraction"]), row
        assert nonnegative(row["bytes_moved"]) and positive(row["vs_gloo"]), row
        if system == "smb2":
            # against the same rule with 1 worker on 1 server, in the same run
            assert positive(row["vs_1_worker_1_server"]) and row["servers"] == 1, row
            assert workers == 2 or row["vs_1_worker_1_server"] == 1.0, row
        if system in ("smb2", "AsyncOptimizer") or workers == 2:
            assert positive(row["bytes_moved"]), row       # one gloo or DDP worker sends nothing


@pytest.mark.slow
def test_bandwidth(tmp_path: Path) -> None:
    r = quick("bandwidth", tmp_path)
    sizes = [1 << 20, 16 << 20, 64 << 20]
    assert r["config"]["sizes"] == sizes and r["config"]["transport"] == "tcp"
    repeat = r["config"]["repeat"]
    rows = r["summary"]["bandwidth"]
    assert [(x["op"], x["size"]) for x in rows] == [(op, s) for s in sizes for op in ("write", "read", "accumulate")]
    assert len(r["samples"]) == len(rows) * repeat
    for x in rows:
        assert x["n"] == repeat and positive(x["rtt_us"]), x
        assert positive(x["smb2_gbps"]) and positive(x["raw_gbps"]) and positive(x["ratio"]), x
    assert [x["size"] for x in r["summary"]["latency"]] == [4096, 64]
    for x in r["summary"]["latency"]:
        assert positive(x["smb2_p50_us"]) and positive(x["raw_p50_us"]) and positive(x["ratio"]), x


@pytest.mark.slow
@needs_etcd
def test_replicas_netns_throughput(tmp_path: Path) -> None:
    # its failover phase: tests/test_netns.py
    ok, why = netns_cluster.can_run()
    if not ok:
        pytest.skip(f"no network namespaces here: {why}")
    r = quick("replicas-netns", tmp_path, "--phases", "throughput")
    shaping = r["throughput"]["server-bound"]
    assert list(r["throughput"]) == ["server-bound"]          # --quick: one shaping
    for replicas in ("replicas=1", "replicas=2"):
        row = shaping[replicas]
        assert positive(row["rtt_64B_us"]) and positive(row["fetch_add_64B_us"]), row
        for op in ("write", "read", "accumulate"):
            assert positive(row[f"{op}_MBps"]) and len(row[f"{op}_MBps_samples"]) == 1, (op, row)
            assert positive(row[f"{op}_link_MiB"]["c"]["in" if op == "read" else "out"]), (op, row)
    assert all(positive(v) for v in shaping["ratio r2/r1"].values()), shaping["ratio r2/r1"]


@pytest.mark.slow
@pytest.mark.timeout(300)
# alone: several attacks are judged within a time window (a hello timeout, a lease, a token
# holder's connects beside a guesser), which a machine busy with other tests can stretch
@pytest.mark.alone
def test_attacks(tmp_path: Path) -> None:
    r = quick("attacks", tmp_path, timeout=290)
    assert [row["attack"] for row in r["rows"]] == sorted(ATTACKS)
    for row in r["rows"]:
        assert row["served_after"] is True and not row["result"].startswith("FAILED"), row
        assert positive(row["rss_before"]) and row["rss_peak"] >= row["rss_before"], row
        assert nonnegative(row["seconds"]), row
