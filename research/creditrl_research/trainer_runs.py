"""Trainer studies shared by the learning-curve experiments: one warm-started checkpoint per
seed, runs × seeds through ``creditrl compare``, and the per-seed readings the verdicts pair up.

A study is a dict ``{"task": name, "overrides": [...], "warm_start": [...], "runs": {run: [...]}}``
of ``creditrl train`` overrides. Seed s warm-starts its own checkpoint (warm-start seed s) and every
run of seed s starts from it (passed as a local model dir): runs of one seed differ by RL alone and
pair up (seed s of run a against seed s of run b), while the spread over seeds includes the
checkpoint's. One checkpoint shared by all seeds made every interval conditional on that one
checkpoint: two seed sets (two checkpoints) then disagreed on verdicts whose intervals each excluded
the null. Checkpoints are cached per (task, warm start, seed), so studies with the same task and
warm start share them.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from creditrl.config import load_config
from creditrl.runtime.models import load_policy, tiny_cache_path
from creditrl.tools import compare, tables
from creditrl_research import rules
from creditrl.tasks import get_task
from creditrl.utils.threads import torch_threads

WARM_START_THREADS = 2   # a warm start is a long SFT run: both cores (1.5× faster than one here)
# The unstable regime of ``otb-stability`` (OTB §6.3), shared by ``stapo-census``: builtin:tiny warm-started
# to ~20% on 2-digit multiplication with a scratchpad, lr 3e-4, no gradient clipping.
UNSTABLE_STUDY = {"task": "multiplication", "warm_start": ["model.warm_start.target_accuracy=0.2"],
                  "overrides": ["optim.lr=3e-4", "optim.max_grad_norm=1e6"]}


def seed_checkpoint(task_name: str, warm_start: list[str], seed: int, threads: int) -> Path:
    """Warm-start ``builtin:tiny`` on ``task_name`` with ``seed`` once (cached per machine) and
    return its dir."""
    model = load_config(None, warm_start).model
    task = get_task(task_name)
    with torch_threads(threads):
        load_policy("builtin:tiny", task, model_cfg=model.tiny, warm_start=model.warm_start, seed=seed, progress=False)
    return tiny_cache_path(task, model.tiny, model.warm_start, seed)


def common_overrides(cfg) -> list[str]:
    """The trainer settings every run of an experiment shares (``cfg``: its config dataclass)."""
    return [f"train.steps={cfg.steps}", f"rollout.prompts_per_step={cfg.prompts_per_step}",
            f"train.eval_problems={cfg.eval_problems}", f"train.eval_samples={cfg.eval_samples}",
            f"train.eval_every={cfg.eval_every}", f"train.pass_k=[{','.join(str(k) for k in cfg.pass_k)}]",
            "train.save_every=0", "train.keep_last=1", f"train.threads={cfg.threads}",
            "logging.report_to=[jsonl]", "logging.plots=false", "logging.completions=2"]


def run_study(cfg, study: dict, runs: dict[str, list[str]], seeds: list[int], out: Path,
              title: str) -> dict[str, list[Path]]:
    """Train ``runs`` × ``seeds`` of ``study``, seed s from its own checkpoint (warm-start seed s), as many
    runs at once as the cores hold at ``cfg.threads`` each (the results do not depend on it); write the
    compare report."""
    plans = []
    for seed in seeds:
        checkpoint = seed_checkpoint(study["task"], warm_start_overrides(cfg, study), seed, cfg.threads)
        spec = compare.CompareSpec(runs=runs, seeds=[seed], overrides=[
            *common_overrides(cfg), f"model.name={checkpoint}", f"task.name={study['task']}", *study["overrides"]])
        plans += compare.plan_runs(spec, out, progress=False)
    plans.sort(key=lambda plan: list(runs).index(plan.name))   # dirs by run, in seed order
    dirs = compare.train_runs(plans, jobs=max(1, len(os.sched_getaffinity(0)) // cfg.threads))
    compare.write_report(dirs, out, title=title)
    return dirs


def warm_start_overrides(cfg, study: dict) -> list[str]:
    """The study's warm start, its step cap from ``cfg`` (0: the study's own) and its threads."""
    cap = [f"model.warm_start.max_steps={cfg.warm_start_max_steps}"] if cfg.warm_start_max_steps else []
    return [*study.get("warm_start", []), *cap, f"model.warm_start.num_threads={WARM_START_THREADS}"]


def read_history(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(held-out evals, training metrics) of one run, oldest first."""
    return compare.read_jsonl(Path(run_dir) / "eval.jsonl"), compare.read_jsonl(Path(run_dir) / "metrics.jsonl")


def by_seed(rows: list[tables.Row], run: str, key: str) -> dict[int, float]:
    """``key`` of ``run`` in final.csv-like rows, by seed (NaN where missing)."""
    out = {}
    for r in rows:
        if r["run"] == run:
            v = r.get(key)
            out[int(r["seed"])] = float(v) if isinstance(v, (int, float)) else math.nan
    return out


def seed_pairs(rows: list[tables.Row], a: str, b: str, key: str) -> tuple[list[float], list[float]]:
    """``key`` of runs a and b over the seeds both have, in seed order (element i pairs up)."""
    va, vb = by_seed(rows, a, key), by_seed(rows, b, key)
    seeds = sorted(set(va) & set(vb))
    return [va[s] for s in seeds], [vb[s] for s in seeds]


def paired(rows: list[tables.Row], a: str, b: str, key: str) -> rules.Estimate:
    """Mean over seeds of ``key``(a) − ``key``(b), paired by seed, with its t-interval."""
    return rules.paired_difference(*seed_pairs(rows, a, b, key))


def paired_ratio(rows: list[tables.Row], a: str, b: str, key: str, n_boot: int) -> rules.Estimate:
    """Σ_seeds ``key``(a) / Σ_seeds ``key``(b), paired by seed, with a paired bootstrap CI."""
    return rules.paired_ratio(*seed_pairs(rows, a, b, key), n_boot=n_boot)


def collapse(evals: list[dict], metrics: list[dict], drop: float = 0.15, in_a_row: int = 2,
             surge: float = 10.0, early: int = 10) -> dict:
    """The pre-registered collapse rule (OTB Fig. 1): held-out sampled accuracy at least ``drop``
    below its running maximum for ``in_a_row`` consecutive evals, or a gradient norm above
    ``surge`` × the median of the first ``early`` steps. Returns {collapsed, step, reason}."""
    best, streak = -math.inf, 0
    for e in evals:
        acc = e.get("sampled_acc", math.nan)
        best = max(best, acc)
        streak = streak + 1 if acc <= best - drop else 0
        if streak >= in_a_row:
            return {"collapsed": True, "step": e["step"], "reason": f"accuracy {acc:.2f} vs max {best:.2f}"}
    norms = [m["grad_norm"] for m in metrics if isinstance(m.get("grad_norm"), (int, float))]
    if len(norms) > early:
        base = sorted(norms[:early])[early // 2]
        for m in metrics[early:]:
            if base > 0 and m.get("grad_norm", 0.0) > surge * base:
                return {"collapsed": True, "step": m["step"], "reason": f"gradient norm {m['grad_norm']:.3g} > "
                        f"{surge:g}× early median {base:.3g}"}
    return {"collapsed": False, "step": None, "reason": ""}


def second_half_mean(metrics: list[dict], key: str = "accuracy") -> float:
    """Mean of ``key`` over the second half of the training steps (learning speed, GRPO-λ §4.2)."""
    vals = [m[key] for m in metrics[len(metrics) // 2:] if isinstance(m.get(key), (int, float))]
    return sum(vals) / len(vals) if vals else math.nan


def seed_of(run_dir: Path) -> int:
    return int(Path(run_dir).name.rsplit("-s", 1)[1])
