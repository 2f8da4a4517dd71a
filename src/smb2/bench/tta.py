"""Time to accuracy: torch DDP (gloo) against smb2's AsyncOptimizer on a simulated cluster.

Every worker and every memory server is its own host: a network namespace of
``tools/netns_cluster.py`` behind a veth link rate limited (tc tbf) in both
directions.  torch DDP runs on the same worker hosts over the same links in
the same run, so both sides pay the same network.  Each worker reads its own
link's byte counters (``/sys/class/net/eth0/statistics`` inside its
namespace), so "bytes per step" is what crossed the wire, headers included.

The task can be learned and downloads nothing: a fixed random teacher (a
linear map, seed 1234) labels Gaussian inputs by its argmax over 10 classes;
the student is an MLP (full: 16-4500-4500-10, 20.4 M parameters; --quick:
64-128-10).  Every worker draws its own batches from its own seed; all
workers evaluate on the same held-out set every ``--eval-every`` steps (the
same work on both sides), and the time axis excludes that evaluation.
Rank 0's accuracy is the curve and its first evaluation at or past the
target the time to target.  A run trains the whole time budget (``--stop
budget``, the default) or ends at the target (``--stop target``, --quick's:
DDP's ranks agree by an all-reduce; smb2's rank 0 leaves a stop file the
others read at their next evaluation; torchft's rank 0 names the exchange after which every
replica stops).  "final" is then the accuracy of the
model the system delivers, on a test set of ``--final-n`` samples drawn
apart, off the clock: DDP's model; torchft's rank 0's; smb2's shared weights once every worker
finished (EASGD: the center, not rank 0's own copy, which the curve shows).

``--task lm`` trains a byte-level decoder-only transformer on the running Python's standard
library source instead (smb2/bench/tta_lm.py: full 6 layers of width 384, 6 heads, 256 bytes of
context, 10.9 M parameters; --quick 2 layers of width 64, 0.14 M): AdamW with warm-up, cosine
decay and clipping at 1.0 for every system, and the figure is the validation loss in nats/byte
(lower is better; target 2.2, --quick 2.8; chance ln 256 = 5.55; collapsed: not below 0.9 of
chance).  "vs DDP" is then how much lower the final loss is than DDP's, in % of DDP's.

Scenarios (state the rates with --rate/--slow-rate):

* ``homogeneous``: W equal workers, every link at ``--rate``;
* ``straggler``: as homogeneous, but the last rank sleeps after every step
  as long as that step's computing took (measured each step): it is 2x slower;
* ``comm-bound``: every link at ``--slow-rate``, where moving the model costs
  more than computing a step;
* ``overloaded``: as straggler (the last rank 2x slower: it sleeps after every step as long as
  that step's computing took), and the worker hosts share the CPUs with busy processes
  (``while True: pass``): ``--hogs`` (default W, one per worker host), each started in its
  host's namespace and **unpinned** (a namespace does not confine CPU, and a 2-core machine has
  no core per host to pin to; no cgroup ``cpu.max`` either): they compete with every worker and
  server for the machine's cores.
* ``fault`` (e): as homogeneous, each system in worker processes of its own, trained the whole
  budget; the last worker is SIGKILLed at 40 % of the budget of rank 0's clock.  ``fault-rejoin``:
  the same, and that worker is started again at 60 % (smb2 takes it back as a rank restarted on
  its own, as one torchrun per worker restarts it: the asynchronous rules let it pull the shared
  weights, and rule ``allreduce``, the default port's, hands it the weights and optimizer state at
  the start of a step and takes it into its lockstep rounds; torchft's replica heals from a peer;
  DDP's group cannot take a rank back, so a run with DDP in it restarts no one).  A table says what each system
  did, as rank 0 saw it: "went on", "stalled N s" (a pause between two steps above 5 typical steps
  and 2 s), or "stopped" (an error).

Every row says whether the run **collapsed**: rank 0's last evaluation or the delivered model's
accuracy below twice chance (0.2 for 10 classes); smb2's rows also count the collapse watch's
reports on any rank (``collapse_warnings``).

Systems (those the targets below compare): ``ddp`` (DistributedDataParallel, gloo ring all-reduce); ``default``, the
porting recipe's one line ``AsyncOptimizer(opt, model, name=...)`` and nothing else
(whatever AsyncOptimizer's defaults are: rule ``allreduce``, DDP's arithmetic); ``diloco``
(``rule="diloco", local_steps=8`` and the rule's defaults, outer lr 0.7 and Nesterov momentum
0.5 -- the paper's 0.9 collapses asynchronously, docs/training.md -- the task's optimizer is the
inner one); ``easgd`` (tau 4);
``torchft``, torchft's DiLoCo (``pip install 'smb2[tta]'``): one replica group per worker host,
its lighthouse on a host of its own, gloo, the same H and inner optimizer, outer SGD lr 0.7 with
Nesterov momentum 0.9 (the paper's).  ``--systems`` also takes ``torchft-streaming`` (Streaming
DiLoCo: two fragments, each exchanged every H steps in turn, overlapping one inner step),
``diloco-auto`` (``local_steps="auto"``: each worker sizes its rounds from its measured step and
exchange times; each worker's rounds are in the row), ``allreduce`` (each worker's optimizer on the mean
of the workers' gradients, summed by the servers part by part during backward: DDP's arithmetic; its
workers stop after the same step, as DDP's), ``allreduce/unpaced`` (the default with each part
sent at once, ``slice_bytes=None``, against the default's 128 KiB slices in the same run),
``delta/stable`` (``rule="delta", staleness=1``: the asynchronous port, the default port before
``allreduce``: each change counted 1/W, lag scaling on),
the variants docs/training.md cites from before the stable default: ``delta``
(every change counted whole, no lag scaling: that time's default port), ``delta/bf16``,
``delta/drop`` (layer dropping 0.7), ``accumulate``, ``accumulate/drop``; and ``diloco/topk:F``,
diloco with a compressed exchange (``compress="topk:F"``: the top-k of each pseudo-gradient by
sparse accumulate, error feedback on the worker) and ``diloco/sparseloco:F`` (``compress="sparseloco:F"``:
the same cut, the residual decaying, no outer momentum step), which ``--compress topk:F`` or
``--compress sparseloco:F`` adds beside dense ``diloco``: the summary gives the bytes each system
pushed per exchange (a worker's uploads, the momentum steps it made included) and the compression's
targets against dense diloco (>= 10x fewer bytes, a final figure within 1 %, in (c) the target >= 1.5x
sooner).  A system whose rule
this smb2 lacks is left out, with a line saying so.

Runs: every system runs ``--runs`` (3) times in every scenario, the asynchronous port
(``delta/stable``, where --systems names it) ``--default-runs`` (10) times in (d), one after another
on the same hosts (its target: none of them collapses); every row gives time
to target, its ratio to DDP's time to target in the same run, the delivered model's final
accuracy on the big held-out set, collapsed or not, and the raw 64 B loopback round trip
measured just before the run.  The summary gives medians over the runs (a missed target counts
as slower than any time) and the count of collapsed runs, then the stability targets, each met or
not.  A run stops at its first evaluation past the budget; where DDP reached the target only after a
system had stopped, that run gives the system no ratio, and the summary says to raise --budget.

"r0 cpu" and "r0 rdy": rank 0's thread-seconds on a CPU and runnable but waiting for one
(/proc schedstat), over its wall time: where the CPU, not the network, is the bottleneck the
second is large.  The servers' shares are in the JSON (``servers_time``).

"drop %": the largest share, over the workers, of the packets their link's egress queue (5 ms of
the rate, ``netns.links.tbf_params``) had no room for, which TCP sent again: where it is large, a
system's bursts (several flows at once out of one host, after an idle compute phase) cost it
time that its bytes alone do not (``egress_drop_pct`` in the JSON: every worker's).

"ceiling" (DDP's rows, and beside every target against DDP): DDP's workers each take steps with
nothing exchanged (under ``no_sync()``, all at once after the run, the straggler sleeping and the
busy processes running as in it); their samples a second over DDP's own is the most "x DDP" a
system can reach in that scenario while it learns as much per sample as DDP does.  A target above
it is met only by a rule that learns more per sample than DDP, which none has shown on the language
model.

"not computing" is the share of rank 0's training time spent not computing:
smb2: AsyncOptimizer's measured wait on communication; torchft: the time in DiLoCo's
optimizer hook (its quorum and exchange, the outer step included); DDP (whose all-reduce
hides inside backward): 1 - the time of as many steps under ``no_sync()``
(measured after the run) over the time of the synchronized ones.

    python tools/bench_tta.py [--quick] [--task mlp|lm]
        [--scenarios homogeneous,straggler,comm-bound,overloaded,fault,fault-rejoin]
        [--systems ddp,default,diloco,easgd,torchft] [--compress topk:0.01|sparseloco:0.02]
        [--runs 3] [--default-runs 10] [--hogs W]
        [--budget S] [--stop budget|target] [--json out.json] [--png out.png]
        [--replicas 2 [--kill-at 0.5]]

``--replicas 2`` keeps the stores on two servers each (a private etcd on a host of its own);
``--kill-at F`` SIGKILLs the first server at that fraction of the budget of rank 0's training
clock: the same run with and without it is what a lost server costs the training.

Needs root, ``ip netns`` and ``tc`` (see netns_cluster.py); otherwise it says
why and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import smb2.testing.netns as netns_cluster  # noqa: E402
from smb2.bench import tta_lm  # noqa: E402  (the language-model task)
from smb2.bench.common import latencies, start_raw_peer, stop_raw_peer
from smb2.testing.launch import READY, server_command  # noqa: E402

from . import report

ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
DDP_PORT = 29500
SERVER_PORT = netns_cluster.DEFAULT_PORT
#: DiLoCo's local steps between pushes of a pseudo-gradient (H)
DILOCO_H = 8
#: AsyncOptimizer's default rule: the one the porting recipe's line ("default") trains with
#: (tests/test_bench_tta.py holds it to AsyncOptimizer's signature)
PORT_RULE = "allreduce"
#: the asynchronous port, the default port before allreduce: in (d) it gets --default-runs runs, none
#: of which may collapse
ASYNC_PORT = "delta/stable"
#: system name -> AsyncOptimizer keywords (None: torch DDP): the systems the targets compare
SYSTEMS: dict[str, dict[str, Any] | None] = {
    "ddp": None,
    # the porting recipe's one line, nothing else: whatever AsyncOptimizer's defaults are (PORT_RULE)
    "default": {},
    "diloco": {"rule": "diloco", "local_steps": DILOCO_H},
    "easgd": {"rule": "easgd", "tau": 4},
    # torchft's DiLoCo: one replica group per worker host, the same H, the paper's outer Nesterov
    "torchft": {"torchft": {"sync_every": DILOCO_H}},
}
#: more systems, by --systems only: the asynchronous port, and the rows docs/training.md cites from before
#: the stable default ("delta" is that time's default port, every change counted whole and no lag scaling)
EXTRA: dict[str, dict[str, Any]] = {
    # the asynchronous port: delta at staleness 1 and its defaults (each change 1/W, lag scaling on)
    ASYNC_PORT: {"rule": "delta", "staleness": 1},
    "delta": {"rule": "delta", "staleness": 1, "average": False, "lag_scaling": False},
    "delta/bf16": {"rule": "delta", "staleness": 1, "push_dtype": "bfloat16"},
    "delta/drop": {"rule": "delta", "staleness": 1, "dropping": 0.7},
    "accumulate": {"rule": "accumulate", "staleness": 1},
    "accumulate/drop": {"rule": "accumulate", "staleness": 1, "dropping": 0.7},
    # torchft's Streaming DiLoCo: the model in two fragments, each exchanged every H steps in turn,
    # the exchange overlapping one inner step
    "torchft-streaming": {"torchft": {"sync_every": DILOCO_H, "fragments": 2, "fragment_sync_delay": 1}},
    # diloco whose rounds each worker sizes from its measured step and exchange times
    "diloco-auto": {"rule": "diloco", "local_steps": "auto"},
    # DDP's arithmetic with the sum on the servers: bf16 gradients up part by part during backward,
    # the mean down rounded to bf16 by the servers
    "allreduce": {"rule": "allreduce"},
    # the default with each part sent at once, not paced in slices: what the pacing costs where the
    # links are fast and the CPUs busy ((b), (d)) against what it saves where the link is slow ((c))
    "allreduce/unpaced": {"rule": "allreduce", "slice_bytes": None},
}
#: torchft's outer optimizer (the DiLoCo paper's): SGD, lr 0.7, Nesterov momentum 0.9
TORCHFT_OUTER: dict[str, Any] = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
#: torchft's lighthouse (on a host of its own) and each replica group's manager and store ports
LIGHTHOUSE_PORT = 29510
TORCHFT_PORT = 29600
#: diloco with a compressed exchange (``compress="topk:F"`` or ``"sparseloco:F"``): the system ``COMPRESSED
#: + spec``; ``--compress spec`` adds it to the systems, and the default one is among EXTRA
COMPRESSED = "diloco/"
EXTRA[COMPRESSED + "topk:0.01"] = {"rule": "diloco", "local_steps": DILOCO_H, "compress": "topk:0.01"}
ALL_SYSTEMS: dict[str, dict[str, Any] | None] = {**SYSTEMS, **EXTRA}


def spec_of(system: str) -> dict[str, Any] | None:
    """The AsyncOptimizer keywords of ``system`` (None: DDP); KeyError for no system: a named one,
    or ``diloco/SPEC`` for any compression spec (``topk:F``, ``sparseloco:F``)."""
    if system in ALL_SYSTEMS:
        return ALL_SYSTEMS[system]
    if system.startswith(COMPRESSED):
        return {"rule": "diloco", "local_steps": DILOCO_H, "compress": system.removeprefix(COMPRESSED)}
    raise KeyError(system)


def rule_of(spec: dict[str, Any]) -> str:
    """The update rule an smb2 system's keywords train with (none named: AsyncOptimizer's default)."""
    return str(spec.get("rule", PORT_RULE))


def takes_a_rank_back(system: str) -> bool:
    """Does ``system`` take back a worker started again alone (fault-rejoin)?  Not DDP's group;
    every smb2 rule (``allreduce``'s workers move in lockstep: its leader hands the restarted one
    its state at the start of a step) and torchft's replica groups."""
    return spec_of(system) is not None


SCENARIOS = ("homogeneous", "straggler", "comm-bound", "overloaded", "fault", "fault-rejoin")
#: (e): the last worker is SIGKILLed at this fraction of the budget of rank 0's training clock, and
#: in "fault-rejoin" started again at the second one
FAULT_AT = {"fault": (0.4, None), "fault-rejoin": (0.4, 0.6)}
#: seconds of training per run where --budget is not given: long enough for DDP to reach the
#: target, or every ratio is only a lower bound.  DDP reaches 0.75 at about step 25; at 200 Mbit/s
#: its all-reduce alone (3 model sizes a step) takes about 5 s a step, 122 s for 25 steps, so
#: (c) at the earlier 60 s could never give a ratio; with the straggler (b) DDP needed 92 s on the
#: loaded 2-core machine (64 s on a quiet one); (d) adds busy processes to (b)
BUDGETS = {"homogeneous": 60.0, "straggler": 120.0, "comm-bound": 200.0, "overloaded": 150.0, "fault": 60.0,
           "fault-rejoin": 60.0}
#: ten classes: chance is 0.1; a curve or a delivered model below twice that collapsed
COLLAPSED_BELOW = 0.2
FULL: dict[str, Any] = {"sizes": [16, 4500, 4500, 10], "workers": 4, "servers": 4, "batch": 32, "lr": 0.05,
        "target": 0.75, "eval_every": 5, "eval_n": 512, "final_n": 4096, "stop": "budget"}
QUICK: dict[str, Any] = {"sizes": [64, 128, 10], "workers": 2, "servers": 2, "batch": 32, "lr": 0.05,
         "target": 0.5, "eval_every": 10, "eval_n": 256, "final_n": 1024, "stop": "target"}
#: --task lm: the byte-level transformer of tta_lm.py (target: validation loss, nats/byte)
LM_FULL: dict[str, Any] = {**tta_lm.FULL, "workers": 4, "servers": 4, "stop": "budget"}
LM_QUICK: dict[str, Any] = {**tta_lm.QUICK, "workers": 2, "servers": 2, "stop": "target"}
CONFIGS = {("mlp", False): FULL, ("mlp", True): QUICK, ("lm", False): LM_FULL, ("lm", True): LM_QUICK}


# ---------------------------------------------------------------------------------------------
# The worker (runs in a worker host's namespace)


def link_bytes() -> int:
    """Bytes this host's link carried so far, both directions (its namespace's eth0)."""
    stats = Path("/sys/class/net/eth0/statistics")
    return int((stats / "tx_bytes").read_text()) + int((stats / "rx_bytes").read_text())


def netns_link_bytes(netns: str) -> int:
    """Bytes the link of host ``netns`` carried so far, both directions (its eth0, read from any
    namespace: a worker watches the links of other hosts, the servers' among them)."""
    out = subprocess.run(["ip", "-n", netns, "-j", "-s", "link", "show", "dev", "eth0"], capture_output=True,
                         text=True, check=True).stdout
    counters = json.loads(out)[0]["stats64"]
    return int(counters["rx"]["bytes"]) + int(counters["tx"]["bytes"])


def egress_tbf() -> dict[str, Any]:
    """This host's egress token bucket (its eth0 tbf qdisc) as ``tc -s`` gives it, with its
    counters so far; {} where the link is unlimited."""
    qdiscs = json.loads(subprocess.run(["tc", "-s", "-j", "qdisc", "show", "dev", "eth0"], capture_output=True,
                                       text=True, check=True).stdout)
    return next((q for q in qdiscs if q.get("kind") == "tbf"), {})


def link_queue(tbf: dict[str, Any]) -> tuple[int, int]:
    """Packets the token bucket ``tbf`` (:func:`egress_tbf`) sent and dropped: a drop is a packet
    its queue had no room for (``tbf_params``: 5 ms of the rate), which TCP sends again."""
    return int(tbf.get("packets", 0)), int(tbf.get("drops", 0))


def link_rate(tbf: dict[str, Any]) -> int | None:
    """The rate limit of the token bucket ``tbf`` (:func:`egress_tbf`) in bits/s, None if unlimited."""
    return 8 * tbf["options"]["rate"] if tbf else None


def worker(a: argparse.Namespace) -> None:
    """Train every system of ``--systems`` in turn (one process per host: torch is imported once);
    one JSON line per system on stdout."""
    for n, system in enumerate(a.systems.split(",")):
        print(json.dumps(train(a, system, f"{a.tag}-{n}", n)), flush=True)


class MlpTask:
    """The classifier task: a fixed random linear teacher labels Gaussian inputs (see the module's doc)."""

    higher_is_better = True
    metric = "accuracy"

    def __init__(self, a: argparse.Namespace) -> None:
        import torch
        from torch import nn

        self.torch = torch
        sizes = json.loads(a.sizes)
        self.teacher = torch.randn(sizes[0], sizes[-1], generator=torch.Generator().manual_seed(1234))
        self.held = torch.randn(a.eval_n, sizes[0], generator=torch.Generator().manual_seed(99))
        self.held_y = (self.held @ self.teacher).argmax(1)
        # the final test set: drawn apart from the curve's, which decides when a run stops
        self.final_x = torch.randn(a.final_n, sizes[0], generator=torch.Generator().manual_seed(7))
        self.final_y = (self.final_x @ self.teacher).argmax(1)
        self.gen = torch.Generator().manual_seed(1000 + a.rank)
        self.inputs, self.size, self.lr = sizes[0], a.batch, a.lr
        torch.manual_seed(0)                      # every rank builds the same initial model
        layers: list[nn.Module] = []
        for i, (m, n) in enumerate(zip(sizes, sizes[1:])):
            layers += [nn.Linear(m, n)] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
        self.model = nn.Sequential(*layers)

    def batch(self) -> Any:
        x = self.torch.randn(self.size, self.inputs, generator=self.gen)
        return x, (x @ self.teacher).argmax(1)

    def loss(self, net: Any, batch: Any) -> Any:
        return self.torch.nn.functional.cross_entropy(net(batch[0]), batch[1])

    def optimizer(self, params: Any) -> Any:
        return self.torch.optim.SGD(params, lr=self.lr)

    def before_step(self, inner: Any, params: Any) -> None:
        """Plain SGD at a constant learning rate: nothing to do."""

    def evaluate(self, net: Any, x: Any = None, y: Any = None) -> float:
        x, y = (self.held, self.held_y) if x is None else (x, y)
        with self.torch.no_grad():
            right = sum(int((net(xs).argmax(1) == ys).sum()) for xs, ys in zip(x.split(512), y.split(512)))
        return right / len(y)

    def final(self, net: Any) -> float:
        return self.evaluate(net, self.final_x, self.final_y)


def make_task(a: argparse.Namespace) -> Any:
    if a.task == "lm":
        return tta_lm.LMTask(json.loads(a.lm), Path(a.corpus), a.rank)
    return MlpTask(a)


def reached(value: float, target: float, higher_is_better: bool) -> bool:
    return value >= target if higher_is_better else value <= target


def train(a: argparse.Namespace, system: str, tag: str, n: int) -> dict[str, Any]:
    """Train ``system``, the ``n``-th of this worker's (its ports are its own: the last system's
    sockets may linger)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    task = make_task(a)
    model = task.model
    nparams = sum(p.numel() for p in model.parameters())
    slow = a.straggler and a.rank == a.world - 1

    def one_step(opt: torch.optim.Optimizer, net: nn.Module) -> None:
        b = task.batch()
        t = time.perf_counter()
        loss = task.loss(net, b)
        opt.zero_grad()
        loss.backward()
        if slow:    # the straggler: its computing takes twice as long (forward+backward, slept again)
            time.sleep(time.perf_counter() - t)
        task.before_step(inner, net.parameters())
        opt.step()

    spec = spec_of(system)
    stop_file = Path(f"{a.stop_file}.{tag}")
    aopt = peer = None
    # allreduce's workers, like DDP's, take the same steps: rank 0 names the last one (see LockstepStop)
    lockstep = LockstepStop(stop_file) if spec is not None and "torchft" not in spec and \
        rule_of(spec) == "allreduce" else None
    if spec is None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
        dist.init_process_group("gloo", init_method=f"tcp://{a.master}:{DDP_PORT + n}", rank=a.rank,
                                world_size=a.world)
        net: nn.Module = nn.parallel.DistributedDataParallel(model)
        opt: torch.optim.Optimizer = task.optimizer(net.parameters())
        inner = opt
    elif "torchft" in spec:
        net = model
        inner = opt = task.optimizer(model.parameters())
        peer = TorchftReplica(a, tag, TORCHFT_PORT + 2 * n, model, inner, spec["torchft"])
    else:
        import smb2.torch
        from smb2.train.dropping import LayerDropping
        options = dict(spec)
        ratio = options.pop("dropping", None)
        net = model
        inner = task.optimizer(model.parameters())
        aopt = smb2.torch.AsyncOptimizer(
            inner, model, name=f"tta-{tag}", rank=a.rank,
            world_size=a.world, resume=False, servers=a.servers,
            dropping=LayerDropping(ratio) if ratio else None,
            **({"replicas": a.replicas} if a.replicas > 1 else {}), **options)
        opt = aopt
    bytes0, queue0 = link_bytes(), link_queue(egress_tbf())
    # the watched hosts' links over this worker's training (smb2 bench agents: the servers' links, and
    # those of hosts that several workers share)
    watched0 = [netns_link_bytes(ns) for ns in a.watch]
    cpu0 = schedstat(os.getpid())
    curve: list[tuple[float, int, float]] = [(0.0, 0, task.evaluate(net))]
    if a.rank == 0:     # the driver times a --kill-at from here: rank 0's clock starts now
        Path(f"{a.stop_file}.{tag}.started").touch()
    t0 = time.perf_counter()
    evaluating = 0.0
    steps = 0
    first_reached: float | None = None
    step_ends: list[tuple[float, float]] = []      # (wall, clock) at the end of each step
    stopped: dict[str, Any] | None = None
    while True:
        try:
            one_step(opt, net)
        except Exception as e:       # (e): a peer died under DDP; anywhere else a failure is the run's
            if a.fault_at is None:
                raise
            stopped = {"at_s": time.perf_counter() - t0 - evaluating, "error": f"{type(e).__name__}: {e}"[:300]}
            break
        steps += 1
        wall_now = time.perf_counter() - t0
        step_ends.append((wall_now, wall_now - evaluating))
        if peer is not None and peer.stopping():
            break
        if lockstep is not None and lockstep.stopping(steps):
            break
        if steps % a.eval_every:
            continue
        te = time.perf_counter()
        value = task.evaluate(net)
        clock = te - t0 - evaluating
        curve.append((clock, steps, value))
        hit = reached(value, a.target, task.higher_is_better)
        if first_reached is None and hit:
            first_reached = clock
        done = clock >= a.budget
        if spec is None:     # DDP: stop together (every rank's model is the same one)
            flag = torch.tensor([1.0 if (hit and a.rank == 0 and a.stop == "target") or done else 0.0])
            try:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            except Exception as e:
                if a.fault_at is None:
                    raise
                stopped = {"at_s": clock, "error": f"{type(e).__name__}: {e}"[:300]}
                break
            done = bool(flag.item())
        elif peer is not None:     # torchft: every replica leaves after the same exchange (peer.stopping)
            if a.rank == 0 and ((hit and a.stop == "target") or done):
                peer.announce_stop()
            done = False
        elif lockstep is not None:
            # a worker finishes step u once round u is complete, which needs rank 0's gradient of it,
            # sent after this: none passes step steps + 1 unwarned
            if a.rank == 0 and ((hit and a.stop == "target") or done):
                lockstep.announce(steps + 1)
            done = False
        else:
            if hit and a.rank == 0 and a.stop == "target":
                stop_file.touch()
            done = done or stop_file.exists()
        evaluating += time.perf_counter() - te
        if done:
            break
    wall = time.perf_counter() - t0
    seconds = wall - evaluating
    moved = link_bytes() - bytes0
    tbf = egress_tbf()
    queue = [n - n0 for n, n0 in zip(link_queue(tbf), queue0, strict=True)]
    watched = {ns: [w0, netns_link_bytes(ns)] for ns, w0 in zip(a.watch, watched0)}
    cpu1 = schedstat(os.getpid())
    out: dict[str, Any] = {"rank": a.rank, "steps": steps, "seconds": seconds, "samples": steps * a.batch,
                           "link_bytes": moved, "link_packets_dropped": queue, "params": nparams, "curve": curve,
                           "reached_s": first_reached, "straggler": slow,
                           "last_eval": curve[-1][2], "link_rate": link_rate(tbf),
                           "time": time_shares(cpu1[0] - cpu0[0], cpu1[1] - cpu0[1], wall)}
    if watched:
        out["watched_links"] = watched
    if a.fault_at is not None:
        out.update(fault_after_kill(step_ends, a.fault_at), stopped=stopped)
    # The final figure is the delivered model's, the one a user keeps, on the final test set
    # (off the clock): DDP's model; torchft's: rank 0's; smb2's shared weights once every worker
    # finished (EASGD: the center, not rank 0's own copy, which swings from one evaluation to the next).
    if aopt is not None:
        aopt.flush()
        st = aopt.stats()
        out.update(wait_s=st["wait_s"], bytes_pushed=st["bytes_pushed"], bytes_pulled=st["bytes_pulled"],
                   exchanges=st["exchanges"], not_computing=st["wait_s"] / seconds if seconds else None,
                   via=st["via"])
        # through a host agent (smb2 bench agents): how this worker reached it, shm on its host or TCP
        mirror = getattr(aopt.store.weights, "mirror", None)
        if mirror is not None:
            out["agent_transport"] = mirror.buffer.client.transports
        if "rounds" in st:      # diloco-auto: the rounds' lengths this worker chose
            out["local_steps"] = st["rounds"]
        aopt.close(wait_all=a.wait_all)
        out["final_model"] = "the center" if rule_of(options) == "easgd" else "the shared weights"
        out["collapses"] = st.get("collapses", 0)
    elif peer is not None:
        out.update(peer.finish(seconds))
        out["final_model"] = "rank 0's model"
    else:
        out["final_model"] = "DDP's model"
    # rank 0's alone: the row reports rank 0, and the others' would only hold their hosts longer
    out["final"] = task.final(net) if a.rank == 0 else None
    if spec is None and stopped is None:
        dist.barrier()
        with net.no_sync():   # type: ignore[operator]
            tc = time.perf_counter()
            for _ in range(min(steps, 10)):
                one_step(opt, net)
            per_step = (time.perf_counter() - tc) / min(steps, 10)
        out["not_computing"] = max(0.0, 1 - per_step * steps / seconds)
        out["compute_step_s"] = per_step        # (this rank's step with nothing exchanged: the ceiling)
        dist.destroy_process_group()
    elif spec is None:      # a peer is gone: the group cannot be torn down together
        out["not_computing"] = None
    return out


def fault_after_kill(step_ends: list[tuple[float, float]], fault_at: float) -> dict[str, Any]:
    """Rank 0's longest pause between two steps after the kill, and its median step time before it:
    a pause far above the latter is a stall.  ``step_ends``: (wall, clock) of each step's end, s since
    rank 0 started (the clock leaves evaluation out); the driver kills ``fault_at`` wall seconds after
    that start, so a pause is counted on the clock from the kill on."""
    pairs = list(zip(step_ends, step_ends[1:]))
    before = [c2 - c1 for (_, c1), (w2, c2) in pairs if w2 < fault_at]
    after = [c2 - c1 - max(0.0, fault_at - w1) for (w1, c1), (w2, c2) in pairs if w2 >= fault_at]
    return {"typical_step_s": statistics.median(before) if before else None,
            "longest_pause_after_kill_s": max(after) if after else None,
            "steps_after_kill": len(after)}


class TorchftReplica:
    """One replica group of torchft (this worker alone) around ``model``: a Manager that joins the
    lighthouse's quorum, torchft's DiLoCo wrapping the inner optimizer; ``finish`` leaves the quorum."""

    def __init__(self, a: argparse.Namespace, tag: str, port: int, model: Any, inner: Any,
                 options: dict[str, Any]) -> None:
        import torch
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo
        from torchft.checkpointing.http_transport import HTTPTransport
        from torchft.local_sgd import DiLoCo

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
        timeout = timedelta(seconds=30)
        host = a.host_addr

        class HostTransport(HTTPTransport):
            """torchft's HTTP checkpoint transport, addressed by this host's address: it names the
            machine's host name, which every namespace shares and none can reach."""

            def address(self) -> str:
                return super().address().replace(socket.gethostname(), host, 1)

        # the replica group's own store (a group of one worker: this process is its rank 0)
        self.store = TCPStore(host, port, is_master=True, wait_for_workers=False)
        self.model, self.inner = model, inner
        self.lockstep = LockstepStop(Path(f"{a.stop_file}.{tag}"))      # (rank 0 announces the last exchange)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1,
            load_state_dict=self.load_state_dict, state_dict=self.state_dict, use_async_quorum=False,
            replica_id=f"{tag}-rank{a.rank}", store_addr=host, store_port=port, rank=0, world_size=1,
            lighthouse_addr=f"http://{a.lighthouse}:{LIGHTHOUSE_PORT}", hostname=host, port=port + 1,
            timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
            checkpoint_transport=HostTransport(timeout=timeout, num_chunks=0),
            # every replica builds the same initial model (seed 0); a rejoining one heals from a peer
            init_sync=False)
        opts = dict(options)
        fragments = opts.pop("fragments", 1)
        parts = fragment(model, fragments)
        outer = [torch.optim.SGD(p.parameters(), **TORCHFT_OUTER) for p in parts]
        self.diloco = DiLoCo(self.manager, parts, inner, outer if fragments > 1 else outer[0],
                             backup_device=torch.device("cpu"), pin_memory=False, **opts)
        # the time in DiLoCo's own step hook (the quorum and the exchange) is the time not computing:
        # a hook registered before DiLoCo's runs before it, one registered after runs after it
        self.wait_s, self._since = 0.0, 0.0
        self.hooks = [inner.register_step_post_hook(self._enter_exchange)]
        self.diloco.__enter__()
        self.hooks.append(inner.register_step_post_hook(self._leave_exchange))
        # every replica's manager heartbeats before any asks for a quorum, so the first quorum
        # holds them all (the lighthouse waits for every heartbeating replica to join)
        rendezvous(a, tag)

    def _enter_exchange(self, *_: Any) -> None:
        self._since = time.perf_counter()

    def _leave_exchange(self, *_: Any) -> None:
        self.wait_s += time.perf_counter() - self._since

    def announce_stop(self) -> None:
        """Rank 0: every replica is to stop after the next exchange.  The others read this before
        they can complete that exchange, which needs rank 0, which wrote it first."""
        self.lockstep.announce(self.manager.current_step() + 1)

    def stopping(self) -> bool:
        """Has this replica reached the exchange after which every replica stops?"""
        return self.lockstep.stopping(self.manager.current_step())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.inner.load_state_dict(state["inner"])

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "inner": self.inner.state_dict()}

    def finish(self, seconds: float) -> dict[str, Any]:
        step = self.manager.current_step()
        for hook in self.hooks:
            hook.remove()
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
        return {"outer_steps": step, "wait_s": self.wait_s, "not_computing": self.wait_s / seconds if seconds else None}


class LockstepStop:
    """Workers that move in step (torchft's replicas, exchange by exchange; allreduce's workers, step
    by step) stop after the same one, which rank 0 names in ``stop_file``, far enough on that every
    worker reads it before it gets there."""

    def __init__(self, stop_file: Path) -> None:
        self.stop_file = stop_file
        self.stop_at: int | None = None

    def announce(self, last: int) -> None:
        """Rank 0: every worker stops once its count reaches ``last``."""
        if self.stop_at is None:
            self.stop_at = last
            tmp = Path(f"{self.stop_file}.tmp")
            tmp.write_text(str(last))
            tmp.rename(self.stop_file)

    def stopping(self, now: int) -> bool:
        """Has this worker's count (``now``) reached the last one?"""
        if self.stop_at is None and self.stop_file.exists():
            self.stop_at = int(self.stop_file.read_text())
        return self.stop_at is not None and now >= self.stop_at


def fragment(model: Any, n: int) -> list[Any]:
    """``model`` as ``n`` modules of consecutive children with about equal parameter counts
    (Streaming DiLoCo's fragments); ``[model]`` for 1."""
    from torch import nn

    if n == 1:
        return [model]
    leaves = [m for m in model.modules() if not list(m.children()) and any(True for _ in m.parameters())]
    total = sum(p.numel() for p in model.parameters())
    parts: list[list[Any]] = [[]]
    done = 0
    for leaf in leaves:
        if len(parts) < n and done >= total * len(parts) / n:
            parts.append([])
        parts[-1].append(leaf)
        done += sum(p.numel() for p in leaf.parameters())
    return [nn.ModuleList(p) for p in parts]


def rendezvous(a: argparse.Namespace, tag: str) -> None:
    """Wait until every worker reached this point (a file per rank beside the stop file)."""
    Path(f"{a.stop_file}.{tag}.ready{a.rank}").touch()
    deadline = time.monotonic() + 120
    while not all(Path(f"{a.stop_file}.{tag}.ready{r}").exists() for r in range(a.world)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker rank {a.rank}: not every worker started torchft within 120 s")
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------
# The driver (runs in the root namespace; builds the hosts, starts servers and workers)


def schedstat(pid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of all of ``pid``'s threads so far."""
    on = wait = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:          # the thread ended meanwhile
            continue
        on += int(fields[0])
        wait += int(fields[1])
    return on / 1e9, wait / 1e9


def time_shares(on: float, wait: float, seconds: float) -> dict[str, float]:
    """Shares of ``seconds``: on a CPU, waiting for a CPU, blocked (on the network, peers, the straggler's sleep).
    Summed over a process's threads: a share above 100 % means several threads at once (the
    AsyncOptimizer's exchange thread beside the training thread)."""
    return {"on_cpu": on / seconds, "waiting_for_cpu": wait / seconds, "blocked": max(0.0, 1 - (on + wait) / seconds)}


def where_time_went(procs: dict[str, subprocess.Popen], before: dict[str, tuple[float, float]],
                    seconds: float) -> dict[str, dict[str, float]]:
    """:func:`time_shares` of each of ``procs`` since ``before``."""
    out = {}
    for name, p in procs.items():
        on, wait = schedstat(p.pid)
        out[name] = time_shares(on - before[name][0], wait - before[name][1], seconds)
    return out


def loopback_rtt_us() -> float:
    """The median raw 64-byte round trip between two processes on loopback (smb2.bench's raw
    peer, no smb2 code on either side), in µs: recorded beside each scenario because this
    machine has a slow mode that moves every figure."""
    async def measure() -> float:
        peer, raw = await start_raw_peer(64)
        try:
            return statistics.median(await latencies(raw.ping, 300))
        finally:
            await stop_raw_peer(peer, raw)
    return asyncio.run(measure())


def start_servers(cluster: netns_cluster.NetnsCluster, hosts: list[int], capacity: str) -> list[subprocess.Popen]:
    """smb2-server on each of ``hosts`` (indexes of the cluster's hosts); waits for the ready lines."""
    procs = []
    for i in hosts:
        # --shm off, as netns_cluster's own servers: the namespaces share this kernel and file
        # system, so a worker would map a server's memory and its pulls would bypass the links
        # --lock-lease 30: rank 0 holds the store's lock while it writes the first 81 MB; on the
        # loaded 2-core machine its renewals (every lease/3) starved past the default 5 s lease and
        # a run died opening its store (StaleFence): the benchmark measures training, not that
        membership = ["--membership", cluster.membership_url] if cluster.membership_url else []
        argv = server_command("--capacity", capacity, "--shm", "off", "--lock-lease", "30", *membership,
                              host=cluster.server_addrs[i], port=SERVER_PORT)
        procs.append(subprocess.Popen(cluster.exec_prefix(cluster.server_netns[i]) + argv, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, start_new_session=True))
    for i, p in zip(hosts, procs):
        assert p.stdout is not None
        line = p.stdout.readline()
        if not READY.search(line):
            raise netns_cluster.ServerStartError(f"smb2-server on host {cluster.server_addrs[i]} did not start "
                                                 f"(exit {p.poll()}): {line!r}")
    return procs


def run_scenario(cluster: netns_cluster.NetnsCluster, cfg: dict[str, Any], systems: list[str], scenario: str,
                 servers: list[str], server_procs: dict[str, subprocess.Popen], workers: list[int], budget: float,
                 run: int = 0, replicas: int = 1, kill_at: float | None = None,
                 lighthouse: int | None = None) -> list[dict[str, Any]]:
    """One worker process on each worker host trains every system in turn; a row per system.
    ``kill_at``: SIGKILL the first server at that fraction of the budget of the first system's
    training clock (rank 0's).  ``lighthouse``: the host of torchft's lighthouse.  In (e) (a
    scenario of :data:`FAULT_AT`) the last worker is SIGKILLed, and started again in fault-rejoin."""
    tag = f"{scenario}-r{run}"
    stop_file = Path(tempfile.gettempdir()) / f"bench-tta-{os.getpid()}-{tag}.stop"
    kill_frac, rejoin_frac = FAULT_AT.get(scenario, (None, None))
    fault_at = None if kill_frac is None else kill_frac * budget
    # DDP's group cannot take a rank back (torchrun would restart the whole job): no rejoin
    rejoins = rejoin_frac is not None and all(takes_a_rank_back(s) for s in systems)
    common = worker_args(cfg, systems, tag, servers, master=cluster.server_addrs[workers[0]], world=len(workers),
                         stop_file=stop_file, replicas=replicas,
                         # a worker that died does not come back in (e) fault: the survivors' smb2 waits briefly
                         wait_all=10 if fault_at is not None and not rejoins else budget + 120)
    if lighthouse is not None:
        common += ["--lighthouse", cluster.server_addrs[lighthouse]]
    if fault_at is not None:
        common += ["--fault-at", str(fault_at)]
    if scenario in ("straggler", "overloaded"):
        common.append("--straggler")
    env = {**os.environ, **ONE_THREAD}
    hogs = start_hogs(cluster, workers[:cfg["hogs"]]) if scenario == "overloaded" else []

    def start_worker(r: int, h: int, own_budget: float, extra_env: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen(cluster.exec_prefix(cluster.server_netns[h])
                                + [sys.executable, "-m", "smb2.bench.tta", "_worker", "--rank", str(r),
                                   "--budget", str(own_budget), "--host-addr", cluster.server_addrs[h], *common],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**env, **extra_env}, text=True)

    peers = start_lighthouse(cluster, lighthouse) if lighthouse is not None else []
    procs = [start_worker(r, h, budget, {}) for r, h in enumerate(workers)]
    before = {name: schedstat(p.pid) for name, p in server_procs.items()}
    t0 = time.monotonic()
    killed: dict[str, Any] = {}
    started = Path(f"{stop_file}.{tag}-0.started")
    if kill_at is not None:
        threading.Thread(target=kill_server_at, daemon=True, args=(
            started, kill_at * budget, server_procs, killed, procs)).start()
    fault: dict[str, Any] = {}
    fault_thread = None
    if fault_at is not None:
        last = len(workers) - 1
        rejoin_at = rejoin_frac * budget if rejoin_frac is not None and rejoins else None
        fault_thread = threading.Thread(target=kill_worker_at, daemon=True, args=(
            started, fault_at, rejoin_at, procs, fault,
            # the rejoining worker trains until the others' budget ends; smb2 takes it back as the
            # rank torchrun restarted
            lambda: start_worker(last, workers[last], budget - (rejoin_at or 0), {"TORCHELASTIC_RESTART_COUNT": "1"})))
        fault_thread.start()
    outs: list[list[dict[str, Any]]] = []
    try:
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=len(systems) * (budget + 300))
            if fault.get("killed") is p:
                if fault_thread is not None:
                    fault_thread.join()
                if "rejoined" not in fault:
                    continue
                p = fault["rejoined"]
                out, err = p.communicate(timeout=budget + 300)
            if p.returncode:
                # the other ranks that failed too say why (one of them may be the cause of this one)
                others = "".join(f"\nworker rank {k} failed too (exit {q.returncode}):\n{q.communicate()[1][-1500:]}"
                                 for k, q in enumerate(procs) if k != r and q.poll() and q is not fault.get("killed"))
                raise RuntimeError(f"worker rank {r} failed (exit {p.returncode}):\n{err[-3000:]}{others}")
            outs.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    finally:
        for p in procs + [fault[k] for k in ("rejoined",) if k in fault] + peers:
            if p.poll() is None:
                p.kill()
                p.wait()
        for hog in hogs:
            hog.kill()
            hog.wait()
        for path in Path(tempfile.gettempdir()).glob(f"{stop_file.name}.*"):
            path.unlink(missing_ok=True)
    rows = [summarize([o[n] for o in outs], system, scenario, cfg) for n, system in enumerate(systems)]
    for row in rows:
        row["run"] = run
        if fault_at is not None:
            row["fault"] = {"killed_rank": len(workers) - 1, "killed_at_s": fault.get("killed_at_s"),
                            "rejoined_at_s": fault.get("rejoined_at_s"), "rank0": {
                                k: outs[0][0].get(k) for k in ("typical_step_s", "longest_pause_after_kill_s",
                                                                "steps_after_kill", "stopped")}}
            row["fault"]["outcome"] = fault_outcome(row["fault"]["rank0"])
            if "rejoined" in fault:     # the restarted worker's own steps: did it train again?
                row["fault"]["rejoined_steps"] = outs[-1][systems.index(row["system"])]["steps"]
                row["fault"]["outcome"] += f"; the restarted worker trained {row['fault']['rejoined_steps']} steps"
    rows[0]["servers_time"] = where_time_went(server_procs, before, time.monotonic() - t0)
    rows[0]["replicas"] = replicas
    if kill_at is not None:
        rows[0]["killed"] = killed
    return rows


def worker_args(cfg: dict[str, Any], systems: list[str], tag: str, servers: list[str], *, master: str, world: int,
                stop_file: Path, replicas: int, wait_all: float) -> list[str]:
    """The options every worker of a run takes (``_worker``'s, less its own: --rank, --budget,
    --host-addr): the task of ``cfg``, the ``systems`` it trains in turn, where the servers are."""
    args = ["--task", cfg["task"], "--batch", str(cfg["batch"]), "--lr", str(cfg["lr"]),
            "--target", str(cfg["target"]), "--eval-every", str(cfg["eval_every"]), "--eval-n",
            str(cfg["eval_n"]), "--final-n", str(cfg["final_n"]), "--stop", cfg["stop"],
            "--systems", ",".join(systems), "--tag", tag, "--servers", ",".join(servers), "--master", master,
            "--world", str(world), "--stop-file", str(stop_file), "--replicas", str(replicas),
            "--wait-all", str(wait_all)]
    return args + (["--lm", json.dumps(cfg), "--corpus", cfg["corpus"]] if cfg["task"] == "lm" else [
        "--sizes", json.dumps(cfg["sizes"])])


def start_hogs(cluster: netns_cluster.NetnsCluster, hosts: list[int]) -> list[subprocess.Popen]:
    """(d): one busy process on each of ``hosts``, started in its namespace and not pinned (see the
    module's doc)."""
    return [subprocess.Popen(cluster.exec_prefix(cluster.server_netns[h]) + [sys.executable, "-c", "while True: pass"])
            for h in hosts]


def start_lighthouse(cluster: netns_cluster.NetnsCluster, host: int) -> list[subprocess.Popen]:
    """torchft's lighthouse on ``host``: a quorum from one replica up, so the survivors of a lost
    worker go on (torchft's defaults otherwise: a replica silent for 5 s is dead)."""
    binary = Path(sys.executable).with_name("torchft_lighthouse")
    proc = subprocess.Popen(cluster.exec_prefix(cluster.server_netns[host])
                            + [str(binary), "--min_replicas", "1", "--bind", f"0.0.0.0:{LIGHTHOUSE_PORT}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return [proc]


def kill_worker_at(started: Path, after: float, rejoin_at: float | None, workers: list[subprocess.Popen],
                   fault: dict[str, Any], restart: Any) -> None:
    """(e): SIGKILL the last worker ``after`` seconds into rank 0's training clock (``started``
    appears when it starts), and start it again (``restart()``) at ``rejoin_at`` if given; notes
    which process and when in ``fault``."""
    while not started.exists():
        if all(p.poll() is not None for p in workers):
            return
        time.sleep(0.05)
    t0 = time.monotonic()
    time.sleep(after)
    if workers[-1].poll() is not None:
        return
    workers[-1].kill()
    fault.update(killed=workers[-1], killed_at_s=time.monotonic() - t0)
    if rejoin_at is not None:
        time.sleep(max(0.0, rejoin_at - (time.monotonic() - t0)))
        if workers[0].poll() is None:
            fault.update(rejoined=restart(), rejoined_at_s=time.monotonic() - t0)


def fault_outcome(r0: dict[str, Any]) -> str:
    """What the system did about the lost worker, as rank 0 saw it: stopped (an error, or no step
    after the kill), stalled (a pause above 5 typical steps and 2 s), or went on."""
    if r0["stopped"]:       # the error without its source location (gloo's "[.../pair.cc:537] ")
        error = re.sub(r"^(\w+: )\[[^]]*\] ", r"\1", r0["stopped"]["error"])
        return f"stopped at {r0['stopped']['at_s']:.1f} s: {error.split('. ')[0][:90]}"
    if not r0["steps_after_kill"]:
        return "stopped (no step after the kill)"
    pause, typical = r0["longest_pause_after_kill_s"], r0["typical_step_s"] or 0.0
    if pause > max(2.0, 5 * typical):
        return f"stalled {pause:.1f} s"
    return "went on"



def kill_server_at(started: Path, after: float, server_procs: dict[str, subprocess.Popen], killed: dict[str, Any],
                   workers: list[subprocess.Popen]) -> None:
    """SIGKILL the first server ``after`` seconds into rank 0's training clock (``started`` appears
    when it starts); notes which server and when in ``killed``."""
    while not started.exists():
        if all(p.poll() is not None for p in workers):
            return
        time.sleep(0.05)
    time.sleep(after)
    name, proc = next(iter(server_procs.items()))
    proc.kill()
    killed.update(server=name, at_s=after)


def available(system: str) -> bool:
    """Does this smb2 have the system's update rule (torchft's: is torchft installed)?"""
    from smb2.train.rules import RULES
    spec = spec_of(system)
    if spec is not None and "torchft" in spec:
        return importlib.util.find_spec("torchft") is not None
    return spec is None or rule_of(spec) in RULES


def expected_bytes_per_step(system: str, params: int, world: int) -> float | None:
    """Payload bytes one worker moves per step by the rule, before protocol overhead (None: varies)."""
    model = 4 * params
    spec = spec_of(system)
    if spec is None:       # DDP's ring all-reduce: 2 (W-1)/W of the gradient out, as much in
        return 2 * 2 * (world - 1) / world * model
    if spec.get("dropping") or "torchft" in spec or rule_of(spec) == "diloco":
        return None         # depends on the gradients / the quorum's membership / the rule's wire
    rule = rule_of(spec)
    if rule == "easgd":             # every tau steps: push local, pull the correction
        return 2 * model / spec["tau"]
    if rule == "allreduce":         # the bf16 gradient up, the mean down rounded to bf16
        return 1.0 * model
    push = 0.5 if spec.get("push_dtype") == "bfloat16" else 1.0
    return (push + 1) * model                   # push the change, pull the f32 weights


def collapsed(task: str, last_eval: float, final: float) -> bool:
    """The classifier: rank 0's last evaluation or the delivered model below twice chance; the
    language model: either not clearly below chance (tta_lm.collapsed)."""
    if task == "lm":
        return tta_lm.collapsed(last_eval) or tta_lm.collapsed(final)
    return min(last_eval, final) < COLLAPSED_BELOW


def summarize(outs: list[dict[str, Any]], system: str, scenario: str, cfg: dict[str, Any]) -> dict[str, Any]:
    r0 = outs[0]
    seconds = max(o["seconds"] for o in outs)
    steps = sum(o["steps"] for o in outs)
    per_step = [o["link_bytes"] / o["steps"] for o in outs]
    row = {"system": system, "scenario": scenario, "workers": len(outs), "params": r0["params"],
           "time_to_target_s": r0["reached_s"], "final": r0["final"], "final_model": r0["final_model"],
           "last_eval": r0["last_eval"], "target": cfg["target"],
           "collapsed": collapsed(cfg["task"], r0["last_eval"], r0["final"]),
           # the collapse watch's reports on any rank (smb2's systems)
           "collapse_warnings": sum(o.get("collapses", 0) for o in outs),
           "samples_per_s": sum(o["samples"] for o in outs) / seconds, "seconds": seconds, "steps": steps,
           "link_bytes_per_step": per_step, "expected_bytes_per_step": expected_bytes_per_step(
               system, r0["params"], len(outs)),
           # each worker's egress queue over its training: packets sent, and % dropped (sent again by TCP)
           "egress_packets": [o["link_packets_dropped"][0] for o in outs],
           "egress_drop_pct": [100 * d / (n + d) if n + d else 0.0
                               for n, d in (o["link_packets_dropped"] for o in outs)],
           "not_computing": r0["not_computing"], "curve": r0["curve"],
           "worker_link_rates": [o["link_rate"] for o in outs], "workers_time": [o["time"] for o in outs]}
    if all(o.get("compute_step_s") for o in outs):
        # DDP's workers, each stepping with nothing exchanged (under no_sync(), all at once, after the
        # run: the straggler's sleep and the busy processes as in it): the samples a second that no
        # system could pass while learning as much per sample as DDP does, and how far that is above
        # DDP's own (the most "x DDP" any such system can reach here)
        row["compute_only_samples_per_s"] = sum(o["samples"] / o["steps"] / o["compute_step_s"] for o in outs)
        row["ceiling"] = row["compute_only_samples_per_s"] / row["samples_per_s"]
    if "bytes_pushed" in r0:
        row["payload_bytes_per_step"] = [(o["bytes_pushed"] + o["bytes_pulled"]) / o["steps"] for o in outs]
        # what a worker uploads per exchange (its pushes, the momentum steps it made included)
        exchanges = sum(o["exchanges"] for o in outs)
        row["pushed_bytes_per_exchange"] = sum(o["bytes_pushed"] for o in outs) / exchanges if exchanges else None
    if "local_steps" in r0:     # diloco-auto: each worker's rounds (a straggler's are shorter)
        row["local_steps"] = [o.get("local_steps") for o in outs]
    return row


def run(a: argparse.Namespace) -> dict[str, Any]:
    cfg: dict[str, Any] = {**CONFIGS[(a.task, a.quick)], "task": a.task}
    if a.task == "lm" and not a.quick and a.lm_size == "small":
        cfg.update(tta_lm.SMALL)
    for key in ("workers", "servers", "target", "eval_n", "final_n", "stop"):
        if getattr(a, key) is not None:
            cfg[key] = getattr(a, key)
    cfg["hogs"] = cfg["workers"] if a.hogs is None else a.hogs
    rates = {sc: a.slow_rate if sc == "comm-bound" else a.rate for sc in SCENARIOS}
    budgets = {sc: a.budget or (12.0 if a.quick else BUDGETS[sc]) for sc in a.scenarios}
    result: dict[str, Any] = {"config": cfg, "rates": rates, "budget_s": budgets, "runs": a.runs,
                              "default_runs": a.default_runs, "rows": [], "rtt_us": {},
                              "overloaded": {"hogs": cfg["hogs"], "pinned": False, "straggler_slowdown": 2}}
    with tempfile.TemporaryDirectory(prefix="bench-tta-") as corpus:
        if a.task == "lm":      # written once here, mapped by every worker
            cfg["corpus"] = corpus
            result["data"] = tta_lm.write_corpus(Path(corpus))
        total = sum(len(run_plan(a, scenario)) for scenario in a.scenarios)
        report.progress("tta", 0, total, f"runs of {', '.join(a.systems)} in {', '.join(a.scenarios)}")
        for scenario in a.scenarios:
            run_one_scenario(a, cfg, scenario, rates[scenario], budgets[scenario], result, total)
    return result


def run_plan(a: argparse.Namespace, scenario: str) -> list[tuple[int, list[str]]]:
    """The runs of ``scenario``: (its number, the systems it trains in turn)."""
    # the asynchronous port gets more runs in (d): "none may collapse" wants more than three
    plan = [(i, list(a.systems)) for i in range(a.runs)]
    if scenario == "overloaded" and ASYNC_PORT in a.systems:
        plan += [(i, [ASYNC_PORT]) for i in range(a.runs, a.default_runs)]
    if scenario in FAULT_AT:
        # (e): each system in its own worker processes (the kill must hit one system only)
        plan = [(i, [s]) for i, systems in plan for s in systems]
    return plan


def run_one_scenario(a: argparse.Namespace, cfg: dict[str, Any], scenario: str, rate: str, budget: float,
                     result: dict[str, Any], total: int) -> None:
    """Every run of every system in ``scenario`` on one namespace cluster; rows into ``result``
    (``total``: the runs of the whole benchmark, for its progress lines)."""
    nserv, nwork = cfg["servers"], cfg["workers"]
    plan = run_plan(a, scenario)
    if scenario in FAULT_AT:
        # (e): trained the whole budget (the kill and the rejoin fall at fractions of it)
        cfg = {**cfg, "stop": "budget"}
    torchft = any("torchft" in (spec_of(s) or {}) for s in a.systems)
    # hosts 0..S-1 are memory servers, S..S+W-1 workers, then torchft's lighthouse: every one
    # behind its own limited link
    with netns_cluster.NetnsCluster(servers=nserv + nwork + torchft, rate=rate, start_servers=False,
                                    quiet=True, etcd=a.replicas > 1) as cluster:
        servers = [f"{cluster.server_addrs[i]}:{SERVER_PORT}" for i in range(nserv)]
        if cluster.membership_url:      # the view names the server hosts only, not the workers'
            cluster.run_coroutine(only_members, cluster.membership_url, servers)
        procs = start_servers(cluster, list(range(nserv)), a.capacity)
        workers = list(range(nserv, nserv + nwork))
        try:
            for i, systems in plan:
                done = sum(map(len, result["rtt_us"].values()))     # the runs before this one
                # the machine's round trip, beside each run: its slow mode moves every figure
                rtt = loopback_rtt_us()
                result["rtt_us"].setdefault(scenario, []).append(rtt)
                hogs = f", {cfg['hogs']} unpinned busy processes" if scenario == "overloaded" else ""
                report.progress("tta", done, total, f"{scenario} run {i + 1} ({rate} links{hogs}, "
                                f"loopback 64 B round trip {rtt:.0f} µs): {', '.join(systems)} ...")
                lighthouse = nserv + nwork if any("torchft" in (spec_of(s) or {}) for s in systems) else None
                for row in run_scenario(cluster, cfg, systems, scenario, servers,
                                        {f"server {addr}": p for addr, p in zip(servers, procs)}, workers,
                                        budget, run=i, replicas=a.replicas, kill_at=a.kill_at,
                                        lighthouse=lighthouse):
                    row["rate"] = rate
                    row["rtt_us"] = rtt
                    result["rows"].append(row)
                    # a run's rows come when its last system is done
                    report.progress("tta", done + 1, total, f"run {i + 1}: {fmt_row(row)}")
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(10)



async def only_members(url: str, members: list[str]) -> None:
    """Make ``members`` the membership view (netns_cluster writes every host of the cluster)."""
    from smb2.membership import open_membership

    async with open_membership(url) as m:
        await m.change(await m.view(), members=members, joining=[])


def add_ratios(result: dict[str, Any]) -> None:
    """Each row against DDP in the same scenario and run: its speed-up to the target (DDP's time /
    its time) and how much better its final figure is than DDP's (None where that run had no DDP):
    the classifier's accuracy in points, the language model's loss in % of DDP's."""
    ddp = {(r["scenario"], r["run"]): r for r in result["rows"] if r["system"] == "ddp"}
    for r in result["rows"]:
        base = ddp.get((r["scenario"], r["run"]))
        mine = r["time_to_target_s"]
        r["ddp_ratio"], r["ddp_missed"] = None, False
        if base and mine:
            if base["time_to_target_s"]:
                r["ddp_ratio"] = base["time_to_target_s"] / mine
            elif r["system"] != "ddp":
                # DDP missed the target within the budget: it would have needed longer, so the budget
                # over this system's time is a lower bound of the speed-up (shown as ">=")
                r["ddp_ratio"], r["ddp_missed"] = result["budget_s"][r["scenario"]] / mine, True
        elif base and base["time_to_target_s"]:
            if base["time_to_target_s"] > r["seconds"]:
                # DDP reached the target only after this system stopped training (a run stops at its
                # first evaluation past the budget, so DDP's can end past it too): whether this system
                # would have reached it as soon is unknown, so no ratio; the summary says to raise
                # --budget
                r["ddp_after_stop"] = True
            else:
                r["ddp_ratio"] = 0.0        # DDP reached the target, this system did not (both missed: None)
        r["final_vs_ddp"] = better_than(result["config"]["task"], r["final"], base["final"]) if base else None


def better_than(task: str, mine: float, theirs: float) -> float:
    """How much better ``mine`` is than ``theirs``: accuracy points, or % less loss (lm)."""
    return 100 * (theirs - mine) / theirs if task == "lm" else 100 * (mine - theirs)


def _median(values: list[float | None], missing: float | None = None) -> float | None:
    """The median of ``values``; a None (a run that missed the target) counts as ``missing``
    (None: left out); None if nothing is left or the median itself is a miss."""
    vals = [missing if v is None else v for v in values]
    known = [v for v in vals if v is not None]
    if not known:
        return None
    m = statistics.median(known)
    return None if m == float("inf") else m


def summarize_runs(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One line per scenario and system: medians over its runs (a missed target is slower than
    any time, so a median of misses is a miss; the ratio of a miss is 0 where DDP reached the
    target, a lower bound where only DDP missed, none where both did), and its collapsed runs."""
    out = []
    keys = list(dict.fromkeys((r["scenario"], r["system"]) for r in result["rows"]))
    for scenario, system in keys:
        rows = [r for r in result["rows"] if (r["scenario"], r["system"]) == (scenario, system)]
        with_ddp = [r for r in rows if r["final_vs_ddp"] is not None]
        out.append({
            "scenario": scenario, "system": system, "runs": len(rows), "rate": rows[0]["rate"],
            "time_to_target_s": _median([r["time_to_target_s"] for r in rows], missing=float("inf")),
            "ddp_ratio": _median([r["ddp_ratio"] for r in with_ddp]),
            # some run's ratio is a lower bound (DDP missed the target there)
            "ddp_ratio_at_least": any(r.get("ddp_missed") for r in with_ddp),
            # runs where DDP reached the target only after this system had stopped: no ratio there
            "ddp_after_stop": sum(1 for r in with_ddp if r.get("ddp_after_stop")),
            "final": _median([r["final"] for r in rows]),
            "final_vs_ddp": _median([r["final_vs_ddp"] for r in with_ddp]),
            "collapsed": sum(1 for r in rows if r["collapsed"]),
            "collapse_warnings": sum(r.get("collapse_warnings", 0) for r in rows),
            "pushed_bytes_per_exchange": _median([r.get("pushed_bytes_per_exchange") for r in rows]),
            # DDP's rows: the most "x DDP" a system that learns as much per sample could reach
            "ceiling": _median([r.get("ceiling") for r in rows]),
            "rtt_us": _median([r["rtt_us"] for r in rows])})
    return out


#: the stability targets (default port and best configuration against DDP):
#: (a) homogeneous, (b) straggler, (c) comm-bound, (d) overloaded
DEFAULT_RATIO = {"homogeneous": 1.0, "straggler": 1.3, "comm-bound": 1.3, "overloaded": 1.3}
BEST_RATIO = {"homogeneous": 1.5, "straggler": 2.0, "comm-bound": 1.5, "overloaded": 2.0}


def targets(summary: list[dict[str, Any]], task: str = "mlp") -> list[dict[str, Any]]:
    """The stability targets, each met or not, with what was measured: the default port never
    collapses, ends within 1 point of DDP (lm: 1 % of its loss), reaches the target >= 1.0x DDP's
    speed in (a) and >= 1.3x in (b)-(d); the asynchronous port (where run) never collapses; the best
    configuration >= 1.5x in (a) and (c), >= 2x in (b) and (d), with a final accuracy at least DDP's
    (lm: a loss within 1 % of it).  (e) has its own table."""
    unit, best_floor = (" %", -1.0) if task == "lm" else (" points", 0.0)
    out = []
    for scenario in (s for s in dict.fromkeys(s["scenario"] for s in summary) if s in DEFAULT_RATIO):
        rows = {s["system"]: s for s in summary if s["scenario"] == scenario}
        ceiling = (rows.get("ddp") or {}).get("ceiling")
        d = rows.get("default")
        if d is not None:
            out.append({"scenario": scenario, "target": f"default port never collapses ({d['runs']} runs)",
                        "measured": f"{d['collapsed']} collapsed, {d['collapse_warnings']} watch reports",
                        "met": d["collapsed"] == 0})
            pts = d["final_vs_ddp"]
            out.append({"scenario": scenario, "target": f"default port final within 1{unit} of DDP",
                        "measured": _opt(pts, "+.1f", unit), "met": pts is not None and pts >= -1.0})
            ratio = d["ddp_ratio"]
            out.append({"scenario": scenario, "target": f"default port time to target >= {DEFAULT_RATIO[scenario]}x "
                        "DDP's", "measured": _ratio(ratio, d["ddp_ratio_at_least"])
                        + beside_ceiling(DEFAULT_RATIO[scenario], ceiling),
                        "met": ratio is not None and ratio >= DEFAULT_RATIO[scenario]})
        port = rows.get(ASYNC_PORT)
        if port is not None:        # the asynchronous port, given --default-runs runs in (d)
            out.append({"scenario": scenario, "target": f"{ASYNC_PORT} never collapses ({port['runs']} runs)",
                        "measured": f"{port['collapsed']} collapsed, {port['collapse_warnings']} watch reports",
                        "met": port["collapsed"] == 0})
        # the best configuration is smb2's own: the peers (DDP, torchft) are what it is measured against
        candidates = [s for name, s in rows.items()
                      if spec_of(name) is not None and "torchft" not in (spec_of(name) or {})
                      and s["ddp_ratio"] is not None]
        best = max(candidates, key=lambda s: s["ddp_ratio"]) if candidates else None
        if best is not None and "ddp" in rows:
            pts = best["final_vs_ddp"]
            out.append({"scenario": scenario, "target": f"best configuration >= {BEST_RATIO[scenario]}x DDP, final "
                        + ("within 1 % of DDP's" if task == "lm" else ">= DDP's"),
                        "measured": f"{best['system']}: {_ratio(best['ddp_ratio'], best['ddp_ratio_at_least'])}, "
                        f"{_opt(pts, '+.1f', unit)}" + beside_ceiling(BEST_RATIO[scenario], ceiling),
                        "met": best["ddp_ratio"] >= BEST_RATIO[scenario] and pts is not None and pts >= best_floor})
        if best is not None and "torchft" in rows:
            out.append(against_torchft(scenario, best, rows["torchft"], task))
        out += compression_targets(scenario, rows, task)
    return out


def beside_ceiling(target: float, ceiling: float | None) -> str:
    """What a speed-up target against DDP is beside the run's ceiling (DDP's workers stepping with
    nothing exchanged): a target above it can be met only by learning more per sample than DDP."""
    if ceiling is None:
        return ""
    return (f" (ceiling {ceiling:.2f}x" + (": the target is above it, reachable only by learning more per "
                                           "sample than DDP" if target > ceiling else "") + ")")


#: smb2's best configuration against torchft's DiLoCo at the same H: its speed to the target at least
#: this many times torchft's (torchft's median time over its own)
TORCHFT_RATIO = {"homogeneous": 1.0, "straggler": 1.3, "comm-bound": 1.0, "overloaded": 1.3}


def against_torchft(scenario: str, best: dict[str, Any], torchft: dict[str, Any], task: str) -> dict[str, Any]:
    """The best configuration against torchft's DiLoCo: the target reached at least TORCHFT_RATIO
    times as fast (the ratio of the median times to target), a final figure within 1 % of torchft's
    (mlp: points).  A run that missed the target counts as slower than any that reached it."""
    mine, theirs = best["time_to_target_s"], torchft["time_to_target_s"]
    ratio = theirs / mine if mine and theirs else (float("inf") if mine and not theirs else None)
    worse = -better_than(task, best["final"], torchft["final"]) \
        if best["final"] is not None and torchft["final"] is not None else None
    unit = " %" if task == "lm" else " points"
    measured = (f"{best['system']}: " + ("torchft missed the target" if ratio == float("inf") else
                                         _opt(ratio, ".2f", "x torchft's speed"))
                + f", final {_opt(None if worse is None else -worse, '+.1f', unit)} against torchft's")
    return {"scenario": scenario, "target": f"best configuration >= {TORCHFT_RATIO[scenario]}x torchft's DiLoCo "
            f"(same H), final within 1{unit} of it", "measured": measured,
            "met": ratio is not None and ratio >= TORCHFT_RATIO[scenario] and worse is not None and worse <= 1.0}


#: compressed against bf16 dense diloco: bytes per exchange at least this many times fewer, and in (c)
#: the target this many times sooner
COMPRESSED_FEWER_BYTES = 10.0
COMPRESSED_SOONER = {"comm-bound": 1.5}


def compression_targets(scenario: str, rows: dict[str, dict[str, Any]], task: str) -> list[dict[str, Any]]:
    """Each compressed diloco against dense ``diloco`` in one scenario: >= 10x fewer bytes pushed per
    exchange, a final figure within 1 % of dense diloco's, and in (c) the target >= 1.5x sooner."""
    dense = rows.get("diloco")
    out: list[dict[str, Any]] = []
    if dense is None:
        return out
    for name, c in rows.items():
        if not name.startswith(COMPRESSED):
            continue
        fewer = (dense["pushed_bytes_per_exchange"] / c["pushed_bytes_per_exchange"]
                 if dense["pushed_bytes_per_exchange"] and c["pushed_bytes_per_exchange"] else None)
        out.append({"scenario": scenario, "target": f"{name} >= {COMPRESSED_FEWER_BYTES:g}x fewer bytes/exchange "
                    "than diloco", "measured": _opt(fewer, ".1f", "x fewer"),
                    "met": fewer is not None and fewer >= COMPRESSED_FEWER_BYTES})
        if c["final"] is not None and dense["final"] is not None:
            worse = -better_than(task, c["final"], dense["final"])
            unit = " %" if task == "lm" else " points"
            out.append({"scenario": scenario, "target": f"{name} final within 1{unit} of diloco's",
                        "measured": _opt(-worse, "+.1f", unit), "met": worse <= 1.0})
        if scenario in COMPRESSED_SOONER:
            ratio = (dense["time_to_target_s"] / c["time_to_target_s"]
                     if dense["time_to_target_s"] and c["time_to_target_s"] else None)
            out.append({"scenario": scenario, "target": f"{name} to target >= {COMPRESSED_SOONER[scenario]}x "
                        "as fast as diloco", "measured": _ratio(ratio, False),
                        "met": ratio is not None and ratio >= COMPRESSED_SOONER[scenario]})
    return out


# ---------------------------------------------------------------------------------------------
# Output


#: the per-run table: its columns and their number formats
ROW_HEADER = ["scenario", "link", "system", "to tgt s", "x DDP", "samples/s", "r0 now", "final", "MB/step",
              "drop %", "not comp", "r0 cpu", "r0 rdy"]
ROW_FORMATS = [None, None, None, "{:.1f}", "{:.2f}x", "{:.1f}", "{:.3f}", "{:.3f}", "{:.2f}", "{:.2f}", "{:.1%}",
               "{:.1%}", "{:.1%}"]


def row_cells(r: dict[str, Any]) -> list[Any]:
    """One run's row of the per-run table (a missed target shows as "miss")."""
    r0 = r["workers_time"][0]
    ttt = r["time_to_target_s"] if r["time_to_target_s"] is not None else "miss"
    return [r["scenario"], r["rate"], r["system"], ttt, r.get("ddp_ratio"), r["samples_per_s"], r["last_eval"],
            r["final"], sum(r["link_bytes_per_step"]) / len(r["link_bytes_per_step"]) / 1e6,
            max(r.get("egress_drop_pct") or [0.0]), r["not_computing"], r0["on_cpu"], r0["waiting_for_cpu"]]


def fmt_row(r: dict[str, Any]) -> str:
    """One run's row on one line (the progress the run prints as it goes)."""
    return "  ".join(report.cell(c, f) for c, f in zip(row_cells(r), ROW_FORMATS))


def _ratio(v: float | None, at_least: bool) -> str:
    """A speed-up against DDP; ">=" where DDP missed the target in some run (a lower bound)."""
    return "-" if v is None else f"{'>=' if at_least and v > 0 else ''}{v:.2f}x"


def _mb(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 1e6


def _opt(v: float | None, spec: str, suffix: str) -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def table(result: dict[str, Any]) -> str:
    return report.table(ROW_HEADER, [row_cells(r) for r in result["rows"]], formats=ROW_FORMATS)


def summary_table(result: dict[str, Any]) -> str:
    """Medians over the runs, and the stability targets, met or not."""
    parts = [report.table(
        ["scenario", "system", "runs", "to tgt s", "x DDP", "ceiling", "final", "vs DDP", "collapsed",
         "64 B rtt µs", "MB pushed/exchange"],
        [[s["scenario"], s["system"], s["runs"], s["time_to_target_s"], _ratio(s["ddp_ratio"], s["ddp_ratio_at_least"]),
          s.get("ceiling"), s["final"], s["final_vs_ddp"], s["collapsed"], s["rtt_us"],
          _mb(s.get("pushed_bytes_per_exchange"))]
         for s in result["summary"]],
        formats=[None, None, None, "{:.1f}", None, "{:.2f}x", "{:.3f}", "{:+.1f}", None, "{:.0f}", "{:.4f}"])]
    short = [s for s in result["summary"] if s.get("ddp_after_stop")]
    if short:       # a ratio of such runs would call a system slower that was only stopped sooner
        parts += ["", *(f"{s['scenario']}: {s['system']} stopped before DDP reached the target in "
                        f"{s['ddp_after_stop']} of {s['runs']} runs (DDP went past the "
                        f"{result['budget_s'][s['scenario']]:g} s budget to its next evaluation): "
                        f"no ratio there; raise --budget" for s in short)]
    faults = [r for r in result["rows"] if "fault" in r]
    if faults:      # (e): what each system did when a worker was killed, as rank 0 saw it
        parts += ["", report.table(
            ["scenario", "system", "killed s", "back s", "to tgt s", "what it did"],
            [[r["scenario"], r["system"], r["fault"]["killed_at_s"], r["fault"]["rejoined_at_s"],
              r["time_to_target_s"], r["fault"]["outcome"]] for r in faults],
            formats=[None, None, "{:.1f}", "{:.1f}", "{:.1f}"])]
    parts += ["", report.table(["scenario", "target", "measured", "met"],
                               [[t["scenario"], t["target"], t["measured"], "met" if t["met"] else "NOT met"]
                                for t in result["targets"]])]
    return "\n".join(parts)


def plot(result: dict[str, Any], path: str) -> None:
    def draw(plt: Any) -> Any:
        scenarios = list(dict.fromkeys(r["scenario"] for r in result["rows"]))
        fig, axes = plt.subplots(1, len(scenarios), figsize=(5.5 * len(scenarios), 4), squeeze=False)
        for ax, sc in zip(axes[0], scenarios):
            for r in result["rows"]:
                if r["scenario"] == sc:
                    line, = ax.plot([c[0] for c in r["curve"]], [c[2] for c in r["curve"]], label=r["system"],
                                    ls="--" if r["system"] == "ddp" else "-")
                    # the delivered model at the end (EASGD: the center), on the final test set
                    ax.plot([r["curve"][-1][0]], [r["final"]], "o", color=line.get_color())
            ax.axhline(result["config"]["target"], color="grey", lw=0.8)
            what = "validation loss, nats/byte" if result["config"]["task"] == "lm" else "held-out accuracy"
            rate = next(r["rate"] for r in result["rows"] if r["scenario"] == sc)
            report.style(ax, title=f"{sc} ({rate} links)", xlabel="wall time s (eval excluded)",
                         ylabel=f"{what} (rank 0; dot: delivered model)")
        fig.tight_layout()
        return fig

    why = report.plot(path, draw)
    print(why or f"plot: {path}", file=sys.stderr if why else sys.stdout)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model, 2 workers, 2 servers (bookkeeping check)")
    ap.add_argument("--task", choices=("mlp", "lm"), default="mlp",
                    help="mlp: the teacher's classifier (accuracy); lm: the byte-level transformer on the "
                         "standard library's source (validation loss, smb2/bench/tta_lm.py)")
    ap.add_argument("--lm-size", choices=("small", "full"), default="full",
                    help="lm: the full model (6 layers of width 384, 256 bytes of context, 10.9 M parameters, "
                         "target 2.2) or the small one (4 layers of width 320, 128 bytes, 5.1 M, target 2.5), "
                         "which a 2-core machine trains to its target within the budget")
    ap.add_argument("--scenarios", type=lambda s: s.split(","), default=None,
                    help=f"comma list of {', '.join(SCENARIOS)} (default: all; --quick: homogeneous)")
    ap.add_argument("--systems", type=lambda s: s.split(","), default=list(SYSTEMS),
                    help=f"comma list of {', '.join(ALL_SYSTEMS)}, or {COMPRESSED}SPEC, SPEC topk:F or sparseloco:F "
                         f"(default: {', '.join(SYSTEMS)})")
    ap.add_argument("--compress", default=None, metavar="SPEC",
                    help="also run diloco with this compressed exchange, topk:F or sparseloco:F (the system "
                         "diloco/SPEC), beside dense diloco: bytes per exchange and time to target against it")
    ap.add_argument("--runs", type=int, default=None,
                    help="runs of every system in every scenario; the rows' medians are reported (default 3; "
                         "--quick: 1)")
    ap.add_argument("--default-runs", type=int, default=None,
                    help=f"runs of the asynchronous port ({ASYNC_PORT}, where --systems names it) in (d) "
                         "overloaded, counting the --runs ones (default 10; --quick: --runs): none may collapse")
    ap.add_argument("--hogs", type=int, default=None,
                    help="(d): busy processes, one on each of the first HOGS worker hosts, unpinned (default: "
                         "one per worker host)")
    ap.add_argument("--rate", default="1gbit", help="link rate of every host in (a) and (b) (tc syntax)")
    ap.add_argument("--slow-rate", default="200mbit", help="link rate of every host in (c) comm-bound")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds of training per run (default per scenario: (a) 60, (b) 120, (c) 200, (d) 150, "
                         "(e) 60; quick 12)")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--servers", type=int, default=None)
    ap.add_argument("--target", type=float, default=None,
                    help="target held-out accuracy (mlp; default 0.75) or validation loss in nats/byte (lm; "
                         "default 2.2, --quick 2.8)")
    ap.add_argument("--eval-n", type=int, default=None,
                    help="held-out samples per evaluation of the curve (default 512; the clock excludes "
                         "evaluation, but on few cores one worker's evaluation slows the others)")
    ap.add_argument("--final-n", type=int, default=None,
                    help="samples of the final test set, drawn apart (default 4096: 0.7 points' standard error)")
    ap.add_argument("--stop", choices=("target", "budget"), default=None,
                    help="end a run at the target or train the whole budget (default: budget, so final "
                         "accuracies compare at equal time; --quick: target)")
    ap.add_argument("--capacity", default="1GiB", help="each server's --capacity")
    ap.add_argument("--replicas", type=int, default=1,
                    help="the stores' replicas (2: the servers get a private etcd on a host of its own)")
    ap.add_argument("--kill-at", type=float, default=None, metavar="FRACTION",
                    help="SIGKILL the first server at this fraction of the budget of rank 0's training clock "
                         "(e.g. 0.5; once per run, in its first system)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    return ap


def _worker_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_tta.py _worker")
    for name, kind in (("rank", int), ("world", int), ("batch", int), ("eval-every", int), ("eval-n", int),
                       ("lr", float), ("target", float), ("budget", float), ("systems", str),
                       ("tag", str), ("servers", str), ("master", str), ("stop-file", str), ("host-addr", str),
                       ("wait-all", float)):
        ap.add_argument(f"--{name}", type=kind, required=True)
    ap.add_argument("--task", choices=("mlp", "lm"), required=True)
    ap.add_argument("--sizes", help="mlp: the layer sizes (JSON)")
    ap.add_argument("--lm", help="lm: its configuration (JSON)")
    ap.add_argument("--corpus", help="lm: the directory of train.bin and val.bin")
    ap.add_argument("--lighthouse", help="torchft's lighthouse host")
    ap.add_argument("--fault-at", type=float, default=None, help="(e): the kill, in s of rank 0's clock")
    ap.add_argument("--final-n", type=int, required=True)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--stop", choices=("target", "budget"), required=True)
    ap.add_argument("--straggler", action="store_true")
    ap.add_argument("--watch", type=lambda s: [ns for ns in s.split(",") if ns], default=[],
                    help="namespaces whose eth0 counters to read at the start and the end of the training")
    return ap


def _known(system: str) -> bool:
    try:
        spec = spec_of(system)
    except KeyError:
        return False
    if spec is not None and "compress" in spec:
        from smb2.train.compress import parse_spec
        try:
            parse_spec(spec["compress"])
        except ValueError:
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        worker(_worker_parser().parse_args(argv[1:]))
        return 0
    a = _parser().parse_args(argv)
    if a.scenarios is None:
        a.scenarios = ["homogeneous"] if a.quick else list(SCENARIOS)
    if a.runs is None:
        a.runs = 1 if a.quick else 3
    if a.default_runs is None:
        a.default_runs = a.runs if a.quick else 10
    a.default_runs = max(a.default_runs, a.runs)
    if a.compress is not None:
        for system in ("diloco", COMPRESSED + a.compress):
            if system not in a.systems:
                a.systems.append(system)
    bad = [s for s in a.scenarios if s not in SCENARIOS] + [s for s in a.systems if not _known(s)]
    if bad:
        _parser().error(f"unknown scenario/system {', '.join(bad)}")
    missing = [s for s in a.systems if not available(s)]
    if missing:
        print(f"bench_tta: this smb2 has no rule for {', '.join(missing)} (torchft's: pip install "
              "'smb2[tta]'): left out", file=sys.stderr)
        a.systems = [s for s in a.systems if s not in missing]
    ok, why = netns_cluster.can_run()
    if not ok:
        print(f"bench_tta: cannot build a namespace cluster here: {why}", file=sys.stderr)
        return 2
    result = run(a)
    add_ratios(result)
    result["summary"] = summarize_runs(result)
    result["targets"] = targets(result["summary"], a.task)
    print(table(result))
    print("loopback 64 B round trip: " + ", ".join(
        f"{sc} {', '.join(f'{us:.0f}' for us in rtts)} µs" for sc, rtts in result["rtt_us"].items()))
    print()
    print(summary_table(result))
    if a.json:
        report.write_json(a.json, result, quiet=True, round_trip_64B_us=report.median_round_trip(
            [us for rtts in result["rtt_us"].values() for us in rtts]))
    if a.png:
        plot(result, a.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
