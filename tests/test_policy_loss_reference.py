"""``policy_loss`` (the autograd composition of the loss terms) against the written-out dense
reference of ``test_policy_gradients.reference_loss`` in float64: the same value and gradient
(with respect to log π, and to the entropy for the entropy bonus) within float64's rounding bound
(``loss_atol``, ``grad_rtol``) for every option alone and every compatible pair, on every aggregation."""
from __future__ import annotations

import itertools

import pytest
import torch

from creditrl import StapoOptions, TraceOptions, policy_loss
from creditrl.core.losses import (ClipCovOptions, DeltaLNormOptions, EntropyBonusOptions, KLCovOptions, SapoOptions,
                                  TopEntropyOptions)
from test_policy_gradients import grad_rtol, loss_atol, reference_loss
from tolerances import assert_close_normwise

B, T = 6, 9


def inputs(seed: int, token_adv: bool):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[0, 5:] = False
    mask[3] = False                                                   # an empty row
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    logp = (old + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0).requires_grad_()
    adv = torch.randn((B, T) if token_adv else (B,), generator=g, dtype=torch.float64)
    return {"logp": logp, "old_logp": old, "advantages": adv, "mask": mask,
            "ref": (old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0),
            "rollout": (old + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0),
            "entropy": (torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_(),
            "truncated": torch.tensor([False, True, False, False, True, False])}


OPTIONS = {  # name -> (group: at most one option per group in a pair, kwargs builder)
    "clip_high": ("clip", lambda x: {"clip_high": 0.28}),
    "clip_c": ("dual", lambda x: {"clip_c": 1.5}),
    **{f"kl_{e}": ("kl", lambda x, e=e: {"ref_logp": x["ref"], "kl_coef": 0.2, "kl_estimator": e})
       for e in ("k1", "k2", "k3")},
    **{m: ("rollout", lambda x, m=m: {"rollout_logp": x["rollout"], "rollout_correction": m,
                                      "rollout_cap": 8.0 if m == "seq-mis" else 1.5})   # a product: keep some rows
       for m in ("tis", "mis", "seq-tis", "seq-mis", "geo-rs")},
    "stapo": ("stapo", lambda x: {"stapo": StapoOptions(tau_p=0.3, high_entropy_fraction=0.5),
                                  "entropy": x["entropy"]}),
    "eps_trace": ("trace", lambda x: {"trace": TraceOptions(lam=0.8, adv_clamp=-0.5)}),
    "eps_trace_both": ("trace", lambda x: {"trace": TraceOptions(lam=0.7, style="both", floor=0.05)}),
    "eps_weight": ("trace", lambda x: {"trace": TraceOptions(lam=0.8, update="weight")}),
    "k3+": ("kl", lambda x: {"ref_logp": x["ref"], "kl_coef": 0.2, "kl_estimator": "k3+"}),
    "k1+_corrected": ("kl", lambda x: {"ref_logp": x["ref"], "kl_coef": 0.2, "kl_estimator": "k1+",
                                       "kl_bias_correction": True}),
    "k3_corrected": ("kl", lambda x: {"ref_logp": x["ref"], "kl_coef": 0.2, "kl_bias_correction": True}),
    "gspo": ("gspo", lambda x: {"gspo": True}),
    "cispo": ("surrogate", lambda x: {"cispo": True}),
    "sapo": ("surrogate", lambda x: {"sapo": SapoOptions(tau_pos=1.5, tau_neg=3.0)}),
    "geo_mean": ("surrogate", lambda x: {"geo_mean": True}),
    "dppo_tv": ("surrogate", lambda x: {"dppo_tv": True}),
    "dppo_kl": ("surrogate", lambda x: {"dppo_kl": True}),
    "clip_cov": ("surrogate", lambda x: {"clip_cov": ClipCovOptions(clip_cov_ratio=1.0, clip_cov_lb=-0.5,
                                                                    clip_cov_ub=0.5)}),
    "kl_cov": ("surrogate", lambda x: {"kl_cov": KLCovOptions(kl_cov_ratio=0.3, ppo_kl_coef=0.4)}),
    "entropy_bonus": ("entropy_bonus", lambda x: {"entropy_bonus": EntropyBonusOptions(coef=0.3),
                                                  "entropy": x["entropy"]}),
    "top_entropy": ("top_entropy", lambda x: {"top_entropy": TopEntropyOptions(quantile=0.4),
                                              "entropy": x["entropy"]}),
    "mask_truncated": ("truncated", lambda x: {"mask_truncated": True, "truncated": x["truncated"]}),
    "delta_l_norm": ("aggregate", lambda x: {"delta_l_norm": DeltaLNormOptions(alpha=0.75)}),
}
SINGLES = [(name,) for name in OPTIONS]
PAIRS = [p for p in itertools.combinations(OPTIONS, 2) if OPTIONS[p[0]][0] != OPTIONS[p[1]][0]]


def compare(combo, agg, seed, token_adv):
    x = inputs(seed, token_adv)
    kwargs = {"agg": agg, "max_len": T + 2 if agg == "seq-mean-token-sum-norm" else None}
    for name in combo:
        kwargs.update(OPTIONS[name][1](x))
    live = [x["logp"]] + ([x["entropy"]] if "entropy_bonus" in combo else [])
    loss, _ = policy_loss(x["logp"], x["old_logp"], x["advantages"], x["mask"], **kwargs)
    grads = torch.autograd.grad(loss, live)
    ref = reference_loss(x["logp"], x["old_logp"], x["advantages"], x["mask"], **kwargs)
    ref_grads = torch.autograd.grad(ref, live)
    # every input float64, so both sides compute in float64 (test_policy_gradients.loss_atol, grad_rtol)
    atol = loss_atol(x["logp"], x["old_logp"], x["advantages"], x["mask"], torch.float64, **kwargs)
    torch.testing.assert_close(loss, ref, atol=atol, rtol=0)
    for name, grad, ref_grad in zip(("gradient", "entropy gradient"), grads, ref_grads):
        assert_close_normwise(grad, ref_grad, grad_rtol(x["mask"], torch.float64), name)
    assert grads[0].abs().sum() > 0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("combo", [()] + SINGLES, ids=lambda c: "+".join(c) or "plain")
def test_every_option_matches_the_dense_reference(combo, agg):
    for seed, token_adv in ((0, False), (1, True)):
        compare(combo, agg, seed, token_adv)


@pytest.mark.parametrize("combo", PAIRS, ids=lambda c: "+".join(c))
def test_every_pair_of_options_matches_the_dense_reference(combo):
    compare(combo, "token-mean", 2, True)
    compare(combo, "seq-mean-token-sum-norm", 3, False)
