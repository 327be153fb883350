"""One diagnose run on a loaded policy, shared by `creditrl diagnose` (``command``) and
``creditrl.diagnose`` (``api``): probe the cost, sample and measure, refuse a run without signal,
rank, and write the outputs."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from creditrl.studies.diagnose import recommend as rc
from creditrl.studies.diagnose import report
from creditrl.studies.diagnose.cost import estimate_text, probe_seconds
from creditrl.studies.diagnose.measure import make_sketch, measure
from creditrl.studies.diagnose.plan import GradientSpace, Plan
from creditrl.trainer.rundir import RunLock

SKETCH_NOTE = report.SKETCH_ERROR


def diagnose_policy(model, tokenizer, task, plan: Plan, space: GradientSpace, rollout: dict, *, setting: dict,
                    run_dir: Path | None = None, progress: bool = False, shrink: str = "diagnose.prompts",
                    log: Callable[[str], None] = print) -> dict:
    """The result (``report.markdown``'s input); written to ``run_dir`` when given."""
    start = time.perf_counter()
    model.eval()
    log(f"gradient space: {space.describe()}")
    sketch = make_sketch(space, plan.seed)
    per_group = probe_seconds(model, tokenizer, task, plan, space, rollout, sketch)
    log(estimate_text(plan, per_group, shrink))
    meas = measure(model, tokenizer, task, plan, space, rollout, sketch=sketch, progress=progress)
    rc.check_informative(meas)
    table = rc.rows(meas, plan)
    result = {"setting": {**setting, "prompts": plan.prompts, "groups_per_prompt": plan.groups_per_prompt,
                          "group_size": plan.group_size, "groups": plan.groups, "folds": plan.folds, "seed": plan.seed,
                          "space": space.describe(), "space_kind": space.kind, "dim": space.dim,
                          "parameters": space.covered, "max_new_tokens": rollout["max_new_tokens"],
                          "temperature": rollout["temperature"]},
              "estimators": table, "recommendation": rc.recommend(meas, table), "noise": rc.noise(meas, plan),
              "informative_fraction": rc.informative_fraction(meas), "groups": meas.groups,
              "sketch_error": SKETCH_NOTE.format(rel=(2 / space.dim) ** 0.5, dim=space.dim)
              if space.kind == "sketch" else None,
              "timing": {"probe_s_per_group": per_group, "sampling_s": meas.seconds["sampling"],
                         "gradients_s": meas.seconds["gradients"],
                         "statistics_s": meas.seconds["statistics"], "total_s": time.perf_counter() - start},
              "stats": meas.stats.to_dict()}
    if run_dir is not None:
        with RunLock(run_dir):
            report.write(run_dir, result)
        log(f"report: {run_dir / 'diagnose.md'}")
    return result
