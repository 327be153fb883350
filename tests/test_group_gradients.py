"""creditrl.runtime.group_gradients: every group's exact gradient under every estimator against a
per-response loop, the sketch and parameter-subset options, and exact per-token gradient norms."""
from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from creditrl import compute_advantages
from creditrl.core.gradients import CountSketch
from creditrl.runtime.group_gradients import group_gradients, per_token_grad_sq_norms, select_parameters
from tolerances import EPS32, assert_close_normwise, sum_rtol

ESTIMATORS = {"reinforce": ("reinforce", {}), "rloo": ("rloo", {}), "dr_grpo": ("dr_grpo", {}), "otb": ("otb", {}),
              "otb+loo": ("otb", {"leave_one_out": True}), "maxpo": ("maxpo", {"k": 2})}


@pytest.fixture(scope="module")
def tiny_rollouts():
    """A random (not warm-started) tiny policy and one rollout batch: 2 groups x 3 responses."""
    from creditrl.runtime.models.tiny import TinyModelConfig, char_tokenizer, tiny_model
    from creditrl.runtime.rollout import generate_rollouts
    from creditrl.tasks import get_task

    torch.manual_seed(0)
    task = get_task("multiplication", digits=1)
    tokenizer = char_tokenizer(task.alphabet())
    model = tiny_model(tokenizer, TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64))
    model.eval()
    problems = [task.sample(random.Random(i)) for i in (1, 2)]  # different prompt lengths -> left padding
    batch = generate_rollouts(model, tokenizer, task, problems, group_size=3, max_new_tokens=6,
                              generator=torch.Generator().manual_seed(0))
    batch.rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])  # non-degenerate groups
    return model, select_parameters(model), batch


def row_logp(model, batch, row):
    """Response log-probs and energies of one row from its own unpadded forward."""
    keep = batch.attention_mask[row] > 0
    ids = batch.input_ids[row][keep][None]
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1].double()
    logp = torch.log_softmax(logits, -1)
    resp = batch.response_mask[row][keep][1:] > 0
    pi = logp.exp()[resp]
    onehot = torch.nn.functional.one_hot(ids[0, 1:][resp], logits.shape[-1]).double()
    return logp.gather(-1, ids[0, 1:, None])[:, 0][resp], (onehot - pi).square().sum(-1)


def backward_rtol(model, batch) -> float:
    """Normwise float32 tolerance of one group's gradient: every element comes out of a chain of float32
    sums, over the group's token positions, the vocabulary, the hidden and the MLP widths, each within
    its length × eps of the magnitudes it adds, in any order (tests/tolerances.py). Measured: 1–1.7 eps
    under ATEN_CPU_CAPABILITY default, avx2 and avx512, 1 and 2 threads; this bound is ~140 eps."""
    c = model.config
    return EPS32 * (3 * batch.input_ids.shape[1] + c.vocab_size + c.hidden_size + c.intermediate_size)


def flat(grads, params):
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)])


def test_group_gradients_match_a_per_response_loop(tiny_rollouts):
    model, params, batch = tiny_rollouts
    rtol = backward_rtol(model, batch)
    got = group_gradients(model, batch, ESTIMATORS, temperature=1.0)
    plain = group_gradients(model, batch, ESTIMATORS, temperature=1.0, shared_prompts=False)
    for g, e in itertools.product(range(2), range(len(ESTIMATORS))):
        assert_close_normwise(plain.grads[g, e], got.grads[g, e], rtol, f"shared prompts, group {g}, estimator {e}")
    mask = batch.response_mask[:, batch.prompt_len:] > 0
    energy = torch.zeros(mask.shape)
    for r in range(6):
        energy[r][mask[r]] = row_logp(model, batch, r)[1].detach().float()
    # energies: float32 softmax sums over the same chain, per token (positive, no cancellation)
    torch.testing.assert_close(got.response_energy, energy.double().sum(1), rtol=rtol, atol=0)
    for e, (name, options) in enumerate(ESTIMATORS.values()):
        adv = compute_advantages(name, rewards=batch.rewards, mask=mask, group=batch.group, energy=energy, **options)
        for g in range(2):
            total = 0
            for r in range(3 * g, 3 * g + 3):   # (1/N) Σ_t A_t log π(y_t) of each response on its own
                logp, _ = row_logp(model, batch, r)
                grads = torch.autograd.grad((adv[r][mask[r]].double() * logp).sum() / 3, params, allow_unused=True)
                total = total + flat(grads, params)
            assert_close_normwise(got.grads[g, e], total, rtol, f"{name}, group {g}")
    assert got.labels == tuple(ESTIMATORS)
    for g in range(2):   # dr_grpo = (N−1)/N·rloo: equal advantages up to one float32 rounding, then the backward
        assert_close_normwise(got.grads[g, 2], got.grads[g, 1] * 2 / 3, rtol + EPS32, f"dr_grpo, group {g}")


def test_group_gradients_sketch_and_subset(tiny_rollouts):
    model, params, batch = tiny_rollouts
    names = {k: ESTIMATORS[k] for k in ("rloo", "otb")}
    full = group_gradients(model, batch, names, temperature=1.0)
    sketch = CountSketch([p.shape for p in params], dim=64, seed=3)
    sketched = group_gradients(model, batch, names, temperature=1.0, sketch=sketch)
    sizes = [p.numel() for p in params]
    for g in range(2):
        for e in range(2):
            pieces = [x.view(p.shape) for x, p in zip(full.grads[g, e].split(sizes), params)]
            # the same float32 gradient sketched by the same float64 map: equal up to float64 bucket sums
            # (at most all D terms in one bucket, each at most Σ|g|)
            atol = sum_rtol(full.grads.shape[-1], torch.float64) * float(full.grads[g, e].double().abs().sum())
            torch.testing.assert_close(sketched.grads[g, e], sketch(pieces), atol=atol, rtol=0)
    head = select_parameters(model, ["model.norm."])
    subset = group_gradients(model, batch, names, temperature=1.0, params=head)
    names_in_order = [n for n, p in model.named_parameters() if p.requires_grad]
    offset = sum(p.numel() for p in params[:names_in_order.index("model.norm.weight")])
    for g, e in itertools.product(range(2), range(2)):   # the same chain of float32 sums, asked for alone
        assert_close_normwise(subset.grads[g, e], full.grads[g, e, offset:offset + head[0].numel()],
                              backward_rtol(model, batch), f"subset, group {g}, estimator {e}")
    with pytest.raises(ValueError, match="prefixes: expected a prefix of at least one trainable parameter name"):
        select_parameters(model, ["nope."])


def test_per_token_grad_norms_match_loop(tiny_rollouts):
    model, params, batch = tiny_rollouts
    rel_tol = 2 * backward_rtol(model, batch)   # a squared norm doubles the gradient's relative rounding
    for row in (0, 4):
        got, seq = per_token_grad_sq_norms(model, params, batch, row, 1.0)
        logp, _ = row_logp(model, batch, row)
        cols = torch.nonzero(batch.response_mask[row, batch.prompt_len:] > 0).flatten().tolist()
        total = 0
        for t, lp in zip(cols, logp):
            f = flat(torch.autograd.grad(lp, params, retain_graph=True, allow_unused=True), params)
            assert math.isclose(got[t].item(), f.pow(2).sum().item(), rel_tol=rel_tol)
            total = total + f
        assert math.isclose(seq.item(), total.pow(2).sum().item(), rel_tol=rel_tol)


BATCH_LEVEL = {"shrinkage": ("shrinkage", {}), "shrinkage+loo": ("shrinkage", {"leave_one_out": True}),
               "reinforce_plus_plus": ("reinforce_plus_plus", {}),
               "reinforce_plus_plus_baseline": ("reinforce_plus_plus_baseline", {}),
               "grpo/batch": ("grpo", {"scale": "batch"}), "grpo": ("grpo", {}), "dr_grpo": ("dr_grpo", {})}


@pytest.mark.parametrize("rewards", [[1.0, 0.0, 0.0, 0.0, 1.0, 1.0], [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]])
def test_batch_level_estimators_use_the_whole_batch(tiny_rollouts, rewards):
    """A batch-level estimator's group gradient is the loop's with the advantages of the whole batch
    (not of the group alone, where shrinkage would be dr_grpo); a group of equal rewards is not skipped
    for them (the shrinkage baseline and the batch whitening give it non-zero advantages)."""
    from dataclasses import replace

    from creditrl.runtime.group_gradients import batch_level_labels

    model, params, batch = tiny_rollouts
    batch = replace(batch, rewards=torch.tensor(rewards))
    assert batch_level_labels(BATCH_LEVEL) == ["shrinkage", "shrinkage+loo", "reinforce_plus_plus",
                                               "reinforce_plus_plus_baseline", "grpo/batch"]
    rtol = backward_rtol(model, batch)
    got = group_gradients(model, batch, BATCH_LEVEL, temperature=1.0, skip_zero=True, dedupe=True)
    mask = batch.response_mask[:, batch.prompt_len:] > 0
    for e, (name, options) in enumerate(BATCH_LEVEL.values()):
        adv = compute_advantages(name, rewards=batch.rewards, mask=mask, group=batch.group, **options)
        for g in range(2):
            grads = torch.autograd.grad(sum((adv[r][mask[r]].double() * row_logp(model, batch, r)[0]).sum() / 3
                                            for r in range(3 * g, 3 * g + 3)), params, allow_unused=True)
            expected = flat(grads, params)
            if float(expected.abs().max()) == 0:
                assert float(got.grads[g, e].abs().max()) == 0, f"{name}, group {g}"
            else:
                assert_close_normwise(got.grads[g, e], expected, rtol, f"{name}, group {g}")
    # λ = v²/(v² + s²) < 1 here, so the shrinkage baseline is not the group mean: shrinkage is not dr_grpo
    labels = list(BATCH_LEVEL)
    gap = (got.grads[:, labels.index("shrinkage")] - got.grads[:, labels.index("dr_grpo")]).norm()
    assert float(gap) > 1e3 * rtol * float(got.grads[:, labels.index("dr_grpo")].norm())
    if rewards[3:] == [1.0, 1.0, 1.0]:   # the equal-reward group still has a shrinkage gradient
        assert float(got.grads[1, labels.index("shrinkage")].abs().max()) > 0


def test_gdpo_rows_see_the_reward_components_the_trainer_passes(tiny_rollouts):
    """gdpo scores each reward component's group z-score; measured without the components (diagnose,
    the in-training diagnosis) it would be GDPO of the summed reward, another estimator. Every path
    that builds advantages for a gradient row (the whole batch, one group, diagnose's per-prompt rows
    and its training steps) gives the trainer's advantages."""
    from dataclasses import replace

    from creditrl.runtime.group_gradients import batch_advantages, group_advantages
    from types import SimpleNamespace

    from creditrl.tools.diagnose.measure import rows_of, step_advantages

    _, _, batch = tiny_rollouts
    task = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    overlong = torch.tensor([-1.0, 0.0, 0.0, 0.0, -0.1, -0.9], dtype=torch.float64)
    batch = replace(batch, rewards=(task + 2 * overlong).float(), components=torch.stack([task, overlong], 1),
                    component_names=["task", "overlong"], component_weights=[1.0, 2.0])
    mask = batch.response_mask[:, batch.prompt_len:] > 0
    trained = compute_advantages("gdpo", rewards=batch.rewards, mask=mask, group=batch.group,
                                 components=batch.components, component_weights=batch.component_weights)
    summed = compute_advantages("gdpo", rewards=batch.rewards, mask=mask, group=batch.group)
    assert float((trained - summed).abs().max()) > 0.1                     # the components matter here
    rows = {"gdpo": ("gdpo", {})}
    torch.testing.assert_close(batch_advantages(batch, rows)["gdpo"], trained)
    group_level = group_advantages(batch, slice(3, 6), mask[3:6].float(), rows)[0]
    one_group = compute_advantages("gdpo", rewards=batch.rewards[3:6], mask=mask[3:6], group=batch.group[3:6],
                                   components=batch.components[3:6], component_weights=[1.0, 2.0])
    torch.testing.assert_close(group_level, one_group)
    assert torch.equal(rows_of(batch, slice(3, 6), 1).components, batch.components[3:6])
    plan = SimpleNamespace(rows=rows, group_size=3, groups_per_prompt=1, batch=2)   # one step of both prompts
    torch.testing.assert_close(step_advantages(batch, plan)["gdpo"], trained)


def test_batch_level_with_energies_is_refused(tiny_rollouts):
    from creditrl.core.estimators.registry import register_estimator
    from creditrl.runtime.group_gradients import batch_advantages

    @register_estimator("test_batch_energy", needs_energy=True, batch_level=True, overwrite=True)
    def test_batch_energy(batch):
        return batch.rewards - batch.rewards.mean()

    _, _, batch = tiny_rollouts
    with pytest.raises(ValueError, match="batch-level and needs energies"):
        batch_advantages(batch, {"x": ("test_batch_energy", {})})


def test_off_policy_rows_see_the_ratios_against_the_behaviour_policy(tiny_rollouts):
    """With ``off_policy`` a loss row's gradient is (1/N) Σ_i Σ_t w_t A_t ∇log π_θ(y_t) with the weight w of
    its loss at r_t = π_θ/π_old, π_old = ``batch.rollout_logp``: PPO-clip r_t where its bound does not bind
    and 0 where it does, CISPO clip(r_t, 0.8, 1.2), CISPO with bounds that never bind r_t (the IS surrogate)."""
    import dataclasses

    from creditrl.core.losses import PolicyLoss
    from creditrl.core.losses.clip import ClipOptions, ratio_bounds

    model, params, batch = tiny_rollouts
    rtol = backward_rtol(model, batch)
    p = batch.prompt_len
    mask = batch.response_mask[:, p:] > 0
    current = torch.zeros(mask.shape, dtype=torch.float64)
    for r in range(6):
        current[r][mask[r]] = row_logp(model, batch, r)[0].detach()
    shift = (torch.rand(mask.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) - 0.5) * 0.8
    old = torch.where(mask, (current + shift).clamp(max=0.0), 0.0)
    full = torch.zeros(batch.input_ids.shape)
    full[:, p:] = old.float()
    stale = dataclasses.replace(batch, rollout_logp=full)
    losses = {"ppo": PolicyLoss({"clip": {"clip_low": 0.2}}),
              "cispo": PolicyLoss({"cispo": None, "clip": {"clip_low": 0.2}}),
              "is": PolicyLoss({"cispo": None, "clip": {"clip_low": 1 - 1e-9, "clip_high": 1e9}})}
    specs = {label: ("rloo", {}) for label in losses}
    got = group_gradients(model, stale, specs, temperature=1.0, losses=losses, off_policy=True)
    adv = compute_advantages("rloo", rewards=batch.rewards, mask=mask, group=batch.group).double()
    ratio = (current - full[:, p:].double()).exp()
    lo, hi = ratio_bounds(adv, ClipOptions(0.2))
    weights = {"ppo": torch.where((ratio < lo) | (ratio > hi), 0.0, ratio), "cispo": ratio.clamp(0.8, 1.2),
               "is": ratio}
    assert bool(((ratio < lo) | (ratio > hi))[mask].any())     # the clip binds somewhere: the rows differ
    for e, label in enumerate(losses):
        for g in range(2):
            total = 0
            for r in range(3 * g, 3 * g + 3):
                logp, _ = row_logp(model, batch, r)
                w = (weights[label][r] * adv[r])[mask[r]]
                total = total + flat(torch.autograd.grad((w * logp).sum() / 3, params, allow_unused=True), params)
            assert_close_normwise(got.grads[g, e], total, rtol, f"{label}, group {g}")
    on_policy = group_gradients(model, stale, specs, temperature=1.0, losses=losses)    # ratio 1: all rows agree
    for e in (1, 2):
        assert_close_normwise(on_policy.grads[:, e], on_policy.grads[:, 0], rtol, f"row {e} at ratio 1")
    with pytest.raises(ValueError, match="batch: off_policy needs the behaviour log-probs in batch.rollout_logp"):
        group_gradients(model, dataclasses.replace(batch, rollout_logp=None), specs, temperature=1.0, losses=losses,
                        off_policy=True)


def test_a_non_finite_cotangent_is_an_error_not_a_zero_gradient():
    """A row whose cotangent holds a NaN (a custom estimator's or loss term's) was classified "zero"
    (NaN > 0 is False) and measured as an exact 0 gradient; it is refused, naming the row."""
    import types

    from creditrl.runtime.group_gradients import _group_draw
    w = torch.nn.Parameter(torch.tensor([0.3, -0.2, 0.5]))
    logp = (torch.tensor([[1.0, 2.0, 0.5], [0.1, -1.0, 2.0]]) @ w).reshape(2, 1).expand(2, 2)
    good = torch.tensor([[0.5, 0.5], [-0.5, -0.5]])
    bad = good.clone()
    bad[0, 1] = float("nan")
    stats = types.SimpleNamespace(logp=logp)
    grads, _, _ = _group_draw(stats, torch.stack([good, good]), [w], None, None, dedupe=False)
    assert bool(torch.isfinite(grads).all()) and float(grads.abs().max()) > 0
    with pytest.raises(ValueError, match=r"cotangents\[1\]"):
        _group_draw(stats, torch.stack([good, bad]), [w], None, None, dedupe=False)
