"""Asynchronous training with the porting recipe on an overloaded host with a
straggler does not collapse (tools/studies/async_collapse.py: the scenario, the test
calls it).

3 real torchrun workers train the example's CNN on digits (SGD lr 0.05,
momentum 0.9, no gradient clipping) with the asynchronous recipe's one line
unchanged, ``AsyncOptimizer(opt, model, name=..., rule="delta", staleness=1)``
(the default port before the default rule became ``allreduce``, whose workers
move in lockstep); the last worker is
30 ms per step slower, and 3 busy processes share the 2 cores with them.
With each worker's change counted whole and no lag scaling (the arithmetic
before the stable configuration became the default, ``--old-default``) the
shared model collapsed to chance in most such runs (docs/training.md,
"Stability", has the counts).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed here (pip install 'smb2[torch]')")
pytest.importorskip("sklearn", reason="the digits data set needs scikit-learn")

TOOL = Path(__file__).resolve().parent.parent / "tools" / "studies" / "async_collapse.py"


def _tool() -> Any:
    spec = importlib.util.spec_from_file_location("async_collapse", TOOL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("async_collapse", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.alone          # it loads the cores on purpose: nothing else may run beside it
@pytest.mark.slow
@pytest.mark.timeout(400)   # one torchrun job of 5 runs; each ends when rank 0 passes 95 %
def test_the_porting_recipe_survives_an_overloaded_host(servers: str) -> None:
    tool = _tool()
    runs = 5
    # the budget is rank 0's steps, not seconds, so a slower machine cannot fail it: on this 2-core
    # machine rank 0 passed 95 % at 50-80 steps (5 of 5 runs), and the earlier default (--old-default)
    # missed it in 2 of 5 runs of 600 steps, one of them collapsed
    rows = tool.run_job(servers, runs=runs, hogs=3, slow_ms=30.0, budget_steps=600, eval_every_steps=10,
                        target=95.0, name="t-collapse")
    failed = [r for r in rows if r.get("error") or r.get("reached_s") is None or r.get("collapsed")]
    # every run reached 95 % (rank 0's model, held-out digits) within 600 of rank 0's steps, and the
    # model each run delivered (the shared weights, after every rank closed) is not at chance
    # (what a failed run's ranks said, whole: pytest would cut a long message short)
    said = [{k: rank.get(k) for k in ("rank", "steps", "error", "reached_s", "best", "final", "open_s", "wall_s")}
            for r in failed for rank in r.get("ranks", [])] or failed
    assert len(rows) == runs and not failed, "\n".join(map(str, said))
    for r in rows:
        assert r["final"] >= 90.0, r            # the delivered model, a moment after rank 0's 95 %
        # and no false alarm: no rank's collapse watch reported these healthy runs
        assert all(rank["guard"]["collapses"] == 0 for rank in r["ranks"]), r["ranks"]
