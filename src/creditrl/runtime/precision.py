"""``train.precision`` resolved once: what runs under autocast and in which dtype, what is stored in
bf16, and whether the loss is scaled. Trainable weights always stay float32 (unless ``model.dtype``
asks otherwise); only the forward/backward compute and frozen copies go low-precision.

``auto`` (the default) is resolved when a run starts, by timing the model itself
(``choose_precision``): whether bf16 autocast pays depends on the machine (on a CPU it needs bf16
matrix units, AVX512-BF16 or AMX; without them its conversions make it slower than fp32). On a
CPU a matrix product is timed first (``matmul_precheck``, well under a second): where bf16's runs
``HOPELESS`` times slower than fp32's, the model is not timed (a minute on SmolLM2 there).
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
NAMES = ("auto", "fp32", "bf16", "fp16")
AUTO_MARGIN = 0.10        # bf16 must save at least this share of fp32's probe time...
AUTO_MIN_COSINE = 0.99    # ...and its gradient must point where fp32's does
UNTIMED_MODELS = ("builtin:tiny",)   # millisecond steps: a timing too noisy to choose by
MATMUL_SIZE = 256         # the precheck's n x n product: its bf16 kernel is the model's
MATMUL_ROUNDS = 10        # the precheck times the best of this many products of each
HOPELESS = 2.0            # bf16 products this many times slower than fp32's: no model runs faster in bf16


@dataclass(frozen=True)
class Precision:
    """``name``: ``fp32`` (no autocast), ``bf16`` (bf16 autocast; CPUs with bf16 units and GPUs),
    ``fp16`` (fp16 autocast with loss scaling; CUDA only) or ``auto`` (not yet resolved: the
    trainer times fp32 against bf16 when a run starts, ``choose_precision``)."""
    name: str = "fp32"

    def __post_init__(self):
        if self.name not in NAMES:
            raise ValueError(f"train.precision: expected one of {list(NAMES)}, got {self.name!r}")

    def check_device(self, device: torch.device) -> None:
        if self.name == "fp16" and torch.device(device).type != "cuda":
            raise ValueError("train.precision: fp16 needs CUDA (its loss scaling); on a CPU use bf16 (same speed-up "
                             "where the CPU has bf16 units, no overflow) or fp32")

    @property
    def resolved(self) -> bool:
        return self.name != "auto"

    @property
    def low(self) -> bool:
        """Whether compute runs in a 16-bit dtype."""
        self.require_resolved()
        return self.name != "fp32"

    @property
    def frozen_dtype(self) -> torch.dtype | None:
        """The dtype of frozen weights (a LoRA base, the KL reference copy): bf16 under autocast,
        which computes in 16 bits anyway; None (keep the model's) for fp32, and for ``auto``, whose
        choice comes after the model loads."""
        return torch.bfloat16 if self.resolved and self.low else None

    @property
    def scales_loss(self) -> bool:
        return self.name == "fp16"

    @contextmanager
    def autocast(self, model):
        """Autocast on the model's device for bf16/fp16; nothing for fp32."""
        if not self.low:
            yield
            return
        with torch.autocast(next(model.parameters()).device.type, dtype=AUTOCAST_DTYPES[self.name]):
            yield

    def require_resolved(self) -> "Precision":
        """``self``, or a ValueError for an unresolved ``auto`` naming who resolves it."""
        if not self.resolved:
            raise ValueError("train.precision: 'auto' is resolved by creditrl's Trainer, which times the model at "
                             "fp32 and bf16 when a run starts; code that builds a Learner or autocasts on its own "
                             "needs train.precision fp32 or bf16 (or runtime.precision.choose_precision)")
        return self


# ----------------------------------------------------------------------------- auto

@dataclass(frozen=True)
class Probe:
    """One timing of the probe at one precision: seconds decoding and seconds of forward+backward,
    and the gradient it left (the parameters' ``.grad``, in order; None where a weight got none)."""
    decode_s: float
    train_s: float
    grads: list[Tensor | None] = field(repr=False)

    @property
    def total_s(self) -> float:
        return self.decode_s + self.train_s


@dataclass(frozen=True)
class PrecisionChoice:
    """What ``auto`` chose and why: the best probe times of each precision (seconds), the cosine
    between the bf16 and fp32 gradients, the reason in words, and the probe's size."""
    chosen: str
    seconds: dict[str, dict[str, float]]
    gradient_cosine: float | None
    reason: str
    probe: str = ""

    def record(self) -> dict:
        return {"setting": "auto", "chosen": self.chosen, "seconds": self.seconds,
                "gradient_cosine": self.gradient_cosine, "reason": self.reason, "probe": self.probe}

    @classmethod
    def from_record(cls, record: dict) -> "PrecisionChoice":
        return cls(record["chosen"], record["seconds"], record["gradient_cosine"], record["reason"],
                   record.get("probe", ""))

    def text(self) -> str:
        """One line for a run's summary and config.yaml."""
        if not self.seconds:
            return f"train.precision=auto chose {self.chosen}, not timed: {self.reason}"
        if all("matmul" in s for s in self.seconds.values()):             # ``matmul_precheck``'s
            times = ", ".join(f"{name} {s['matmul'] * 1e3:.3g} ms" for name, s in self.seconds.items())
            return f"train.precision=auto chose {self.chosen}: {self.probe} took {times}; {self.reason}"
        times = ", ".join(f"{name} {s['total']:.3g} s (decode {s['decode']:.3g} + forward/backward "
                          f"{s['forward_backward']:.3g})" for name, s in self.seconds.items())
        return f"train.precision=auto chose {self.chosen}: {self.probe} took {times}; {self.reason}"


def choose_precision(run_probe: Callable[[Precision], Probe], *, rounds: int = 2, margin: float = AUTO_MARGIN,
                     min_cosine: float = AUTO_MIN_COSINE, probe: str = "") -> PrecisionChoice:
    """``auto``: bf16 when the probe runs at least ``margin`` faster under bf16 autocast than in
    fp32 and the bf16 gradient's cosine with fp32's is >= ``min_cosine`` (weights stay float32
    either way, so what bf16 changes is the compute's rounding); fp32 otherwise.

    ``run_probe(precision)`` decodes a few steps and runs one forward+backward at ``precision``
    (``model_probe``). Each precision runs once untimed (first-call costs: kernel selection,
    allocation), then ``rounds`` >= 1 times interleaved, alternating which goes first; the best
    time of each is compared (a busy machine only adds time)."""
    names = ("fp32", "bf16")
    for name in names:
        run_probe(Precision(name))
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    grads: dict[str, list] = {}
    for i in range(max(rounds, 1)):
        for name in (names if i % 2 == 0 else names[::-1]):
            result = run_probe(Precision(name))
            times[name].append((result.decode_s, result.train_s))
            grads.setdefault(name, result.grads)          # one gradient per precision is kept
    seconds = {}
    for name, runs in times.items():
        decode, train = min(runs, key=sum)
        seconds[name] = {"decode": decode, "forward_backward": train, "total": decode + train}
    cosine = gradient_cosine(grads["fp32"], grads["bf16"])
    speedup = seconds["fp32"]["total"] / seconds["bf16"]["total"] if seconds["bf16"]["total"] > 0 else math.inf
    needed = 1 / (1 - margin)
    if not math.isfinite(cosine) or cosine < min_cosine:
        chosen, why = "fp32", f"the bf16 gradient's cosine with fp32's is {cosine:.4f} (< {min_cosine})"
    elif speedup < needed:
        chosen, why = "fp32", f"bf16 ran {speedup:.2f}x as fast as fp32 (needs >= {needed:.2f}x)"
    else:
        chosen, why = "bf16", f"bf16 ran {speedup:.2f}x as fast as fp32, gradient cosine {cosine:.4f}"
    rule = f"rule: bf16 when >= {needed:.2f}x as fast with gradient cosine >= {min_cosine}, else fp32"
    return PrecisionChoice(chosen, seconds, cosine, f"{why} ({rule})", probe)


def matmul_seconds(size: int = MATMUL_SIZE, rounds: int = MATMUL_ROUNDS) -> dict[str, float]:
    """The best of ``rounds`` seconds of a ``size`` x ``size`` float32 product on the CPU, plain and
    under bf16 autocast, alternating (one untimed call of each first; a busy machine only adds time)."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=gen), torch.randn(size, size, generator=gen)
    best = {"fp32": math.inf, "bf16": math.inf}
    for i in range(rounds + 1):
        for name in ("fp32", "bf16"):
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name == "bf16"):
                torch.mm(a, b)
            if i:
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def matmul_precheck(seconds: Callable[[], dict[str, float]] = matmul_seconds) -> PrecisionChoice | None:
    """``auto`` on a CPU before the model is timed: fp32 where bf16 autocast's matrix product runs at
    least ``HOPELESS`` times slower than fp32's (no bf16 units: the model's products, most of a step,
    would too, where the rule needs bf16 >= 1/(1 - AUTO_MARGIN) times faster); None, time the model,
    otherwise."""
    times = seconds()
    slower = times["bf16"] / times["fp32"] if times["fp32"] > 0 else math.nan   # a clock too coarse: no verdict
    if not slower >= HOPELESS:
        return None
    reason = (f"bf16 autocast's product ran {slower:.1f}x slower than fp32's (>= {HOPELESS:g}x: this CPU has no fast "
              f"bf16 kernels, so the model was not timed; bf16 is kept when >= {1 / (1 - AUTO_MARGIN):.2f}x as fast)")
    return PrecisionChoice("fp32", {name: {"matmul": t} for name, t in times.items()}, None, reason,
                           f"a {MATMUL_SIZE}x{MATMUL_SIZE} matrix product (best of {MATMUL_ROUNDS})")


def gradient_cosine(a: list[Tensor | None], b: list[Tensor | None]) -> float:
    """Cosine between two gradients given per parameter (None: no gradient, counted as 0), in float64."""
    dot = norm_a = norm_b = 0.0
    for x, y in zip(a, b):
        if x is not None:
            norm_a += float(x.double().square().sum())
        if y is not None:
            norm_b += float(y.double().square().sum())
        if x is not None and y is not None:
            dot += float((x.double() * y.double()).sum())
    return dot / math.sqrt(norm_a * norm_b) if norm_a > 0 and norm_b > 0 else math.nan


def model_probe(model, decode: Callable[[], object], forward_backward: Callable[[], Tensor]
                ) -> Callable[[Precision], Probe]:
    """``run_probe`` for ``choose_precision`` on ``model``: ``decode()`` samples a small batch (a few
    decoding steps; timed, then dropped), ``forward_backward()`` returns the scalar whose forward
    and backward are timed, on one fixed batch (so the two precisions' gradients compare). Under
    each precision's autocast; no optimizer step, so the weights never change (``probing``
    restores the rest)."""
    params = list(model.parameters())
    device = params[0].device

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def run(precision: Precision) -> Probe:
        model.zero_grad(set_to_none=True)
        sync()
        start = time.perf_counter()
        with precision.autocast(model):
            decode()
        sync()
        decoded = time.perf_counter()
        with precision.autocast(model):
            loss = forward_backward()
        loss.backward()
        sync()
        done = time.perf_counter()
        grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
        return Probe(decoded - start, done - decoded, grads)
    return run


@contextmanager
def probing(model):
    """Leave ``model`` and torch's global RNG as they were: gradients cleared, mode restored."""
    training, rng = model.training, torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        model.zero_grad(set_to_none=True)
        model.train(training)
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
