"""One diagnose run on a loaded policy, shared by `creditrl diagnose` (``command``) and
``creditrl.diagnose`` (``api``): Adam's v̂ (warm-up, unless given), the rounds, the verdicts
(``summarize``, also used on simulated measurements by the tests), and the outputs."""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from creditrl.runtime.gradient_space import GradientSpace
from creditrl.runtime.group_gradients import batch_level_labels
from creditrl.tools.diagnose import adam
from creditrl.tools.diagnose import recommend as rc
from creditrl.tools.diagnose import report
from creditrl.tools.diagnose.measure import (Accumulator, Measurement, ModelSource, make_sketch, measure, status,
                                             step_ids)
from creditrl.tools.diagnose.plan import Plan
from creditrl.utils.durations import format_duration
from creditrl.utils.rundir import RunLock, check_new_run, clear_run, mark_run


def summarize(meas: Measurement, plan: Plan) -> dict:
    """The verdicts of a measurement: rows, recommendation (Holm labels), power, noise scale and the
    reference's status (``status``, with the prompts the trend needs)."""
    table = rc.rows(meas, plan)
    rec = rc.recommend(table, plan, meas)
    return {"rows": table, "recommendation": rec, "power": rc.power_line(table, plan, rec),
            "noise": rc.noise(meas, plan), "reference": status(plan, meas.stats, meas.prompts),
            "informative_fraction": rc.informative_fraction(meas)}


def plan_text(plan: Plan) -> str:
    return (f"measuring {len(plan.rows) - 1} rows ({len(plan.estimators)} estimators × {len(plan.losses)} loss(es)) "
            f"in rounds of {plan.prompts} prompts × {plan.groups_per_prompt} groups of {plan.group_size}, until the "
            f"reference is resolved and `{plan.configured}`'s efficiency interval is within ±{plan.target_width:.0%}, "
            f"or {format_duration(plan.budget_s)} (diagnose.budget_min)")


def diagnose_policy(model, tokenizer, task, plan: Plan, space: GradientSpace, rollout: dict, *, setting: dict,
                    vhat: list | None = None, adam_source: str = "", run_dir: Path | None = None,
                    overwrite: bool = False, key: str = "diagnose.run_name", progress: bool = False,
                    log: Callable[[str], None] = print, started: float | None = None) -> dict:
    """The result (``report.markdown``'s input); written to ``run_dir`` when given. An existing
    ``run_dir`` is replaced (``overwrite``) only here, once the new report is complete. ``started``:
    when the budget began (default now)."""
    start = time.perf_counter() if started is None else started
    model.eval()
    log(f"gradient space: {space.describe()}")
    log(plan_text(plan))
    precondition, warmup = None, 0.0
    if plan.adam:
        if vhat is None:
            begin = time.perf_counter()
            vhat = adam.from_warmup(model, tokenizer, task, plan, space, rollout, setting["adam_warmup"])
            warmup = time.perf_counter() - begin
            adam_source = f"a warm-up of {setting['adam_warmup']} groups at this policy, E[ĝ_step²]"
        precondition = adam.factors(vhat)
    sketch = make_sketch(space, plan.seed)
    source = ModelSource(model, tokenizer, task, plan, space, rollout, sketch, precondition)
    acc = Accumulator(plan, space.dim, precondition is not None)
    meas = measure(source, plan, acc, deadline=start + plan.budget_s, progress=progress, log=log)
    meas.checker = source.checker
    timing = {"warmup_s": warmup, "total_s": time.perf_counter() - start}
    result = assemble(meas, plan, space, rollout, {**setting, "adam_source": adam_source or "none"}, timing)
    if run_dir is not None:
        publish(run_dir, result, overwrite=overwrite, key=key)
        log(f"report: {run_dir / 'diagnose.md'}")
    return result


def step_sizes(plan: Plan) -> list[int]:
    """The distinct numbers of prompts in the training steps a round is cut into (``step_ids``):
    [plan.batch] unless the round's prompts are not a multiple of it."""
    groups = torch.bincount(step_ids(plan.prompts, plan.groups_per_prompt, max(1, plan.batch)))
    return sorted({int(n) for n in groups[groups > 0]})


def assemble(meas: Measurement, plan: Plan, space: GradientSpace, rollout: dict, setting: dict, timing: dict) -> dict:
    """The whole result: ``summarize``'s verdicts, the setting, the measurement's record, the timings."""
    groups, sampled = max(len(meas.groups), 1), max(meas.sampled_groups, 1)
    return {**summarize(meas, plan),
            "setting": {**setting, "prompts": meas.prompts, "prompts_per_round": plan.prompts,
                        "groups_per_prompt": plan.groups_per_prompt, "group_size": plan.group_size,
                        "groups": len(meas.groups), "folds": min(plan.folds, meas.prompts), "seed": plan.seed,
                        "space": space.describe(), "space_kind": space.kind, "dim": space.dim,
                        "parameters": space.covered, "max_new_tokens": rollout["max_new_tokens"],
                        "temperature": rollout["temperature"], "configured": plan.configured,
                        "target_width": plan.target_width, "budget_min": plan.budget_s / 60,
                        "losses": [{"name": x.name, "text": x.text, "notes": list(x.notes)} for x in plan.losses],
                        "batch_level": batch_level_labels(plan.estimators), "step": plan.batch,
                        "step_sizes": step_sizes(plan)},
            "measurement": {"stop": meas.stop, "exhausted": meas.exhausted, "rounds": meas.rounds,
                            "sampled_groups": meas.sampled_groups, "responses": meas.responses,
                            "invalid": meas.invalid, "backward": meas.backward, "checker": meas.checker},
            "groups": meas.groups,
            "sketch_error": report.SKETCH_ERROR.format(rel=(2 / space.dim) ** 0.5, dim=space.dim)
            if space.kind == "sketch" else None,
            "timing": {**timing, "sampling_s": meas.seconds["sampling"], "gradients_s": meas.seconds["gradients"],
                       "statistics_s": meas.seconds["statistics"],
                       "sampling_s_per_group": meas.seconds["sampling"] / sampled,
                       "gradients_s_per_group": meas.seconds["gradients"] / groups},
            "stats": meas.stats.to_dict(), "adam_stats": meas.adam.to_dict() if meas.adam is not None else None}


def publish(run_dir: Path, result: dict, *, overwrite: bool, key: str) -> None:
    """Write the report beside ``run_dir``, then (holding its lock) clear an overwritten run and move
    the files in: a failure while writing leaves the old report as it was."""
    # again: a directory may have appeared while measuring
    check_new_run(run_dir, overwrite=overwrite, key=key, resume_hint=False, kind="diagnose")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=run_dir.parent, prefix=f".tmp-{run_dir.name}-") as folder:
        tmp = Path(folder)
        report.write(tmp, result)
        mark_run(tmp, "diagnose")
        with RunLock(run_dir):
            clear_run(run_dir)
            for file in tmp.iterdir():
                os.replace(file, run_dir / file.name)
