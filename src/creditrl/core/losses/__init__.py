"""Policy losses: aggregation, clipped loss with rollout correction, STAPO, GRPO-λ traces."""
from creditrl.core.losses.aggregation import AGG_MODES, agg_loss
from creditrl.core.losses.diagnostics import KL_ESTIMATORS, kl_estimate, power_proxy, ppl_gap, variance_proxy
from creditrl.core.losses.policy import METRIC_KEYS, ROLLOUT_CORRECTIONS, policy_loss
from creditrl.core.losses.stapo import STAPO_POOLS, StapoOptions, spurious_token_mask
from creditrl.core.losses.traces import TRACE_STYLES, TRACE_UPDATES, TraceOptions, apply_trace

__all__ = ["AGG_MODES", "KL_ESTIMATORS", "METRIC_KEYS", "ROLLOUT_CORRECTIONS", "STAPO_POOLS",
           "TRACE_STYLES", "TRACE_UPDATES", "StapoOptions", "TraceOptions", "agg_loss",
           "apply_trace", "kl_estimate", "policy_loss", "power_proxy", "ppl_gap", "spurious_token_mask",
           "variance_proxy"]
