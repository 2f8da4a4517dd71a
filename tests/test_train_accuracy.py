"""Asynchronous training on smb2 against single-process training.

Four worker processes train the same numpy MLP on scikit-learn's digits for
the same number of epochs (the "average" end policy: together they process
as many samples as the single process) through a LocalCluster of four
smb2-server processes.  Each update rule must reach the single process's
test accuracy within 1 point; layer dropping at 0.7 must cut the bytes pushed
by at least 65 % and stay within 1.5 points.

The seeds are fixed; asynchrony still makes each run differ a little: on
this model the single process's accuracy varies by about 0.3 points (std)
over seeds, the four-worker runs land 0 to 0.7 below it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import smb2
from smb2.train.example import data
from smb2.train.example.job import JobConfig, run_job, single_process

pytest.importorskip("sklearn", reason="the digits data set comes with scikit-learn (pip install 'smb2[test]')")

# 4 worker processes x 30 epochs: close to the default 120 s on a loaded
# 2-core machine, more now that the small model is striped over all 4
# servers (4 requests per pull instead of 1)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EPOCHS = 30
BASE = {"epochs": EPOCHS, "lr": 0.1, "batch": 32, "sizes": [64, 256, 10], "seed": 0, "workers": 4}
# EASGD moves the center by an average of the workers' models: it wants a
# larger step (the linear-scaling rule) to cover the same ground in as many epochs
EASGD = {"lr": 0.4, "rule_options": {"tau": 4, "alpha": 0.5}}


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("digits") / "digits.npz"
    data.save(path, data.digits())
    yield path


def _job(cfg: JobConfig, path: Path) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        async with smb2.LocalCluster(servers=4, processes=True) as cluster:
            return await run_job(cfg, cluster.addresses, path, name="acc-" + cfg.rule, timeout=300)
    return asyncio.run(main())


def _baseline(cfg: JobConfig, path: Path) -> float:
    return float(single_process(cfg, data.load(path))["accuracy"])


# (locked with per_layer=True locks each tensor instead of the whole model: the same arithmetic,
# which test_torch_optimizer.py's concurrent workers check loses no update; not trained again here)
# alone: asynchronous workers whose accuracy depends on being scheduled alike (easgd ended 2 points low once
# beside the parallel pass, 96.7-97.2 % in 7 runs alone or beside two busy loops)
@pytest.mark.alone
@pytest.mark.parametrize("rule,extra", [
    ("accumulate", {}),
    ("locked", {}),
    ("easgd", EASGD),
], ids=["accumulate", "locked", "easgd"])
def test_four_workers_match_single_process(digits: Path, rule: str, extra: dict[str, Any]) -> None:
    cfg = JobConfig(rule=rule, **{**BASE, **extra})
    base = _baseline(cfg, digits)
    res = _job(cfg, digits)
    assert res["workers"] == 4 and min(res["iterations"]) > 0
    # together the workers did the same number of epochs
    assert sum(res["iterations"]) >= 4 * res["target"]
    print(f"{rule}: {res['accuracy']:.2f} % vs single process {base:.2f} %")
    assert res["accuracy"] >= base - 1.0, (rule, res["accuracy"], base)


def test_layer_dropping_cuts_bytes_keeps_accuracy(digits: Path) -> None:
    # the bytes of a push without dropping do not depend on how long the job trains: 2 epochs
    # (test_four_workers_match_single_process[accumulate] trains this configuration to accuracy)
    full_cfg = JobConfig(rule="accumulate", **{**BASE, "epochs": 2})
    drop_cfg = JobConfig(rule="accumulate", dropping=0.7, **BASE)
    base = _baseline(JobConfig(rule="accumulate", **BASE), digits)
    full = _job(full_cfg, digits)
    drop = _job(drop_cfg, digits)

    def per_push(r: dict[str, Any]) -> float:
        return r["bytes_pushed"] / sum(w["pushes"] for w in r["per_worker"])

    cut = 1 - per_push(drop) / per_push(full)
    print(f"layer dropping 0.7: {cut:.1%} fewer bytes pushed; accuracy {drop['accuracy']:.2f} % "
          f"vs {base:.2f} % single")
    assert cut >= 0.65
    assert drop["dropping"]["saved_fraction"] >= 0.65
    assert drop["accuracy"] >= base - 1.5


@pytest.mark.parametrize("policy", ["first", "slowest"])
def test_end_policies_end_all_workers_together(digits: Path, policy: str) -> None:
    cfg = JobConfig(rule="accumulate", policy=policy, **{**BASE, "epochs": 2})
    res = _job(cfg, digits)
    its, target = res["iterations"], res["target"]
    # every worker stopped (the job returned), at the moment the policy named
    if policy == "first":
        assert max(its) >= target
    else:
        assert min(its) >= target
    assert res["accuracy"] > 80
