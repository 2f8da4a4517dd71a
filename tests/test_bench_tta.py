"""The quick mode of the time-to-accuracy benchmark (smb2 bench tta): its
bookkeeping, not its speed.

Two memory-server hosts and two worker hosts, each a network namespace behind a 1 Gbit/s
link; torch DDP and the compared systems (the default port, diloco, easgd) train the small
model on the same worker hosts in one run.  Checked: every system trained and learned
something and no curve ended at chance, the bytes that crossed each worker's link per step
match the model's size and the rule, the summary and the targets table are filled in, and
DDP and smb2 saw the same links.  Skipped, with the reason, where namespaces cannot be built or torch is
missing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import smb2.testing.netns as netns_cluster
from smb2.bench import tta as bench_tta

# alone: the benchmark must reach its target within a time budget
pytestmark = [pytest.mark.timeout(120), pytest.mark.alone]


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("torch")
    ok, why = netns_cluster.can_run()
    if not ok:
        pytest.skip(f"no network namespaces here: {why}")
    out = tmp_path_factory.mktemp("tta") / "tta.json"
    r = subprocess.run([sys.executable, "-m", "smb2.bench", "tta", "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, f"bench_tta --quick failed (exit {r.returncode}): {r.stderr[-3000:]}"
    return json.loads(out.read_text())


def test_every_system_trained(result: dict) -> None:
    rows = {r["system"]: r for r in result["rows"]}
    # the compared systems, every one (diloco where this smb2 has the rule)
    assert set(rows) == {s for s in bench_tta.SYSTEMS if bench_tta.available(s)} and "default" in rows
    assert result["runs"] == 1 and all(r["run"] == 0 for r in result["rows"])
    for name, r in rows.items():
        assert r["workers"] == bench_tta.QUICK["workers"] and r["steps"] > 0, name
        assert r["samples_per_s"] > 0 and r["curve"][-1][0] > 0, name
        # ten classes: chance is 0.1; the quick target is 0.5 within the time budget
        assert r["time_to_target_s"] is not None, f"{name} never reached {r['target']}: {r['curve']}"
        assert r["last_eval_acc"] >= r["target"], name       # --quick stops at the target
        # the delivered model (smb2: the shared weights, EASGD's center) on the final test set
        assert r["final_model"] == {"ddp": "DDP's model", "easgd": "the center"}.get(name, "the shared weights")
        right = r["final_acc"] * result["config"]["final_n"]
        assert abs(right - round(right)) < 1e-6 and r["final_acc"] > 0.3, (name, r["final_acc"])
        assert r["final_points_vs_ddp"] == pytest.approx(100 * (r["final_acc"] - rows["ddp"]["final_acc"])), name
        assert 0.0 <= r["not_computing"] <= 1.0, name
        # no system's curve ended at chance, and the row says so
        assert r["curve"][-1][2] > bench_tta.COLLAPSED_BELOW and not r["collapsed"], (name, r["curve"][-3:])
        assert r["collapse_warnings"] == 0, name
        assert 1 < r["rtt_us"] < 5000, name        # the round trip beside each row, in µs
    assert all(r["ddp_ratio"] is not None for r in rows.values())
    # the summary (medians of one run: the run) and the stability targets, each judged
    summary = {s["system"]: s for s in result["summary"]}
    assert set(summary) == set(rows)
    for name, s in summary.items():
        assert s["runs"] == 1 and s["collapsed"] == 0 and s["final_acc"] == rows[name]["final_acc"], name
        assert s["time_to_target_s"] == rows[name]["time_to_target_s"], name
    said = {t["target"].split(" >=")[0].split(" within")[0].split(" never")[0] for t in result["targets"]}
    assert said == {"default port", "default port final", "default port time to target", "best configuration"}
    assert all(isinstance(t["met"], bool) and t["scenario"] == "homogeneous" for t in result["targets"])


def test_bytes_per_step_match_model_and_rule(result: dict) -> None:
    rows = {r["system"]: r for r in result["rows"]}
    sizes = bench_tta.QUICK["sizes"]
    params = sum(m * n + n for m, n in zip(sizes, sizes[1:]))
    for name, r in rows.items():
        assert r["params"] == params, name
        want = r["expected_bytes_per_step"]
        measured = r["link_bytes_per_step"]
        assert len(measured) == r["workers"]
        if want is None:
            # diloco, a round of H steps (bytes a parameter): two bf16 accumulates and the pull (8), and
            # for the worker whose push completes a group of W the momentum step too (read 8, write 6):
            # at most 22, under 3 of the default's float32 steps (8 each)
            full = rows["default"]["link_bytes_per_step"]
            assert all(0 < m < 3 / bench_tta.DILOCO_H * f for m, f in zip(measured, full)), (name, measured, full)
            continue
        # on the wire: the rule's payload plus Ethernet/IP/TCP headers and acks (a few %)
        for m in measured:
            assert 0.97 * want <= m <= 1.15 * want, f"{name}: {m:.0f} B/step on the link, rule says {want:.0f}"
        for p in r.get("payload_bytes_per_step", []):   # AsyncOptimizer's own count of its payload
            assert 0.98 * want <= p <= 1.05 * want, f"{name}: payload {p:.0f} B/step, rule says {want:.0f}"
    # the rules against each other: EASGD exchanges every 4th step
    assert rows["easgd"]["expected_bytes_per_step"] == 0.25 * rows["default"]["expected_bytes_per_step"]


def test_the_machine_round_trip_is_recorded(result: dict) -> None:
    [us] = result["rtt_us"]["homogeneous"]     # one per run
    assert 1 < us < 5000, us        # a loopback round trip, in µs: microseconds, not seconds or ns


def test_ddp_and_smb2_saw_the_same_links(result: dict) -> None:
    rate = netns_cluster.parse_rate(result["rates"]["homogeneous"])
    for r in result["rows"]:
        assert r["worker_link_rates"] == [rate] * r["workers"], r["system"]
