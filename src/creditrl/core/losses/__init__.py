"""Policy losses: one autograd composition of registered terms (clip, rollout correction, KL,
STAPO, GRPO-λ traces, aggregation; the surrogates CISPO, SAPO, GMPO, DPPO, Clip-/KL-Cov, GSPO's
sequence ratio, the entropy terms, truncation masking, ΔL normalisation), plus the loss-side
diagnostics."""
from creditrl.core.losses.terms import (STAGES, LossState, LossTerm, builtin_loss_terms, get_loss_term, list_loss_terms,
                                        register_loss_term, resolve_loss_terms)
from creditrl.core.losses.aggregation import AGG_MODES, AggregationOptions, agg_loss
from creditrl.core.losses.clip import ClipOptions
from creditrl.core.losses.diagnostics import KL_ESTIMATORS, kl_estimate, power_proxy, ppl_gap, variance_proxy
from creditrl.core.losses.kl import KL_PENALTIES, KLOptions
from creditrl.core.losses.rollout_correction import ROLLOUT_CORRECTIONS, RolloutCorrectionOptions
from creditrl.core.losses.stapo import STAPO_POOLS, StapoOptions, spurious_token_mask
from creditrl.core.losses.traces import TRACE_STYLES, TRACE_UPDATES, TraceOptions, apply_trace
from creditrl.core.losses.policy import METRIC_KEYS, ON_POLICY_AS_CLIP, PolicyLoss
from creditrl.core.losses.compose import Fields, compose, policy_loss
from creditrl.core.losses.entropy import EntropyBonusOptions, EntropyControl, TopEntropyOptions
from creditrl.core.losses.covariance import ClipCovOptions, KLCovOptions
from creditrl.core.losses.sapo import SapoOptions
from creditrl.core.losses.delta_l import DeltaLNormOptions

__all__ = ["AGG_MODES", "KL_ESTIMATORS", "KL_PENALTIES", "METRIC_KEYS", "ON_POLICY_AS_CLIP", "ROLLOUT_CORRECTIONS", "STAGES", "STAPO_POOLS",
           "TRACE_STYLES", "TRACE_UPDATES", "AggregationOptions", "ClipOptions", "KLOptions", "LossState",
           "LossTerm", "PolicyLoss", "RolloutCorrectionOptions", "StapoOptions", "TraceOptions", "agg_loss",
           "apply_trace", "get_loss_term", "kl_estimate", "list_loss_terms", "policy_loss", "power_proxy",
           "ppl_gap", "register_loss_term", "resolve_loss_terms", "spurious_token_mask", "variance_proxy",
           "ClipCovOptions", "DeltaLNormOptions", "EntropyBonusOptions", "EntropyControl", "KLCovOptions",
           "SapoOptions", "TopEntropyOptions", "Fields", "builtin_loss_terms", "compose"]
