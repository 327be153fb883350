"""creditrl: critic-free advantage estimators and policy losses for RL post-training of LLMs.

Public API (lazily imported so ``import creditrl`` stays cheap):

- token statistics:  ``token_stats``, ``TokenStats``
- estimators:        ``compute_advantages``, ``list_estimators``, ``register_estimator``,
                     ``AdvantageBatch``, ``maxk_quantities``, ``pass_at_k``
- losses:            ``policy_loss``, ``compose``, ``Fields``, ``PolicyLoss``, ``agg_loss``, ``spurious_token_mask``, ``apply_trace``,
                     ``variance_proxy``, ``power_proxy``
- loss terms:        ``register_loss_term``, ``get_loss_term``, ``list_loss_terms``, ``LossState``,
                     ``ClipOptions``, ``AggregationOptions``, ``KLOptions``, ``RolloutCorrectionOptions``,
                     ``StapoOptions``, ``TraceOptions``
- measurement:       ``diagnose`` (which estimator gives the best gradient on your model and data)
- models and tasks:  ``load_policy`` (``builtin:tiny``, ``builtin:smollm2-135m`` or a model directory),
                     ``TinyModelConfig``, ``WarmStartConfig``, ``get_task``, ``list_tasks``

examples/minimal_loop.py is the whole RL loop on these names, in one file.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "token_stats": "creditrl.core.token_stats",
    "TokenStats": "creditrl.core.token_stats",
    "compute_advantages": "creditrl.core.estimators",
    "list_estimators": "creditrl.core.estimators",
    "register_estimator": "creditrl.core.estimators",
    "AdvantageBatch": "creditrl.core.estimators",
    "maxk_quantities": "creditrl.core.estimators.maxk",
    "pass_at_k": "creditrl.core.estimators.maxk",
    "policy_loss": "creditrl.core.losses",
    "PolicyLoss": "creditrl.core.losses",
    "compose": "creditrl.core.losses",
    "Fields": "creditrl.core.losses",
    "register_loss_term": "creditrl.core.losses",
    "get_loss_term": "creditrl.core.losses",
    "list_loss_terms": "creditrl.core.losses",
    "LossState": "creditrl.core.losses",
    "ClipOptions": "creditrl.core.losses",
    "AggregationOptions": "creditrl.core.losses",
    "KLOptions": "creditrl.core.losses",
    "RolloutCorrectionOptions": "creditrl.core.losses",
    "agg_loss": "creditrl.core.losses",
    "spurious_token_mask": "creditrl.core.losses",
    "apply_trace": "creditrl.core.losses",
    "variance_proxy": "creditrl.core.losses",
    "power_proxy": "creditrl.core.losses",
    "StapoOptions": "creditrl.core.losses",
    "TraceOptions": "creditrl.core.losses",
    "diagnose": "creditrl.tools.diagnose",
    "load_policy": "creditrl.runtime.models",
    "TinyModelConfig": "creditrl.config",
    "WarmStartConfig": "creditrl.config",
    "get_task": "creditrl.tasks",
    "list_tasks": "creditrl.tasks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'creditrl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
