"""Import this module to install creditrl's verl trainer hooks in the importing process.

For runs that use creditrl's estimators with verl's own policy losses (no
``CreditPolicyLossConfig``), name it in ``actor_rollout_ref.model.external_lib``: verl imports it
when it builds the model config, after its trainer and loss modules are loaded. See
``creditrl.integrations.verl.install_trainer_hooks``, the one place verl functions are rebound.
"""
from creditrl.integrations.verl import install_trainer_hooks

install_trainer_hooks()
