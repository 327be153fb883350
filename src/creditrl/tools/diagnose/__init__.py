"""`creditrl diagnose`: measure, on a user's own model and task, which advantage estimator (under which
loss) gives the best gradient at matched signal, and whether a larger group pays.

- ``plan``: the rows (every registered estimator × every loss compared), the rounds and the stopping rule;
- ``measure``: rounds of distinct prompts, each round sampled in one batched generate call, each group's
  exact gradient under every row, streamed into statistics over prompts; the stopping rule;
- ``recommend``: efficiencies, scale, cosine, raw variance, noise scale; Holm-calibrated labels, the
  power line and the recommendation;
- ``adam`` / ``optimizer_state``: Adam's v̂ for the Adam column (a warm-up, or a run's checkpoint);
- ``report``: diagnose.md / .json / .png, written atomically, no "nan" anywhere;
- ``run``: one run on a loaded policy; ``command``: from a `train` config; ``api``: for TRL users.
"""
from creditrl.tools.diagnose.api import DatasetTask, diagnose

__all__ = ["DatasetTask", "diagnose"]
