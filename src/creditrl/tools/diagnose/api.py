"""``creditrl.diagnose(model, tokenizer, dataset, reward_funcs, ...)``: `creditrl diagnose` for a TRL
user, without creditrl's config. ``dataset``: a Hugging Face ``datasets.Dataset`` (or a list of row
dicts) with a ``prompt`` column (a string or chat messages, TRL's conventions); every other column
is passed to the reward functions. ``reward_funcs``: TRL-style reward functions
``f(prompts, completions, **columns) -> list[float | None]`` (one or a list, summed as TRL does with
``reward_weights``), called through ``creditrl.tasks.rewards`` exactly as in training."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable, Sequence

from creditrl.tools.diagnose.plan import Plan, choose_space, make_plan
from creditrl.tools.diagnose.run import diagnose_policy
from creditrl.tasks.base import Problem
from creditrl.tasks.chat import check_prompt
from creditrl.tasks.rewards import RewardFunction, Scores, score_terms
from creditrl.utils.rundir import check_new_run
from creditrl.config import Config, DiagnoseConfig, RolloutConfig, AlgorithmConfig, validate


class DatasetTask:
    """A task over a dataset's rows (``sample`` draws a row) scored by TRL-style reward functions."""

    name = "dataset"
    max_tool_calls = 0
    tool_stop = None

    def __init__(self, dataset, reward_funcs: Callable | Sequence[Callable], reward_weights: Sequence[float] | None,
                 chat_template: str = "auto", system_prompt: str | None = None):
        rows = [dict(row) for row in dataset]
        if not rows or "prompt" not in rows[0]:
            got = sorted(rows[0]) if rows else "no rows"
            raise ValueError(f"dataset: expected rows with a 'prompt' column (TRL's convention), got {got}")
        self.problems = [Problem(check_prompt(r["prompt"], f"dataset row {i} prompt"), str(r.get("answer", "")),
                                 {"columns": {k: v for k, v in r.items() if k != "prompt"},
                                  "ground_truth": r.get("answer")}) for i, r in enumerate(rows)]
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        weights = [1.0] * len(funcs) if reward_weights is None else [float(w) for w in reward_weights]
        if not funcs or len(weights) != len(funcs):
            raise ValueError(f"reward_weights: expected one weight per reward function ({len(funcs)}), got {weights}")
        columns = sorted({k for p in self.problems for k in p.meta["columns"]})
        self._terms = [(RewardFunction(f, convention="trl", columns=columns, timeout=None, what="reward_funcs"), w)
                       for f, w in zip(funcs, weights)]
        self.chat_template, self.system_prompt = chat_template, system_prompt

    def sample(self, rng: random.Random) -> Problem:
        return rng.choice(self.problems)

    def test_set(self) -> list[Problem]:
        return list(self.problems)

    def score(self, problems: list[Problem], responses: list[str]) -> Scores:
        return score_terms(self._terms, problems, responses)

    def reward(self, problem: Problem, response: str) -> float:
        return self.score([problem], [response]).rewards[0]

    def tool_output(self, response_so_far: str) -> str | None:
        return None


def plan_for(group_size: int, estimators, k, prompts, groups_per_prompt, folds, seed, estimator: str,
             prompts_per_step: int) -> Plan:
    """The same plan (and checks) as the command, from keyword arguments (errors name the config keys)."""
    cfg = Config(rollout=RolloutConfig(group_size=group_size, prompts_per_step=prompts_per_step),
                 algorithm=AlgorithmConfig(estimator=estimator),
                 diagnose=DiagnoseConfig(prompts=prompts, groups_per_prompt=groups_per_prompt, folds=folds,
                                         estimators=list(estimators) if estimators is not None else None, k=k,
                                         seed=seed))
    validate(cfg)
    return make_plan(cfg)


def diagnose(model, tokenizer, dataset, reward_funcs, *, reward_weights: Sequence[float] | None = None,
             group_size: int = 8, prompts: int = 24, groups_per_prompt: int = 3, estimators: Sequence[str] | None = None,
             k: int | None = None, max_new_tokens: int = 256, temperature: float = 1.0, top_p: float = 1.0,
             params: Sequence[str] | None = None, max_memory_gb: float = 2.0, sketch_dim: int = 65536,
             folds: int | None = None, seed: int = 0, estimator: str = "grpo", prompts_per_step: int = 8,
             output_dir: str | Path | None = None, overwrite: bool = False, progress: bool = True) -> dict[str, Any]:
    """Measure which estimator gives the best gradient on this model and data (see `creditrl diagnose`;
    the arguments are its ``diagnose.*`` and ``rollout.*`` keys). Returns the result (``["recommendation"]
    ["text"]``, ``["estimators"]``, ``["noise"]``, ...); with ``output_dir`` also writes diagnose.md/json/png
    there. ``estimator``: the one you train with now (its noise scale is reported)."""
    plan = plan_for(group_size, estimators, k, prompts, groups_per_prompt, folds, seed, estimator, prompts_per_step)
    task = DatasetTask(dataset, reward_funcs, reward_weights)
    run_dir = Path(output_dir).expanduser() if output_dir is not None else None
    if run_dir is not None:
        check_new_run(run_dir, overwrite=overwrite, key="output_dir", resume_hint=False)   # deleted once done
    space = choose_space(model, params, len(plan.specs), plan.folds, plan.groups_per_prompt, max_memory_gb, sketch_dim)
    rollout = {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens, "max_tool_tokens": 16,
               "stop_strings": ()}
    setting = {"model": getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__,
               "task": f"dataset of {len(task.problems)} rows", "configured": plan.configured}
    return diagnose_policy(model, tokenizer, task, plan, space, rollout, setting=setting, run_dir=run_dir,
                           overwrite=overwrite, key="output_dir", progress=progress, shrink="prompts")
