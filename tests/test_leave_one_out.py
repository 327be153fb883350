"""The ``leave_one_out`` option of ``otb``, ``otb_isolated``, ``ogb`` and ``opo``: loops, the exact
leave-in identity A = (1 − ω)·A^LOO, and unbiasedness by enumerating every group outcome."""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from creditrl import compute_advantages
from creditrl.core.groups import GroupIndex
from enumerable_policy import GROUP, THETA, estimator_output, outcome_gradients, true_gradient
from tolerances import sum_rtol

LOO = ("otb", "otb_isolated", "ogb", "opo")
TOKEN_LEVEL = ("otb", "otb_isolated")
# Tolerances (tests/tolerances.py): every quantity here is a sum over at most one group's valid tokens
# (groups of <= 5 x 7 steps: 35 terms) of values <= 7 (returns of <= 7 token rewards in [-1, 1], rewards 0..2;
# cumulative energies <= 7). F32: compute_advantages' float32 output. F32_WEIGHTS: the leave-one-out forms
# run in float64 but sum their energies in float32, as the leave-in forms do; a weighted baseline's ratio
# moves by at most twice its weights' relative rounding times its values. F64: a float64 path throughout.
F32 = sum_rtol(35) * 7
F32_WEIGHTS = 2 * sum_rtol(35) * 7
F64 = sum_rtol(35, torch.float64) * 7


def random_batch(seed: int, sizes=(3, 4, 1, 5, 2), steps: int = 7, token_rewards: bool = False):
    """Shuffled non-contiguous group ids, holey masks, an empty response, energies with exact zeros,
    a group whose energies are all zero."""
    g = torch.Generator().manual_seed(seed)
    group = torch.repeat_interleave(torch.tensor([11, -3, 40, 7, 2][: len(sizes)]), torch.tensor(sizes))
    group = group[torch.randperm(group.numel(), generator=g)]
    num = group.numel()
    mask = torch.rand(num, steps, generator=g) < 0.7
    mask[0] = False
    energy = torch.rand(num, steps, generator=g) * (torch.rand(num, steps, generator=g) < 0.7)
    energy[group == 2] = 0.0
    rewards = (torch.randint(-4, 5, (num, steps), generator=g) / 4 * mask if token_rewards  # exact sums
               else torch.randint(0, 3, (num,), generator=g).float())
    return dict(rewards=rewards, mask=mask, group=group, energy=energy)


def member_steps(batch):
    """Per row: the valid columns, the per-step returns G_t and energies (float64 lists)."""
    mask, r = batch["mask"], batch["rewards"].double()
    out = []
    for b in range(mask.shape[0]):
        cols = [t for t in range(mask.shape[1]) if mask[b, t]]
        if r.dim() == 2:  # γ = 1 returns-to-go over valid steps (rewards sit on valid tokens here)
            returns = [sum(r[b, c].item() for c in cols[k:]) for k in range(len(cols))]
        else:
            returns = [r[b].item()] * len(cols)
        out.append((cols, returns, [batch["energy"][b, c].item() for c in cols]))
    return out


def weights_of(energies: list[float], cumulative: bool) -> list[float]:
    return list(itertools.accumulate(energies)) if cumulative else list(energies)


def weighted_or_plain(values: list[float], weights: list[float]) -> float:
    total = sum(weights)
    return sum(v * w for v, w in zip(values, weights)) / total if total > 0 else sum(values) / len(values)


def loop_token(batch, cumulative: bool, leave_one_out: bool):
    """OTB / isolated straight from the definitions (module docstring of ``estimators.otb``)."""
    rows = member_steps(batch)
    out = torch.zeros(batch["mask"].shape, dtype=torch.float64)
    for gid in batch["group"].unique().tolist():
        members = [b for b in range(len(rows)) if batch["group"][b] == gid]
        for i in members:
            cols, returns, energies = rows[i]
            w_i = weights_of(energies, cumulative)
            others = [j for j in members if j != i]
            for t, col in enumerate(cols):
                live = [j for j in others if len(rows[j][0]) > t]
                if leave_one_out:
                    if not [j for j in others if rows[j][0]]:
                        continue                                  # no other non-empty member: 0
                    if live:
                        base = weighted_or_plain([rows[j][1][t] for j in live],
                                                 [weights_of(rows[j][2], cumulative)[t] for j in live])
                    else:                                         # i outlives the others: their final returns
                        base = sum(rows[j][1][-1] for j in others if rows[j][0]) / len(
                            [j for j in others if rows[j][0]])
                else:
                    if not live:
                        continue                                  # a single live member: 0
                    group_live = [i] + live
                    base = weighted_or_plain([rows[j][1][t] for j in group_live],
                                             [w_i[t] if j == i else weights_of(rows[j][2], cumulative)[t]
                                              for j in group_live])
                out[i, col] = returns[t] - base
    return out


def loop_sequence(batch, name: str, leave_one_out: bool):
    """OPO / OGB: R − Σ u R / Σ u over the group (or the others), plain mean where Σ u = 0."""
    mask, r = batch["mask"], batch["rewards"].double()
    r = (r * mask).sum(1) if r.dim() == 2 else r
    u = mask.sum(1).double() if name == "opo" else (batch["energy"].double() * mask).sum(1)
    out = torch.zeros(mask.shape[0], dtype=torch.float64)
    for gid in batch["group"].unique().tolist():
        members = [b for b in range(mask.shape[0]) if batch["group"][b] == gid]
        if len(members) == 1:
            continue
        for i in members:
            pool = [j for j in members if j != i] if leave_one_out else members
            out[i] = r[i] - weighted_or_plain([r[j].item() for j in pool], [u[j].item() for j in pool])
    return out[:, None] * mask


def loop(batch, name, leave_one_out):
    if name in TOKEN_LEVEL:
        return loop_token(batch, name == "otb", leave_one_out)
    return loop_sequence(batch, name, leave_one_out)


# ---------------------------------------------------------------- values against loops


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("token_rewards", [False, True])
@pytest.mark.parametrize("name", LOO)
def test_leave_one_out_matches_loop(name, seed, token_rewards):
    batch = random_batch(seed, token_rewards=token_rewards)
    got = compute_advantages(name, **batch, leave_one_out=True).double()
    torch.testing.assert_close(got, loop(batch, name, True), atol=F32, rtol=0)
    exact = estimator_output(name, batch, leave_one_out=True)
    tol = F64 if name == "opo" else F32_WEIGHTS     # OPO's weights are lengths: exact
    torch.testing.assert_close(exact, loop(batch, name, True), atol=tol, rtol=0)
    default = compute_advantages(name, **batch).double()        # the option's default is the paper's form
    torch.testing.assert_close(default, loop(batch, name, False), atol=F32, rtol=0)


def own_share(batch, name: str) -> torch.Tensor:
    """ω [B,T]: each valid token's (or response's) share of its step's (group's) weights, from a loop;
    1/n where the weights sum to 0; 1 where the member is alone."""
    rows = member_steps(batch)
    omega = torch.zeros(batch["mask"].shape, dtype=torch.float64)
    for b, (cols, _, energies) in enumerate(rows):
        members = [j for j in range(len(rows)) if batch["group"][j] == batch["group"][b]]
        for t, col in enumerate(cols):
            if name in TOKEN_LEVEL:
                live = [j for j in members if len(rows[j][0]) > t]
                w = {j: weights_of(rows[j][2], name == "otb")[t] for j in live}
            else:
                live = members
                w = {j: float(len(rows[j][0])) if name == "opo" else sum(rows[j][2]) for j in live}
            total = sum(w.values())
            omega[b, col] = w[b] / total if total > 0 else 1.0 / len(live)
    return omega


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("token_rewards", [False, True])
@pytest.mark.parametrize("name", LOO)
def test_leave_in_is_the_loo_advantage_shrunk_by_the_own_share(name, seed, token_rewards):
    """A = (1 − ω)·A^LOO exactly: the definitions' leave-in value (a loop) against the library's LOO."""
    batch = random_batch(seed, token_rewards=token_rewards)
    loo = estimator_output(name, batch, leave_one_out=True)
    tol = F64 if name == "opo" else F32_WEIGHTS     # OPO's weights are lengths: exact
    torch.testing.assert_close(loop(batch, name, False), (1 - own_share(batch, name)) * loo, atol=tol, rtol=0)


def test_loo_edge_cases_are_defined_and_finite():
    """Others' weights all 0 → their plain mean; no other member alive at a step → the others' final
    returns; a singleton or only empty others → 0; a member with all the weight keeps the others' mean."""
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    energy = torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [1e-30, 0, 0, 0], [0, 0, 0, 0]])
    rewards = torch.tensor([1.0, 0.0, 2.0, 5.0, 3.0])
    group = torch.tensor([0, 0, 0, 1, 1])
    adv = compute_advantages("otb", rewards=rewards, mask=mask, group=group, energy=energy, leave_one_out=True)
    assert torch.isfinite(adv).all()
    # row 0: others' cumulative energies are 0 → plain mean of the others alive (rows 1, 2 at t=0: 1.0;
    # row 1 at t=1: 0.0); at t=2, 3 no other member is alive → the others' final returns, mean 1.0
    torch.testing.assert_close(adv[0], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    # row 1: row 0 holds all the weight (1.0) → baseline R_0 = 1 at both steps
    torch.testing.assert_close(adv[1, :2], torch.tensor([-1.0, -1.0]))
    assert torch.equal(adv[3], torch.zeros(4))                   # its only other member is empty
    assert torch.equal(adv[4], torch.zeros(4))
    seq = compute_advantages("ogb", rewards=rewards, mask=mask, group=group, energy=energy, leave_one_out=True)
    # group 1: each member's only other member has zero energy → the plain mean of the others
    torch.testing.assert_close(seq[3, :3], torch.full((3,), 5.0 - 3.0))
    alone = compute_advantages("opo", rewards=torch.tensor([1.0]), mask=torch.ones(1, 2), group=torch.tensor([0]),
                               leave_one_out=True)
    assert torch.equal(alone, torch.zeros(1, 2))


def test_exclusive_sum_does_not_cancel():
    """A member holding almost all of a group's weight leaves the others' tiny sum exact."""
    x = torch.tensor([1e20, 1e-3, 2e-3, 5.0, 6.0], dtype=torch.float64)
    for ids in (torch.tensor([0, 0, 0, 1, 1]), torch.tensor([7, 3, 7, 3, 7])):   # unequal sizes, interleaved
        got = GroupIndex.from_ids(ids).exclusive_sum(x)
        for i in range(5):
            assert got[i].item() == sum(x[j].item() for j in range(5) if ids[j] == ids[i] and j != i)
    blocks = GroupIndex.from_ids(torch.tensor([0, 0, 1, 1]))
    assert blocks.block == 2
    assert torch.equal(blocks.exclusive_sum(torch.tensor([[1e20, 1.0], [1e-3, 2.0], [3.0, 4.0], [5.0, 6.0]],
                                                        dtype=torch.float64)),
                       torch.tensor([[1e-3, 2.0], [1e20, 1.0], [5.0, 6.0], [3.0, 4.0]], dtype=torch.float64))


# ---------------------------------------------------------------- hypothesis properties


@st.composite
def batches(draw):
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    steps = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 10_000))
    batch = random_batch(seed, sizes=tuple(sizes), steps=steps)
    return batch


@settings(max_examples=40, deadline=None)
@given(batch=batches(), name=st.sampled_from(LOO), row=st.integers(0, 30), delta=st.floats(-3, 3))
def test_loo_baseline_ignores_the_response_itself(batch, name, row, delta):
    """A^LOO_i moves by exactly ΔR_i when R_i changes, and not at all when i's energies change."""
    i = row % batch["mask"].shape[0]
    base = estimator_output(name, batch, leave_one_out=True)
    moved = dict(batch, rewards=batch["rewards"].clone())
    moved["rewards"][i] += delta
    shifted = estimator_output(name, moved, leave_one_out=True)
    sizes = GroupIndex.from_ids(batch["group"]).member_sizes()
    others = [j for j in range(len(sizes)) if batch["group"][j] == batch["group"][i] and j != i
              and bool(batch["mask"][j].any())]
    if others:
        change = moved["rewards"][i].double() - batch["rewards"][i].double()   # delta as float32 holds it
        expected = base[i] + change * batch["mask"][i]
        # the own reward enters A^LOO_i once, in float64: one more rounding of values <= 3 + 7
        torch.testing.assert_close(shifted[i], expected, atol=F64 * 10 / 7, rtol=0)
    energised = dict(batch, energy=batch["energy"].clone())
    energised["energy"][i] = energised["energy"][i] * 3.0 + 0.5
    torch.testing.assert_close(estimator_output(name, energised, leave_one_out=True)[i], base[i], atol=F64, rtol=0)


@settings(max_examples=40, deadline=None)
@given(batch=batches(), name=st.sampled_from(LOO), shift=st.floats(-5, 5), scale=st.floats(0.1, 10))
def test_loo_is_translation_invariant_and_scale_equivariant(batch, name, shift, scale):
    base = estimator_output(name, batch, leave_one_out=True)
    moved = dict(batch, rewards=batch["rewards"] * scale + shift)
    # rewards·scale + shift rounded to float32, then F32_WEIGHTS on values <= 2·scale + |shift|
    torch.testing.assert_close(estimator_output(name, moved, leave_one_out=True), base * scale,
                               atol=F32_WEIGHTS / 7 * (2 * scale + abs(shift)), rtol=0)


# ---------------------------------------------------------------- unbiasedness by enumeration

def expected_estimate(theta: torch.Tensor, eos: bool, name: str, **options) -> torch.Tensor:
    """E[ĝ] over every outcome of a group of 3, ĝ = (1/N) Σ_i Σ_t A_t^(i) s_t^(i), in float64."""
    grads, prob = outcome_gradients(theta, eos, [(name, options)])
    assert abs(float(prob.sum()) - 1.0) < sum_rtol(prob.numel(), torch.float64)
    return prob @ grads[:, 0]


# E[ĝ] and ∇J are float64 sums over a group's outcomes (at most 15³ = 3375) of terms <= 2 (advantages exact in
# float32 here: rewards 0/1, groups of 3): each within 3375 eps64 x 2 of the exact value
ENUMERATION = 2 * sum_rtol(3375, torch.float64) * 2


@pytest.mark.parametrize("eos", [False, True], ids=["fixed-length", "eos-ended"])
@pytest.mark.parametrize("name", [*LOO, "rloo"])
def test_leave_one_out_is_unbiased_by_enumeration(name, eos):
    """Every group outcome of a policy with shared parameters (3 positions, vocabulary 2 or 3 with
    EOS, groups of 3): E[ĝ] = ∇J to 1e-9 for every leave_one_out form and for rloo."""
    options = {} if name == "rloo" else {"leave_one_out": True}
    grad = true_gradient(THETA, eos)
    assert float(grad.norm()) > 0.1
    torch.testing.assert_close(expected_estimate(THETA, eos, name, **options), grad, atol=ENUMERATION, rtol=0)


@pytest.mark.parametrize("eos", [False, True], ids=["fixed-length", "eos-ended"])
def test_leave_in_forms_are_biased_by_enumeration(eos):
    """The same enumeration shows the leave-in forms' bias: dr_grpo is exactly (N−1)/N·∇J, and
    the energy- and length-weighted leave-in baselines miss ∇J (so the test above can fail)."""
    grad = true_gradient(THETA, eos)
    torch.testing.assert_close(expected_estimate(THETA, eos, "dr_grpo"), grad * (GROUP - 1) / GROUP, atol=ENUMERATION,
                               rtol=0)
    for name in LOO:
        if name == "opo" and not eos:
            continue   # equal lengths: OPO's leave-in weights are constant, exactly (N−1)/N too
        assert float((expected_estimate(THETA, eos, name) - grad).norm()) > 1e-3 * float(grad.norm()), name
