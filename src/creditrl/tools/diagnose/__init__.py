"""`creditrl diagnose`: measure, on a user's own model and task, which advantage estimator gives the
best gradient at matched signal and whether a larger group pays.

- ``plan``: the estimators, the sampling plan and the gradient space for the memory allowed;
- ``measure``: P prompts × M groups of N, each group's exact gradient under every estimator;
- ``recommend``: efficiencies, scale, cosine, raw variance, noise scale; the recommendation;
- ``report``: diagnose.md / .json / .png, written atomically;
- ``cost``: the one-group probe behind the up-front cost estimate;
- ``run``: one run on a loaded policy; ``command``: from a `train` config; ``api``: for TRL users.
"""
from creditrl.tools.diagnose.api import DatasetTask, diagnose

__all__ = ["DatasetTask", "diagnose"]
