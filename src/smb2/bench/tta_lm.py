"""The language-model task of smb2 bench tta (smb2.bench.tta): a byte-level decoder-only transformer on the
running Python's standard library source, its data, its evaluation and its learning-rate schedule.

Data (no download): every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (site- and
dist-packages left out), sorted by path; every 10th file (index 9, 19, ...) is held out for
validation, the others are concatenated into the training text.  Tokens are bytes (256 of them),
so chance is ln 256 = 5.55 nats/byte.  :func:`write_corpus` writes both splits once (the driver);
:class:`LMTask` maps them in every worker.

Training batches are ``batch`` windows of ``context + 1`` bytes at random offsets, drawn from a
generator seeded by the worker's rank: every system sees the same data in the same order on the
same rank.  Validation is the mean cross entropy (nats/byte) over a fixed set of ``eval_n`` windows
of the held-out text (seed 99); the final figure is the same over ``final_n`` other windows (seed 7).

The inner optimizer is AdamW (betas 0.9/0.95, weight decay 0.1) with a linear warm-up over the
first ``warmup`` steps and a cosine decay to a tenth of the peak at ``decay_steps``, held there
after; gradients are clipped to norm 1.0 before every step.  The step is each worker's own
optimizer step, the same schedule for every system.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path
from typing import Any

#: a byte's chance cross entropy: ln 256 nats
CHANCE = math.log(256)
#: a run whose final loss is not below this share of chance learned nothing (it collapsed)
COLLAPSED_SHARE = 0.9
HELD_OUT_EVERY = 10
CLIP = 1.0
#: full: 6 layers of width 384, 6 heads, 256 bytes of context (10.8 M parameters)
FULL: dict[str, Any] = {"layers": 6, "width": 384, "heads": 6, "context": 256, "batch": 16, "lr": 1e-3,
                        "warmup": 100, "decay_steps": 3000, "target": 2.2, "eval_every": 16, "eval_n": 64,
                        "final_n": 512}
#: --lm-size small: 4 layers of width 320, 5 heads, 128 bytes of context (5.1 M parameters): the
#: full model takes about 4.5 s a step on one core, so four workers sharing two cores make a few
#: dozen steps a minute; this one about a fifth of that, and reaches a lower loss in a few minutes
SMALL: dict[str, Any] = {"layers": 4, "width": 320, "heads": 5, "context": 128, "batch": 16, "lr": 2e-3,
                         "warmup": 30, "decay_steps": 1000, "target": 2.5, "eval_every": 16, "eval_n": 64,
                         "final_n": 256}
#: --quick: 2 layers of width 64, 4 heads, 64 bytes of context (0.13 M parameters): seconds on 1 core
QUICK: dict[str, Any] = {"layers": 2, "width": 64, "heads": 4, "context": 64, "batch": 16, "lr": 3e-3,
                         "warmup": 20, "decay_steps": 1000, "target": 2.8, "eval_every": 16, "eval_n": 32,
                         "final_n": 128}


def source_files() -> list[Path]:
    """The standard library's ``*.py`` files, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))


def write_corpus(directory: Path) -> dict[str, Any]:
    """Write ``train.bin`` and ``val.bin`` (the held-out files) into ``directory``; returns their
    statistics (files, bytes)."""
    train, val = bytearray(), bytearray()
    files = source_files()
    for i, path in enumerate(files):
        (val if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).extend(path.read_bytes())
    (directory / "train.bin").write_bytes(train)
    (directory / "val.bin").write_bytes(val)
    return {"root": sysconfig.get_paths()["stdlib"], "files": len(files),
            "val_files": len(files) // HELD_OUT_EVERY, "train_bytes": len(train), "val_bytes": len(val),
            "held_out": f"every {HELD_OUT_EVERY}th file by sorted path"}


def collapsed(final_loss: float) -> bool:
    """A final validation loss that is not clearly below chance."""
    return not final_loss < COLLAPSED_SHARE * CHANCE


def lr_factor(step: int, warmup: int, decay_steps: int) -> float:
    """Linear warm-up to 1 over ``warmup`` steps, cosine decay to 0.1 at ``decay_steps``, then 0.1."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, decay_steps - warmup))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


class LMTask:
    """The model, its batches, its optimizer and its evaluation, in a worker process."""

    higher_is_better = False
    metric = "validation loss (nats/byte)"

    def __init__(self, cfg: dict[str, Any], corpus: Path, rank: int) -> None:
        import numpy as np
        import torch

        self.torch = torch
        self.cfg = cfg
        self.context = cfg["context"]
        self.train = torch.from_numpy(np.fromfile(corpus / "train.bin", dtype=np.uint8).astype(np.int64))
        val = torch.from_numpy(np.fromfile(corpus / "val.bin", dtype=np.uint8).astype(np.int64))
        self.held = self._windows(val, cfg["eval_n"], 99)
        self.final_set = self._windows(val, cfg["final_n"], 7)
        self.gen = torch.Generator().manual_seed(1000 + rank)
        torch.manual_seed(0)                  # every rank builds the same initial model
        self.model = TinyGPT(cfg["layers"], cfg["width"], cfg["heads"], cfg["context"])
        self.step = 0

    def _windows(self, text: Any, n: int, seed: int) -> Any:
        starts = self.torch.randint(0, len(text) - self.context - 1, (n,),
                                    generator=self.torch.Generator().manual_seed(seed))
        return self.torch.stack([text[s:s + self.context + 1] for s in starts.tolist()])

    def batch(self) -> Any:
        starts = self.torch.randint(0, len(self.train) - self.context - 1, (self.cfg["batch"],), generator=self.gen)
        return self.torch.stack([self.train[s:s + self.context + 1] for s in starts.tolist()])

    def loss(self, net: Any, windows: Any) -> Any:
        logits = net(windows[:, :-1])
        return self.torch.nn.functional.cross_entropy(logits.reshape(-1, 256), windows[:, 1:].reshape(-1))

    def optimizer(self, params: Any) -> Any:
        return self.torch.optim.AdamW(params, lr=self.cfg["lr"], betas=(0.9, 0.95), weight_decay=0.1)

    def before_step(self, inner: Any, params: Any) -> None:
        """Clip the gradients and set this step's learning rate (the schedule counts this worker's steps)."""
        self.torch.nn.utils.clip_grad_norm_(params, CLIP)
        for group in inner.param_groups:
            group["lr"] = self.cfg["lr"] * lr_factor(self.step, self.cfg["warmup"], self.cfg["decay_steps"])
        self.step += 1

    def evaluate(self, net: Any, windows: Any = None) -> float:
        windows = self.held if windows is None else windows
        with self.torch.no_grad():
            parts = [float(self.loss(net, w)) * len(w) for w in windows.split(64)]
        return sum(parts) / len(windows)

    def final(self, net: Any) -> float:
        return self.evaluate(net, self.final_set)


def _model_class() -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, width: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            return x + self.mlp(self.ln2(x))

    class TinyGPTModel(nn.Module):
        """A decoder-only transformer over bytes: token and position embeddings, pre-norm blocks
        of causal self-attention and a 4x MLP, a final norm and a linear head to 256 logits."""

        def __init__(self, layers: int, width: int, heads: int, context: int) -> None:
            super().__init__()
            self.tokens = nn.Embedding(256, width)
            self.positions = nn.Embedding(context, width)
            self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
            self.ln = nn.LayerNorm(width)
            self.head = nn.Linear(width, 256)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
            return self.head(self.ln(self.blocks(x)))

    return TinyGPTModel


def TinyGPT(layers: int, width: int, heads: int, context: int) -> Any:  # noqa: N802  (builds a class instance)
    """The model (torch imported only when a model is built)."""
    return _model_class()(layers, width, heads, context)
