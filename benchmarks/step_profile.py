"""Where a creditrl training step's time goes (``bench_trainer.py --profile``): wall seconds of
sampling and update, split into the model's forward passes, ``token_stats``, the backward pass,
the optimizer step and the rest (sampler bookkeeping, tokenizer, rewards, estimator, loss,
metrics: Python and small ops), each as a share of the step and, for the matmul-bound parts,
against this CPU's measured matmul throughput.

FLOPs are counted from the model: 2 x (Linear weights) per token fed to a forward (the output
head only on the positions whose logits are kept), backward = 2 x the update's forward;
attention's own products (~4·T·d per token and layer, a few % at these lengths) are left out,
so the achieved GFLOP/s are slight underestimates.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

import creditrl.runtime.scoring as scoring
import creditrl.trainer.update as update

PARTS = ("model forward", "token_stats", "backward", "optimizer step")


def matmul_gflops(rows: int, inner: int, cols: int, dtype=torch.float32, seconds: float = 0.5) -> float:
    """Measured GFLOP/s of [rows, inner] @ [inner, cols] on this CPU (best of repeated calls)."""
    a, b = torch.randn(rows, inner, dtype=dtype), torch.randn(inner, cols, dtype=dtype)
    best, spent = float("inf"), 0.0
    a @ b
    while spent < seconds:
        start = time.perf_counter()
        a @ b
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
    return 2 * rows * inner * cols / best / 1e9


class StepClock:
    """Accumulates seconds and FLOPs per (phase, part) while attached to a model; ``phase``
    ("sampling", "update") marks the trainer's stage."""

    def __init__(self):
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.flops: dict[tuple[str, str], float] = defaultdict(float)
        self.current = "other"
        self._undo: list = []

    @contextmanager
    def phase(self, name: str):
        self.current, start = name, time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name, "total"] += time.perf_counter() - start
            self.current = "other"

    def timed(self, part: str, fn, flops=None):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds[self.current, part] += time.perf_counter() - start
            if flops is not None:
                self.flops[self.current, part] += flops(args, kwargs, out)
            return out
        return wrapper

    def attach(self, model) -> None:
        head = model.get_output_embeddings().weight.numel()
        body = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)) - head
        starts = []

        def pre(module, args, kwargs):
            starts.append(time.perf_counter())

        def post(module, args, kwargs, out):
            key = (self.current, "model forward")
            self.seconds[key] += time.perf_counter() - starts.pop()
            ids = kwargs.get("input_ids", args[0] if args else None)
            positions = out.logits.shape[0] * out.logits.shape[1]
            # the sampler's prefix pass feeds embeddings (inputs_embeds [B, T, d]) instead of ids
            tokens = ids.numel() if ids is not None else kwargs["inputs_embeds"].shape[:-1].numel()
            forward = 2 * body * tokens + 2 * head * positions
            self.flops[key] += forward
            if torch.is_grad_enabled():
                self.flops[self.current, "backward"] += 2 * forward
        handles = [model.register_forward_pre_hook(pre, with_kwargs=True),
                   model.register_forward_hook(post, with_kwargs=True)]
        backward, step, stats = torch.Tensor.backward, update.optimizer_step, scoring.token_stats
        torch.Tensor.backward = self.timed("backward", backward)
        update.optimizer_step = self.timed("optimizer step", step)
        scoring.token_stats = self.timed("token_stats", stats)
        self._undo = [lambda: [h.remove() for h in handles],
                      lambda: setattr(torch.Tensor, "backward", backward),
                      lambda: setattr(update, "optimizer_step", step),
                      lambda: setattr(scoring, "token_stats", stats)]

    def detach(self) -> None:
        for undo in self._undo:
            undo()
        self._undo = []

    def parts(self) -> list[tuple[str, float, float]]:
        """(row name, seconds, FLOPs) of each timed part, each phase's rest, and the whole step."""
        rows = []
        for phase in ("sampling", "update"):
            known = 0.0
            for part in PARTS:
                sec = self.seconds.get((phase, part), 0.0)
                if sec == 0.0:
                    continue
                known += sec
                rows.append((f"{phase}: {part}", sec, self.flops.get((phase, part), 0.0)))
            what = "sampler, tokenizer, rewards" if phase == "sampling" else "estimator, loss, metrics"
            rows.append((f"{phase}: other ({what}; Python)", self.seconds[phase, "total"] - known, 0.0))
        rows.append(("step", sum(self.seconds[p, "total"] for p in ("sampling", "update")), sum(self.flops.values())))
        return rows

    def report(self, steps: int, peak: float) -> list[str]:
        """Per-step rows: seconds, share of the step, GFLOP and GFLOP/s (and the share of ``peak``)."""
        rows = self.parts()
        total = rows[-1][1]
        lines = [f"{'part of the step':<54}{'s/step':>8}{'share':>7}{'GFLOP':>8}{'GFLOP/s':>9}{'of peak':>9}"]
        lines += [_row_text(name, sec, flops, steps, total, peak) for name, sec, flops in rows]
        return lines


def report_runs(clocks: list[StepClock], steps: int, peak: float) -> list[str]:
    """Several runs' ``StepClock``s: per part the median s/step and share, the spread of the share over
    the runs ((max - min) share, in points) and the GFLOP/s at the median time."""
    runs = [clock.parts() for clock in clocks]
    lines = [f"{'part of the step (median of ' + str(len(runs)) + ' runs)':<54}{'s/step':>8}{'share':>7}"
             f"{'spread':>8}{'GFLOP':>8}{'GFLOP/s':>9}{'of peak':>9}"]
    for i, (name, _, flops) in enumerate(runs[0]):
        secs = [run[i][1] for run in runs if run[i][0] == name]
        shares = [run[i][1] / run[-1][1] for run in runs if run[i][0] == name and run[-1][1] > 0]
        sec = statistics.median(secs)
        rate = flops / sec / 1e9 if sec > 0 and flops else 0.0
        cells = f"{flops / steps / 1e9:>8.1f}{rate:>9.1f}{rate / peak:>9.0%}" if flops else f"{'':>26}"
        lines.append(f"{name:<54}{sec / steps:>8.3f}{statistics.median(shares):>7.0%}"
                     f"{100 * (max(shares) - min(shares)):>7.1f}p{cells}")
    return lines


def _row_text(name: str, sec: float, flops: float, steps: int, total: float, peak: float) -> str:
    rate = flops / sec / 1e9 if sec > 0 and flops else 0.0
    cells = (f"{flops / steps / 1e9:>8.1f}{rate:>9.1f}{rate / peak:>9.0%}" if flops else f"{'':>26}")
    return f"{name:<54}{sec / steps:>8.3f}{sec / total:>7.0%}{cells}"
