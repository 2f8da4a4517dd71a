"""The quick mode of the time-to-accuracy benchmark (smb2 bench tta): its bookkeeping, not
its speed.

Two memory-server hosts and two worker hosts, each a network namespace behind a 1 Gbit/s
link (and torchft's lighthouse on a host of its own); torch DDP, torchft's DiLoCo and the
compared smb2 systems (the default port: rule allreduce, diloco, easgd) train the small model on the same
worker hosts in one run.  Checked: every system trained and learned something and no curve
ended at chance, the bytes that crossed each worker's link per step match the model's size and
the rule, the summary and the targets table are filled in, and DDP and smb2 saw the same links.
The language-model task (--task lm) likewise: every system, torchft's included, ends clearly
below chance.  Skipped, with the reason, where namespaces cannot be built or torch is missing;
torchft missing fails (make test installs it: smb2[tta]).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

import smb2.testing.netns as netns_cluster
from smb2.bench import tta as bench_tta
from smb2.bench import tta_lm

# alone: the benchmark must reach its target within a time budget
pytestmark = [pytest.mark.timeout(120), pytest.mark.alone]
TORCHFT_MISSING = "torchft is not installed: make test installs it (pip install -e '.[tta]')"
FINAL_MODEL = {"ddp": "DDP's model", "easgd": "the center", "torchft": "rank 0's model"}
#: the language model's quick run: DDP, torchft's DiLoCo and smb2's default port (rule allreduce), diloco
#: and the asynchronous port (rule delta)
LM_SYSTEMS = ["ddp", "default", "diloco", "torchft", bench_tta.ASYNC_PORT]


def quick(tmp: Path, *args: str) -> dict:
    """``bench_tta.py --quick`` with ``args``: its JSON (skipped where namespaces cannot be built)."""
    pytest.importorskip("torch")
    ok, why = netns_cluster.can_run()
    if not ok:
        pytest.skip(f"no network namespaces here: {why}")
    out = tmp / "tta.json"
    r = subprocess.run([sys.executable, "-m", "smb2.bench", "tta", "--quick", "--json", str(out), *args],
                       capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, f"bench_tta --quick {' '.join(args)} failed (exit {r.returncode}): {r.stderr[-3000:]}"
    assert "left out" not in r.stderr, r.stderr[-2000:]      # torchft among them: the test install has it
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("torch")
    assert bench_tta.available("torchft"), TORCHFT_MISSING
    return quick(tmp_path_factory.mktemp("tta"))


@pytest.fixture(scope="module")
def lm_result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("torch")
    assert bench_tta.available("torchft"), TORCHFT_MISSING
    return quick(tmp_path_factory.mktemp("tta-lm"), "--task", "lm", "--systems", ",".join(LM_SYSTEMS))


def test_every_system_trained(result: dict) -> None:
    rows = {r["system"]: r for r in result["rows"]}
    # the compared systems, every one (diloco where this smb2 has the rule)
    assert set(rows) == {s for s in bench_tta.SYSTEMS if bench_tta.available(s)} and "default" in rows
    assert "torchft" in rows, TORCHFT_MISSING
    assert result["runs"] == 1 and all(r["run"] == 0 for r in result["rows"])
    for name, r in rows.items():
        assert r["workers"] == bench_tta.QUICK["workers"] and r["steps"] > 0, name
        assert r["samples_per_s"] > 0 and r["curve"][-1][0] > 0, name
        # ten classes: chance is 0.1; the quick target is 0.5 within the time budget
        assert r["time_to_target_s"] is not None, f"{name} never reached {r['target']}: {r['curve']}"
        assert r["last_eval"] >= r["target"], name       # --quick stops at the target
        # the delivered model (smb2: the shared weights, EASGD's center) on the final test set
        assert r["final_model"] == FINAL_MODEL.get(name, "the shared weights"), name
        right = r["final"] * result["config"]["final_n"]
        assert abs(right - round(right)) < 1e-6 and r["final"] > 0.3, (name, r["final"])
        assert r["final_vs_ddp"] == pytest.approx(100 * (r["final"] - rows["ddp"]["final"])), name
        assert 0.0 <= r["not_computing"] <= 1.0, name
        # no system's curve ended at chance, and the row says so
        assert r["curve"][-1][2] > bench_tta.COLLAPSED_BELOW and not r["collapsed"], (name, r["curve"][-3:])
        assert r["collapse_warnings"] == 0, name
        assert 1 < r["rtt_us"] < 5000, name        # the round trip beside each row, in µs
    assert all(r["ddp_ratio"] is not None for r in rows.values())
    # DDP's ceiling: its workers' steps with nothing exchanged, against its own samples a second
    ddp = rows["ddp"]
    assert ddp["compute_only_samples_per_s"] > 0
    assert ddp["ceiling"] == pytest.approx(ddp["compute_only_samples_per_s"] / ddp["samples_per_s"])
    assert all("ceiling" not in r for name, r in rows.items() if name != "ddp")
    # the summary (medians of one run: the run) and the stability targets, each judged
    summary = {s["system"]: s for s in result["summary"]}
    assert set(summary) == set(rows)
    for name, s in summary.items():
        assert s["runs"] == 1 and s["collapsed"] == 0 and s["final"] == rows[name]["final"], name
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
        # each worker's egress queue (its tbf's counters): packets it sent, and the share dropped
        assert len(r["egress_drop_pct"]) == len(r["egress_packets"]) == r["workers"], name
        assert all(n > 0 for n in r["egress_packets"]) and all(0 <= d < 100 for d in r["egress_drop_pct"]), name
        want = r["expected_bytes_per_step"]
        measured = r["link_bytes_per_step"]
        assert len(measured) == r["workers"]
        if want is None:
            # diloco, a round of H steps (bytes a parameter): two bf16 accumulates and the pull (8), and
            # for the worker whose push completes a group of W the momentum step too (read 8, write 6):
            # at most 22 and headers, under 3 float32 steps of rule delta (a push and a pull: 8 each);
            # torchft's DiLoCo all-reduces float32 pseudo-gradients once a round: 8 (W-1)/W out and as
            # much in, at most 16
            full = bench_tta.expected_bytes_per_step("delta", params, r["workers"])
            assert full == 8 * params
            assert all(0 < m < 3 / bench_tta.DILOCO_H * full for m in measured), (name, measured, full)
            continue
        # on the wire: the rule's payload plus Ethernet/IP/TCP headers and acks (a few %)
        for m in measured:
            assert 0.97 * want <= m <= 1.15 * want, f"{name}: {m:.0f} B/step on the link, rule says {want:.0f}"
        for p in r.get("payload_bytes_per_step", []):   # AsyncOptimizer's own count of its payload
            assert 0.98 * want <= p <= 1.05 * want, f"{name}: payload {p:.0f} B/step, rule says {want:.0f}"
    # the rules against each other: EASGD exchanges (a push and a pull) every 4th step, where rule delta
    # pushes and pulls every step; the default port, rule allreduce, sends the bf16 gradient and reads
    # the mean rounded to bf16 by the servers
    delta = bench_tta.expected_bytes_per_step("delta", params, rows["easgd"]["workers"])
    assert rows["easgd"]["expected_bytes_per_step"] == 0.25 * delta
    assert rows["default"]["expected_bytes_per_step"] == 1.0 * 4 * params


def test_the_machine_round_trip_is_recorded(result: dict) -> None:
    [us] = result["rtt_us"]["homogeneous"]     # one per run
    assert 1 < us < 5000, us        # a loopback round trip, in µs: microseconds, not seconds or ns


def test_ddp_and_smb2_saw_the_same_links(result: dict) -> None:
    rate = netns_cluster.parse_rate(result["rates"]["homogeneous"])
    for r in result["rows"]:
        assert r["worker_link_rates"] == [rate] * r["workers"], r["system"]


def test_every_system_trains_the_language_model(lm_result: dict) -> None:
    rows = {r["system"]: r for r in lm_result["rows"]}
    assert list(rows) == LM_SYSTEMS
    data = lm_result["data"]        # the standard library's source, every 10th file held out
    assert data["files"] > 100 and data["val_files"] == data["files"] // 10
    assert data["train_bytes"] > 5 * data["val_bytes"] > 0
    params = {r["params"] for r in rows.values()}
    assert len(params) == 1 and 50_000 < params.pop() < 1_000_000       # the tiny quick model
    for name, r in rows.items():
        assert r["workers"] == bench_tta.LM_QUICK["workers"] and r["steps"] > 0, name
        assert r["final_model"] == FINAL_MODEL.get(name, "the shared weights"), name
        # chance is ln 256 = 5.55 nats/byte; the quick target (2.8) is far below it, and the quick
        # mode stops there: a loss, lower is better
        assert r["time_to_target_s"] is not None, f"{name} never reached {r['target']}: {r['curve'][-3:]}"
        assert r["curve"][0][2] > r["target"] >= r["last_eval"], (name, r["curve"])
        assert r["final"] < 0.7 * tta_lm.CHANCE and not r["collapsed"], (name, r["final"])
        assert r["ddp_ratio"] is not None, name
        # the final loss against DDP's, in % of DDP's loss (positive: lower than DDP's)
        ddp = rows["ddp"]["final"]
        assert r["final_vs_ddp"] == pytest.approx(100 * (ddp - r["final"]) / ddp), name
    assert {t["scenario"] for t in lm_result["targets"]} == {"homogeneous"}
    # the default port's rule, allreduce, moves the bf16 gradient up and the mean down, rounded to
    # bf16 by the servers, each step (one float32 model size), plus headers, the round counters' polls
    # and the start (the weights pulled once)
    assert bench_tta.rule_of(bench_tta.spec_of("default") or {}) == "allreduce"
    ar = rows["default"]
    assert ar["expected_bytes_per_step"] == 1.0 * 4 * ar["params"]
    for m in ar["link_bytes_per_step"]:
        assert ar["expected_bytes_per_step"] <= m <= 1.3 * ar["expected_bytes_per_step"], ar["link_bytes_per_step"]


@pytest.fixture(scope="module")
def compressed_result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("torch")
    return quick(tmp_path_factory.mktemp("tta-topk"), "--systems", "ddp", "--compress", "topk:0.01")


def test_the_compressed_exchange_trains_and_pushes_fewer_bytes(compressed_result: dict) -> None:
    # --compress adds dense diloco and diloco/topk:0.01; both train, and the compressed one pushes
    # per exchange 2 x 1 % x 6 bytes a parameter where dense diloco pushes 2 x 2 (bf16), plus the
    # same momentum step each (6 bytes per W = 2 exchanges): (0.12 + 3) / (4 + 3) = 0.45 of it
    rows = {r["system"]: r for r in compressed_result["rows"]}
    assert list(rows) == ["ddp", "diloco", "diloco/topk:0.01"]
    dense, topk = rows["diloco"], rows["diloco/topk:0.01"]
    assert topk["time_to_target_s"] is not None and not topk["collapsed"], topk["curve"][-3:]
    assert topk["final"] > 0.3 and topk["final_model"] == "the shared weights"
    ratio = topk["pushed_bytes_per_exchange"] / dense["pushed_bytes_per_exchange"]
    assert 0.3 < ratio < 0.6, ratio
    # the compression's targets against dense diloco, each judged
    judged = [t for t in compressed_result["targets"] if t["target"].startswith("diloco/topk:0.01")]
    assert len(judged) == 2 and all(isinstance(t["met"], bool) for t in judged), judged
    summary = {s["system"]: s for s in compressed_result["summary"]}
    assert summary["diloco/topk:0.01"]["pushed_bytes_per_exchange"] == topk["pushed_bytes_per_exchange"]


def test_a_fault_is_reported_by_what_rank_0_saw() -> None:
    """(e)'s verdicts from rank 0's steps: an error stops it, a pause far above its step time is a
    stall, anything else went on."""
    stopped = {"stopped": {"at_s": 7.8, "error": "RuntimeError: [/gloo/pair.cc:537] Connection reset by peer"},
               "steps_after_kill": 0, "longest_pause_after_kill_s": None, "typical_step_s": 0.05}
    assert bench_tta.fault_outcome(stopped) == "stopped at 7.8 s: RuntimeError: Connection reset by peer"
    went = {"stopped": None, "steps_after_kill": 40, "longest_pause_after_kill_s": 0.3, "typical_step_s": 0.05}
    assert bench_tta.fault_outcome(went) == "went on"
    assert bench_tta.fault_outcome({**went, "longest_pause_after_kill_s": 4.8}) == "stalled 4.8 s"
    assert bench_tta.fault_outcome({**went, "steps_after_kill": 0}).startswith("stopped")
    # (wall, clock) of each step's end: the pause that spans the kill (at wall 4) counts from the
    # kill, not from the step before it, and on the clock (an evaluation of 0.5 s left out)
    ends = [(1.0, 1.0), (2.0, 2.0), (3.5, 3.0), (9.5, 9.0), (10.5, 10.0)]
    seen = bench_tta.fault_after_kill(ends, fault_at=4.0)
    assert seen == {"typical_step_s": 1.0, "longest_pause_after_kill_s": 5.5, "steps_after_kill": 2}


def test_the_language_model_schedule_and_collapse() -> None:
    """Warm-up rises linearly to the peak, the cosine ends at a tenth of it and holds; a loss not
    clearly below chance (ln 256) is a collapse; the lower loss reaches a loss target."""
    assert tta_lm.lr_factor(0, 10, 100) == pytest.approx(0.1)
    assert tta_lm.lr_factor(9, 10, 100) == pytest.approx(1.0)
    assert tta_lm.lr_factor(10, 10, 100) == pytest.approx(1.0)
    assert tta_lm.lr_factor(55, 10, 100) == pytest.approx(0.55)
    assert tta_lm.lr_factor(100, 10, 100) == tta_lm.lr_factor(10_000, 10, 100) == pytest.approx(0.1)
    assert tta_lm.collapsed(5.5) and tta_lm.collapsed(float("nan")) and not tta_lm.collapsed(3.0)
    assert bench_tta.reached(2.1, 2.2, higher_is_better=False) and not bench_tta.reached(2.3, 2.2, False)
    assert bench_tta.reached(0.8, 0.75, higher_is_better=True)


def test_the_best_configuration_is_smb2_s_own_and_is_measured_against_torchft() -> None:
    # torchft's DiLoCo is a peer, never "the best configuration"; the best one is set against it
    def row(system: str, t: float | None, ratio: float | None, final: float) -> dict:
        return {"scenario": "homogeneous", "system": system, "runs": 3, "time_to_target_s": t, "ddp_ratio": ratio,
                "ddp_ratio_at_least": False, "final": final, "final_vs_ddp": -1.0, "collapsed": 0,
                "collapse_warnings": 0, "pushed_bytes_per_exchange": None}
    summary = [row("ddp", 70.0, 1.0, 2.28), row("diloco", 100.0, 0.7, 2.40), row("torchft", 80.0, 0.875, 2.42)]
    found = {t["target"].split(",")[0]: t for t in bench_tta.targets(summary, "lm")}
    best = found["best configuration >= 1.5x DDP"]
    assert best["measured"].startswith("diloco: 0.70x") and not best["met"]
    peer = found["best configuration >= 1.0x torchft's DiLoCo (same H)"]
    assert peer["measured"].startswith("diloco: 0.80x torchft's speed") and "+0.8 %" in peer["measured"]
    assert not peer["met"]
    summary[1] = row("diloco", 64.0, 1.1, 2.41)        # sooner, and a final loss within 1 % of torchft's
    peer = {t["target"].split(",")[0]: t for t in bench_tta.targets(summary, "lm")}[
        "best configuration >= 1.0x torchft's DiLoCo (same H)"]
    assert peer["met"] and peer["measured"].startswith("diloco: 1.25x")
    summary[2] = row("torchft", None, None, 2.60)      # torchft missed the target: any time beats it
    peer = {t["target"].split(",")[0]: t for t in bench_tta.targets(summary, "lm")}[
        "best configuration >= 1.0x torchft's DiLoCo (same H)"]
    assert peer["met"] and "torchft missed the target" in peer["measured"]


def test_a_target_against_ddp_is_set_beside_the_run_s_ceiling() -> None:
    """The ceiling (DDP's workers stepping with nothing exchanged, over DDP's samples a second) is
    printed beside every target against DDP, and a target above it says so; met or not is still
    the measured ratio's alone."""
    def row(system: str, t: float, ratio: float, ceiling: float | None = None) -> dict:
        return {"scenario": "straggler", "system": system, "runs": 3, "time_to_target_s": t, "ddp_ratio": ratio,
                "ddp_ratio_at_least": False, "final": 2.3, "final_vs_ddp": 0.0, "collapsed": 0,
                "collapse_warnings": 0, "pushed_bytes_per_exchange": None, "ceiling": ceiling}
    summary = [row("ddp", 60.0, 1.0, ceiling=1.6), row("default", 50.0, 1.2)]
    found = {t["target"].split(",")[0]: t for t in bench_tta.targets(summary, "lm")}
    default = found["default port time to target >= 1.3x DDP's"]
    assert default["measured"] == "1.20x (ceiling 1.60x)" and not default["met"]
    best = found["best configuration >= 2.0x DDP"]
    assert best["measured"].endswith("(ceiling 1.60x: the target is above it, reachable only by learning more per "
                                     "sample than DDP)") and not best["met"]
    summary[1] = row("default", 20.0, 3.0)      # a rule that learned more per sample: met, ceiling or not
    found = {t["target"].split(",")[0]: t for t in bench_tta.targets(summary, "lm")}
    assert found["best configuration >= 2.0x DDP"]["met"]
    summary[0] = row("ddp", 60.0, 1.0)          # no ceiling measured (a run whose DDP lost a peer)
    found = {t["target"].split(",")[0]: t for t in bench_tta.targets(summary, "lm")}
    assert found["default port time to target >= 1.3x DDP's"]["measured"] == "3.00x"


def test_a_system_stopped_before_ddp_reached_the_target_gets_no_ratio() -> None:
    """A run stops at its first evaluation past the budget, so DDP can reach the target after it
    (a slow day: 283 s against a 150 s budget) while a system whose evaluations fell otherwise
    stopped before training that long: a miss there says nothing of its speed.  It gets no ratio,
    and the summary says to raise --budget; a system that trained as long as DDP needed and still
    missed is a miss (0x)."""
    def row(system: str, run: int, t: float | None, seconds: float) -> dict:
        return {"scenario": "overloaded", "system": system, "run": run, "time_to_target_s": t, "seconds": seconds,
                "final": 2.5 if t else 2.8, "rate": "1gbit", "collapsed": False, "rtt_us": 60.0}
    result = {"config": {"task": "lm"}, "budget_s": {"overloaded": 150.0},
              "rows": [row("ddp", 0, 283.0, 290.0), row("default", 0, None, 160.0),
                       row("ddp", 1, 140.0, 150.0), row("default", 1, None, 155.0)]}
    bench_tta.add_ratios(result)
    stopped, missed = result["rows"][1], result["rows"][3]
    assert stopped["ddp_ratio"] is None and stopped["ddp_after_stop"]
    assert missed["ddp_ratio"] == 0.0 and not missed.get("ddp_after_stop")
    result["summary"] = bench_tta.summarize_runs(result)
    result["targets"] = []
    default = next(s for s in result["summary"] if s["system"] == "default")
    assert default["ddp_after_stop"] == 1 and default["ddp_ratio"] == 0.0
    assert ("overloaded: default stopped before DDP reached the target in 1 of 2 runs (DDP went past the 150 s "
            "budget to its next evaluation): no ratio there; raise --budget") in bench_tta.summary_table(result)


def test_the_default_system_is_the_one_line_port() -> None:
    """"default" passes AsyncOptimizer no keyword, so it trains with AsyncOptimizer's default rule
    (allreduce: its workers step in lockstep, and take a killed one started again alone back); the
    extra runs of (d), for "none may collapse", go to the asynchronous port, rule delta."""
    import inspect
    torch_optimizer = pytest.importorskip("smb2.torch.optimizer")
    default = inspect.signature(torch_optimizer.AsyncOptimizer).parameters["rule"].default
    assert bench_tta.spec_of("default") == {} and bench_tta.PORT_RULE == default == "allreduce"
    assert bench_tta.rule_of(bench_tta.spec_of(bench_tta.ASYNC_PORT) or {}) == "delta"
    # (the default, allreduce, takes a worker restarted alone back into its lockstep rounds)
    assert bench_tta.takes_a_rank_back("default") and not bench_tta.takes_a_rank_back("ddp")
    assert bench_tta.takes_a_rank_back(bench_tta.ASYNC_PORT) and bench_tta.takes_a_rank_back("diloco")
    a = argparse.Namespace(systems=["ddp", "default", bench_tta.ASYNC_PORT], runs=3, default_runs=5)
    plan = bench_tta.run_plan(a, "overloaded")
    assert plan[3:] == [(3, [bench_tta.ASYNC_PORT]), (4, [bench_tta.ASYNC_PORT])]
    assert bench_tta.run_plan(a, "homogeneous") == plan[:3]


def test_a_compressed_system_is_named_by_its_spec() -> None:
    # diloco/SPEC for either compression, as --compress SPEC adds it; a bad spec is refused before any run
    for spec in ("topk:0.01", "sparseloco:0.02", "sparseloco:0.02,decay=0.9"):
        assert bench_tta.spec_of(bench_tta.COMPRESSED + spec) == {"rule": "diloco", "local_steps": bench_tta.DILOCO_H,
                                                                  "compress": spec}
    with pytest.raises(SystemExit):
        bench_tta.main(["--quick", "--compress", "sparseloco:2"])
