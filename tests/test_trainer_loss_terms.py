"""The new loss terms inside ``creditrl train``'s Learner: the entropy bonus's gradient reaches the
model (equal to a brute-force full-softmax computation), the truncation flags travel from the
rollout to the loss, the adaptive entropy controller steps once per optimizer step, the config
refuses what cannot combine before any work, and a run that keeps no token says so."""
from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from creditrl.config import ConfigError, load_config
from creditrl.core.losses import PolicyLoss
from creditrl.runtime.models.tiny import TinyModelConfig, char_tokenizer, tiny_model
from creditrl.runtime.rollout import generate_rollouts
from creditrl.recipe.resolve import resolve_config
from creditrl.tasks import get_task
from creditrl.trainer.report import learned_nothing, no_signal
from creditrl.trainer.update import Batch, Learner

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)


@pytest.fixture(scope="module")
def setup():
    task = get_task("addition", digits=1)
    return task, char_tokenizer(task.alphabet())


def rollout(task, tok, model, seed=0, max_new_tokens=5):
    problems = [task.sample(random.Random(seed + i)) for i in range(3)]
    batch = generate_rollouts(model, tok, task, problems, group_size=4, max_new_tokens=max_new_tokens,
                              generator=torch.Generator().manual_seed(seed))
    batch.rewards = (torch.arange(12) % 3 == 0).float()
    batch.correct = batch.rewards >= 1
    return batch


def config(*overrides):
    return load_config(None, ["rollout.group_size=4", "rollout.max_new_tokens=5", "optim.lr=1e-3", *overrides])


def test_entropy_bonus_gradient_in_the_learner_equals_a_full_softmax_computation(setup):
    """Learner.accumulate (shared-prompt scoring, chunked token_stats with the entropy on the graph)
    against the loss on log-probs and entropies from the full logits' softmax."""
    task, tok = setup
    model = tiny_model(tok, SMALL, seed=0)
    cfg = config("loss.entropy_bonus.enabled=true", "loss.entropy_bonus.coef=0.7", "train.chunk_size=3")
    learner = Learner(model, cfg)
    batch = Batch.from_rollout(rollout(task, tok, model), torch.device("cpu"))
    rows = torch.arange(batch.size)
    with torch.no_grad():
        old = learner.old_statistics(batch, [rows], fused=False)[0]
    adv = torch.randn(batch.size, batch.mask.shape[1], generator=torch.Generator().manual_seed(1)) * batch.mask
    learner.optimizer.zero_grad(set_to_none=True)
    learner.accumulate(batch, [rows], [None], old, adv, None, None)
    ours = [p.grad.clone() for p in learner.params]

    model.zero_grad(set_to_none=True)
    t, p = batch.tensors, batch.prompt_len
    logits = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"], position_ids=t["position_ids"]).logits
    log_probs = torch.log_softmax(logits[:, p - 1:-1].double() / cfg.rollout.temperature, -1)
    logp = log_probs.gather(-1, t["input_ids"][:, p:, None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    loss, _ = learner.loss(logp, old.logp, adv, batch.mask, entropy=entropy, truncated=batch.truncated)
    loss.backward()
    for a, b in zip(ours, (param.grad for param in learner.params)):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-3, atol=1e-6)
    # without the bonus the gradient differs: the entropy's gradient did reach the weights
    plain = Learner(tiny_model(tok, SMALL, seed=0), config("train.chunk_size=3"))
    plain.optimizer.zero_grad(set_to_none=True)
    plain.accumulate(batch, [rows], [None], old, adv, None, None)
    assert any(not torch.allclose(a, q.grad, atol=1e-6) for a, q in zip(ours, plain.params))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("terms", [[], ["loss.kl_coef=0.1", "loss.rollout_correction=mis", "loss.rollout_cap=1.3"],
                                   ["loss.sapo.enabled=true", "loss.entropy_bonus.enabled=true",
                                    "loss.entropy_bonus.coef=0.1", "loss.mask_truncated.enabled=true"],
                                   ["loss.gspo.enabled=true"], ["loss.geo_mean.enabled=true"]])
def test_micro_batched_metrics_equal_the_whole_batchs(setup, agg, terms):
    """Learner.accumulate over two micro-batches logs the metrics of one pass over the whole
    mini-batch: each micro-batch's mean is weighted by the tokens or responses it is over (a
    row-weighted clip fraction under a seq-mean aggregation would differ), the loss by agg_count,
    whose sum is the whole batch's."""
    task, tok = setup
    model = tiny_model(tok, SMALL, seed=0)
    sampled = rollout(task, tok, model, max_new_tokens=5)
    sampled.stopped = torch.tensor([True, True, False] * 4)
    learner = Learner(model, config(f"loss.agg={agg}", "loss.clip_high=0.28", *terms))
    batch = Batch.from_rollout(sampled, torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    rows = torch.arange(batch.size)
    with torch.no_grad():
        old = learner.old_statistics(batch, [rows], fused=False)[0]
    # ratios away from 1 (clip fractions, KLs and the MIS drop are nonzero), uneven lengths per chunk
    noisy = lambda x: x + 0.5 * torch.randn(x.shape, generator=g) * batch.mask  # noqa: E731
    old = dataclasses.replace(old, logp=noisy(old.logp).clamp(max=0.0))
    batch = dataclasses.replace(batch, rollout_logp=noisy(batch.rollout_logp).clamp(max=0.0))
    ref = noisy(old.logp).clamp(max=0.0)
    adv = torch.randn(batch.size, batch.mask.shape[1], generator=g) * batch.mask
    whole = learner.accumulate(batch, [rows], [None], old, adv, ref, None)
    learner.optimizer.zero_grad(set_to_none=True)
    parts = learner.accumulate(batch, [rows[:5], rows[5:]], [None, None], old, adv, ref, None)
    assert parts.keys() == whole.keys()
    if not terms:                                                  # the clip binds somewhere
        assert whole["clip_frac_low"] + whole["clip_frac_high"] > 0
    for key, value in whole.items():
        assert parts[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_truncated_rows_reach_the_loss(setup):
    task, tok = setup
    model = tiny_model(tok, SMALL, seed=0)
    batch = rollout(task, tok, model, max_new_tokens=3)
    batch.stopped = torch.tensor([True, False] * 6)           # rows 1, 3, ... hit the cap
    learner = Learner(model, config("loss.mask_truncated.enabled=true"))
    seen = []
    loss = learner.loss.loss

    def spy(*args, **kwargs):
        seen.append(kwargs["truncated"].clone())
        return loss(*args, **kwargs)
    learner.loss = dataclasses.replace(learner.loss, loss=spy)
    metrics = learner.update(batch, torch.Generator().manual_seed(0)).metrics
    assert torch.equal(seen[0], ~batch.stopped)
    mask = batch.response_mask[:, batch.prompt_len:]
    assert metrics["kept_frac"] == pytest.approx(float(mask[batch.stopped].sum() / mask.sum()), rel=1e-6)
    assert metrics["truncated_masked_frac"] == pytest.approx(1 - metrics["kept_frac"], rel=1e-6)


def test_adaptive_entropy_applies_the_controllers_coefficient_step_by_step(setup):
    """Target above any entropy: β starts applied at 0 (no step measured yet), then grows by
    coef_delta per optimizer step and is applied (TRL's rule), two optimizer steps per update."""
    task, tok = setup
    model = tiny_model(tok, SMALL, seed=0)
    cfg = config("loss.entropy_bonus.enabled=true", "loss.entropy_bonus.adaptive=true", "loss.entropy_bonus.coef=0.1",
                 "loss.entropy_bonus.target=50.0", "loss.entropy_bonus.coef_delta=0.01", "optim.minibatch_size=6",
                 "rollout.prompts_per_step=3")                     # rollout()'s 3 prompts × 4: two mini-batches
    learner = Learner(model, cfg)
    applied = []
    for step in range(3):
        metrics = learner.update(rollout(task, tok, model, seed=step), torch.Generator().manual_seed(step)).metrics
        applied.append(metrics["entropy_bonus_coef"])         # the mean over the update's two optimizer steps
        assert metrics["bonus_entropy"] > 0
    # metrics are float32 tensors until the one host copy: ~1e-8 of rounding
    assert applied == pytest.approx([(0.0 + 0.11) / 2, (0.12 + 0.13) / 2, (0.14 + 0.15) / 2], abs=1e-7)
    assert learner.entropy_control.coef == pytest.approx(0.16) and learner.entropy_control.last_entropy < 50


def test_config_refuses_what_cannot_combine_before_any_work():
    with pytest.raises(ConfigError, match="^loss: loss terms 'cispo' and 'sapo' are both surrogate terms"):
        resolve_config(load_config(None, ["loss.cispo.enabled=true", "loss.sapo.enabled=true"]))
    # a surrogate by name in loss.terms is its section switched on; both at once is one term twice
    listed = resolve_config(load_config(None, ["loss.terms=[{path: cispo}]"]))
    assert listed.loss == resolve_config(load_config(None, ["loss.cispo.enabled=true"])).loss
    with pytest.raises(ConfigError, match=r"^loss.terms\[0\]: loss term 'cispo' is also on as loss.cispo.enabled=true"):
        resolve_config(load_config(None, ["loss.terms=[{path: cispo}]", "loss.cispo.enabled=true"]))
    with pytest.raises(ConfigError, match=r"loss.sapo.tau_neg: expected a value in \(0, inf\], got 0"):
        resolve_config(load_config(None, ["loss.sapo.enabled=true", "loss.sapo.tau_neg=0"]))
    cfg = resolve_config(load_config(None, ["loss.kl_cov.enabled=true", "loss.kl_cov.kl_cov_ratio=0.01"]))
    assert cfg.loss["kl_cov"] == {"enabled": True, "kl_cov_ratio": 0.01, "ppo_kl_coef": 0.1}


def test_a_surrogate_that_cannot_act_on_policy_is_noted():
    from creditrl.recipe.build import policy_loss_from_config
    from creditrl.trainer.loop import on_policy_notes

    cfg = config("loss.cispo.enabled=true")
    (note,) = on_policy_notes(policy_loss_from_config(cfg).loss, cfg)
    assert note.startswith("note: loss.cispo: every update of this run is on-policy")
    for other in (config("loss.cispo.enabled=true", "optim.epochs=2"),
                  config("loss.cispo.enabled=true", "optim.minibatch_size=8"),
                  config("loss.clip_cov.enabled=true")):
        assert on_policy_notes(policy_loss_from_config(other).loss, other) == []


def test_settings_that_do_less_than_they_seem_are_warned():
    from creditrl.recipe.build import policy_loss_from_config
    from creditrl.trainer.loop import idle_setting_notes

    def notes(*overrides):
        cfg = config(*overrides)
        return idle_setting_notes(policy_loss_from_config(cfg).loss, cfg)

    (note,) = notes("train.steps=10", "optim.warmup_steps=40")
    assert note.startswith("warning: optim.warmup_steps=40 > train.steps=10: the learning rate never reaches "
                           "optim.lr=0.001; it peaks at 25% of it")
    (note,) = notes("loss.entropy_bonus.enabled=true")
    assert note.startswith("warning: loss.entropy_bonus is on with coef=0")
    bonus = "loss.entropy_bonus.enabled=true"
    (note,) = notes(bonus, "loss.entropy_bonus.coef=-0.1")
    assert note.startswith("warning: loss.entropy_bonus.coef=-0.1 is negative: the term lowers the entropy")
    assert notes("loss.rollout_cap=3", "loss.kl_estimator=k2", "optim.min_lr_ratio=0.5") == [
        "warning: loss.rollout_cap=3.0 (loss.rollout_correction is off) does nothing",
        "warning: loss.kl_estimator='k2' / kl_bias_correction=False (loss.kl_coef=0: no KL term) does nothing",
        "warning: optim.min_lr_ratio=0.5 (optim.schedule=constant has no floor) does nothing"]
    assert notes("model.name=/some/model", "model.tiny.hidden_size=64", "model.warm_start.lr=0.5") == [
        "warning: model.tiny.hidden_size=64 (model.name is '/some/model', not builtin:tiny) does nothing",
        "warning: model.warm_start.lr=0.5 (model.name is '/some/model', not builtin:tiny) does nothing"]
    assert notes("train.steps=3", "logging.diagnose_every=4") == [
        "warning: logging.diagnose_every=4 (> train.steps=3: no step is diagnosed) does nothing"]
    for fine in (("train.steps=10", "optim.warmup_steps=10"), (bonus, "loss.entropy_bonus.coef=0.01"),
                 ("model.tiny.hidden_size=64",), ("train.steps=4", "logging.diagnose_every=4"),
                 (bonus, "loss.entropy_bonus.adaptive=true"), (), ("loss.rollout_correction=tis", "loss.rollout_cap=3"),
                 ("loss.kl_coef=0.1", "loss.kl_estimator=k2"), ("optim.schedule=cosine", "optim.min_lr_ratio=0.5")):
        assert notes(*fine) == []


def test_a_run_that_keeps_no_token_says_so():
    step = {"step": 1, "reward_invalid_frac": 0.0, "zero_spread_frac": 0.5, "kept_frac": 0.0, "clipped_frac": 1.0,
            "adv_mean": 0.1, "adv_std": 0.5}
    assert no_signal(step) == "nothing_kept"
    warning = learned_nothing([step, {**step, "step": 2}], "grpo")
    assert "every token was dropped from the loss" in warning and "loss.mask_truncated" in warning
    assert no_signal({**step, "kept_frac": 0.5}) is None
    assert math.isfinite(PolicyLoss().__call__(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1),
                                               torch.zeros(1, 2))[1]["kept_frac"])


def test_diagnose_names_the_new_terms_it_cannot_measure_group_by_group():
    """diagnose measures a loss group by group through log π: clip_cov's draw and top_entropy's quantile
    over the mini-batch are named as not separable, the entropy bonus as acting through the entropy;
    the per-row and per-token terms, and delta_l_norm (count · L is a sum over rows), measure exactly;
    mask_truncated gets the rollout's truncation flags (a cut row's cotangent is 0)."""
    from creditrl.runtime.group_gradients import loss_cotangent, non_additive_terms
    from creditrl.tools.diagnose.plan import loss_notes

    named = {name: PolicyLoss({name: options}) for name, options in (
        ("clip_cov", {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.0}), ("top_entropy", {"quantile": 0.5}),
        ("entropy_bonus", {"coef": 0.01}), ("kl_cov", None), ("gspo", None), ("cispo", None), ("sapo", None),
        ("geo_mean", None), ("dppo_tv", None), ("dppo_kl", None), ("mask_truncated", None), ("delta_l_norm", None))}
    assert {name for name, loss in named.items() if non_additive_terms(loss)} == {"clip_cov", "top_entropy"}
    assert {name for name, loss in named.items() if loss_notes(loss)} == {"clip_cov", "top_entropy", "entropy_bonus"}
    assert "acts through the entropy's gradient" in loss_notes(named["entropy_bonus"])[0]
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 4, generator=gen, dtype=torch.float64)
    adv, mask = torch.randn(3, generator=gen, dtype=torch.float64), torch.ones(3, 4, dtype=torch.bool)
    cut = torch.tensor([False, True, False])
    cot = loss_cotangent(named["mask_truncated"], logp, adv, mask, logp, torch.zeros_like(logp), cut)
    assert (cot[1] == 0).all() and (cot[[0, 2]] != 0).all()


def test_a_run_whose_every_response_was_cut_names_max_new_tokens():
    """rollout.max_new_tokens=1: every response is cut, every reward 0; the warning blamed the task's
    difficulty (or a group size), not the setting."""
    step = {"step": 1, "reward_invalid_frac": 0.0, "zero_spread_frac": 1.0, "reward_std": 0.0, "reward_mean": 0.0,
            "kept_frac": 1.0, "clipped_frac": 1.0, "adv_mean": 0.0, "adv_std": 0.0}
    warning = learned_nothing([step, {**step, "step": 2}], "grpo")
    assert "every response was cut at rollout.max_new_tokens (clipped_frac 1 at every step" in warning
    other = learned_nothing([step, {**step, "step": 2, "clipped_frac": 0.5}], "grpo")
    assert "max_new_tokens" not in other and "every group's rewards were equal" in other
