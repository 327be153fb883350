"""In-training diagnosis: the matched-signal efficiency of other estimators against the one being
trained, measured on the training steps' own groups (``logging.diagnose_every``, and the TRL
plug-in's ``DiagnoseCallback``).

On a diagnosed step, before its update, each of the step's groups gets its exact gradient
(``group_gradients``) under: the plain policy gradient of ``rloo`` (the unbiased reference), the
configured estimator under the configured loss at ratio 1, and each compared estimator under the
same loss. Each group is an independent unit; a sliding window of the last ``window`` diagnosed
steps (``creditrl.core.gradients.window.StepWindow``) gives the efficiency of every compared
estimator against the configured one with a delete-one-step jackknife 95% interval, its cosine to
the reference, and B_simple of the configured estimator. A value that is undefined (a mean gradient
not yet resolved, fewer than 2 steps in the window) is left out of the metrics, never logged as NaN.
"""
from __future__ import annotations

import math
import time

from creditrl.core.estimators.labels import label_options
from creditrl.core.gradients import CountSketch, Interval
from creditrl.core.gradients.window import StepWindow
from creditrl.core.losses import PolicyLoss
from creditrl.runtime.gradient_space import LARGE_MODEL_PARAMS, choose_space
from creditrl.runtime.group_gradients import batch_level_labels, group_gradients
from creditrl.runtime.rollout import RolloutBatch

REF = "reference"
DEFAULT_COMPARED = ("rloo", "grpo", "otb")


def compared_rows(configured: str, configured_options: dict, compared, k: int | None) -> dict[str, tuple[str, dict]]:
    """label -> (registered name, options): the configured estimator with its own options first, then
    every compared label (``NAME+loo`` for the leave_one_out form; an unknown one raises)."""
    rows = {configured: (label_options(configured, k)[0], dict(configured_options))}
    for label in compared if compared is not None else DEFAULT_COMPARED:
        if label not in rows:
            rows[label] = label_options(label, k)
    return rows


class StepDiagnosis:
    """``observe(batch)`` on a diagnosed step; ``metrics()`` the window's numbers; ``table()`` them in
    Markdown (module docstring). ``max_memory_gb`` bounds one step's flat gradients (else they are
    count-sketched to ``sketch_dim``)."""

    def __init__(self, model, rows: dict[str, tuple[str, dict]], configured: str, loss: PolicyLoss, *,
                 temperature: float, window: int, groups: int, max_memory_gb: float = 1.0,
                 sketch_dim: int = 65536, seed: int = 0):
        self.model, self.configured, self.temperature = model, configured, temperature
        self.rows = {REF: ("rloo", {}), **rows}
        self.losses = {REF: None, **dict.fromkeys(rows, loss)}
        self.space = choose_space(model, None, len(self.rows), 0, groups, max_memory_gb, sketch_dim,
                                  key="logging.diagnose_params", memory_key="logging.diagnose (memory)")
        self.sketch = (CountSketch([p.shape for p in self.space.params], self.space.dim, seed=seed)
                       if self.space.kind == "sketch" else None)
        self.shared = sum(p.numel() for p in model.parameters()) >= LARGE_MODEL_PARAMS
        self.window = StepWindow(tuple(self.rows), window)
        self.seconds: list[float] = []

    def observe(self, batch: RolloutBatch) -> dict[str, float]:
        """Measure one step's groups (at the current weights, before the update) and return the
        window's metrics plus ``time_diagnose``."""
        start = time.perf_counter()
        draws = group_gradients(self.model, batch, self.rows, temperature=self.temperature,
                                params=list(self.space.params), sketch=self.sketch, shared_prompts=self.shared,
                                losses=self.losses, dedupe=True, skip_zero=True)
        self.window.add(draws.grads)
        self.seconds.append(time.perf_counter() - start)
        return {**self.metrics(), "time_diagnose": self.seconds[-1]}

    def state_dict(self) -> dict:
        """The window and the timings, for a checkpoint: a resumed run's ``diagnose/*`` go on from them."""
        return {"window": self.window.state_dict(), "seconds": list(self.seconds)}

    def load_state_dict(self, state: dict) -> None:
        self.window.load_state_dict(state["window"])
        self.seconds = list(state["seconds"])

    def quality(self) -> tuple[dict, Interval]:
        return self.window.quality(REF, self.configured), self.window.noise_scale(self.configured)

    def metrics(self) -> dict[str, float]:
        quality, noise = self.quality()
        out = {"diagnose/steps": float(len(self.window.steps))}
        for label in self.rows:
            if label in (REF, self.configured):
                continue
            q = quality[label]
            efficiency = (q.efficiency.value, q.efficiency.low, q.efficiency.high)
            if all(math.isfinite(v) for v in efficiency):   # a point without its interval would be read as a ranking
                out.update(zip((f"diagnose/{label}/efficiency", f"diagnose/{label}/efficiency_low",
                                f"diagnose/{label}/efficiency_high"), efficiency))
            cosine = q.cosine.clamped(-1.0, 1.0)   # the bias-corrected estimate may pass 1: with its interval
            if all(math.isfinite(v) for v in (cosine.value, cosine.low, cosine.high)):
                out.update(zip((f"diagnose/{label}/cosine", f"diagnose/{label}/cosine_low",
                                f"diagnose/{label}/cosine_high"), (cosine.value, cosine.low, cosine.high)))
        if math.isfinite(noise.value):
            out["diagnose/noise_scale"] = noise.value
        return out

    @property
    def labels(self) -> list[str]:
        """The estimators compared with the one trained."""
        return [label for label in self.rows if label not in (REF, self.configured)]

    def table(self, plain_step_s: float | None = None) -> list[str]:
        """The window's numbers as a Markdown section (for summary.md), with the cost per diagnosed step."""
        if not self.window.steps:
            return []
        quality, noise = self.quality()
        lines = ["## In-training diagnosis", "",
                 f"The last {len(self.window.steps)} diagnosed step(s), each group a unit; efficiency at matched "
                 f"signal against `{self.configured}` (the estimator trained) under the configured loss, 95% "
                 f"jackknife intervals over the steps; cosine to the plain gradient of `rloo` (unbiased). "
                 f"Gradient space: {self.space.describe()}.", "",
                 "| estimator | efficiency vs trained | cosine |", "|---|---|---|"]
        for label in self.rows:
            if label != REF:
                q = quality[label]
                lines.append(f"| `{label}` | {q.efficiency} | {q.cosine.clamped(-1.0, 1.0)} |")
        lines += ["", f"B_simple of `{self.configured}`: {noise} groups."]
        shared = [label for label in batch_level_labels(self.rows) if label != REF]
        if shared:
            lines += [f"{', '.join(f'`{x}`' for x in shared)} read statistics of the whole step, which its groups "
                      f"share; each group still counts as an independent unit here, so the covariance this adds "
                      f"between a step's groups is left out of their variance."]
        cost = sum(self.seconds) / len(self.seconds)
        ratio = f", {cost / plain_step_s:.2f}× a plain step ({plain_step_s:.1f} s)" if plain_step_s else ""
        return lines + [f"Cost: {cost:.1f} s per diagnosed step{ratio}.", ""]

