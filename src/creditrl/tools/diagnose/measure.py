"""Sampling and measuring for `creditrl diagnose`, in rounds.

A round draws P distinct prompts (``distinct_prompts``: a prompt is never measured twice, so the
prompts are independent units; a task with fewer distinct prompts ends the run with what it has,
and the report says so), samples all of their M groups of N in one batched ``generate`` call (each
prompt prefilled once, its cache shared by its M·N rows), then takes each group's exact gradient
under every row (``creditrl.runtime.group_gradients``: one forward per group, one backward per
distinct non-zero cotangent) and streams them into ``GradientMoments`` whose units are the
prompts, with the Adam-preconditioned copies in a second one. After each round the stopping rule
(``status``) is checked: the reference's mean gradient resolved (cross-fitted ‖μ̂‖² >= 3 standard
errors) and the configured estimator's efficiency interval within ±target_width; the wall-time
budget is checked before each round and each prompt, against what they have cost so far (``Pace``).

``measure`` takes a ``Source`` (the model, or in tests an enumerable policy): ``prompts(n)``,
``sample(problems)`` and ``draws(round, i)``.
"""
from __future__ import annotations

import json
import math
import random
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

import torch
from torch import Tensor
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from creditrl.core.estimators import compute_advantages
from creditrl.core.gradients import CountSketch, GradientMoments, GradientStats, Interval, gradient_quality
from creditrl.core.gradients import signal_interval
from creditrl.runtime.gradient_space import GradientSpace, LARGE_MODEL_PARAMS
from creditrl.runtime.group_gradients import (GroupDraws, batch_advantages, batch_level_labels, group_gradients,
                                             reward_parts)
from creditrl.runtime.rollout import RolloutBatch, generate_rollouts
from creditrl.tools.diagnose.plan import ADAM, GRPO, REF, Plan
from creditrl.utils.durations import format_duration
from creditrl.utils.stats import t_quantile

RESOLVED_SE = 3.0          # the reference's ‖μ̂‖² must be at least this many standard errors above 0


class Source(Protocol):
    def prompts(self, count: int) -> list: ...

    def sample(self, problems: list) -> Any: ...

    def draws(self, sampled: Any, index: int) -> GroupDraws: ...


@dataclass
class Measurement:
    """``stats`` (plain) and ``adam`` (preconditioned) over prompts; ``groups`` one row per group;
    ``nonzero`` row -> groups with a non-zero gradient; ``seconds``: sampling, gradients, statistics,
    per row advantages; ``sampled_groups`` the groups sampled (a round's last prompts may go
    unmeasured); ``rounds`` one record per round; ``stop`` why the rounds ended;
    ``exhausted`` the task's distinct prompts ran out; ``checker`` what the reward checker reported."""
    stats: GradientStats | None = None
    adam: GradientStats | None = None
    prompts: int = 0
    groups: list[dict] = field(default_factory=list)
    nonzero: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    responses: int = 0
    invalid: int = 0
    backward: int = 0
    sampled_groups: int = 0
    rounds: list[dict] = field(default_factory=list)
    stop: str = ""
    exhausted: bool = False
    checker: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- the model source


def prompt_key(problem) -> str:
    return json.dumps(problem.prompt, sort_keys=True, default=str)


class PromptDraws:
    """Distinct prompts of a task: ``take(n)`` draws until ``n`` prompts never seen before, giving
    up once ``patience`` draws in a row repeat (the task has no more: its data set, or a small
    procedural space such as 1-digit addition's 100 problems)."""

    def __init__(self, task, seed: Any, patience: int = 2000):
        self.task, self.rng, self.patience = task, random.Random(f"diagnose-{seed}"), patience
        self.seen: set[str] = set()
        self.exhausted = False

    def take(self, count: int) -> list:
        out, misses = [], 0
        while len(out) < count and misses < self.patience:
            problem = self.task.sample(self.rng)
            key = prompt_key(problem)
            if key in self.seen:
                misses += 1
                continue
            self.seen.add(key)
            out.append(problem)
            misses = 0
        self.exhausted = len(out) < count
        return out


def rows_of(batch: RolloutBatch, rows: slice, prompt: int) -> RolloutBatch:
    """The rows of one prompt, without the left padding they all share."""
    attn = batch.attention_mask[rows]
    first = int(torch.nonzero(attn.any(0)).min()) if bool(attn.any()) else 0
    first = min(first, batch.prompt_len - 1)
    cut = {k: getattr(batch, k)[rows, first:] for k in ("input_ids", "attention_mask", "position_ids",
                                                         "response_mask", "rollout_logp")}
    rest = {k: getattr(batch, k)[rows] for k in ("rewards", "group", "correct", "stopped") if getattr(batch, k) is not None}
    optional = {k: None if getattr(batch, k) is None else getattr(batch, k)[rows]
                for k in ("reward_invalid", "reward_timeouts", "components")}
    return replace(batch, **cut, **rest, **optional, response_texts=batch.response_texts[rows],
                   problems=batch.problems[rows], prompt_len=batch.prompt_len - first,
                   prompt_texts=batch.prompt_texts[prompt:prompt + 1], reward_extras=None)


def step_ids(prompts: int, groups_per_prompt: int, step: int) -> Tensor:
    """[P·M] the training step of each group of a round (prompt-major: prompt p's groups are p·M ..
    p·M + M − 1): the m-th groups of ``step`` consecutive prompts form a step, as a training batch holds
    ``step`` distinct prompts with one group each."""
    prompt = torch.arange(prompts).repeat_interleave(groups_per_prompt)
    slot = torch.arange(groups_per_prompt).repeat(prompts)
    return slot * math.ceil(prompts / step) + prompt // step


def step_advantages(batch: RolloutBatch, plan: Plan) -> dict[str, Tensor]:
    """label -> [B, R] advantages of the batch-level rows (``batch_level_labels``) over the training
    steps of a round (``step_ids``: ``plan.batch`` prompts, one group each), so that a shrinkage
    baseline or a batch whitening sees the other prompts of a step as in training. The groups of a
    step then share its statistics: the per-group variance diagnose reports leaves out the covariance
    this adds between them (the report's notes say so for these rows)."""
    labels = batch_level_labels(plan.rows)
    if not labels:
        return {}
    n = plan.group_size
    prompts = batch.rewards.shape[0] // (n * plan.groups_per_prompt)
    row_step = step_ids(prompts, plan.groups_per_prompt, max(1, plan.batch)).repeat_interleave(n)
    out = {label: torch.zeros(batch.rewards.shape[0], batch.response_mask.shape[1] - batch.prompt_len)
           for label in labels}
    for s in torch.unique(row_step).tolist():      # a few steps per round
        idx = torch.nonzero(row_step == s).flatten()
        sub = replace(batch, rewards=batch.rewards[idx], group=batch.group[idx], response_mask=batch.response_mask[idx],
                      components=None if batch.components is None else batch.components[idx])
        for label, adv in batch_advantages(sub, {k: plan.rows[k] for k in labels}).items():
            out[label][idx] = adv.to(out[label].device)
    return out


class ModelSource:
    """Rounds sampled from the policy (module docstring); ``checker`` collects the reward checker's
    warnings (an error it raised, a value that is not a number), shown again once."""

    def __init__(self, model, tokenizer, task, plan: Plan, space: GradientSpace, rollout: dict,
                 sketch: CountSketch | None = None, precondition: list | None = None):
        self.model, self.tokenizer, self.task, self.plan, self.space = model, tokenizer, task, plan, space
        self.rollout, self.sketch, self.precondition = rollout, sketch, precondition
        self.draw = PromptDraws(task, plan.seed)
        self.generator = torch.Generator().manual_seed(plan.seed)
        self.checker: list[str] = []
        self.shared = sum(p.numel() for p in model.parameters()) >= LARGE_MODEL_PARAMS
        self._wide: tuple[RolloutBatch, dict] | None = None

    def prompts(self, count: int) -> list:
        return self.draw.take(count)

    def sample(self, problems: list) -> RolloutBatch:
        """All M groups of every problem in one generate call: the problem once, M·N responses."""
        m, n = self.plan.groups_per_prompt, self.plan.group_size
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batch = generate_rollouts(self.model, self.tokenizer, self.task, problems, group_size=m * n,
                                      generator=self.generator, **self.rollout)
        for w in caught:
            text = str(w.message)
            if text.startswith("checker") and text not in self.checker:
                self.checker.append(text)
                warnings.warn(text, stacklevel=2)
        return replace(batch, group=torch.arange(len(problems) * m).repeat_interleave(n))

    def advantage_seconds(self, batch: RolloutBatch) -> dict[str, float]:
        """Wall time of each estimator's advantages on this round's responses (energies given: they
        come from the gradient's own forward), its own extra cost."""
        mask = batch.response_mask[:, batch.prompt_len:] > 0
        out = {}
        for label, (name, options) in self.plan.estimators.items():
            start = time.perf_counter()
            compute_advantages(name, rewards=batch.rewards, mask=mask, group=batch.group, energy=mask.float(),
                               **reward_parts(batch, name, slice(None)), **options)
            out[label] = time.perf_counter() - start
        return out

    def draws(self, batch: RolloutBatch, index: int) -> GroupDraws:
        size = self.plan.groups_per_prompt * self.plan.group_size
        rows = slice(index * size, (index + 1) * size)
        if self._wide is None or self._wide[0] is not batch:      # once per round
            self._wide = (batch, step_advantages(batch, self.plan))
        sub = rows_of(batch, rows, index)
        return group_gradients(self.model, sub, self.plan.rows, temperature=self.rollout["temperature"],
                               params=list(self.space.params), sketch=self.sketch,
                               shared_prompts=self.shared,
                               losses=self.plan.row_losses, precondition=self.precondition, dedupe=True,
                               skip_zero=True, batch_wide={k: v[rows] for k, v in self._wide[1].items()})


def make_sketch(space: GradientSpace, seed: int) -> CountSketch | None:
    """The count sketch of a ``sketch`` space (None for flat spaces)."""
    return CountSketch([p.shape for p in space.params], space.dim, seed=seed) if space.kind == "sketch" else None


# ----------------------------------------------------------------------------- accumulating


class Accumulator:
    """The statistics of the rows (and their Adam copies) over prompts, and the per-group record."""

    def __init__(self, plan: Plan, dim: int, adam: bool):
        self.plan, self.names = plan, tuple(plan.rows)
        self.plain = GradientMoments(self.names, dim, folds=plan.folds)
        self.adam = GradientMoments(tuple(n + ADAM for n in self.names), dim, folds=plan.folds) if adam else None
        self.out = Measurement(nonzero=dict.fromkeys(self.names, 0),
                               seconds={"sampling": 0.0, "gradients": 0.0, "statistics": 0.0})

    def add(self, draws: GroupDraws) -> None:
        """One prompt's M groups; the prompt is the unit."""
        start = time.perf_counter()
        unit = [self.out.prompts] * draws.grads.shape[0]
        self.plain.add_many(draws.grads.cpu(), unit)
        if self.adam is not None:
            self.adam.add_many(draws.preconditioned.cpu(), unit)
        self.out.seconds["statistics"] += time.perf_counter() - start
        self.record(draws)
        self.out.prompts += 1

    def record(self, draws: GroupDraws) -> None:
        """Per group: reward mean and spread, mean length; per row: non-zero gradients."""
        out, n = self.out, self.plan.group_size
        rewards = draws.rewards.double().view(-1, n)
        lengths = draws.lengths.double().view(-1, n)
        for label, count in zip(draws.labels, (draws.grads.abs().amax(-1) > 0).sum(0).tolist()):
            out.nonzero[label] += int(count)
        out.backward += draws.backward
        spread = (rewards.amax(1) - rewards.amin(1)).tolist()
        for g, (mean, width, length) in enumerate(zip(rewards.mean(1).tolist(), spread, lengths.mean(1).tolist())):
            out.groups.append({"prompt": out.prompts, "group": g, "reward_mean": mean, "informative": width > 0,
                               "response_len": length})

    def stats(self, names=None) -> GradientStats:
        return self.plain.stats(names)

    def finish(self) -> Measurement:
        start = time.perf_counter()
        self.out.stats = self.plain.stats()
        self.out.adam = self.adam.stats() if self.adam is not None else None
        self.out.seconds["statistics"] += time.perf_counter() - start
        return self.out


# ----------------------------------------------------------------------------- the stopping rule


STRUCTURAL = ("rloo", "dr_grpo")   # exact multiples of the reference whatever the data


def width_rows(plan: Plan) -> list[str]:
    """The rows the stopping rule may read, in order: the configured one, then grpo and a spare, for when
    the ones before are exact multiples of the reference (rloo itself, dr_grpo; grpo too where every
    informative group has the same reward spread, e.g. 0/1 rewards at N = 2). The spare is reinforce (no
    baseline: no multiple of rloo's gradient) where measured, else the first other ranked row that is not
    a multiple by construction."""
    others = [r for r in plan.rows if r not in (REF, plan.configured, GRPO) and plan.ranked(r)
              and plan.row_parts[r][0] not in STRUCTURAL]
    spare = ["reinforce"] if "reinforce" in others else others[:1]
    return list(dict.fromkeys([plan.configured] + ([GRPO] if GRPO in plan.rows else []) + spare))


def width_row(plan: Plan, stats: GradientStats) -> tuple[str, Interval]:
    """The row whose efficiency interval the stopping rule reads: the first of ``width_rows`` whose
    efficiency against the reference is not exact (``Interval.exact``: 1 by construction, an interval that
    says nothing about how well the rows are resolved); the configured one when all are."""
    quality = gradient_quality(stats, REF)
    for label in width_rows(plan):
        if label in quality and not quality[label].efficiency.exact:
            return label, quality[label].efficiency
    return plan.configured, quality[plan.configured].efficiency


def needed_prompts(measured: int, signal: Interval, width: Interval, target: float) -> float:
    """The prompts the trend says both conditions need (standard errors shrink as 1/√P): inf when
    the signal's estimate is not positive (the trend has no level to extrapolate: any bound, e.g.
    the upper 95% one, would be a guess, and an optimistic one)."""
    if not math.isfinite(signal.se) or signal.folds < 2 or not signal.value > 0:
        return math.inf
    need = measured * (RESOLVED_SE * signal.se / signal.value) ** 2
    if width.defined and width.se > 0:
        need = max(need, measured * (t_quantile(width.folds - 1) * width.se / math.log1p(target)) ** 2)
    elif not width.defined:
        need = max(need, measured + 1)
    return need


def status_names(plan: Plan) -> list[str]:
    """The rows the stopping rule reads (their statistics alone are computed between rounds)."""
    return list(dict.fromkeys([REF, *width_rows(plan)]))


def status(plan: Plan, stats: GradientStats, prompts: int) -> dict:
    """Where the measurement stands: the reference's signal (value, se, z), the width row and its
    half-width (×(1 ± w)), whether both conditions hold, and the prompts the trend needs."""
    signal = signal_interval(stats, REF)
    label, width = width_row(plan, stats)
    half = math.expm1(t_quantile(width.folds - 1) * width.se) if width.defined else math.inf
    z = signal.value / signal.se if signal.se > 0 else (math.inf if signal.value > 0 else -math.inf)
    resolved = bool(signal.se >= 0 and signal.value >= RESOLVED_SE * signal.se and signal.value > 0)
    return {"prompts": prompts, "signal": signal, "z": z, "resolved": resolved, "width_row": label,
            "width": half, "narrow": resolved and half <= plan.target_width,
            "needed": needed_prompts(prompts, signal, width, plan.target_width)}


# ----------------------------------------------------------------------------- the rounds


def progress_bar(enabled: bool) -> Progress:
    return Progress(TextColumn("[bold]diagnose[/bold] {task.description}"), BarColumn(),
                    TextColumn("{task.completed:.0f}/{task.total:.0f} prompts"), TimeElapsedColumn(),
                    TextColumn("ETA {task.fields[eta]}"), disable=not enabled, transient=False)


WIDEST_SHOWN = 10.0   # an interval wider than ±1000% says only that the efficiency is not resolved


def width_text(state: dict) -> str:
    width = state["width"]
    if not math.isfinite(width):
        return "undefined"
    return f"±{width:.0%}" if width <= WIDEST_SHOWN else f"> ±{WIDEST_SHOWN:.0%}"


def z_text(state: dict) -> str:
    return f"{state['z']:.1f} SE" if math.isfinite(state["z"]) else "undefined SE"


def eta_text(state: dict, per_prompt: float, left: float) -> str:
    more = state["needed"] - state["prompts"]
    if not math.isfinite(more):
        return "unknown (signal not resolved)"
    seconds = max(0.0, more) * per_prompt
    return format_duration(seconds) + (" (beyond the budget)" if seconds > left else "")


@dataclass
class Pace:
    """What a round's sampling and bookkeeping, a prompt and the status between rounds have cost on
    the run's clock, so the rounds stop before work that would end past the budget rather than after
    it. Each check reserves the latest status computation (``closing``, the one after the round) and
    the closing statistics forecast from it: ``final`` × as much (``final_cost``)."""
    out: Measurement
    final: float = 1.0
    prompts: int = 0
    measuring: float = 0.0
    status_time: float = 0.0   # the status computations between rounds, in all
    closing: float = 0.0       # the latest one

    def prompt(self) -> float:
        return self.measuring / self.prompts if self.prompts else 0.0

    def next_round(self) -> float:
        """A new round's sampling and bookkeeping (the rounds' time besides their prompts and status)
        and its first prompt."""
        rounds = self.out.rounds
        between = sum(r["seconds"] for r in rounds) - self.measuring - self.status_time
        return (between / len(rounds) if rounds else 0.0) + self.prompt()

    def allows(self, cost: float, now: float, deadline: float) -> bool:
        """Whether work expected to cost ``cost`` ends by the deadline with the closing statistics;
        the first two prompts always run (no statistic exists before them)."""
        return self.prompts < 2 or now + cost + self.closing * (1 + self.final) <= deadline


def final_cost(rows: int, status_rows: int, adam: bool) -> float:
    """The closing statistics' cost over a status computation's: both are dominated by the folds'
    cross Gram of K·E sums of D floats, (K·E)²·D multiply-adds, over the status rows (E') between rounds
    and over every row at the end, again for the Adam copies: (1 + adam)·(E/E')²."""
    return (1 + adam) * (rows / status_rows) ** 2


def measure(source: Source, plan: Plan, acc: Accumulator, *, clock: Callable[[], float] = time.perf_counter,
            deadline: float = math.inf, progress: bool = False, log: Callable[[str], None] | None = None
            ) -> Measurement:
    """Rounds until the stopping rule holds, the budget (``deadline`` on ``clock``) runs out or the
    task's distinct prompts do (module docstring)."""
    out = acc.out
    pace = Pace(out, final_cost(len(plan.rows), len(status_names(plan)), acc.adam is not None))
    with progress_bar(progress) as bar:
        job = bar.add_task("first round", total=plan.prompts, eta="…")
        while True:
            if not pace.allows(pace.next_round(), clock(), deadline):
                out.stop = "budget"
                break
            problems = source.prompts(plan.prompts)
            out.exhausted = len(problems) < plan.prompts
            if not problems:
                out.stop = "exhausted"
                break
            start = clock()
            sampled = source.sample(problems)
            out.seconds["sampling"] += clock() - start
            out.sampled_groups += len(problems) * plan.groups_per_prompt
            measured = out.prompts
            over = run_round(source, sampled, len(problems), acc, clock, deadline, bar, job, pace)
            note_round(source, sampled, out, out.prompts - measured, len(problems))
            if len(out.rounds) == 0:
                check_signal(out, getattr(source, "checker", []))
            before = clock()
            state = status(plan, acc.stats(status_names(plan)), out.prompts) if out.prompts >= 2 else None
            pace.closing = clock() - before
            pace.status_time += pace.closing
            out.rounds.append({**(state or {}), "seconds": clock() - start})
            stop = "budget" if over else "resolved" if state and state["narrow"] else \
                "exhausted" if out.exhausted else ""
            if state is not None:
                spent = sum(r["seconds"] for r in out.rounds) / max(out.prompts, 1)
                eta = "none (the task's distinct prompts ran out)" if out.exhausted else \
                    eta_text(state, spent, deadline - clock())
                bar.update(job, total=max(out.prompts, min(state["needed"], 10 * out.prompts)),
                           description=f"width {width_text(state)} (target ±{plan.target_width:.0%}), reference "
                                       f"{z_text(state)} (target {RESOLVED_SE:.0f})", eta=eta)
                if log is not None and not progress:
                    log(f"round {len(out.rounds)}: {out.prompts} prompts; reference ‖μ̂‖² at {z_text(state)} (target "
                        f"{RESOLVED_SE:.0f}); {state['width_row']} interval {width_text(state)} (target "
                        f"±{plan.target_width:.0%}); ETA {eta}")
            if stop:
                out.stop = stop
                break
    return acc.finish()


def note_round(source: Source, sampled, out: Measurement, measured: int, count: int) -> None:
    """Invalid rewards of the round's ``measured`` prompts of ``count`` (rows are prompt-major: the
    report counts what was measured) and each estimator's advantage time of the sampled round (when
    the source has them)."""
    invalid = getattr(sampled, "reward_invalid", None)
    if invalid is not None:
        invalid = invalid[:invalid.numel() // count * measured]
        out.responses += int(invalid.numel())
        out.invalid += int(invalid.sum())
    timed = getattr(source, "advantage_seconds", None)
    for label, seconds in (timed(sampled) if timed is not None else {}).items():
        out.seconds[f"advantages/{label}"] = out.seconds.get(f"advantages/{label}", 0.0) + seconds


def check_signal(out: Measurement, checker: list[str]) -> None:
    """After the first round: refuse to go on when no group's rewards varied, saying whether every
    reward was invalid (and what the checker reported) or merely equal."""
    if any(g["informative"] for g in out.groups):
        return
    groups = len(out.groups)
    if out.responses and out.invalid == out.responses:
        why = f"; the checker reported: {checker[0]}" if checker else (
            " (the reward function returned None, NaN or inf for every completion)")
        raise ValueError(f"reward: every reward was invalid ({out.invalid} of {out.responses} completions in the first "
                         f"{groups} groups: counted as 0, so no group has a reward spread){why}. Check the reward "
                         f"function (task.options.checker, or reward_funcs) on a few completions: it must return "
                         f"a number for each")
    raise ValueError(f"task: every group is uninformative ({groups} groups, all with identical rewards within the "
                     f"group; {out.invalid} of {out.responses} rewards invalid): no estimator can be ranked; raise the "
                     f"temperature (rollout.temperature) or pick prompts of a difficulty where the model is "
                     f"sometimes right")


def run_round(source: Source, sampled, count: int, acc: Accumulator, clock, deadline: float, bar, job,
              pace: Pace) -> bool:
    """Measure a round's prompts one by one; True when the budget ran out or the next prompt would
    end past it (the round's remaining prompts are dropped)."""
    for i in range(count):
        if not pace.allows(pace.prompt(), clock(), deadline):
            return True
        start = clock()
        draws = source.draws(sampled, i)
        acc.out.seconds["gradients"] += clock() - start
        acc.add(draws)
        pace.prompts, pace.measuring = pace.prompts + 1, pace.measuring + clock() - start
        bar.advance(job, 1)
        if clock() > deadline and pace.prompts >= 2:   # the first two always run (``Pace.allows``)
            return True
    return False
