"""``creditrl experiment``: each paper's central claim reproduced in miniature.

Each experiment module registers one ``Experiment`` (``registry``: presets, run, verdicts, report);
``runner`` runs them and assembles docs/results.md. Experiments share code only through lower modules
(``creditrl_research.rules``, ``fixed_policy``, ``trainer_runs``, ``synthetic_policy``, and the
package's ``creditrl.tools``, ``creditrl.core.gradients``, ``creditrl.runtime``), never through each other.
"""
from creditrl_research.experiments.registry import Experiment, experiment_names, get_experiment, register_experiment
# registered in the order the report lists them
from creditrl_research.experiments import maxk_bandit, grad_variance, horizon, proxy_fidelity  # noqa: F401,E402
from creditrl_research.experiments import otb_stability, stapo_census, learning_curves  # noqa: F401,E402
from creditrl_research.experiments import time_to_accuracy, real_model, off_policy  # noqa: F401,E402
from creditrl_research.experiments.runner import (DEFAULT_RUNS, collect_verdicts, experiment_config, main,  # noqa: E402
                                                 run_experiment, write_report, default_checks)

__all__ = ["Experiment", "experiment_names", "get_experiment", "register_experiment", "DEFAULT_RUNS",
           "collect_verdicts", "default_checks", "experiment_config", "main", "run_experiment", "write_report"]
