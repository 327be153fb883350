"""creditrl's verl plug-in: entry-point loading, estimator and loss adapters, verl's own OTB."""
from __future__ import annotations

import importlib
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("verl")

import torch  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402

from tolerances import EPS32, sum_rtol  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

import creditrl  # noqa: E402
from creditrl.integrations import verl as plugin  # noqa: E402
from creditrl.core.estimators.registry import get_estimator  # noqa: E402
from creditrl.core.losses import DeltaLNormOptions, StapoOptions, TraceOptions  # noqa: E402

MAXK = {"maxpo", "ei", "pkpo", "passk_chen", "maxk_bon"}


def verl_batch(seed=0, lengths=(5, 3, 6, 6, 2, 4, 1, 6, 6), uids=("a", "a", "a", "b", "b", "b", "c", "c", "c"),
               steps=7, binary=False):
    """verl-shaped inputs: outcome score on the last valid token, numpy object array of uids."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    mask = (torch.arange(steps)[None] < lengths[:, None]).float()
    score = torch.randint(0, 2, (len(lengths),), generator=gen).float() if binary else torch.rand(len(lengths), generator=gen)
    rewards = torch.zeros(len(lengths), steps)
    rewards[torch.arange(len(lengths)), lengths - 1] = score
    logits = torch.randn(len(lengths), steps, 11, generator=gen)
    tokens = torch.randint(0, 11, (len(lengths), steps), generator=gen)
    stats = creditrl.token_stats(logits, tokens, mask)
    return dict(token_level_rewards=rewards, response_mask=mask, index=np.array(uids, dtype=object),
                old_log_probs=stats.logp, sum_pi_squared=stats.sum_p2, stats=stats)


# creditrl's OTB and verl's, both float32, against each other: B_t = Σ G W / Σ W over a group's <= 3 members of
# cumulative energies over <= 7 steps; each sum within (21 + 8)·eps32 of its magnitude, so the ratio within
# twice that times max |G| (scores in [0, 1]), and A = G − B one more rounding (tests/tolerances.py)
OTB_ATOL = 2 * sum_rtol(21 + 8) * 1.0 + EPS32


def group_of(uids):
    return torch.from_numpy(np.unique(uids, return_inverse=True)[1])


def test_plain_import_verl_loads_the_plugin_through_the_entry_point():
    code = ("import verl; from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn;"
            "import creditrl; names = creditrl.list_estimators();"
            "assert all(get_adv_estimator_fn('creditrl_' + n).__creditrl__ == n for n in names), names;"
            "assert get_policy_loss_fn('creditrl_stapo').__module__ == 'creditrl.integrations.verl';"
            "assert get_policy_loss_fn('creditrl_grpo_lambda').__module__ == 'creditrl.integrations.verl'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_import_creditrl_does_not_import_trl_or_verl():
    code = "import sys, creditrl; creditrl.compute_advantages; assert 'verl' not in sys.modules and 'trl' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


# int64: what verl's trainer passes; bool and int64 masks get a [B] result written into creditrl's own copy
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.int64, torch.bool])
@pytest.mark.parametrize("name", creditrl.list_estimators())
def test_registered_estimator_matches_direct_call(name, mask_dtype):
    batch = verl_batch(binary=name == "passk_chen")
    options = {"k": 2} if name in MAXK else {}
    fn = core_algos.get_adv_estimator_fn(plugin.PREFIX + name)
    response_mask = batch["response_mask"].to(mask_dtype)
    given = response_mask.clone()
    advantages, returns = fn(token_level_rewards=batch["token_level_rewards"], response_mask=response_mask,
                             index=batch["index"], config={"creditrl": options},
                             old_log_probs=batch["old_log_probs"], sum_pi_squared=batch["sum_pi_squared"])
    assert torch.equal(response_mask, given)  # the caller's mask is never written
    expected = creditrl.compute_advantages(name, rewards=batch["token_level_rewards"], mask=batch["response_mask"],
                                           group=group_of(batch["index"]), energy=batch["stats"].energy, **options)
    # the plug-in rebuilds the energies as 1 − 2π_y + Σπ² from verl's log-probs and Σπ² (within 4·eps32 per token
    # of token_stats' energy); a baseline Σ G W / Σ W moves by <= max|G|·Σ|ΔW| / Σ W over a group's 21 tokens
    energy = batch["stats"].energy
    lowest = min(float(energy[group_of(batch["index"]) == g].sum()) for g in group_of(batch["index"]).unique())
    torch.testing.assert_close(advantages, expected, atol=OTB_ATOL + 2 * 21 * 4 * EPS32 / lowest, rtol=0)
    if not get_estimator(name).masked_output:  # sequence-level: verl's convention, returns = advantages
        assert returns is advantages
        return
    # token-level: returns are the reward-to-go, computed independently with a loop
    mask, rewards = batch["response_mask"], batch["token_level_rewards"]
    loop = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        running = 0.0
        for t in reversed(range(rewards.shape[1])):
            running += float(rewards[b, t] * mask[b, t])
            loop[b, t] = running * mask[b, t]
    assert torch.equal(returns, loop)        # the score on each row's last token: every return is it, exactly


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.int64, torch.bool])
@pytest.mark.parametrize("name", [n for n in creditrl.list_estimators()
                                  if get_estimator(n).masked_output and not get_estimator(n).needs_energy])
def test_token_level_estimator_without_actor_stats_returns_the_loops_returns(name, mask_dtype, holes):
    """Without the actor's stats (no energy buffer to reuse), a token-level estimator's advantages are the
    direct call's and its returns the reward-to-go of a loop: for a [B] result (REINFORCE++'s), both
    come from one read of a caller's float32 mask, and the two must not be confused."""
    batch = verl_batch()
    mask = batch["response_mask"].clone()
    if holes:
        mask[:, 1] = 0.0
    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)
    rewards = torch.zeros_like(batch["token_level_rewards"])
    rewards[torch.arange(mask.shape[0]), last] = batch["token_level_rewards"].sum(1)
    fn = core_algos.get_adv_estimator_fn(plugin.PREFIX + name)
    advantages, returns = fn(token_level_rewards=rewards, response_mask=mask.to(mask_dtype), index=batch["index"],
                             config=None)
    expected = creditrl.compute_advantages(name, rewards=rewards, mask=mask, group=group_of(batch["index"]))
    assert torch.equal(advantages, expected)
    assert torch.equal(returns, rewards.sum(1, keepdim=True) * mask)    # R on each valid token, exactly
    assert name == "reinforce" or not torch.equal(advantages, returns)


@pytest.mark.parametrize("value", ["false", 1, None])
def test_bool_estimator_option_takes_a_bool(value):
    """algorithm.creditrl.leave_one_out="false" would be truthy: refused, naming the key."""
    batch = verl_batch()
    with pytest.raises(ValueError, match=r"algorithm.creditrl.leave_one_out: expected bool, got "
                                         + ("null" if value is None else re.escape(f"{value!r} ({type(value).__name__})"))):
        core_algos.get_adv_estimator_fn("creditrl_otb")(
            token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"],
            index=batch["index"], config={"creditrl": {"leave_one_out": value}},
            old_log_probs=batch["old_log_probs"], sum_pi_squared=batch["sum_pi_squared"])


def test_energy_estimator_without_actor_energy_names_the_fix():
    """Without either actor tensor verl called the estimator around creditrl's hook (verl always has
    old_log_probs): the error names the hook's setting; with old_log_probs alone, sum_pi_squared's."""
    batch = verl_batch()
    fn = core_algos.get_adv_estimator_fn("creditrl_otb")
    inputs = dict(token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"],
                  index=batch["index"], config=None)
    with pytest.raises(ValueError, match=r"verl passed neither, so creditrl's trainer hook is not installed .*"
                                         r"external_lib=creditrl.integrations.verl_hooks"):
        fn(**inputs)
    with pytest.raises(ValueError, match=r"no sum_pi_squared: set actor_rollout_ref.actor.calculate_sum_pi_squared"):
        fn(**inputs, old_log_probs=batch["old_log_probs"])


def test_a_loss_mode_as_text_names_its_field():
    with pytest.raises(ValueError, match=r"loss_terms: expected a list or its JSON text, got 'cispo', which is not valid"):
        plugin.CreditPolicyLossConfig(loss_mode="creditrl", loss_terms="cispo")


def _bad_index(batch, uids):
    return {**batch, "index": np.array(uids, dtype=object)}


@pytest.mark.parametrize("change, message", [
    (lambda b: {**b, "old_log_probs": b["old_log_probs"].exp()}, r"old_log_probs: expected values <= 0"),
    (lambda b: {**b, "sum_pi_squared": b["sum_pi_squared"] + 1}, r"sum_pi_squared: expected values in \(0, 1\]"),
    (lambda b: {**b, "sum_pi_squared": b["sum_pi_squared"] * 0}, r"sum_pi_squared: expected values in \(0, 1\]"),
    (lambda b: _bad_index(b, ["a", "a", "a", 1, 1, 1, "c", "c", "c"]), r"index: expected uids of one type .*\['int', 'str'\]"),
    (lambda b: _bad_index(b, ["a", "a", "a", float("nan"), None, "b", "c", "c", "c"]),
     r"index: expected one uid per row, got None/NaN at rows \[3, 4\]"),
    (lambda b: {**b, "response_mask": b["response_mask"][:, :-1]}, r"response_mask: expected shape \[9, 7\]"),
    (lambda b: {**b, "response_mask": b["response_mask"].long() * 2}, r"mask: expected a bool or 0/1 mask.* in rows \[0, "),
])
def test_bad_actor_stats_uids_and_mask_are_named(change, message):
    batch = change(verl_batch())
    fn = core_algos.get_adv_estimator_fn("creditrl_otb")
    with pytest.raises(ValueError, match=message):
        fn(token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"],
           index=batch["index"], config=None, old_log_probs=batch["old_log_probs"],
           sum_pi_squared=batch["sum_pi_squared"])


def test_actor_stats_are_checked_on_response_tokens_only():
    batch = verl_batch()
    padded = batch["response_mask"] == 0
    fn = core_algos.get_adv_estimator_fn("creditrl_otb")
    advantages, _ = fn(token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"],
                       index=batch["index"], config=None,
                       old_log_probs=batch["old_log_probs"].masked_fill(padded, 5.0),
                       sum_pi_squared=batch["sum_pi_squared"].masked_fill(padded, 0.0))
    assert torch.isfinite(advantages).all()


def verl_otb(batch, **kwargs):
    return core_algos.compute_optimal_token_baseline_advantage(
        token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"], index=batch["index"],
        old_log_probs=batch["old_log_probs"], sum_pi_squared=batch["sum_pi_squared"], **kwargs)


def credit_otb(batch, **kwargs):
    return core_algos.get_adv_estimator_fn("creditrl_otb")(
        token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"], index=batch["index"],
        config=None, old_log_probs=batch["old_log_probs"], sum_pi_squared=batch["sum_pi_squared"], **kwargs)


@pytest.mark.parametrize("seed", range(3))
def test_verl_otb_agrees_where_the_definitions_coincide(seed):
    """Groups of >= 2, positive energies, no zero-tail rule: B_t = sum G W / sum W in both."""
    batch = verl_batch(seed, lengths=(5, 3, 6, 6, 2, 6), uids=("a", "a", "a", "b", "b", "b"))
    ours, our_returns = credit_otb(batch)
    theirs, their_returns = verl_otb(batch, handle_zero_tail=False)
    torch.testing.assert_close(ours, theirs, atol=OTB_ATOL, rtol=0)
    torch.testing.assert_close(our_returns, their_returns)
    weights = torch.rand(batch["response_mask"].shape, generator=torch.Generator().manual_seed(seed)) + 0.5
    ours, _ = credit_otb(batch, rollout_is_weights=weights)
    theirs, _ = verl_otb(batch, handle_zero_tail=False, rollout_is_weights=weights)
    torch.testing.assert_close(ours, theirs, atol=OTB_ATOL, rtol=0)


def test_verl_otb_differs_on_the_zero_tail_singletons_and_zero_energy():
    batch = verl_batch(1, lengths=(5, 3, 7, 2, 4, 6), uids=("a", "a", "a", "b", "b", "c"))
    ours, returns = credit_otb(batch)
    theirs, _ = verl_otb(batch, handle_zero_tail=True)
    # zero tail: group a's unique longest response (7) past the second longest (5): verl's
    # baseline is 0 (A = G_t); creditrl has one live member there and gives A = 0.
    tail = torch.zeros_like(ours, dtype=torch.bool)
    tail[2, 5:7] = True
    tail[4, 2:4] = True  # same in group b (lengths 2 and 4)
    # singleton group c: verl gives A = G_t (no baseline), creditrl gives 0.
    tail[5, :6] = True
    torch.testing.assert_close(theirs[tail], returns[tail])
    assert torch.all(ours[tail] == 0)
    torch.testing.assert_close(ours[~tail], theirs[~tail], atol=OTB_ATOL, rtol=0)
    # all energies 0 (every token certain): verl divides by eps (baseline 0, A = G_t);
    # creditrl falls back to the plain group mean of the returns.
    zero = dict(batch, old_log_probs=torch.zeros_like(batch["old_log_probs"]),
                sum_pi_squared=torch.ones_like(batch["sum_pi_squared"]))
    theirs, _ = verl_otb(zero, handle_zero_tail=False)
    ours, _ = credit_otb(zero)
    valid = batch["response_mask"].bool()
    torch.testing.assert_close(theirs[valid], returns[valid])
    mean_a = returns[:3, 0].mean()
    assert torch.isclose(ours[0, 0], returns[0, 0] - mean_a, atol=sum_rtol(3 + 2) * 1.0, rtol=0)   # a mean of 3


def holey_batch(seed, lengths=(5, 3, 7, 6, 2, 6, 4, 7), uids=("a", "a", "a", "b", "b", "b", "c", "c"), steps=8):
    """verl-shaped inputs with masked spans inside responses (tool output) and token rewards on valid
    tokens only: an outcome score on the last valid token plus step rewards."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    mask = (torch.arange(steps)[None] < lengths[:, None]).float()
    mask[0, 1:3] = 0
    mask[3, 2] = 0
    rewards = torch.randn(len(lengths), steps, generator=gen) * (torch.rand(len(lengths), steps, generator=gen) < 0.3)
    rewards[torch.arange(len(lengths)), lengths - 1] += torch.rand(len(lengths), generator=gen)
    return dict(token_level_rewards=rewards * mask, response_mask=mask, index=np.array(uids, dtype=object))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_equals_verls_function(seed, gamma):
    """Global whitening of the returns-to-go over the batch's valid tokens, discounted over valid steps."""
    from verl.trainer.config import AlgoConfig
    batch = holey_batch(seed)
    theirs, their_returns = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        token_level_rewards=batch["token_level_rewards"].double(), response_mask=batch["response_mask"].double(),
        config=AlgoConfig(gamma=gamma))
    ours = creditrl.compute_advantages("reinforce_plus_plus", rewards=batch["token_level_rewards"],
                                       mask=batch["response_mask"], group=group_of(batch["index"]), gamma=gamma)
    torch.testing.assert_close(ours.double(), theirs, atol=1e-5, rtol=1e-5)
    # gamma as creditrl's option, and as verl's own algorithm.gamma (what verl's function reads)
    for config in ({"creditrl": {"gamma": gamma}}, AlgoConfig(gamma=gamma)):
        plugin_adv, plugin_returns = core_algos.get_adv_estimator_fn("creditrl_reinforce_plus_plus")(
            token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"],
            index=batch["index"], config=config)
        torch.testing.assert_close(plugin_adv.double(), theirs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(plugin_returns.double(), their_returns, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_norm_adv_by_std_in_grpo_false_is_grpo_without_the_std_as_in_verl(seed):
    from verl.trainer.config import AlgoConfig
    batch = verl_batch(seed)
    theirs, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=batch["token_level_rewards"].double(), response_mask=batch["response_mask"].double(),
        index=batch["index"], norm_adv_by_std_in_grpo=False)
    for name in ("creditrl_grpo", "creditrl_dr_grpo"):
        ours, _ = core_algos.get_adv_estimator_fn(name)(
            token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"],
            index=batch["index"], config=AlgoConfig(norm_adv_by_std_in_grpo=False))
        torch.testing.assert_close(ours.double(), theirs, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name, config, message", [
    ("creditrl_grpo", {"gamma": 0.9}, r"algorithm.gamma: creditrl_grpo takes one outcome reward per response .*"
                                      r"expected 1.0 \(verl's default\), got 0.9"),
    ("creditrl_reinforce", {"gamma": 0.9, "creditrl": {"gamma": 0.5}},
     r"algorithm.gamma=0.9 and algorithm.creditrl.gamma=0.5 disagree"),
    ("creditrl_rloo", {"norm_adv_by_std_in_grpo": False},
     r"algorithm.norm_adv_by_std_in_grpo: .*creditrl_rloo has no such option.*got False"),
    ("creditrl_grpo", {"norm_adv_by_std_in_grpo": False, "creditrl": {"scale": "batch"}},
     r"norm_adv_by_std_in_grpo=False and algorithm.creditrl.scale='batch' disagree"),
])
def test_verls_own_algorithm_keys_are_refused_where_they_would_do_nothing(name, config, message):
    batch = verl_batch(0)
    with pytest.raises(ValueError, match=message):
        core_algos.get_adv_estimator_fn(name)(token_level_rewards=batch["token_level_rewards"],
                                              response_mask=batch["response_mask"], index=batch["index"], config=config)


@pytest.mark.parametrize("seed", range(3))
def test_reinforce_plus_plus_baseline_equals_verls_function(seed):
    batch = holey_batch(seed)
    theirs, _ = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
        token_level_rewards=batch["token_level_rewards"].double(), response_mask=batch["response_mask"].double(),
        index=batch["index"])
    ours = creditrl.compute_advantages("reinforce_plus_plus_baseline", rewards=batch["token_level_rewards"],
                                       mask=batch["response_mask"], group=group_of(batch["index"]))
    torch.testing.assert_close(ours.double(), theirs, atol=1e-5, rtol=1e-5)


def test_reinforce_plus_plus_differs_on_singletons_and_rewards_on_masked_tokens():
    """verl keeps a lone response's R (its group mean is 0) and drops a reward placed on a masked token;
    creditrl centres the singleton to 0 and counts the masked token's reward at the preceding valid token."""
    batch = holey_batch(0, uids=("a", "a", "a", "b", "b", "b", "c", "d"))
    theirs, _ = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
        token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"], index=batch["index"])
    ours = creditrl.compute_advantages("reinforce_plus_plus_baseline", rewards=batch["token_level_rewards"],
                                       mask=batch["response_mask"], group=group_of(batch["index"]))
    valid = batch["response_mask"].bool()
    assert torch.unique(ours[6][valid[6]]).numel() == 1 and torch.unique(theirs[6][valid[6]]).numel() == 1
    assert not torch.allclose(ours[6][valid[6]], theirs[6][valid[6]])   # c, d singletons: 0 vs R, then whitened
    from verl.trainer.config import AlgoConfig
    rewards = batch["token_level_rewards"].clone()
    rewards[0, 1] = 1.0                                              # a reward on a masked (tool) token
    theirs, _ = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        token_level_rewards=rewards, response_mask=batch["response_mask"], config=AlgoConfig(gamma=1.0))
    ours = creditrl.compute_advantages("reinforce_plus_plus", rewards=rewards, mask=batch["response_mask"],
                                       group=group_of(batch["index"]))
    dropped = creditrl.compute_advantages("reinforce_plus_plus", rewards=rewards * batch["response_mask"],
                                          mask=batch["response_mask"], group=group_of(batch["index"]))
    torch.testing.assert_close(dropped, theirs, atol=1e-5, rtol=1e-5)    # verl = the reward dropped
    assert not torch.allclose(ours, theirs, atol=1e-3)


def actor_config(loss_mode="creditrl", **policy_loss):
    """verl's actor config with creditrl's policy-loss fields; verl picks the loss by ``loss_mode``."""
    return ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=2, clip_ratio_c=3.0,
                       policy_loss=plugin.CreditPolicyLossConfig(loss_mode=loss_mode, **policy_loss))


def loss_inputs(seed=0, shape=(6, 5)):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(shape, generator=gen) * 3
    logp = (old + 0.3 * torch.randn(shape, generator=gen)).clamp(max=0).requires_grad_()   # log-probs: <= 0
    mask = torch.ones(shape)
    mask[0, 3:] = 0
    mask[4, 1:] = 0
    advantages = torch.randn(shape, generator=gen) * mask
    return dict(old_log_prob=old, log_prob=logp, advantages=advantages, response_mask=mask)


def test_stapo_loss_with_verl_keywords_matches_policy_loss():
    inputs = loss_inputs()
    entropy = torch.rand(inputs["response_mask"].shape, generator=torch.Generator().manual_seed(5)) * 2
    config = actor_config(stapo_tau_p=0.3, stapo_high_entropy_fraction=0.2)
    fn = core_algos.get_policy_loss_fn("creditrl_stapo")
    with plugin.token_entropy(entropy):
        loss, metrics = fn(**inputs, loss_agg_mode="token-mean", config=config, rollout_is_weights=None)
    expected, expected_metrics = creditrl.policy_loss(
        inputs["log_prob"], inputs["old_log_prob"], inputs["advantages"], inputs["response_mask"], clip_low=0.2,
        clip_high=0.2, clip_c=3.0, agg="token-mean", stapo=StapoOptions(tau_p=0.3, high_entropy_fraction=0.2),
        entropy=entropy)
    torch.testing.assert_close(loss, expected)
    assert metrics["actor/creditrl/spurious_ratio"] == expected_metrics["spurious_ratio"] > 0
    loss.backward()
    assert inputs["log_prob"].grad is not None
    with pytest.raises(ValueError, match=r"calculate_entropy=True, and actor.policy_loss._target_=creditrl.integrations"
                                         r".verl.CreditPolicyLossConfig: .*the hook"):
        fn(**loss_inputs(), loss_agg_mode="token-mean", config=config, rollout_is_weights=None)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_grpo_lambda_at_lambda_zero_equals_verl_vanilla(mode):
    """ε-trace with λ = 0, style recent, no advantage clamp is GRPO's clipped loss (Theorem 1)."""
    inputs = loss_inputs(1)
    weights = torch.rand(inputs["response_mask"].shape, generator=torch.Generator().manual_seed(2)) * 2
    config = actor_config(trace_lam=0.0, trace_adv_clamp=-1e9)
    for rollout_is_weights in (None, weights):
        ours, metrics = core_algos.get_policy_loss_fn("creditrl_grpo_lambda")(
            **inputs, loss_agg_mode=mode, config=config, rollout_is_weights=rollout_is_weights)
        theirs, _ = core_algos.compute_policy_loss_vanilla(**inputs, loss_agg_mode=mode, config=config,
                                                           rollout_is_weights=rollout_is_weights)
        torch.testing.assert_close(ours, theirs)
    assert "actor/creditrl/kept_frac" in metrics


def test_grpo_lambda_uses_the_trace_with_its_defaults_or_the_fields():
    inputs = loss_inputs(3)
    fn = core_algos.get_policy_loss_fn("creditrl_grpo_lambda")
    for fields, options in (({}, TraceOptions()), ({"trace_lam": 0.8}, TraceOptions(lam=0.8))):
        loss, _ = fn(**inputs, loss_agg_mode="token-mean", config=actor_config(**fields), rollout_is_weights=None)
        expected, _ = creditrl.policy_loss(inputs["log_prob"], inputs["old_log_prob"], inputs["advantages"],
                                           inputs["response_mask"], clip_c=3.0, trace=options)
        torch.testing.assert_close(loss, expected)
    with pytest.raises(ValueError, match="lam: expected a value in"):
        actor_config(trace_lam=1.5)
    with pytest.raises(ValueError, match="trace_lam: set while trace=False"):
        actor_config(trace=False, trace_lam=0.5)


def test_generic_loss_mode_takes_every_term_and_a_users_term_by_import_path(monkeypatch):
    """loss_mode=creditrl: terms on by their fields (stapo_*, trace=True) plus loss_terms by import
    path, equal to creditrl.policy_loss with the same terms; the user's metric is logged."""
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent / "plugins"))
    inputs = loss_inputs(5)
    entropy = torch.rand(inputs["response_mask"].shape, generator=torch.Generator().manual_seed(5)) * 2
    user = [{"path": "length_penalty_term:length_penalty", "coef": 0.05}]
    config = actor_config(stapo_tau_p=0.3, trace=True, loss_terms=user)
    with plugin.token_entropy(entropy):
        loss, metrics = core_algos.get_policy_loss_fn("creditrl")(
            **inputs, loss_agg_mode="seq-mean-token-mean", config=config, rollout_is_weights=None)
    expected, _ = creditrl.policy_loss(
        inputs["log_prob"], inputs["old_log_prob"], inputs["advantages"], inputs["response_mask"], clip_c=3.0,
        agg="seq-mean-token-mean", stapo=StapoOptions(tau_p=0.3), trace=TraceOptions(), entropy=entropy, terms=user)
    torch.testing.assert_close(loss, expected)
    assert metrics["actor/creditrl/length_penalty"] > 0
    plain, _ = core_algos.get_policy_loss_fn("creditrl")(**inputs, loss_agg_mode="token-mean",
                                                          config=actor_config(), rollout_is_weights=None)
    theirs, _ = core_algos.compute_policy_loss_vanilla(**inputs, loss_agg_mode="token-mean", config=actor_config())
    torch.testing.assert_close(plain, theirs)
    with pytest.raises(ValueError, match="unknown option\\(s\\) \\['cof'\\]; valid options are \\['coef'\\]"):
        actor_config(loss_terms=[{"path": "length_penalty_term:length_penalty", "cof": 1}])


def test_global_batch_normalisation_follows_verl_agg_loss():
    inputs = loss_inputs(4)
    config = actor_config(trace_lam=0.0, trace_adv_clamp=-1e9)
    mask = inputs["response_mask"]
    for mode, info in [("token-mean", {"dp_size": 2, "batch_num_tokens": 3 * int(mask.sum())}),
                       ("seq-mean-token-mean", {"dp_size": 2, "global_batch_size": 17}),
                       ("seq-mean-token-sum-norm", {"dp_size": 4, "global_batch_size": 9})]:
        config.global_batch_info.clear()
        config.global_batch_info.update(info)
        ours, _ = core_algos.get_policy_loss_fn("creditrl_grpo_lambda")(**inputs, loss_agg_mode=mode, config=config,
                                                                         rollout_is_weights=None)
        theirs, _ = core_algos.compute_policy_loss_vanilla(**inputs, loss_agg_mode=mode, config=config)
        torch.testing.assert_close(ours, theirs)


def plugin_inputs(seed, shape=(6, 8)):
    """verl-shaped float64 inputs with ratios where the clips bind, every row with a token."""
    gen = torch.Generator().manual_seed(seed)
    old = torch.log(torch.rand(shape, generator=gen, dtype=torch.float64) * 0.9 + 0.05)
    logp = old + 0.3 * torch.randn(shape[0], 1, generator=gen, dtype=torch.float64) \
        + 0.4 * torch.randn(shape, generator=gen, dtype=torch.float64)
    logp = torch.where(logp > -1e-3, -1e-3 - 0.1 * torch.rand(shape, generator=gen, dtype=torch.float64), logp)
    mask = (torch.rand(shape, generator=gen) < 0.75).double()
    mask[:, 0] = 1
    advantages = torch.randn(shape[0], 1, generator=gen, dtype=torch.float64).expand(shape) * mask
    weights = torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5
    return dict(old_log_prob=old, log_prob=logp, advantages=advantages, response_mask=mask), weights


# verl name -> (the creditrl loss_mode's actor.policy_loss fields, verl's own fields, verl's aggregations for it)
VERL_LOSSES = {
    "cispo": ({"loss_terms": [{"path": "cispo"}]}, {}, ["token-mean", "token-sum", "seq-mean-token-mean",
                                                     "seq-mean-token-sum-norm"]),
    "gspo": ({"gspo": True}, {}, ["token-mean", "token-sum", "seq-mean-token-mean"]),
    "dppo_tv": ({"dppo_tv": True}, {}, ["token-mean", "seq-mean-token-sum"]),
    "dppo_kl": ({"loss_terms": [{"path": "dppo_kl"}]}, {}, ["token-mean", "seq-mean-token-mean"]),
    "sapo": ({"sapo": True}, {"tau_pos": 1.3, "tau_neg": 2.0}, ["seq-mean-token-mean"]),
    "geo_mean": ({"geo_mean": True}, {}, ["seq-mean-token-mean"]),
    "kl_cov": ({"kl_cov": True}, {"kl_cov_ratio": 0.1, "ppo_kl_coef": 0.5}, ["token-mean", "token-sum"]),
    "clip_cov": ({"loss_terms": [{"path": "clip_cov"}]}, {"clip_cov_ratio": 1.0, "clip_cov_lb": 0.0,
                                                          "clip_cov_ub": 0.5}, ["token-mean", "seq-mean-token-sum"]),
}


@pytest.mark.parametrize("name", list(VERL_LOSSES))
def test_each_verl_named_loss_through_the_plugin_equals_verls_own(name):
    """loss_mode=creditrl with the term on (its switch or a loss_terms entry by name) equals verl's
    function with the same ActorConfig (SAPO's tau_*, Clip-/KL-Cov's policy_loss fields are verl's),
    with rollout IS weights and verl's global-batch normalisation. clip_ratio_c = 10: verl's GSPO
    and Clip-Cov have no dual clip, creditrl's clip surrogate applies verl's clip_ratio_c."""
    ours_fields, verl_fields, modes = VERL_LOSSES[name]
    policy_fields = {k: v for k, v in verl_fields.items() if not k.startswith("tau")}
    actor_fields = {k: v for k, v in verl_fields.items() if k.startswith("tau")}
    inputs, weights = plugin_inputs(hash(name) % 1000)
    rows, tokens = inputs["response_mask"].shape[0], int(inputs["response_mask"].sum())
    for mode in modes:
        infos = [{}, {"dp_size": 2, "batch_num_tokens": 3 * tokens, "global_batch_size": 3 * rows}]
        for info in infos[:1] if name == "geo_mean" else infos:    # verl's geo_mean ignores global_batch_info
            config = ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=2, clip_ratio_c=10.0,
                                 clip_ratio_high=0.28, **actor_fields,
                                 policy_loss=plugin.CreditPolicyLossConfig(loss_mode="creditrl", **ours_fields,
                                                                           **policy_fields))
            verl_config = ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=2, clip_ratio_c=10.0,
                                      clip_ratio_high=0.28, **actor_fields,
                                      policy_loss=PolicyLossConfig(**policy_fields))
            for c in (config, verl_config):
                c.global_batch_info.clear()
                c.global_batch_info.update(info)
            lp_ours, lp_verl = (inputs["log_prob"].clone().requires_grad_() for _ in range(2))
            ours, metrics = core_algos.get_policy_loss_fn("creditrl")(
                **{**inputs, "log_prob": lp_ours}, loss_agg_mode=mode, config=config, rollout_is_weights=weights)
            theirs, _ = core_algos.get_policy_loss_fn(name)(
                **{**inputs, "log_prob": lp_verl}, loss_agg_mode=mode, config=verl_config, rollout_is_weights=weights)
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-12)
            grads = torch.autograd.grad(ours, lp_ours)[0], torch.autograd.grad(theirs, lp_verl)[0]
            torch.testing.assert_close(*grads, rtol=1e-5, atol=1e-12)
    assert "actor/creditrl/kept_frac" in metrics


def test_verl_plugin_refuses_what_a_verl_policy_loss_cannot_be_fed_and_feeds_the_entropy_bonus():
    with pytest.raises(ValueError, match="mask_truncated: verl passes a policy loss no truncation flags"):
        actor_config(loss_terms=[{"path": "mask_truncated"}])
    with pytest.raises(ValueError, match="entropy_bonus_adaptive: verl calls a policy loss per micro-batch"):
        actor_config(entropy_bonus_adaptive=True)
    inputs = loss_inputs(6)
    entropy = (torch.rand(inputs["response_mask"].shape, generator=torch.Generator().manual_seed(1)) * 2)
    entropy.requires_grad_()
    config = actor_config(entropy_bonus_coef=0.2)
    with plugin.token_entropy(entropy):
        loss, metrics = core_algos.get_policy_loss_fn("creditrl")(**inputs, loss_agg_mode="token-mean",
                                                                  config=config, rollout_is_weights=None)
    (grad,) = torch.autograd.grad(loss, entropy)          # verl's entropy keeps its graph into the bonus
    mask = inputs["response_mask"]
    torch.testing.assert_close(grad, -0.2 * mask / mask.sum())
    assert metrics["actor/creditrl/entropy_bonus_coef"] == pytest.approx(0.2)


@pytest.mark.parametrize("fields, message", [
    ({"loss_mode": "vanilla", "stapo": True, "stapo_tau_p": 0.3},
     r"loss_mode: 'vanilla' is verl's own policy loss, which reads none of creditrl's fields \(stapo, stapo_tau_p\)"),
    ({"loss_mode": "creditrl_stapo", "stapo": False},
     r"stapo: loss_mode='creditrl_stapo' switches stapo on; expected stapo unset or true, got False"),
    ({"loss_mode": "creditrl_grpo_lambda", "trace": False}, r"trace: loss_mode='creditrl_grpo_lambda' switches trace on"),
    ({"loss_mode": "creditrl_bogus"}, r"loss_mode: expected one of \['creditrl', 'creditrl_stapo', "
                                      r"'creditrl_grpo_lambda'\] \(creditrl's\) or one of verl's, got 'creditrl_bogus'"),
])
def test_a_loss_mode_that_contradicts_creditrls_fields_is_refused_when_the_config_is_built(fields, message):
    with pytest.raises(ValueError, match=message):
        plugin.CreditPolicyLossConfig(**fields)


@pytest.mark.parametrize("field, value", [("trace_lam", 1.5), ("stapo_tau_p", -1.0), ("delta_l_norm_alpha", 3.0),
                                          ("top_entropy_quantile", 1.5)])
def test_an_option_error_names_the_config_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}: expected a value in"):
        plugin.CreditPolicyLossConfig(loss_mode="creditrl", **{field: value})


def test_a_bad_loss_agg_mode_is_named_with_verls_modes():
    with pytest.raises(ValueError, match=r"loss_agg_mode: .*'bogus'.*'token-sum'"):
        core_algos.get_policy_loss_fn("creditrl")(**loss_inputs(0), loss_agg_mode="bogus", config=actor_config(),
                                                  rollout_is_weights=None)


def test_verls_own_loss_mode_without_creditrls_fields_is_accepted():
    assert plugin.CreditPolicyLossConfig(loss_mode="vanilla", clip_cov_ratio=0.001).loss_mode == "vanilla"
    assert plugin.CreditPolicyLossConfig(loss_mode="creditrl_stapo", stapo=True).stapo is True


def test_delta_l_norm_in_verl_weights_each_micro_batch_by_its_share_of_the_responses():
    """verl passes no global Σ n^-α: each micro-batch's ΔL (weights summing to 1/M) is scaled by
    its responses / global_batch_size · dp, so the weights over the global batch still sum to 1/M."""
    inputs = loss_inputs(7)
    config = actor_config(delta_l_norm=True, delta_l_norm_alpha=0.5)
    config.global_batch_info.update({"dp_size": 2, "global_batch_size": 20})
    loss, _ = core_algos.get_policy_loss_fn("creditrl")(**inputs, loss_agg_mode="token-mean", config=config,
                                                        rollout_is_weights=None)
    local, _ = creditrl.policy_loss(inputs["log_prob"], inputs["old_log_prob"], inputs["advantages"],
                                    inputs["response_mask"], clip_c=3.0, delta_l_norm=DeltaLNormOptions(0.5))
    rows = int((inputs["response_mask"].sum(-1) > 0).sum())
    torch.testing.assert_close(loss, local * rows / 20 * 2)


def test_compute_advantage_hook_passes_the_actor_energy():
    batch = verl_batch()
    data = DataProto.from_dict(tensors={k: batch[k] for k in ("token_level_rewards", "response_mask",
                                                               "old_log_probs", "sum_pi_squared")},
                               non_tensors={"uid": batch["index"]})
    calls = []

    def compute_advantage(data, adv_estimator, gamma=1.0, lam=1.0, num_repeat=1, norm_adv_by_std_in_grpo=True,
                          config=None):  # verl 0.9.1's signature; forwards only the basic kwargs
        calls.append(adv_estimator)
        return data

    wrapped = plugin.wrap_compute_advantage(compute_advantage)
    wrapped(data, "grpo", config=None)
    assert calls == ["grpo"]  # verl's own estimators go to verl
    out = wrapped(data, adv_estimator="creditrl_otb", gamma=1.0, config={"creditrl": {}})
    assert calls == ["grpo"]
    expected = creditrl.compute_advantages("otb", rewards=batch["token_level_rewards"], mask=batch["response_mask"],
                                           group=group_of(batch["index"]), energy=batch["stats"].energy)
    torch.testing.assert_close(out.batch["advantages"], expected)


def test_gdpo_reads_verls_gdpo_reward_keys_through_the_hook():
    batch = verl_batch()
    gen = torch.Generator().manual_seed(3)
    fields = {"acc": torch.randint(0, 2, (9,), generator=gen).float().numpy(),
              "format": torch.rand(9, generator=gen).numpy()}
    data = DataProto.from_dict(tensors={k: batch[k] for k in ("token_level_rewards", "response_mask")},
                               non_tensors={"uid": batch["index"], **fields})
    wrapped = plugin.wrap_compute_advantage(lambda data, adv_estimator, config=None: data)
    config = {"creditrl": {"eps": 1e-4}, "gdpo_reward_keys": ["acc", "format"], "gdpo_reward_weights": [1.0, 0.5]}
    out = wrapped(data, adv_estimator="creditrl_gdpo", config=config)
    components = torch.from_numpy(np.stack([fields["acc"], fields["format"]], 1))
    # verl's gdpo reads the keyed fields, not the score (token_level_rewards here are unrelated to them):
    # the hook does not ask the score to be their weighted sum, as compute_advantages does
    expected = creditrl.compute_advantages("gdpo", rewards=(components * torch.tensor([1.0, 0.5])).nansum(1).float(),
                                           mask=batch["response_mask"], group=group_of(batch["index"]),
                                           components=components, component_weights=[1.0, 0.5], eps=1e-4)
    torch.testing.assert_close(out.batch["advantages"], expected)
    assert not torch.allclose(expected, creditrl.compute_advantages(
        "gdpo", rewards=batch["token_level_rewards"], mask=batch["response_mask"], group=group_of(batch["index"]),
        eps=1e-4))
    with pytest.raises(ValueError, match=r"algorithm.gdpo_reward_keys: \['missing'\] not among"):
        wrapped(data, adv_estimator="creditrl_gdpo", config={"gdpo_reward_keys": ["missing"]})


def test_reload_is_idempotent_and_foreign_names_are_refused():
    first = core_algos.get_adv_estimator_fn("creditrl_otb")
    module = importlib.reload(plugin)
    second = core_algos.get_adv_estimator_fn("creditrl_otb")
    assert second is not first and second.__creditrl__ == "otb"
    importlib.reload(module)
    assert not any("creditrl" in type(f).__module__ for f in sys.meta_path)   # no import hooks

    def foreign(**kwargs):
        return None

    core_algos.ADV_ESTIMATOR_REGISTRY["creditrl_rloo"] = foreign
    try:
        with pytest.raises(ValueError, match="creditrl_rloo"):
            module.register_estimators()
    finally:
        del core_algos.ADV_ESTIMATOR_REGISTRY["creditrl_rloo"]
        module.register_estimators()


@pytest.mark.parametrize("layout", ["masked-last-token", "multi-turn"])
def test_scores_on_masked_tokens_follow_verl(layout):
    """verl puts the score at the last attention-mask position, which may be a masked (tool)
    token: sequence-level estimators count it in the row total as verl does; token-level returns
    count it at the nearest preceding valid token."""
    mask = torch.ones(4, 5)
    if layout == "masked-last-token":
        mask[:, 4] = 0
    else:                                   # turn 1, tool output, turn 2, tool output holding the score
        mask[:, 2] = 0
        mask[:, 4] = 0
    rewards = torch.zeros(4, 5)
    rewards[:, 4] = torch.tensor([1.0, 0, 1, 0])
    index = np.array(["a"] * 4, dtype=object)
    ours, _ = core_algos.get_adv_estimator_fn("creditrl_grpo")(
        token_level_rewards=rewards, response_mask=mask, index=index, config=None)
    theirs, _ = core_algos.compute_grpo_vectorized_outcome_advantage(rewards, mask, index)
    # verl's z-scores and ours: a mean and a std of 4 float32 values, then a division (|z| <= 1)
    torch.testing.assert_close(ours, theirs.float(), atol=2 * sum_rtol(4 + 4), rtol=0)
    # ±1/√(4/3) to the 3 digits written (the 1e-6 std guard moves it by ~1e-6)
    assert torch.allclose(ours[:, 0], torch.tensor([0.866, -0.866, 0.866, -0.866]), atol=5e-4)
    _, returns = core_algos.get_adv_estimator_fn("creditrl_reinforce")(
        token_level_rewards=rewards, response_mask=mask, index=index, config=None)
    assert torch.equal(returns, rewards[:, 4:5] * mask)   # the score reaches every valid token


def test_bench_peers_quick_runs_and_agrees_with_verl():
    """The benchmark against verl's own functions runs (smoke size) and every creditrl path
    agrees with verl's result on valid tokens."""
    import pathlib
    import re
    script = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_peers.py"
    result = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    largest = float(re.search(r"largest max\|diff\|: ([0-9.e+-]+)", result.stdout).group(1))
    assert largest <= 1e-5, result.stdout


def test_trainer_hooks_install_from_verl_extension_points():
    """The loss hook is installed when verl builds CreditPolicyLossConfig (in the driver and each
    worker) or on import of creditrl.integrations.verl_hooks; rebinding is idempotent and reaches
    aliases imported by name."""
    import types

    from verl.workers.utils import losses
    original = getattr(losses.ppo_loss, "__creditrl__", losses.ppo_loss)
    alias = types.ModuleType("verl._creditrl_test_alias")
    alias.ppo_loss = losses.ppo_loss                      # as engine_workers' ``from ... import ppo_loss``
    sys.modules[alias.__name__] = alias
    try:
        plugin.CreditPolicyLossConfig(loss_mode="creditrl_stapo", stapo_tau_p=0.1)
        assert losses.ppo_loss.__creditrl__ is original and alias.ppo_loss is losses.ppo_loss
        wrapped = losses.ppo_loss
        assert "verl.workers.utils.losses" in plugin.install_trainer_hooks()
        assert losses.ppo_loss.__creditrl__ is original               # wraps the original, never a wrapper
        importlib.import_module("creditrl.integrations.verl_hooks")
        assert alias.ppo_loss is losses.ppo_loss and wrapped.__creditrl__ is original
    finally:
        del sys.modules[alias.__name__]


@pytest.mark.parametrize("value", ["false", 1, "no"])
def test_a_boolean_option_takes_a_bool(value):
    """``leave_one_out="false"`` once computed the leave-one-out form (a truthy string)."""
    batch = verl_batch()
    fn = core_algos.get_adv_estimator_fn(plugin.PREFIX + "otb")
    with pytest.raises(ValueError, match=r"algorithm.creditrl.leave_one_out: expected bool"):
        fn(token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"],
           index=batch["index"], config={"creditrl": {"leave_one_out": value}},
           old_log_probs=batch["old_log_probs"], sum_pi_squared=batch["sum_pi_squared"])
    with pytest.raises(ValueError, match=r"otb.leave_one_out: expected bool"):
        creditrl.compute_advantages("otb", rewards=batch["token_level_rewards"], mask=batch["response_mask"],
                                    group=group_of(batch["index"]), energy=batch["stats"].energy, leave_one_out=value)


# creditrl's rollout_correction mode -> verl's (rollout_is, rollout_rs), cap C as rollout_is_threshold and as
# rollout_rs_threshold (a single k1 threshold C is verl's bounds [1/C, C])
VERL_ROLLOUT = {"tis": ("token", None), "seq-tis": ("sequence", None), "mis": ("token", "token_k1"),
                "seq-mis": ("sequence", "seq_sum_k1"), "rs": (None, "token_k1"), "geo-rs": (None, "seq_mean_k1")}


def verl_rollout_correction(old, rollout, mask, mode, cap):
    """verl's IS weights [B,T] and its response mask after rejection, for creditrl's ``mode``."""
    from verl.trainer.ppo.rollout_corr_helper import (compute_rollout_correction_weights,
                                                      compute_rollout_rejection_mask)
    is_level, rs = VERL_ROLLOUT[mode]
    log_ratio, mask = old - rollout, mask.to(old.dtype)
    weights = mask if is_level is None else compute_rollout_correction_weights(
        log_ratio=log_ratio, response_mask=mask, rollout_is=is_level, rollout_is_threshold=cap)[0]
    kept = mask if rs is None else compute_rollout_rejection_mask(
        log_ratio=log_ratio, response_mask=mask, rollout_rs=rs, rollout_rs_threshold=cap)[0]
    return weights, kept


def rollout_inputs(mode, seed=4, shape=(48, 9)):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.arange(shape[1])[None] < torch.randint(1, shape[1] + 1, (shape[0], 1), generator=gen)
    old = -torch.rand(shape, generator=gen, dtype=torch.float64) * 3
    spread = 0.15 if mode.startswith("seq") else 0.5          # a product of ratios spreads √T times more
    rollout = (old + spread * torch.randn(shape, generator=gen, dtype=torch.float64)).clamp(max=0)
    return old, rollout, mask


@pytest.mark.parametrize("mode", list(VERL_ROLLOUT))
def test_rollout_correction_is_verls_weight_times_its_rejection_mask(mode):
    """The factor each mode puts on a token's gradient (what OTB's off-policy energies read) is verl's IS
    weight times its rejection mask; sequence weights are the product of the token ratios (a geometric
    mean is no importance weight), and something is dropped and kept in every dropping mode."""
    from creditrl.core.losses.rollout_correction import correction_weights
    cap = 1.6
    old, rollout, mask = rollout_inputs(mode)
    weights, kept = verl_rollout_correction(old, rollout, mask, mode, cap)
    torch.testing.assert_close(correction_weights(old - rollout, mask, mode, cap), weights * kept,
                               rtol=1e-12, atol=0)
    if VERL_ROLLOUT[mode][1] is not None:
        assert 0 < int((mask & (kept == 0)).sum()) < int(mask.sum())


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("mode", list(VERL_ROLLOUT))
def test_rollout_correction_loss_is_verls_vanilla_loss_with_its_weights_and_mask(mode, agg):
    """policy_loss under each mode equals verl's vanilla loss given verl's IS weights and its rejected
    response mask: value and gradient, dropped tokens out of the denominators as in verl."""
    cap = 1.6
    old, rollout, mask = rollout_inputs(mode, seed=5)
    adv = torch.randn(mask.shape[0], generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    logp = (old + 0.2 * torch.randn(old.shape, generator=torch.Generator().manual_seed(7),
                                    dtype=torch.float64)).clamp(max=0).requires_grad_()
    ours, _ = creditrl.policy_loss(logp, old, adv, mask, rollout_logp=rollout, rollout_correction=mode,
                                   rollout_cap=cap, clip_c=3.0, agg=agg)
    weights, kept = verl_rollout_correction(old, rollout, mask, mode, cap)
    theirs, _ = core_algos.compute_policy_loss_vanilla(
        old_log_prob=old, log_prob=logp, advantages=adv[:, None] * mask, response_mask=kept, loss_agg_mode=agg,
        config=actor_config(), rollout_is_weights=None if VERL_ROLLOUT[mode][0] is None else weights)
    rtol = 1e-12 + (2e-8 if agg.startswith("seq") else 0.0)   # verl's + 1e-8 in a row's denominator of >= 1
    torch.testing.assert_close(ours, theirs, rtol=rtol, atol=1e-15)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0],
                               rtol=rtol, atol=1e-15)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_loss_modes_report_verls_own_metric_names(agg):
    """``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower`` (the dual clip) and ``actor/ppo_kl`` as verl's
    vanilla loss reports them, on ratios that reach every bound (r from e^-1.5 to e^2.5, A of both signs)."""
    inputs = loss_inputs(2, shape=(8, 12))
    old = inputs["old_log_prob"]
    inputs["log_prob"] = (old + torch.linspace(-1.5, 2.5, 12)).clamp(max=0).requires_grad_()
    config = actor_config()
    ours = core_algos.get_policy_loss_fn("creditrl")(**inputs, loss_agg_mode=agg, config=config, rollout_is_weights=None)[1]
    theirs = core_algos.compute_policy_loss_vanilla(**inputs, loss_agg_mode=agg, config=config, rollout_is_weights=None)[1]
    for name in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"):
        assert ours[name] == pytest.approx(float(theirs[name]), rel=1e-6, abs=1e-7), name
    assert ours["actor/pg_clipfrac"] > 0 and ours["actor/pg_clipfrac_lower"] > 0
