"""One diagnose run on a loaded policy, shared by `creditrl diagnose` (``command``) and
``creditrl.diagnose`` (``api``): probe the cost, sample and measure, refuse a run without signal,
rank, and write the outputs."""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Callable

from creditrl.tools.diagnose import recommend as rc
from creditrl.tools.diagnose import report
from creditrl.tools.diagnose.cost import estimate_text, probe_seconds
from creditrl.tools.diagnose.measure import make_sketch, measure
from creditrl.tools.diagnose.plan import GradientSpace, Plan
from creditrl.utils.rundir import RunLock, check_new_run, clear_run

SKETCH_NOTE = report.SKETCH_ERROR


def diagnose_policy(model, tokenizer, task, plan: Plan, space: GradientSpace, rollout: dict, *, setting: dict,
                    run_dir: Path | None = None, overwrite: bool = False, key: str = "diagnose.run_name",
                    progress: bool = False, shrink: str = "diagnose.prompts", log: Callable[[str], None] = print) -> dict:
    """The result (``report.markdown``'s input); written to ``run_dir`` when given. An existing
    ``run_dir`` is replaced (``overwrite``) only here, once the new report is complete."""
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
        publish(run_dir, result, overwrite=overwrite, key=key)
        log(f"report: {run_dir / 'diagnose.md'}")
    return result


def publish(run_dir: Path, result: dict, *, overwrite: bool, key: str) -> None:
    """Write the report beside ``run_dir``, then (holding its lock) clear an overwritten run and move
    the files in: a failure while writing leaves the old report as it was."""
    check_new_run(run_dir, overwrite=overwrite, key=key, resume_hint=False)   # again: it may have appeared
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=run_dir.parent, prefix=f".tmp-{run_dir.name}-") as folder:
        tmp = Path(folder)
        report.write(tmp, result)
        with RunLock(run_dir):
            clear_run(run_dir)
            for file in tmp.iterdir():
                os.replace(file, run_dir / file.name)
