"""The field's estimators (issue 34): REINFORCE++(-baseline), MaxRL, the James–Stein shrinkage baseline,
GDPO and grpo's ``scale``, each against a straightforward loop written here, plus the properties their
papers guarantee (hypothesis). Equality with verl's and TRL's own code: test_integration_verl.py,
test_integration_trl.py."""
from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from creditrl.utils.imports import is_builtin
from creditrl import compute_advantages, list_estimators
from creditrl.core.estimators import check_group_size
from creditrl.core.estimators.labels import all_labels
from creditrl.core.estimators.registry import get_estimator
from test_leave_one_out import random_batch

NEW = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "maxrl", "shrinkage", "gdpo")
ROOT = Path(__file__).resolve().parents[1]


def make_batch(seed: int, sizes=(3, 4, 1, 5, 2), token_rewards: bool = False):
    """test_leave_one_out's batch (shuffled group ids, a singleton, holey masks, an empty response)
    without energies."""
    batch = random_batch(seed, sizes, token_rewards=token_rewards)
    del batch["energy"]
    return batch


def members(group):
    return {gid: [i for i in range(group.numel()) if group[i] == gid] for gid in group.unique().tolist()}


def seq_rewards(batch):
    r = batch["rewards"]
    return [float((r[i] * batch["mask"][i]).sum()) if r.dim() == 2 else float(r[i]) for i in range(r.shape[0])]


def loop_whiten(values, mask, eps):
    """values[b][t] over the valid tokens: (x - mean) / sqrt(var_{n-1} + eps), 0 elsewhere."""
    cells = [(b, t) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]
    n = len(cells)
    mean = sum(values[b][t] for b, t in cells) / max(n, 1)
    var = sum((values[b][t] - mean) ** 2 for b, t in cells) / max(n - 1, 1)
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for b, t in cells:
        out[b, t] = (values[b][t] - mean) / math.sqrt(var + eps)
    return out


def loop_returns(batch, gamma):
    mask, r = batch["mask"], batch["rewards"]
    out = [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    for b in range(mask.shape[0]):
        acc, valid = 0.0, [t for t in range(mask.shape[1]) if mask[b, t]]
        for t in reversed(valid):     # a [B] outcome reward arrives at the last valid token
            acc = (float(r[b, t]) if r.dim() == 2 else float(r[b]) * (t == valid[-1])) + gamma * acc
            out[b][t] = acc
    return out


def loop_centred(batch):
    r, out = seq_rewards(batch), [0.0] * len(batch["group"])
    for idx in members(batch["group"]).values():
        if len(idx) > 1:
            mean = sum(r[i] for i in idx) / len(idx)
            for i in idx:
                out[i] = r[i] - mean
    return out


def broadcast(values, mask):
    return torch.tensor(values, dtype=torch.float64)[:, None] * mask


def check(ours, ref, atol=2e-5):
    torch.testing.assert_close(ours.double(), ref.double(), atol=atol, rtol=1e-5)


# ---------------------------------------------------------------- loop references


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma", [1.0, 0.8])
@pytest.mark.parametrize("token_rewards", [False, True])
def test_reinforce_plus_plus_matches_loop(seed, gamma, token_rewards):
    batch = make_batch(seed, token_rewards=token_rewards)
    ours = compute_advantages("reinforce_plus_plus", **batch, gamma=gamma)
    check(ours, loop_whiten(loop_returns(batch, gamma), batch["mask"], 1e-8))


@pytest.mark.parametrize("seed", range(4))
def test_reinforce_plus_plus_baseline_matches_loop(seed):
    batch = make_batch(seed)
    per_row = loop_centred(batch)
    values = [[per_row[b]] * batch["mask"].shape[1] for b in range(len(per_row))]
    check(compute_advantages("reinforce_plus_plus_baseline", **batch, eps=1e-6),
          loop_whiten(values, batch["mask"], 1e-6))


@pytest.mark.parametrize("seed", range(4))
def test_maxrl_matches_loop(seed):
    batch = make_batch(seed)
    batch["rewards"][batch["group"] == 7] = 0.0          # a group of all-zero rewards: mean 0
    r, out = seq_rewards(batch), [0.0] * len(batch["group"])
    for idx in members(batch["group"]).values():
        mean = sum(r[i] for i in idx) / len(idx)
        if len(idx) > 1 and mean > 0:
            for i in idx:
                out[i] = (r[i] - mean) / mean
    check(compute_advantages("maxrl", **batch), broadcast(out, batch["mask"]))


def loop_shrinkage(batch, leave_one_out):
    """The authors' construction, sample by sample (JSPO-Official compute_jspo_outcome_advantage), for
    ``leave_one_out``; the leave-in form from every prompt. Singletons: 0."""
    r, groups = seq_rewards(batch), members(batch["group"])
    prompts = {g: idx for g, idx in groups.items() if len(idx) > 1}
    out = [0.0] * len(r)

    def stats(keys):
        means = {g: sum(r[i] for i in prompts[g]) / len(prompts[g]) for g in keys}
        noise = {g: sum((r[i] - means[g]) ** 2 for i in prompts[g]) / (len(prompts[g]) - 1) / len(prompts[g])
                 for g in keys}
        grand = sum(means.values()) / len(keys)
        v2 = sum(noise.values()) / len(keys)
        s2 = sum((m - grand) ** 2 for m in means.values()) / len(keys)
        return grand, (v2 / (v2 + s2) if v2 + s2 > 0 else 0.0)

    for g, idx in prompts.items():
        others = [h for h in prompts if h != g]
        if leave_one_out:
            grand, lam = stats(others) if others else (0.0, 0.0)
        else:
            grand, lam = stats(list(prompts))
        for i in idx:
            own = [r[j] for j in idx if j != i] if leave_one_out else [r[j] for j in idx]
            out[i] = r[i] - ((1 - lam) * sum(own) / len(own) + lam * grand)
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("leave_one_out", [False, True])
def test_shrinkage_matches_loop(seed, leave_one_out):
    batch = make_batch(seed)
    check(compute_advantages("shrinkage", **batch, leave_one_out=leave_one_out),
          broadcast(loop_shrinkage(batch, leave_one_out), batch["mask"]))


def test_shrinkage_with_one_prompt_is_dr_grpo_or_rloo():
    batch = make_batch(0, sizes=(5, 1))
    check(compute_advantages("shrinkage", **batch), compute_advantages("dr_grpo", **batch))
    check(compute_advantages("shrinkage", **batch, leave_one_out=True), compute_advantages("rloo", **batch))


def loop_gdpo(components, weights, group, eps):
    b, k = components.shape
    z = [[0.0] * k for _ in range(b)]
    for idx in members(group).values():
        for c in range(k):
            vals = [(i, float(components[i, c])) for i in idx if not math.isnan(float(components[i, c]))]
            if len(vals) < 2:
                continue
            mean = sum(v for _, v in vals) / len(vals)
            std = math.sqrt(sum((v - mean) ** 2 for _, v in vals) / (len(vals) - 1))
            for i, v in vals:
                z[i][c] = (v - mean) / (std + eps)
    scored = [i for i in range(b) if not all(math.isnan(float(components[i, c])) for c in range(k))]
    total = [sum(w * zc for w, zc in zip(weights, z[i])) for i in range(b)]
    mean = sum(total[i] for i in scored) / len(scored)
    std = math.sqrt(sum((total[i] - mean) ** 2 for i in scored) / (len(scored) - 1))
    return [(total[i] - mean) / (std + eps) if i in scored else 0.0 for i in range(b)]


@pytest.mark.parametrize("seed", range(4))
def test_gdpo_matches_loop(seed):
    batch = make_batch(seed)
    g = torch.Generator().manual_seed(100 + seed)
    components = torch.stack([batch["rewards"], torch.randint(0, 3, batch["rewards"].shape, generator=g).float(),
                              torch.rand(batch["rewards"].shape, generator=g)], 1)
    components[1, 1] = float("nan")                      # a term that gave no reward
    components[2] = float("nan")                         # a response no term scored
    weights = [1.0, 0.5, -0.25]
    total = (components * torch.tensor(weights)).nansum(1)         # the reward the components make
    ours = compute_advantages("gdpo", **{**batch, "rewards": total}, components=components, component_weights=weights,
                              eps=1e-4)
    check(ours, broadcast(loop_gdpo(components, weights, batch["group"], 1e-4), batch["mask"]))
    # no components: the total reward is the one component
    total = batch["rewards"][:, None]
    check(compute_advantages("gdpo", **batch), broadcast(loop_gdpo(total, [1.0], batch["group"], 1e-6), batch["mask"]))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_scale_matches_loop(seed, scale):
    batch = make_batch(seed)
    r, centred = seq_rewards(batch), loop_centred(batch)
    groups = members(batch["group"])
    out = []
    for i, value in enumerate(centred):
        idx = next(v for v in groups.values() if i in v)
        if scale == "group":
            mean = sum(r[j] for j in idx) / len(idx)
            std = math.sqrt(sum((r[j] - mean) ** 2 for j in idx) / max(len(idx) - 1, 1))
        elif scale == "batch":
            mean = sum(r) / len(r)
            std = math.sqrt(sum((x - mean) ** 2 for x in r) / (len(r) - 1))
        else:
            std = 1.0 - 1e-6
        out.append(value / (std + 1e-6))
    check(compute_advantages("grpo", **batch, scale=scale), broadcast(out, batch["mask"]))


# ---------------------------------------------------------------- what the papers guarantee

rewards_st = st.lists(st.integers(0, 4), min_size=6, max_size=12)


def batch_from(values, group_size=3, steps=4):
    rewards = torch.tensor(values[: len(values) // group_size * group_size], dtype=torch.float32)
    group = torch.arange(rewards.numel()) // group_size
    mask = torch.ones(rewards.numel(), steps)
    return dict(rewards=rewards, mask=mask, group=group)


@settings(max_examples=40, deadline=None)
@given(rewards_st, st.floats(0.1, 10.0), st.floats(-5.0, 5.0))
def test_reinforce_plus_plus_is_whitened_and_affine_invariant(values, scale, shift):
    batch = batch_from(values)
    for name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        adv = compute_advantages(name, **batch).double()
        valid = batch["mask"].bool()
        n = int(valid.sum())
        assert abs(float(adv[valid].sum())) <= 1e-4 * n
        second = float(adv[valid].square().sum()) / (n - 1)
        assert second <= 1 + 1e-5 and (second == 0 or second >= 1 - 1e-3)   # variance/(variance+eps)
        moved = compute_advantages(name, **{**batch, "rewards": batch["rewards"] * scale + shift}).double()
        if second > 0.5:     # well above eps: whitening removes any affine change of the rewards
            torch.testing.assert_close(moved, adv, atol=1e-3, rtol=1e-3)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 1), min_size=6, max_size=12), st.floats(0.1, 10.0))
def test_maxrl_reweights_successes_by_inverse_pass_rate(values, scale):
    """Binary rewards: A_i + 1 = R_i / p̂ (the 1/p weighting of maximum likelihood), each group's
    advantages sum to 0, the advantage does not depend on the reward's scale; p̂ = 0 gives 0."""
    batch = batch_from(values)
    adv = compute_advantages("maxrl", **batch)[:, 0].double()
    r, group = batch["rewards"].double(), batch["group"]
    for gid in group.unique():
        rows = group == gid
        p = float(r[rows].mean())
        if p == 0:
            assert torch.all(adv[rows] == 0)
            continue
        torch.testing.assert_close(adv[rows] + 1, r[rows] / p)
        assert abs(float(adv[rows].sum())) < 1e-5
    scaled = compute_advantages("maxrl", **{**batch, "rewards": batch["rewards"] * scale})[:, 0].double()
    torch.testing.assert_close(scaled, adv, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_maxrl_is_the_gradient_of_the_order_n_minus_1_truncation(size):
    """Exact enumeration of every N-tuple of a 3-armed softmax bandit (arm 0 succeeds): (1/N) E[Σ_i A_i
    ∇log π(y_i)] is ∇J_{N-1}, J_n = -Σ_{k<=n} (1-p)^k / k (the docstring's claim), not ∇J_N."""
    import itertools
    theta = torch.tensor([-0.7, 0.4, 0.1], dtype=torch.float64, requires_grad=True)
    probs = torch.softmax(theta, 0)

    def truncation_grad(n):
        value = -sum((1 - probs[0]) ** k / k for k in range(1, n + 1))
        return torch.autograd.grad(value, theta, retain_graph=True)[0] if n else torch.zeros(3, dtype=torch.float64)
    tuples = list(itertools.product(range(3), repeat=size))
    rewards = torch.tensor([float(arm == 0) for t in tuples for arm in t])
    adv = compute_advantages("maxrl", rewards=rewards, mask=torch.ones(len(rewards), 1),
                             group=torch.arange(len(tuples)).repeat_interleave(size))[:, 0].double()
    p = probs.detach()
    expected = torch.zeros(3, dtype=torch.float64)
    for i, arms in enumerate(tuples):
        weight = float(torch.prod(p[list(arms)]))
        for j, arm in enumerate(arms):
            score = -p.clone()
            score[arm] += 1                              # ∇_θ log softmax(θ)[arm]
            expected += weight * float(adv[i * size + j]) * score
    expected /= size
    # float32 advantages: relative rounding ~1e-7 of each term
    torch.testing.assert_close(expected, truncation_grad(size - 1), rtol=1e-6, atol=1e-7)
    assert float((expected - truncation_grad(size)).abs().max()) > 1e-3


@settings(max_examples=40, deadline=None)
@given(rewards_st, st.integers(0, 5), st.floats(-3.0, 3.0))
def test_shrinkage_leave_one_out_baseline_ignores_the_own_reward(values, which, delta):
    """Unbiasedness of the paper's form: b_i does not depend on R_i, so changing R_i by δ changes A_i
    by exactly δ."""
    batch = batch_from(values)
    which = which % batch["rewards"].numel()
    base = compute_advantages("shrinkage", **batch, leave_one_out=True)[:, 0].double()
    moved_rewards = batch["rewards"].clone()
    moved_rewards[which] += delta
    moved = compute_advantages("shrinkage", **{**batch, "rewards": moved_rewards}, leave_one_out=True)[:, 0].double()
    assert abs(float(moved[which] - base[which]) - delta) < 1e-5


@settings(max_examples=40, deadline=None)
@given(rewards_st, st.floats(0.1, 10.0), st.floats(-5.0, 5.0))
def test_shrinkage_baseline_lies_between_the_prompt_and_the_batch_mean(values, scale, shift):
    batch = batch_from(values)
    r, group = batch["rewards"].double(), batch["group"]
    adv = compute_advantages("shrinkage", **batch)[:, 0].double()
    baseline = r - adv
    grand = float(torch.stack([r[group == g].mean() for g in group.unique()]).mean())
    for gid in group.unique():
        own = float(r[group == gid].mean())
        low, high = min(own, grand), max(own, grand)
        assert torch.all(baseline[group == gid] >= low - 1e-5) and torch.all(baseline[group == gid] <= high + 1e-5)
    moved = compute_advantages("shrinkage", **{**batch, "rewards": batch["rewards"] * scale + shift})[:, 0].double()
    torch.testing.assert_close(moved, adv * scale, atol=1e-4 * max(scale, 1), rtol=1e-4)


@settings(max_examples=40, deadline=None)
@given(rewards_st, st.lists(st.floats(0.1, 10.0), min_size=2, max_size=2),
       st.lists(st.floats(-5.0, 5.0), min_size=2, max_size=2))
def test_gdpo_ignores_each_components_scale_and_offset(values, scales, shifts):
    """The point of normalise-then-sum: each component's own affine scale (a > 0) drops out (up to eps),
    so no term dominates by its units; each group's summed z-scores add up to 0."""
    batch = batch_from(values)
    second = torch.tensor(values[::-1][: batch["rewards"].numel()], dtype=torch.float32) % 3
    components = torch.stack([batch["rewards"], second], 1)
    adv = compute_advantages("gdpo", **{**batch, "rewards": components.sum(1)}, components=components,
                             eps=1e-9)[:, 0].double()
    moved = components * torch.tensor(scales) + torch.tensor(shifts)
    again = compute_advantages("gdpo", **{**batch, "rewards": moved.sum(1)}, components=moved, eps=1e-9)[:, 0].double()
    torch.testing.assert_close(again, adv, atol=1e-4, rtol=1e-4)
    for gid in batch["group"].unique():
        assert abs(float(adv[batch["group"] == gid].sum())) < 1e-4


@settings(max_examples=40, deadline=None)
@given(rewards_st, st.floats(0.1, 10.0), st.floats(-5.0, 5.0))
def test_grpo_batch_scale_is_dr_grpo_over_one_batch_std(values, scale, shift):
    batch = batch_from(values)
    r = batch["rewards"].double()
    adv = compute_advantages("grpo", **batch, scale="batch", eps=1e-9).double()
    expected = compute_advantages("dr_grpo", **batch).double() / (float(r.std()) + 1e-9)
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)
    if float(r.std()) > 0:
        moved = compute_advantages("grpo", **{**batch, "rewards": batch["rewards"] * scale + shift},
                                   scale="batch", eps=1e-9).double()
        torch.testing.assert_close(moved, adv, atol=1e-3, rtol=1e-3)


# ---------------------------------------------------------------- degenerate input, bad input


def test_gdpo_components_that_cancel_give_zero_not_an_amplified_residue():
    """z_1 = -z_2 in every response: S = 0 exactly, and the eps terms' residue divided by its own batch
    spread would be O(1) advantages (TRL's and verl's formula do that)."""
    r = torch.tensor([1.0, 0.0, 1.0, 3.0, 1.0, 3.0, 3.0, 4.0, 3.0])
    mirrored = torch.stack([r, -3.0 * r + 1.0], 1)
    for eps in (1e-9, 1e-6, 1e-4):
        adv = compute_advantages("gdpo", rewards=mirrored.sum(1), mask=torch.ones(9, 2), group=torch.arange(9) // 3,
                                 components=mirrored, eps=eps)
        assert torch.equal(adv, torch.zeros(9, 2))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=6, max_size=12), st.floats(0.1, 10.0), st.floats(0.1, 10.0),
       st.floats(-5.0, 5.0), st.floats(-5.0, 5.0))
def test_gdpo_components_that_cancel_after_float32_rounding_give_zero(values, scale, mirror, shift, offset):
    """Mirrored components (z_2 = -z_1 in exact arithmetic: a z-score ignores a positive scale and a
    shift) each scaled and shifted in float32: the products' rounding leaves S ~ 1e-7 in every
    response, which dividing by its own batch spread would turn into O(1) advantages; it is within
    float32 rounding of 0, so A = 0 exactly."""
    batch = batch_from(values)
    r = batch["rewards"]
    components = torch.stack([r * scale + shift, r * -mirror + offset], 1)         # float32 products
    adv = compute_advantages("gdpo", **{**batch, "rewards": components.sum(1)}, components=components, eps=1e-9)
    assert torch.equal(adv, torch.zeros_like(adv))


@pytest.mark.parametrize("offset", [0.0, 1e6, -4e6])
def test_gdpo_of_one_component_keeps_its_signal_at_any_offset(offset):
    """One component cannot cancel: rewards offset by 1e6 (4e6 times their spread, exact in float32) are
    GDPO's z-scores as without the offset (they once read as float32 rounding and gave A = 0), and
    as the loop gives."""
    spread = torch.tensor([0.0, 0.25, 0.5, 0.75, 0.0, 0.0, 1.0, 1.0])
    group = torch.arange(8) // 4
    adv = compute_advantages("gdpo", rewards=spread + offset, mask=torch.ones(8, 2), group=group)
    expected = torch.tensor(loop_gdpo(spread.double()[:, None], [1.0], group, 1e-6), dtype=torch.float64)
    assert float(expected.abs().max()) > 1.0
    torch.testing.assert_close(adv[:, 0].double(), expected, rtol=1e-5, atol=1e-5)


def test_gdpo_keeps_a_small_signal_beyond_float32_rounding():
    """Mirrored components with one value moved by 1e-3 (1,000x float32 rounding of the values) in a group
    of three distinct values (so its z-scores change): the signal S ~ 1e-3 is kept and scaled as the loop does."""
    r = torch.tensor([1.0, 0.0, 2.0, 3.0, 1.0, 4.0, 3.0, 4.0, 0.0])
    components = torch.stack([r, -r], 1)
    components[4, 1] += 1e-3
    group = torch.arange(9) // 3
    adv = compute_advantages("gdpo", rewards=components.sum(1), mask=torch.ones(9, 2), group=group,
                             components=components, eps=1e-9)
    expected = torch.tensor(loop_gdpo(components.double(), [1.0, 1.0], group, 1e-9), dtype=torch.float64)
    assert float(expected.abs().max()) > 1.0                     # the moved group's responses carry O(1) advantages
    torch.testing.assert_close(adv[:, 0].double(), expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(adv[:, 1], adv[:, 0])


def test_degenerate_batches_give_zero_not_nan():
    batch = dict(rewards=torch.ones(6), mask=torch.ones(6, 3), group=torch.arange(6) // 3)
    for name in NEW:
        assert torch.equal(compute_advantages(name, **batch), torch.zeros(6, 3)), name
    zero = dict(batch, rewards=torch.zeros(6))
    assert torch.equal(compute_advantages("maxrl", **zero), torch.zeros(6, 3))
    signed = dict(batch, rewards=torch.tensor([0.0, 1.0, 0.0, 2.0, -1.0, 1.0]))       # ±1 rewards: refused
    with pytest.raises(ValueError, match=r"rewards: maxrl needs rewards >= 0 .* got -1 in row 4 \(1 negative"):
        compute_advantages("maxrl", **signed)
    one_token = dict(rewards=torch.tensor([0.0, 1.0]), mask=torch.tensor([[1.0, 0.0], [0.0, 0.0]]),
                     group=torch.zeros(2, dtype=torch.long))
    assert torch.equal(compute_advantages("reinforce_plus_plus", **one_token), torch.zeros(2, 2))


@pytest.mark.parametrize("call, message", [
    (dict(name="rloo", scale="batch"), r"rloo: unknown option\(s\) \['scale'\]; valid options are \[\]"),
    (dict(name="gdpo", scale="batch"), r"gdpo: unknown option\(s\) \['scale'\]"),
    (dict(name="grpo", scale="global"), r"grpo.scale: unknown value 'global'; valid values are \['group', 'batch', 'none'\]"),
    (dict(name="reinforce_plus_plus", eps=0.0), r"reinforce_plus_plus.eps: expected a value in \(0, 3.40282e\+38\], got"),
    (dict(name="gdpo", eps=-1.0), r"gdpo.eps: expected a value in \(0, 3.40282e\+38\], got"),
    (dict(name="maxrl", leave_one_out=True), r"maxrl: unknown option\(s\) \['leave_one_out'\]"),
    (dict(name="gdpo", components=torch.ones(6, 2, 1)), r"components: expected a 2-D tensor"),
    (dict(name="gdpo", components=torch.ones(5, 2)), r"components: expected shape \[6, \*\], got \[5, 2\]"),
    (dict(name="gdpo", components=torch.full((6, 2), float("inf"))), r"components: expected finite values or NaN"),
    (dict(name="gdpo", components=torch.ones(6, 2), component_weights=[1.0]), r"component_weights: expected shape \[2\]"),
    (dict(name="gdpo", component_weights=[1.0]), r"component_weights: given without components"),
])
def test_bad_options_are_refused_naming_the_key(call, message):
    call = dict(call)
    name = call.pop("name")
    with pytest.raises((ValueError, TypeError), match=message):
        compute_advantages(name, rewards=torch.ones(6), mask=torch.ones(6, 3), group=torch.arange(6) // 3, **call)


def test_group_size_one():
    """Singletons learn only where the estimator compares responses across prompts."""
    assert check_group_size("reinforce_plus_plus", {}, 1)
    for name in ("reinforce_plus_plus_baseline", "maxrl", "shrinkage", "gdpo"):
        assert not check_group_size(name, {}, 1), name


# ---------------------------------------------------------------- the registry reaches every front end


def test_facts_are_declared_in_the_decorator():
    assert get_estimator("reinforce_plus_plus").token_level and "gamma" in get_estimator("reinforce_plus_plus").options
    assert not get_estimator("reinforce_plus_plus_baseline").token_level
    assert get_estimator("gdpo").reward_components
    assert {n for n in list_estimators() if get_estimator(n).batch_level} == {
        "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gdpo", "shrinkage"}
    assert get_estimator("shrinkage").leave_one_out and "shrinkage+loo" in all_labels(None)
    assert get_estimator("grpo").options["scale"] == "group"
    assert set(NEW) <= set(list_estimators())


def test_every_estimator_is_listed_by_the_cli_the_docs_and_the_readme():
    env = {"PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "creditrl.cli", "estimators"], capture_output=True, text=True,
                         env=env, timeout=120).stdout
    config = (ROOT / "docs" / "config.md").read_text()
    table = (ROOT / "README.md").read_text().split("## Estimators", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([a-z_+]+)` \|.*\| ([^|]+) \|$", table, re.M)}
    builtin = [n for n in list_estimators() if is_builtin(get_estimator(n).fn)]   # not other tests' plug-ins
    assert set(NEW) <= set(builtin)
    for name in builtin:
        assert name in out, name
        assert f"### `{name}`" in config, name
        assert name in rows and rows[name].strip(), f"README's estimator table lacks {name} or its source"
    assert "algorithm.options.scale" in config


def test_every_description_is_its_whole_first_paragraph():
    """``creditrl estimators`` and docs/config.md show each estimator's and loss term's first paragraph,
    whole: a docstring's first line cut sentences mid-way ("... s_i = (K/N) mu_i,")."""
    from creditrl.core.estimators.registry import get_estimator, list_estimators
    from creditrl.core.losses.terms import get_loss_term, list_loss_terms
    from creditrl.utils.options import doc_summary

    assert doc_summary("A b,\n    c d (eq. 1):\n\n        x = y\n") == "A b, c d (eq. 1)"
    assert doc_summary(None) == "" and doc_summary("One.") == "One."
    specs = [get_estimator(n) for n in list_estimators()] + [get_loss_term(n) for n in list_loss_terms()]
    for spec in specs:       # a test's own registration may have no docstring: an empty description
        first = " ".join(x.strip() for x in (spec.fn.__doc__ or "").strip().split("\n\n")[0].splitlines())
        assert spec.doc == first.rstrip(":"), spec.name
        assert not spec.doc.endswith((",", ":")) and "\n" not in spec.doc, spec.name
