"""creditrl: critic-free advantage estimators and policy losses for RL post-training of LLMs.

Public API (lazily imported so ``import creditrl`` stays cheap):

- token statistics:  ``token_stats``, ``TokenStats``
- estimators:        ``compute_advantages``, ``list_estimators``, ``register_estimator``,
                     ``AdvantageBatch``, ``maxk_quantities``, ``pass_at_k``
- losses:            ``policy_loss``, ``agg_loss``, ``spurious_token_mask``, ``apply_trace``,
                     ``variance_proxy``, ``power_proxy``, ``StapoOptions``, ``TraceOptions``
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "token_stats": "creditrl.token_statistics",
    "TokenStats": "creditrl.token_statistics",
    "compute_advantages": "creditrl.estimators",
    "list_estimators": "creditrl.estimators",
    "register_estimator": "creditrl.estimators",
    "AdvantageBatch": "creditrl.estimators",
    "maxk_quantities": "creditrl.estimators.maxk",
    "pass_at_k": "creditrl.estimators.maxk",
    "policy_loss": "creditrl.losses",
    "agg_loss": "creditrl.losses",
    "spurious_token_mask": "creditrl.losses",
    "apply_trace": "creditrl.losses",
    "variance_proxy": "creditrl.losses",
    "power_proxy": "creditrl.losses",
    "StapoOptions": "creditrl.losses",
    "TraceOptions": "creditrl.losses",
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
