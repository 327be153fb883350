"""compute_advantages and the non-max@K estimators against straightforward loop references."""
from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from creditrl import compute_advantages, list_estimators, register_estimator
from creditrl.core.estimators.steps import StepIndex, discounted_suffix_sum
from tolerances import EPS32, sum_rtol

ALL = ("dr_grpo", "ei", "grpo", "maxk_bon", "maxpo", "ogb", "opo", "otb", "otb_isolated", "passk_chen", "pkpo",
       "reinforce", "rloo")
CENTRED = ("dr_grpo", "grpo", "rloo", "opo", "ogb", "otb", "otb_isolated")
# Advantages are float32 (the output contract), the loops float64. Each advantage here is a few float32 sums
# over at most one group's valid tokens (groups of <= 5 responses x 9 steps: 45 terms) of values <= 10 in
# magnitude (rewards 0..2, or N(0,1) token rewards summed over <= 9 tokens, times energies <= 1 or
# discounts <= 1): within 45 eps32 of 10 per sum (tests/tolerances.py), ~5e-5, for every summation order.
F32 = sum_rtol(45) * 10


def make_batch(seed: int, sizes=(3, 4, 1, 5), steps: int = 9, token_rewards: bool = False):
    """Random batch: shuffled non-contiguous group ids, holey masks (prompt/tool tokens), an
    empty response, energies with exact zeros (certain tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([11, -3, 40, 7, 2, 5][: len(sizes)])
    group = torch.repeat_interleave(ids, torch.tensor(sizes))
    num = group.numel()
    perm = torch.randperm(num, generator=g)
    group = group[perm]
    mask = torch.rand(num, steps, generator=g) < 0.7
    mask[0] = False                                               # an empty response
    energy = torch.rand(num, steps, generator=g) * (torch.rand(num, steps, generator=g) < 0.8)
    if token_rewards:
        rewards = torch.randn(num, steps, generator=g) * mask
    else:
        rewards = torch.randint(0, 3, (num,), generator=g).float()
    return dict(rewards=rewards, mask=mask, group=group, energy=energy)


# ---------------------------------------------------------------- loop references


def ref_returns(rewards, mask, gamma):
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        valid = [t for t in range(mask.shape[1]) if mask[b, t]]
        acc = 0.0
        for t in reversed(valid):    # a [B] outcome reward arrives at the last valid token
            acc = (rewards[b, t].item() if rewards.dim() == 2 else rewards[b].item() * (t == valid[-1])) + gamma * acc
            out[b, t] = acc
    return out


def seq_rewards(batch):
    r = batch["rewards"]
    return (r * batch["mask"]).sum(1).double() if r.dim() == 2 else r.double()


def ref_sequence(name, batch, eps=1e-6):
    r, mask, group = seq_rewards(batch), batch["mask"], batch["group"]
    out = torch.zeros(r.numel(), dtype=torch.float64)
    for gid in group.unique().tolist():
        idx = [i for i in range(r.numel()) if group[i] == gid]
        vals = [r[i].item() for i in idx]
        n = len(idx)
        if n == 1:
            continue
        mean = sum(vals) / n
        for i, v in zip(idx, vals):
            if name == "dr_grpo":
                out[i] = v - mean
            elif name == "grpo":
                std = math.sqrt(sum((x - mean) ** 2 for x in vals) / (n - 1))
                out[i] = (v - mean) / (std + eps)
            elif name == "rloo":
                out[i] = v - (sum(vals) - v) / (n - 1)
            elif name in ("opo", "ogb"):
                w = [mask[j].sum().item() if name == "opo" else batch["energy"][j][mask[j]].double().sum().item()
                     for j in idx]
                base = sum(a * b for a, b in zip(w, vals)) / sum(w) if sum(w) > 0 else mean
                out[i] = v - base
    return out[:, None] * mask


def ref_otb(batch, cumulative=True, gamma=1.0, is_weights=None):
    mask, group = batch["mask"], batch["group"]
    energy = batch["energy"].double() * (1 if is_weights is None else is_weights.double() ** 2)
    returns = ref_returns(batch["rewards"], mask, gamma)
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for gid in group.unique().tolist():
        idx = [i for i in range(mask.shape[0]) if group[i] == gid]
        cols = {i: [t for t in range(mask.shape[1]) if mask[i, t]] for i in idx}
        w = {}
        for i in idx:
            run, w[i] = 0.0, []
            for t in cols[i]:
                run = run + energy[i, t].item() if cumulative else energy[i, t].item()
                w[i].append(run)
        for step in range(max(len(c) for c in cols.values())):
            live = [i for i in idx if len(cols[i]) > step]
            if len(live) < 2:
                continue
            gs = [returns[i, cols[i][step]].item() for i in live]
            ws = [w[i][step] for i in live]
            base = sum(a * b for a, b in zip(gs, ws)) / sum(ws) if sum(ws) > 0 else sum(gs) / len(gs)
            for i, gval in zip(live, gs):
                out[i, cols[i][step]] = gval - base
    return out


def run(name, batch, **options):
    return compute_advantages(name, **batch, **options).double()


# ---------------------------------------------------------------- values


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("token_rewards", [False, True])
@pytest.mark.parametrize("name", ["dr_grpo", "grpo", "rloo", "opo", "ogb"])
def test_sequence_estimators_match_loops(name, seed, token_rewards):
    batch = make_batch(seed, token_rewards=token_rewards)
    assert torch.allclose(run(name, batch), ref_sequence(name, batch), atol=F32, rtol=0)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_is_returns_to_go(seed, gamma):
    batch = make_batch(seed, token_rewards=True)
    got = run("reinforce", batch, gamma=gamma)
    assert torch.allclose(got, ref_returns(batch["rewards"], batch["mask"], gamma), atol=F32, rtol=0)
    outcome = make_batch(seed)
    want = outcome["rewards"][:, None].double() * outcome["mask"]
    assert torch.equal(run("reinforce", outcome), want)
    # its own result: one value per row where every valid token's return is R (broadcast by the
    # output contract), the [B,T] returns where token rewards spread over the row
    from creditrl.core.estimators import estimator_output
    assert estimator_output("reinforce", **outcome)[0].shape == outcome["rewards"].shape
    assert estimator_output("reinforce", **batch, gamma=gamma)[0].shape == batch["mask"].shape


@pytest.mark.parametrize("name", ["reinforce", "reinforce_plus_plus", "otb", "otb_isolated"])
@pytest.mark.parametrize("seed", range(3))
def test_outcome_rewards_are_discounted_from_the_last_valid_token(name, seed):
    """[B] rewards with gamma < 1 give what [B,T] rewards with R on each row's last valid token give (verl's
    form), G_t = γ^(L-1-t)·R, on holey masks with an empty row; not R on every token. The two paths
    (γ powers, and the blocked suffix sum) both work in float64 and round once to float32, so they
    may differ in the last float32 bit; whitening (reinforce_plus_plus) scales that by 1/std."""
    outcome = make_batch(seed)
    mask = outcome["mask"]
    on_last = torch.zeros(mask.shape)
    for b in range(mask.shape[0]):
        valid = mask[b].nonzero().flatten().tolist()
        if valid:
            on_last[b, valid[-1]] = outcome["rewards"][b]
    got = run(name, outcome, gamma=0.7)
    assert torch.allclose(got, run(name, {**outcome, "rewards": on_last}, gamma=0.7), rtol=2 * EPS32, atol=F32)
    if name == "reinforce":
        assert torch.allclose(got, ref_returns(outcome["rewards"], mask, 0.7), atol=F32, rtol=0)
        assert not torch.allclose(got, run(name, outcome))      # gamma changes the result


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), extra=st.sampled_from([None, 1e-30, -1e-30, 0.5, -0.0]),
       holes=st.booleans())
def test_returns_take_the_outcome_shortcut_only_when_every_other_reward_is_zero(seed, extra, holes):
    """``constant_returns`` (R on every valid token, no returns-to-go pass) must hold only when
    token rewards sit on each row's last valid token: one reward elsewhere, however tiny, takes
    the general path. A -0.0 elsewhere may take either path; both give the loop's returns."""
    from creditrl.core.estimators import build_batch
    g = torch.Generator().manual_seed(seed)
    rows, steps = 5, 9
    mask = torch.arange(steps)[None, :] < torch.randint(1, steps + 1, (rows,), generator=g)[:, None]
    if holes:
        mask &= torch.rand(rows, steps, generator=g) < 0.8
        mask[:, 0] = True
    last = steps - 1 - mask.flip(1).to(torch.uint8).argmax(1)
    rewards = torch.zeros(rows, steps)
    rewards[torch.arange(rows), last] = torch.randn(rows, generator=g)
    if extra is not None:
        row = int(torch.randint(rows, (1,), generator=g))
        earlier = torch.nonzero(mask[row, :last[row]]).flatten()
        if not earlier.numel():
            return
        rewards[row, earlier[0]] = extra
    batch = build_batch(rewards=rewards, mask=mask, group=torch.zeros(rows, dtype=torch.long))
    if extra is None or extra != 0.0:
        assert batch.constant_returns is (extra is None)
    torch.testing.assert_close(batch.returns.double(), ref_returns(rewards, mask, 1.0), atol=F32, rtol=0)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", ["otb", "otb_isolated"])
@pytest.mark.parametrize("token_rewards", [False, True])
def test_otb_matches_loop(name, seed, token_rewards):
    batch = make_batch(seed, token_rewards=token_rewards)
    gamma = 0.8 if token_rewards else 1.0
    got = run(name, batch, gamma=gamma)
    assert torch.allclose(got, ref_otb(batch, cumulative=name == "otb", gamma=gamma), atol=F32, rtol=0)


def test_is_weights_square_the_energy():
    batch = make_batch(5)
    rho = torch.rand(batch["mask"].shape, generator=torch.Generator().manual_seed(0)) * 2
    for name in ("otb", "otb_isolated", "ogb"):
        got = run(name, batch, is_weights=rho)
        # ρ² folded into the energies inside or outside: one float32 product's rounding apart per energy
        assert torch.allclose(got, run(name, {**batch, "energy": batch["energy"] * rho ** 2}), atol=F32, rtol=0)
    assert torch.allclose(run("otb", batch, is_weights=rho), ref_otb(batch, is_weights=rho), atol=F32, rtol=0)


def test_zero_energy_uses_plain_mean_not_zero():
    mask = torch.ones(3, 4, dtype=torch.bool)
    batch = dict(rewards=torch.tensor([1.0, 2.0, 6.0]), mask=mask, group=torch.zeros(3, dtype=torch.long),
                 energy=torch.zeros(3, 4))
    for name in ("otb", "otb_isolated", "ogb"):
        assert torch.allclose(run(name, batch), torch.tensor([-2.0, -1.0, 3.0]).double()[:, None].expand(3, 4))


def test_degenerate_inputs_are_finite_and_documented():
    batch = make_batch(1)
    batch["mask"][:] = False                                 # every response empty
    for name in ALL:
        opts = {"k": 1} if name in ("maxpo", "maxk_bon", "passk_chen") else {"k": 2} if name in ("pkpo", "ei") else {}
        if name == "passk_chen":
            batch = {**batch, "rewards": (batch["rewards"] > 0).float()}
        out = run(name, batch, **opts)
        assert torch.equal(out, torch.zeros_like(out))
    single = dict(rewards=torch.tensor([3.0]), mask=torch.ones(1, 4), group=torch.tensor([0]), energy=torch.rand(1, 4))
    for name in ALL:
        opts = {"k": 1} if name in ("maxpo", "maxk_bon", "passk_chen") else {"k": 2} if name in ("pkpo", "ei") else {}
        batch = {**single, "rewards": torch.tensor([1.0])} if name == "passk_chen" else single
        want = 3.0 if name == "reinforce" else 0.0
        assert torch.equal(run(name, batch, **opts), torch.full((1, 4), want).double()), name
    tied = dict(rewards=torch.ones(4), mask=torch.ones(4, 3), group=torch.zeros(4, dtype=torch.long),
                energy=torch.rand(4, 3))
    for name in ("grpo", "dr_grpo", "rloo", "otb", "ogb"):
        assert torch.equal(run(name, tied), torch.zeros(4, 3).double())


def test_bf16_and_output_contract():
    batch = make_batch(2, token_rewards=True)
    low = {k: (v.bfloat16() if v.is_floating_point() else v) for k, v in batch.items()}
    low["mask"] = batch["mask"].to(torch.int64)
    for name in ("grpo", "otb", "reinforce", "ogb"):
        out = compute_advantages(name, **low)
        assert out.dtype == torch.float32 and out.shape == batch["mask"].shape
        assert torch.equal(out[~batch["mask"]], torch.zeros(int((~batch["mask"]).sum())))
        ref = compute_advantages(name, **{k: (v.float() if v.is_floating_point() else v) for k, v in low.items()})
        assert torch.equal(out, ref)     # bf16 values upcast inside, or before: the same float32 computation


def test_long_discounted_returns_do_not_overflow():
    steps = 20_000
    rewards = torch.zeros(2, steps, dtype=torch.float64)
    rewards[:, -1] = 1.0
    rewards[1, ::97] = -0.5
    for gamma in (0.9, 0.99, 0.999):
        got = discounted_suffix_sum(rewards, gamma)
        want = torch.zeros_like(rewards)
        acc = torch.zeros(2, dtype=torch.float64)
        for t in reversed(range(steps)):
            acc = rewards[:, t] + gamma * acc
            want[:, t] = acc
        assert torch.isfinite(got).all()
        # float64 suffix sums of 20,000 terms: within 20,000 eps64 (4e-12) of the loop relative to the sums'
        # magnitudes, which bound the results here; the documented cut: values < 1e-150 relative are dropped
        assert torch.allclose(got, want, rtol=sum_rtol(steps, torch.float64) * 4, atol=1e-140)


def test_step_index_compacts_valid_tokens():
    mask = torch.tensor([[0, 1, 1, 0, 1], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    steps = StepIndex.from_mask(mask)
    x = torch.arange(15.0).reshape(3, 5)
    assert steps.compact(x).tolist() == [[1, 2, 4, 0], [5, 0, 0, 0], [0, 0, 0, 0]]   # + the dump column
    assert torch.equal(steps.expand(steps.compact(x)), x * mask)
    assert steps.live().tolist() == [[True] * 3 + [False], [True, False, False, False], [False] * 4]
    prefix = StepIndex.from_mask(torch.tensor([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool))
    assert prefix.pos is None                                   # right-padded: its own compacted view (L = T)
    y = torch.arange(10.0).reshape(2, 5)
    assert prefix.compact(y).tolist() == [[0, 1, 0, 0, 0], [5, 0, 0, 0, 0]]
    assert prefix.expand(prefix.compact(y)).tolist() == [[0, 1, 0, 0, 0], [5, 0, 0, 0, 0]]
    # rewards on masked tokens move to the nearest preceding valid step (the first if none precedes)
    r = torch.tensor([[1.0, 2, 4, 8, 16], [1, 2, 4, 8, 16], [1, 2, 4, 8, 16]])
    assert steps.compact_rewards(r, r.sum(1)).tolist() == [[3, 12, 16, 0], [31, 0, 0, 0], [0, 0, 0, 0]]
    assert prefix.compact_rewards(r[:2], r[:2].sum(1)).tolist() == [[1, 30, 0, 0, 0], [31, 0, 0, 0, 0]]


def moved_returns_loop(rewards, mask, gamma):
    """Reference for the masked-token rule: move each reward to the nearest preceding valid token
    (the first valid one if none precedes), then discounted returns over valid tokens."""
    out = torch.zeros_like(rewards, dtype=torch.float64)
    for b in range(rewards.shape[0]):
        cols = [t for t in range(rewards.shape[1]) if mask[b, t]]
        if not cols:
            continue
        moved = {c: 0.0 for c in cols}
        for t in range(rewards.shape[1]):
            before = [c for c in cols if c <= t]
            moved[before[-1] if before else cols[0]] += float(rewards[b, t])
        acc = 0.0
        for c in reversed(cols):
            acc = moved[c] + gamma * acc
            out[b, c] = acc
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), gamma=st.sampled_from([1.0, 0.9, 0.0]), padded=st.booleans())
def test_rewards_on_masked_tokens_count_at_the_preceding_valid_token(seed, gamma, padded):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(6, 8, generator=g) * (torch.rand(6, 8, generator=g) < 0.5)
    if padded:
        mask = torch.arange(8)[None, :] < torch.randint(0, 9, (6, 1), generator=g)
    else:
        mask = torch.rand(6, 8, generator=g) < 0.6
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    got = compute_advantages("reinforce", rewards=rewards, mask=mask, group=group, gamma=gamma).double()
    assert torch.allclose(got, moved_returns_loop(rewards, mask, gamma), atol=F32, rtol=0)
    # sequence-level estimators use each row's whole total, masked tokens included (as verl)
    seq = compute_advantages("dr_grpo", rewards=rewards, mask=mask, group=group)
    want = rewards.sum(1) - rewards.sum(1).view(2, 3).mean(1).repeat_interleave(3)
    assert torch.allclose(seq, want[:, None] * mask, atol=F32, rtol=0)


def test_score_on_a_masked_last_token_counts_as_in_verl():
    """The minimal case: the score sits on a masked (tool) token after the response."""
    mask = torch.ones(4, 5)
    mask[:, 4] = 0
    rewards = torch.zeros(4, 5)
    rewards[:, 4] = torch.tensor([1.0, 0, 1, 0])
    grpo = compute_advantages("grpo", rewards=rewards, mask=mask, group=torch.zeros(4, dtype=torch.long))
    # ±1/√(4/3): the z-score of 0/1 rewards with the population std (0.5) and its 1e-6 guard; written to 3 digits
    assert torch.allclose(grpo[:, :4], torch.tensor([0.866, -0.866, 0.866, -0.866])[:, None], atol=5e-4)
    assert (grpo[:, 4] == 0).all()
    # token-level: the score counts at t = 3 and so in every earlier return
    energy = torch.rand(4, 5, generator=torch.Generator().manual_seed(0))
    otb = compute_advantages("otb", rewards=rewards, mask=mask, group=torch.zeros(4, dtype=torch.long),
                             energy=energy)
    seq = compute_advantages("otb", rewards=rewards.sum(1), mask=mask, group=torch.zeros(4, dtype=torch.long),
                             energy=energy)
    assert torch.allclose(otb, seq, atol=F32, rtol=0) and otb[:, :4].abs().min() > 0.1


@pytest.mark.parametrize("name", ["otb", "otb_isolated"])
def test_otb_right_padded_fast_path_matches_loop(name):
    batch = make_batch(7, token_rewards=True)
    lengths = torch.randint(0, 10, (batch["group"].numel(),), generator=torch.Generator().manual_seed(1))
    batch["mask"] = torch.arange(9)[None, :] < lengths[:, None]
    batch["rewards"] = batch["rewards"] * batch["mask"]
    got = run(name, batch, gamma=0.9)
    assert torch.allclose(got, ref_otb(batch, cumulative=name == "otb", gamma=0.9), atol=F32, rtol=0)


# ---------------------------------------------------------------- properties


def sized_batch(seed, token_rewards=False):
    g = torch.Generator().manual_seed(seed)
    sizes = tuple(torch.randint(3, 6, (3,), generator=g).tolist())
    return make_batch(seed, sizes=sizes, token_rewards=token_rewards)


def group_sums(x, group):
    return torch.stack([x[group == gid].sum(0) for gid in group.unique()])


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 100_000), token_rewards=st.booleans())
def test_centering(seed, token_rewards):
    batch = sized_batch(seed, token_rewards)
    for name in ("dr_grpo", "grpo", "rloo"):
        seq = run(name, {**batch, "mask": torch.ones_like(batch["mask"])})[:, 0]
        assert group_sums(seq, batch["group"]).abs().max() < F32
    # OTB: sum_i W_t^(i) A_t^(i) = 0 over live members at every step
    steps = StepIndex.from_mask(batch["mask"])
    adv = steps.compact(run("otb", batch).float())
    weights = steps.compact(batch["energy"] * batch["mask"]).cumsum(1) * steps.live()
    assert group_sums(weights * adv, batch["group"]).abs().max() < F32 * 9   # weights: cumulative energies <= 9


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 100_000), shift=st.floats(-20, 20), scale=st.floats(0.1, 10))
def test_invariances(seed, shift, scale):
    batch = sized_batch(seed)
    perm = torch.randperm(batch["group"].numel(), generator=torch.Generator().manual_seed(seed))
    relabel = {**{k: v[perm] for k, v in batch.items()}, "group": batch["group"][perm] * 13 - 4}
    for name in CENTRED + ("maxpo", "pkpo", "ei", "maxk_bon"):
        opts = {"k": 2} if name in ("maxpo", "pkpo", "ei", "maxk_bon") else {}
        base = run(name, batch, **opts)
        # batch order, permutation within groups and relabeling of ids
        assert torch.allclose(run(name, relabel, **opts), base[perm], atol=F32, rtol=0), name
        if name in ("grpo", "maxk_bon"):  # scale-invariant z-scores
            # not exact: the std's 1e-6 guard weighs 1/scale more after scaling (up to 10x at scale 0.1 on a
            # std >= 0.4 of 0..2 rewards: |z| x 2.5e-5) on top of float32 rounding
            assert torch.allclose(run(name, {**batch, "rewards": batch["rewards"] * scale}, **opts), base, atol=1e-3)
            continue
        shifted = run(name, {**batch, "rewards": batch["rewards"] + shift}, **opts)
        if name not in ("pkpo", "ei"):  # EI is translation invariant too
            assert torch.allclose(shifted, base, atol=sum_rtol(45) * (10 + abs(shift)), rtol=0), name   # |values| + |shift|
        scaled = run(name, {**batch, "rewards": batch["rewards"] * scale}, **opts)
        assert torch.allclose(scaled, base * scale, atol=F32 * scale, rtol=0), name


# ---------------------------------------------------------------- registry and errors


def test_registry_lists_all_and_accepts_third_party():
    assert set(ALL) <= set(list_estimators())

    @register_estimator("test_constant", overwrite=True)
    def constant(batch, *, value: float = 1.0):
        return torch.full_like(batch.rewards, value)

    batch = make_batch(0)
    out = compute_advantages("test_constant", **batch, value=2.5)
    assert torch.equal(out, 2.5 * batch["mask"].float())
    with pytest.raises(ValueError, match=r"test_constant: unknown option\(s\) \['valu'\]; valid options are \['value'\]"):
        compute_advantages("test_constant", **batch, valu=2.5)


def test_registering_before_the_first_call_meets_the_built_ins():
    """A fresh process where a user's estimator is registered before any call (the built-ins load on first
    use): ``overwrite=True`` replaces a built-in and leaves the others working; without it the clash is
    refused at registration, not at some later call of another estimator."""
    code = """
import torch, creditrl
@creditrl.register_estimator("grpo", overwrite=True)
def mine(batch):
    return batch.rewards * 0
args = dict(rewards=torch.tensor([1., 0.]), mask=torch.ones(2, 2), group=torch.tensor([0, 0]))
print(creditrl.compute_advantages("grpo", **args).abs().sum().item(), creditrl.compute_advantages("rloo", **args)[0, 0].item())
try:
    creditrl.register_estimator("rloo")(mine)
except ValueError as err:
    print(err)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "0.0 1.0"
    assert out[1].startswith("estimator 'rloo' is already registered to <function rloo")


def test_error_messages():
    batch = make_batch(0)
    with pytest.raises(ValueError, match="unknown estimator 'gpro'; valid estimators are .*'grpo'"):
        compute_advantages("gpro", **batch)
    with pytest.raises(ValueError, match=r"grpo: unknown option\(s\) \['epsilon'\]; valid options are \['eps', 'scale'\]"):
        compute_advantages("grpo", **batch, epsilon=1.0)
    bad = batch["rewards"].clone()
    bad[[1, 4]] = float("nan")
    with pytest.raises(ValueError, match=r"rewards: 2 row\(s\) contain NaN or inf, e.g. rows \[1, 4\]"):
        compute_advantages("grpo", **{**batch, "rewards": bad})
    many = torch.full((14,), float("inf"))
    with pytest.raises(ValueError, match=r"rows \[0, 1, 2, 3, 4, 5, 6, 7, 8, 9\]$"):
        compute_advantages("grpo", rewards=many, mask=torch.ones(14, 2), group=torch.zeros(14, dtype=torch.long))
    energy = batch["energy"].clone()
    energy[2, batch["mask"][2].nonzero()[0]] = float("inf")
    with pytest.raises(ValueError, match=r"energy: 1 row\(s\) contain NaN or inf, e.g. rows \[2\]"):
        compute_advantages("otb", **{**batch, "energy": energy})
    energy = batch["energy"].clone()
    energy[3, batch["mask"][3].nonzero()[0]] = -0.1
    with pytest.raises(ValueError, match=r"energy: expected values >= 0, got -0.1 in rows \[3\]"):
        compute_advantages("otb", **{**batch, "energy": energy})
    energy[3] = -1e-8 * batch["mask"][3]                        # rounding: accepted, clamped
    compute_advantages("otb", **{**batch, "energy": energy})
    with pytest.raises(ValueError, match="energy: estimator 'otb' needs per-token energies"):
        compute_advantages("otb", **{**batch, "energy": None})
    with pytest.raises(ValueError, match=r"rewards: expected shape \[6, 9\]|rewards: expected shape \[13, 9\]"):
        compute_advantages("grpo", **{**batch, "rewards": torch.zeros(batch["group"].numel(), 3)})
    with pytest.raises(ValueError, match=r"rewards: expected shape \[13\], got \[5\]"):
        compute_advantages("grpo", **{**batch, "rewards": torch.zeros(5)})
    with pytest.raises(TypeError, match="group: expected an integer tensor, got dtype torch.float32"):
        compute_advantages("grpo", **{**batch, "group": batch["group"].float()})
    with pytest.raises(ValueError, match=r"energy: expected shape \[13, 9\], got \[13, 8\]"):
        compute_advantages("otb", **{**batch, "energy": batch["energy"][:, :8]})
    with pytest.raises(ValueError, match=r"mask: expected a bool or 0/1 mask, got values outside \{0, 1\}.* in rows \[1, "):
        compute_advantages("grpo", **{**batch, "mask": batch["mask"] * 2.0})
    with pytest.raises(TypeError, match="rewards: expected a torch.Tensor, got list"):
        compute_advantages("grpo", **{**batch, "rewards": [1.0] * 13})
    with pytest.raises(ValueError, match=r"gamma: expected a value in \[0, 1\], got 1.5"):
        compute_advantages("reinforce", **batch, gamma=1.5)
    token = make_batch(0, token_rewards=True)
    token["rewards"][3, 2] = float("nan")
    with pytest.raises(ValueError, match=r"rewards: 1 row\(s\) contain NaN or inf, e.g. rows \[3\]"):
        compute_advantages("grpo", **token)
    with pytest.raises(ValueError, match="is_weights: expected values >= 0"):
        compute_advantages("otb", **batch, is_weights=-torch.ones_like(batch["energy"]))


@pytest.mark.parametrize("values", [[1.2, 0.4], [0.5], [1e-30], [0.9999], [0.99999994], [-1.0], [2.0],
                                    [float("nan")]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_float_masks_must_hold_only_zeros_and_ones(values, dtype):
    """Every value other than 0 and 1 is caught, 0.99999994 included."""
    from creditrl.utils.validate import check_mask
    mask = torch.ones(3, 6, dtype=dtype)
    mask[1, : len(values)] = torch.tensor(values, dtype=dtype)
    if torch.equal(mask, mask.round().clamp(0, 1)):
        pytest.skip(f"{values} rounds to 0/1 in {dtype}")
    with pytest.raises(ValueError, match=r"mask: expected a bool or 0/1 mask.* in rows \[1\]"):
        check_mask("mask", mask)
    # non-contiguous masks are checked alike
    wide = torch.ones(3, 12, dtype=dtype)
    wide[:, ::2] = mask
    with pytest.raises(ValueError, match=r"in rows \[1\]"):
        check_mask("mask", wide[:, ::2])
    assert check_mask("mask", wide[:, 1::2]) is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.int64])
def test_long_rows_of_any_mask_dtype_give_the_bool_masks_advantages(dtype):
    """Row lengths past 16-bit float precision (bf16 sums 4,099 ones to 4,096): every estimator
    that reads lengths or steps must give exactly what a bool mask gives."""
    g = torch.Generator().manual_seed(0)
    steps = 4099
    valid = torch.ones(4, steps, dtype=torch.bool)
    valid[1, 4000:] = False
    valid[2, 17] = False
    rewards = torch.zeros(4, steps)
    rewards[:, -1] = torch.rand(4, generator=g)
    rewards[1, 3999] = 0.5
    energy = torch.rand(4, steps, generator=g)
    group = torch.tensor([0, 0, 1, 1])
    for name in ("otb", "reinforce", "grpo"):
        expected = compute_advantages(name, rewards=rewards, mask=valid, group=group, energy=energy)
        got = compute_advantages(name, rewards=rewards, mask=valid.to(dtype), group=group, energy=energy)
        assert torch.equal(got, expected), name


def test_bool_masks_holding_other_bytes_count_as_true():
    """A bool tensor viewed from other bytes (numpy, ``uint8.view(bool)``) may hold 2..255, which
    torch's bool operations read as True: lengths, the float copy and the advantages must too."""
    raw = torch.tensor([[0, 2, 1, 3], [1, 1, 0, 255], [7, 0, 0, 1]], dtype=torch.uint8)
    odd, canonical = raw.view(torch.bool), raw != 0
    inputs = dict(rewards=torch.tensor([1.0, 0.0, 2.0]), group=torch.tensor([0, 0, 0]),
                  energy=torch.rand(3, 4, generator=torch.Generator().manual_seed(0)))
    from creditrl.core.estimators import build_batch
    assert torch.equal(build_batch(**inputs, mask=odd).lengths, torch.tensor([3, 3, 2]))
    assert torch.equal(build_batch(**inputs, mask=odd).valid, canonical.float())
    for name in ("grpo", "otb", "reinforce"):
        assert torch.equal(compute_advantages(name, mask=odd, **inputs), compute_advantages(name, mask=canonical, **inputs))


@settings(max_examples=60, deadline=None)
@given(steps=st.sampled_from([1, 8, 16, 1024, 1032, 1033]),
       layout=st.sampled_from(["contiguous", "transposed", "offset 8", "offset 3"]),
       rows=st.integers(1, 5), density=st.floats(0.0, 1.0), seed=st.integers(0, 10_000))
def test_bool_mask_lengths_count_each_nonzero_byte(steps, layout, rows, density, seed):
    """A bool mask's ``lengths`` (an integer pass over its bytes clamped to 0/1) against a loop that
    counts the nonzero bytes, whatever they hold (1..255), across whole-word rows (T % 8 == 0, the
    word-sum path) and the rest, contiguous or not; ``valid`` is the same mask as 0/1 floats."""
    from creditrl.core.estimators import build_batch
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(rows, steps, generator=g) < density
    raw = (keep * torch.randint(1, 256, keep.shape, generator=g)).to(torch.uint8)
    if layout == "transposed":
        raw = raw.t().contiguous().t()
    elif layout in ("offset 8", "offset 3"):  # contiguous rows starting that many bytes into the storage
        skip = int(layout.split()[1])
        raw = torch.cat([torch.zeros(skip, dtype=torch.uint8), raw.reshape(-1)])[skip:].view(rows, steps)
    mask = raw.view(torch.bool)
    batch = build_batch(rewards=torch.rand(rows, generator=g), mask=mask, group=torch.zeros(rows, dtype=torch.long))
    expected = [sum(1 for t in range(steps) if int(raw[b, t]) != 0) for b in range(rows)]
    assert batch.lengths.dtype == torch.int64 and batch.lengths.tolist() == expected
    assert torch.equal(batch.valid, keep.float())


@pytest.mark.parametrize("pending", [False, True], ids=["checked", "rule pending"])
@pytest.mark.parametrize("dtype", [torch.float32, "signed-zero float32", torch.bool, torch.int64])
def test_broadcast_pair_is_two_broadcasts(dtype, pending, monkeypatch):
    """``broadcast_pair`` (one read of a caller's float32 mask for two products) gives each product of a
    loop bit for bit, signed zeros included, whatever the mask; a mask whose rule is still pending is
    checked first, and a bad one refused, naming its row."""
    import creditrl.core.estimators as estimators
    if pending:
        monkeypatch.setattr(estimators, "FUSED_RULE_MIN_ELEMENTS", 0)
    g = torch.Generator().manual_seed(3)
    keep = torch.rand(5, 37, generator=g) < 0.7
    mask = torch.where(keep, 1.0, -0.0) if dtype == "signed-zero float32" else keep.to(dtype)
    first, second = torch.randn(5, generator=g), torch.randn(5, generator=g)

    def build(m):
        return estimators.build_batch(rewards=torch.rand(5, generator=g), mask=m, group=torch.zeros(5, dtype=torch.long),
                                      defer_mask_check=True)
    pair = build(mask).broadcast_pair(first, second)
    for got, per_row in zip(pair, (first, second)):
        want = torch.tensor([[float(per_row[b]) * float(mask[b, t]) for t in range(37)] for b in range(5)])
        assert got.dtype == torch.float32 and torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
    if dtype == torch.float32:
        bad = mask.clone()
        bad[2, 3] = 0.5
        with pytest.raises(ValueError, match=r"mask: expected a bool or 0/1 mask.* in rows \[2\]"):
            build(bad).broadcast_pair(first, second)


@settings(max_examples=120, deadline=None)
@given(dtype=st.sampled_from([torch.bool, "odd-byte bool", torch.float32, "signed-zero float32", torch.float64,
                              torch.bfloat16, torch.int64]),
       layout=st.sampled_from(["contiguous", "transposed"]), rows=st.integers(1, 6), steps=st.integers(1, 40),
       density=st.sampled_from([0.0, 0.3, 0.9, 1.0]),
       placement=st.sampled_from(["last", "none", "anywhere", "two", "-0.0 elsewhere", "1e-30 elsewhere"]),
       seed=st.integers(0, 10_000))
def test_rewards_off_last_token_matches_a_loop(dtype, layout, rows, steps, density, placement, seed):
    """``rewards_off_last_token`` (what ``constant_returns`` reads: one pass over the rewards and the
    mask) against a loop: True iff some nonzero reward lies off its row's last valid column (column 0
    for an empty row), for every mask dtype and layout; -0.0 is no reward."""
    from creditrl.core.estimators import build_batch
    from creditrl.core.estimators.steps import rewards_off_last_token
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(rows, steps, generator=g) < density
    if dtype == "odd-byte bool":
        mask = (keep * torch.randint(1, 256, keep.shape, generator=g)).to(torch.uint8).view(torch.bool)
    elif dtype == "signed-zero float32":
        mask = torch.where(keep, 1.0, -0.0)
    else:
        mask = keep.to(dtype)
    if layout == "transposed":
        mask = mask.t().contiguous().t()
    last = [max((t for t in range(steps) if keep[b, t]), default=0) for b in range(rows)]
    rewards = torch.zeros(rows, steps)
    for b in range(rows):
        column = int(torch.randint(steps, (1,), generator=g))
        rewards[b, last[b]] = float(torch.randn(1, generator=g)) if placement != "none" else 0.0
        if placement == "anywhere":
            rewards[b] = 0.0
            rewards[b, column] = 1.0
        elif placement in ("two", "-0.0 elsewhere", "1e-30 elsewhere"):
            rewards[b, column] += {"two": 0.5, "-0.0 elsewhere": -0.0, "1e-30 elsewhere": 1e-30}[placement]
    expected = any(float(rewards[b, t]) != 0.0 and t != last[b] for b in range(rows) for t in range(steps))
    batch = build_batch(rewards=torch.rand(rows, generator=g), mask=mask, group=torch.zeros(rows, dtype=torch.long))
    given = batch.mask_bytes if mask.dtype == torch.bool else batch.given_mask
    assert rewards_off_last_token(rewards, given) is expected


def test_rewards_off_last_token_beyond_float32_positions():
    """Columns 2^24 and 2^24 + 1 are one float32 (positions go float64 there): a reward on the
    first, the last valid token on the second, is off its row's last token."""
    from creditrl.core.estimators.steps import rewards_off_last_token
    steps = (1 << 24) + 2                                       # the last valid column is 2^24 + 1
    mask = torch.ones(1, steps)
    rewards = torch.zeros(1, steps)
    rewards[0, 1 << 24] = 1.0
    assert rewards_off_last_token(rewards, mask)
    rewards[0, 1 << 24], rewards[0, (1 << 24) + 1] = 0.0, 1.0
    assert not rewards_off_last_token(rewards, mask)


@settings(max_examples=80, deadline=None)
@given(dtype=st.sampled_from([torch.bool, torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
                              torch.int32, torch.uint8, torch.int8, "odd-byte bool"]),
       layout=st.sampled_from(["contiguous", "transposed", "strided"]),
       rows=st.integers(1, 6), steps=st.integers(1, 9), seed=st.integers(0, 10_000))
def test_a_last_use_broadcast_writes_only_creditrls_own_copy(dtype, layout, rows, steps, seed):
    """``on_tokens(out, last_use=True)`` (what compute_advantages and the plug-ins call) may write a
    [B] result into the batch's own float32 mask copy: it must give ``broadcast``'s values bit for
    bit (signed zeros included) and never write the caller's mask, whatever its dtype and layout
    (a bool viewed from bytes 2..255 included)."""
    from creditrl.core.estimators import build_batch
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(rows, steps, generator=g) < 0.7
    if dtype == "odd-byte bool":
        dtype, mask = torch.bool, (keep * torch.randint(1, 256, keep.shape, generator=g)).to(torch.uint8).view(torch.bool)
    else:
        mask = keep.to(dtype)
    if layout == "transposed":
        mask = mask.t().contiguous().t()
    elif layout == "strided":
        mask = torch.stack([mask, mask], dim=2)[:, :, 0]
    def raw(m):                                           # a bool's bytes (cloning a bool canonicalises them)
        return m.view(torch.uint8) if m.dtype == torch.bool else m
    given = raw(mask).clone()
    inputs = dict(rewards=torch.rand(rows, generator=g), mask=mask, group=torch.zeros(rows, dtype=torch.long))
    out = torch.randn(rows, generator=g)
    expected = out[:, None] * keep.float()                # the loop's rule: the row's value where valid, 0 elsewhere
    for warm in (False, True):                            # with and without ``valid`` derived before
        batch = build_batch(**inputs)
        if warm:
            batch.valid, batch.lengths
        got = batch.on_tokens(out, last_use=True)
        assert got.dtype == torch.float32 and torch.equal(got, expected)
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))   # -0.0 where out < 0, as broadcast
        assert torch.equal(raw(mask), given) and mask.dtype == dtype
    assert torch.equal(build_batch(**inputs).on_tokens(out), expected)
    for name in ("grpo", "rloo", "reinforce"):
        compute_advantages(name, **inputs)
        assert torch.equal(raw(mask), given), name


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32, torch.int64])
def test_with_energy_equals_building_the_batch_with_it(mask_dtype):
    """Energies attached after the mask is checked (verl's plug-in) give what build_batch gives with
    them, IS weights included, keep the views already derived from the mask, and are checked alike."""
    from creditrl.core.estimators import build_batch, estimate, with_energy
    g = torch.Generator().manual_seed(3)
    mask = (torch.rand(6, 5, generator=g) < 0.8).to(mask_dtype)
    inputs = dict(rewards=torch.rand(6, generator=g), mask=mask, group=torch.tensor([0, 0, 0, 1, 1, 1]))
    energy, weights = torch.rand(6, 5, generator=g), torch.rand(6, 5, generator=g) * 2
    whole = build_batch(**inputs, energy=energy, is_weights=weights)
    first = build_batch(**inputs)
    valid = first.valid
    later = with_energy(first, energy, weights)
    assert later.valid is valid and torch.equal(later.raw_energy, whole.raw_energy)
    for name in ("otb", "ogb", "grpo"):
        assert torch.equal(estimate(name, later), estimate(name, whole)), name
    with pytest.raises(ValueError, match="energy: expected values >= 0"):
        with_energy(first, -torch.ones(6, 5))
    with pytest.raises(ValueError, match=r"energy: expected shape \[6, 5\]"):
        with_energy(first, torch.ones(6, 4))
    # checked=True: the energies as they are (the caller tested them), the IS weights still tested
    trusted = with_energy(first, whole.raw_energy / weights.square(), weights, checked=True)
    assert torch.allclose(trusted.raw_energy, whole.raw_energy, rtol=4 * torch.finfo(torch.float32).eps)
    with pytest.raises(ValueError, match="is_weights: expected values >= 0"):
        with_energy(first, energy, -weights, checked=True)
    with pytest.raises(ValueError, match=r"energy: with checked=True expected float32 .* got torch.float64"):
        with_energy(first, energy.double(), checked=True)


@pytest.mark.parametrize("bad", [2, -1, 2**24 + 1, 2**40])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.int8])
def test_integer_masks_are_checked_on_their_float32_copy(bad, dtype):
    """An integer mask (verl passes int64) is replaced by its float32 copy and checked on the copy's
    bits in one pass: no integer but 0 and 1 converts into [0, 1], so every other value is refused,
    naming the rows and the given dtype; a 0/1 one gives the bool mask's advantages exactly."""
    if bad < torch.iinfo(dtype).min or bad > torch.iinfo(dtype).max:
        pytest.skip(f"{bad} does not fit {dtype}")
    rewards, group = torch.tensor([1.0, 0.0, 3.0, 2.0]), torch.tensor([0, 0, 1, 1])
    valid = torch.tensor([[1, 1, 0, 0, 0], [1, 0, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    for name in ("grpo", "rloo", "reinforce"):
        expected = compute_advantages(name, rewards=rewards, mask=valid, group=group)
        got = compute_advantages(name, rewards=rewards, mask=valid.to(dtype), group=group)
        assert got.dtype == torch.float32 and torch.equal(got, expected)
    mask = valid.to(dtype)
    mask[2, 3] = bad
    with pytest.raises(ValueError, match=rf"mask: expected a bool or 0/1 mask.*\(dtype {dtype}\) in rows \[2\]"):
        compute_advantages("grpo", rewards=rewards, mask=mask, group=group)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5), block=st.booleans(), seed=st.integers(0, 999))
def test_group_index_any_layout_matches_loops(sizes, block, seed):
    """Contiguous blocks (any id values and order) use a [G, N] view; other layouts a scatter;
    both must give the loops' sums, means and differences."""
    from creditrl.core.groups import GroupIndex
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(50, generator=g)[: len(sizes)] - 20
    if block:
        sizes = [sizes[0]] * len(sizes)
        group = ids.repeat_interleave(sizes[0])
    else:
        group = torch.repeat_interleave(ids, torch.tensor(sizes))[torch.randperm(sum(sizes), generator=g)]
    x = torch.randn(group.numel(), 3, generator=g, dtype=torch.float64)
    idx = GroupIndex.from_ids(group)
    assert (idx.block is not None) == (block and len(sizes) > 0) or not block
    for b in range(group.numel()):
        members = group == group[b]
        torch.testing.assert_close(idx.gather(idx.sum(x))[b], x[members].sum(0))
        torch.testing.assert_close(idx.mean(x)[b], x[members].mean(0))
        torch.testing.assert_close(idx.subtract(x, idx.sum(x))[b], x[b] - x[members].sum(0))
    weights = torch.randn(group.numel(), 2, generator=g, dtype=torch.float64)
    sums = idx.weighted_sums(weights, x)                                           # [G, 2, 3]
    for b in range(group.numel()):
        members = group == group[b]
        want = weights[members].T @ x[members]
        torch.testing.assert_close(sums[idx.dense[b]], want)


@settings(max_examples=150, deadline=None)
@given(runs=st.lists(st.tuples(st.integers(-3, 3), st.integers(1, 4)), min_size=1, max_size=6))
def test_group_layout_is_a_block_exactly_when_a_loop_says_so(runs):
    """``GroupIndex.from_ids`` takes the [G, N] block layout exactly when the rows are runs of one
    length N whose ids never repeat; any other layout (ragged runs, an id back after another's run)
    takes the general path. Runs are (id, length): adjacent equal ids merge into one run, as they
    would in a batch."""
    from creditrl.core.groups import GroupIndex
    group = torch.tensor([i for i, n in runs for _ in range(n)])
    merged = []                                             # the loop: maximal runs of one id
    for value in group.tolist():
        if merged and merged[-1][0] == value:
            merged[-1][1] += 1
        else:
            merged.append([value, 1])
    lengths, ids = {n for _, n in merged}, [i for i, _ in merged]
    block = len(lengths) == 1 and len(set(ids)) == len(ids)
    idx = GroupIndex.from_ids(group)
    assert idx.block == (merged[0][1] if block else None)
    dense = torch.unique(group, return_inverse=True)[1]             # the same partition either way
    assert torch.equal(dense[:, None] == dense[None, :], idx.dense[:, None] == idx.dense[None, :])


def test_negative_zero_in_a_float_mask_is_zero():
    """-0.0 (e.g. from mask * negative) is 0: its int32 bit pattern is negative, so the fast
    bit-pattern range check hands it to the float path, which accepts it."""
    from creditrl.utils.validate import check_mask
    mask = torch.tensor([[1.0, -0.0, 1.0], [0.0, 1.0, -0.0]])
    assert check_mask("mask", mask) is mask
    out = compute_advantages("dr_grpo", rewards=torch.tensor([1.0, 0.0]), mask=mask, group=torch.zeros(2, dtype=torch.long))
    assert out.tolist() == [[0.5, 0.0, 0.5], [0.0, -0.5, 0.0]]


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), steps=st.sampled_from([1, 2, 7, 256, 300, 4097, 9000]), seed=st.integers(0, 10_000),
       holes=st.booleans())
def test_right_padding_detection_matches_shifted_comparison(rows, steps, seed, holes):
    """The positions test (sum of positions == L(L-1)/2) agrees with 'the mask never rises'."""
    from creditrl.core.estimators.steps import _right_padded
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, steps + 1, (rows,), generator=g)
    mask = torch.arange(steps)[None, :] < lengths[:, None]
    if holes and steps > 1:
        b, t = int(torch.randint(rows, (1,), generator=g)), int(torch.randint(steps, (1,), generator=g))
        mask[b, t] = ~mask[b, t]
    valid = mask.float()
    expected = not bool((mask[:, 1:] & ~mask[:, :-1]).any())
    assert _right_padded(valid, valid.sum(1).long()) == expected


@pytest.mark.parametrize("precision", ["ieee", "bf16"])
@pytest.mark.parametrize("steps", [256, 257, 8000, 65536, 65537])
def test_right_padding_detection_sees_one_position_off_at_the_largest_sums(steps, precision):
    """At each path's largest totals (one matrix-vector sum up to T = 256, two up to 65,536, shifted
    views beyond), a row whose last valid token sits one step late (its positions sum to L(L-1)/2 + 1)
    is not right-padded, also where float32 matmuls may round their inputs to bf16 (on CPUs with
    bf16 units): positions summed whole would lose the 1 above 2^24, or to bf16's 8 bits."""
    from creditrl.core.estimators.steps import _right_padded
    valid = torch.ones(3, steps)
    valid[1, -1] = 0.0
    valid[2, -2:] = torch.tensor([0.0, 1.0])                       # the last valid token one step late
    lengths = valid.sum(1).long()
    backend = torch.backends.mkldnn.matmul
    before, backend.fp32_precision = backend.fp32_precision, precision
    try:
        assert _right_padded(valid[:2], lengths[:2])
        assert not _right_padded(valid, lengths)
    finally:
        backend.fp32_precision = before


@pytest.mark.parametrize("name", ["rewards", "mask", "group", "energy"])
def test_meta_tensors_are_refused_naming_the_argument(name):
    inputs = {"rewards": torch.tensor([1.0, 0.0]), "mask": torch.ones(2, 3), "group": torch.zeros(2, dtype=torch.long),
              "energy": torch.ones(2, 3)}
    inputs[name] = inputs[name].to("meta")
    with pytest.raises(ValueError, match=rf"^{name}: expected a tensor with values .* on the 'meta' device"):
        compute_advantages("otb", **inputs)


@pytest.mark.parametrize("value", ["false", "true", 1, 0, None, 1.0])
def test_bool_options_take_a_bool(value):
    """leave_one_out="false" is truthy: refused, naming the option, instead of turning it on."""
    batch = {"rewards": torch.tensor([1.0, 0.0, 1.0]), "mask": torch.ones(3, 2), "group": torch.zeros(3, dtype=torch.long),
             "energy": torch.ones(3, 2)}
    for name in ("otb", "ogb", "opo"):
        with pytest.raises(ValueError, match=rf"^{name}.leave_one_out: expected bool, got " + (
                "null" if value is None else re.escape(f"{value!r} ({type(value).__name__})"))):
            compute_advantages(name, **batch, leave_one_out=value)
        compute_advantages(name, **batch, leave_one_out=False)


@pytest.mark.parametrize("name, options, counts", [
    ("grpo", {}, True), ("dr_grpo", {}, True), ("rloo", {}, True), ("maxpo", {"k": 2}, True),
    ("shrinkage", {}, True), ("reinforce_plus_plus_baseline", {}, True),
    ("opo", {}, False), ("ogb", {}, False), ("otb", {}, False), ("otb_isolated", {}, False),
    ("reinforce_plus_plus", {}, False)])
def test_a_row_without_valid_tokens_is_in_the_statistics_as_documented(name, options, counts):
    """compute_advantages' docstring: an empty row gets 0, and its reward enters a plain group statistic
    (as TRL and verl score a masked, truncated completion) but weighs 0 in length/energy-weighted ones."""
    gen = torch.Generator().manual_seed(3)
    rewards = torch.rand(12, generator=gen)
    group = torch.arange(12) // 4
    mask = torch.ones(12, 3)
    mask[0] = 0
    energy = torch.rand(12, 3, generator=gen) * mask
    kept = compute_advantages(name, rewards=rewards, mask=mask, group=group, energy=energy, **options)
    dropped = compute_advantages(name, rewards=rewards[1:], mask=mask[1:], group=group[1:], energy=energy[1:],
                                 **options)
    assert torch.equal(kept[0], torch.zeros(3))
    same = torch.allclose(kept[1:], dropped, atol=1e-6)
    assert same != counts, (name, (kept[1:] - dropped).abs().max())
