"""Sampling controls of `creditrl train` (issue 34): DAPO's dynamic sampling and soft overlong
punishment, and the reward components that reach gdpo."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from creditrl import compute_advantages
from creditrl.config import ConfigError, load_config
from creditrl.runtime.dynamic_sampling import sample_varying_groups
from creditrl.runtime.models.tiny import TinyModelConfig, char_tokenizer, tiny_model
from creditrl.core.groups import uniform_groups
from creditrl.runtime.rollout import (concat_rollouts, generate_rollouts, sample_metrics, score_rollouts,
                                      select_groups)
from creditrl.runtime.scoring import response_stats
from creditrl.core.token_stats import TokenStats
from creditrl.tasks import Problem, get_task
from creditrl.tasks.rewards import RewardComponent, Scores, overlong_penalty

TINY = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def policy():
    task = get_task("addition", digits=1)
    tok = char_tokenizer(task.alphabet())
    return task, tok, tiny_model(tok, TINY, seed=0)


def rollouts(policy, prompts=4, group_size=2, seed=0, max_new_tokens=4, **kwargs):
    task, tok, model = policy
    problems = [task.sample(random.Random(seed * 100 + i)) for i in range(prompts)]
    return generate_rollouts(model, tok, task, problems, group_size=group_size, max_new_tokens=max_new_tokens,
                             generator=torch.Generator().manual_seed(seed), **kwargs)


# ----------------------------------------------------------------------------- the overlong penalty


def test_overlong_penalty_equals_trls_function_and_verls_formula():
    from trl.rewards import get_soft_overlong_punishment
    limit, buffer = 20, 6
    lengths = list(range(0, limit + 1))
    trl = get_soft_overlong_punishment(limit, buffer)([[0] * n for n in lengths])
    assert overlong_penalty(lengths, limit, buffer, 1.0) == pytest.approx(trl, abs=1e-12)
    factor = 0.7
    for length, ours in zip(lengths, overlong_penalty(lengths, limit, buffer, factor)):
        # verl 0.9.1 workers/reward_manager/dapo.py, written out
        exceed = length - (limit - buffer)
        assert ours == pytest.approx(min(-exceed / buffer * factor, 0.0), abs=1e-12)
    assert overlong_penalty([limit], limit, buffer, factor) == [pytest.approx(-factor)]


def test_the_penalty_is_its_own_component_and_never_changes_correctness():
    scores = Scores([1.0, 1.0, math.nan, 0.0], {}, [False] * 4)
    fields = score_rollouts(scores, torch.tensor([2, 10, 10, 9]), 10, (4, 0.5))
    penalty = [0.0, -0.5, -0.5, -0.375]
    assert fields["rewards"].tolist() == pytest.approx([1.0, 0.5, -0.5, -0.375])
    assert fields["correct"].tolist() == [True, True, False, False]          # the task's reward, unshaped
    assert fields["reward_invalid"].tolist() == [False, False, True, False]
    assert fields["task_rewards"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert fields["reward_extras"]["overlong"].tolist() == pytest.approx(penalty)
    assert fields["component_names"] == ["task", "overlong"] and fields["component_weights"] == [1.0, 1.0]
    assert math.isnan(fields["components"][2, 0]) and fields["components"][:, 1].tolist() == pytest.approx(penalty)
    terms = Scores([1.5, 0.0], {}, [False] * 2, [RewardComponent("exact", 1.0, [1.0, 0.0]),
                                                 RewardComponent("fmt", 0.5, [1.0, math.nan])])
    fields = score_rollouts(terms, torch.tensor([1, 1]), 10, None)
    assert fields["component_names"] == ["exact", "fmt"] and fields["component_weights"] == [1.0, 0.5]
    assert fields["task_rewards"] is None and "overlong" not in fields["reward_extras"]
    assert score_rollouts(Scores([1.0], {}, [False]), torch.tensor([1]), 10, None)["components"] is None


def test_rollouts_apply_the_penalty_on_sampled_tokens(policy):
    plain = rollouts(policy, max_new_tokens=4)
    shaped = rollouts(policy, max_new_tokens=4, overlong=(3, 1.0))
    lengths = shaped.response_mask[:, shaped.prompt_len:].sum(1)
    expected = torch.tensor(overlong_penalty(lengths.tolist(), 4, 3, 1.0))
    assert torch.equal(shaped.correct, plain.correct)                      # same samples, same seed
    torch.testing.assert_close(shaped.rewards.double(), plain.rewards.double() + expected)
    assert shaped.reward_signal("reward").tolist() == plain.rewards.double().tolist()


# ----------------------------------------------------------------------------- groups: select, join, filter


def test_uniform_groups_leave_missing_values_out():
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, math.nan, 2.0, math.nan, math.nan, 3.0, 3.0])
    group = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    assert uniform_groups(values, group).tolist() == [True, False, True, True, True]


def test_selected_and_joined_batches_keep_every_row_and_its_statistics(policy):
    _, _, model = policy
    a, b = rollouts(policy, prompts=3, seed=1), rollouts(policy, prompts=2, seed=2, max_new_tokens=3)
    kept = select_groups(a, torch.tensor([True, False, True]))
    assert kept.group.tolist() == [0, 0, 1, 1] and kept.prompt_texts == [a.prompt_texts[0], a.prompt_texts[2]]
    assert kept.response_texts == [a.response_texts[i] for i in (0, 1, 4, 5)]
    joined = concat_rollouts([kept, b], pad_id=0)
    assert joined.group.tolist() == [0, 0, 1, 1, 2, 2, 3, 3] and joined.num_groups == 4
    assert joined.num_tokens == kept.num_tokens + b.num_tokens
    assert torch.equal(joined.rewards, torch.cat([kept.rewards, b.rewards]))
    # the model sees the same tokens: per-token log-probs of every row equal its own batch's
    parts = [(kept, range(4)), (b, range(4, 8))]
    with torch.no_grad():
        whole = response_stats(model, joined.input_ids, joined.attention_mask, joined.position_ids,
                               joined.response_mask, joined.prompt_len, temperature=1.0, group=joined.group)
        for part, rows in parts:
            own = response_stats(model, part.input_ids, part.attention_mask, part.position_ids, part.response_mask,
                                 part.prompt_len, temperature=1.0, group=part.group)
            for i, row in enumerate(rows):
                n = int(part.response_mask[i, part.prompt_len:].sum())
                torch.testing.assert_close(whole.logp[row, :n], own.logp[i, :n], atol=1e-5, rtol=1e-5)


class Scripted:
    """``sample(n)``: the first n groups of a real batch with the next scripted rewards."""

    def __init__(self, base, script):
        self.base, self.script, self.calls = base, list(script), []

    def __call__(self, count):
        self.calls.append(count)
        batch = select_groups(self.base, torch.arange(self.base.num_groups) < count)
        rewards = torch.tensor(self.script.pop(0)[: 2 * count], dtype=torch.float32)
        batch.rewards, batch.correct = rewards, rewards >= 1
        return batch


def test_dynamic_sampling_refills_dropped_groups_up_to_the_bound(policy):
    base = rollouts(policy, prompts=4, seed=3)
    # round 1: groups 0 and 2 vary; round 2 (2 new prompts): one varies; round 3 (1): it varies
    sample = Scripted(base, [[1, 0, 1, 1, 0, 1, 0, 0], [0, 0, 1, 0], [0, 1]])
    out = sample_varying_groups(sample, 4, "reward", max_rounds=5, pad_id=0)
    assert sample.calls == [4, 2, 1]
    assert out.metrics == {"filtered_frac": pytest.approx(1 - 4 / 7), "refill_rounds": 2, "kept_groups": 4,
                           "refill_tokens": sum(b.num_tokens for b in out.sampled[1:])}
    assert out.batch.num_groups == 4 and not uniform_groups(out.batch.rewards, out.batch.group).any()
    bounded = sample_varying_groups(Scripted(base, [[1, 0, 1, 1, 0, 1, 0, 0], [0, 0, 1, 1]]), 4, "reward",
                                    max_rounds=2, pad_id=0)
    assert bounded.metrics["kept_groups"] == 2 and bounded.batch.num_groups == 2   # trains on what it kept
    nothing = sample_varying_groups(Scripted(base, [[1] * 8, [0] * 8]), 4, "accuracy", max_rounds=2, pad_id=0)
    assert nothing.batch is None and nothing.metrics["kept_groups"] == 0 and nothing.metrics["filtered_frac"] == 1.0


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 1.0, 2.0, math.nan]), min_size=2, max_size=2), min_size=1, max_size=8))
def test_uniform_groups_match_a_loop(groups):
    values = torch.tensor([v for g in groups for v in g], dtype=torch.float64)
    group = torch.arange(len(groups)).repeat_interleave(2)
    expected = [len({v for v in g if not math.isnan(v)}) < 2 for g in groups]
    assert uniform_groups(values, group).tolist() == expected


@pytest.fixture(scope="module")
def base4(policy):
    return rollouts(policy, prompts=4, seed=7)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 1), min_size=8, max_size=8), min_size=4, max_size=4), st.integers(1, 4))
def test_dynamic_sampling_keeps_the_varying_groups_in_order(base4, script, max_rounds):
    """Against a loop: each round asks for the missing count, keeps exactly its varying groups, stops at
    P kept groups or after max_rounds; the metrics count what was drawn."""
    sample = Scripted(base4, script)
    out = sample_varying_groups(sample, 4, "reward", max_rounds=max_rounds, pad_id=0)
    missing, kept, asked, drawn = 4, [], [], 0
    for rewards in script[:max_rounds]:
        asked.append(missing)
        pairs = [rewards[2 * g: 2 * g + 2] for g in range(missing)]
        drawn += missing
        varying = [p for p in pairs if p[0] != p[1]]
        kept += varying
        missing -= len(varying)
        if missing == 0:
            break
    assert sample.calls == asked and out.metrics["kept_groups"] == len(kept)
    assert out.metrics["filtered_frac"] == pytest.approx(1 - len(kept) / drawn)
    assert out.metrics["refill_rounds"] == len(asked) - 1
    if kept:
        assert out.batch.rewards.view(-1, 2).tolist() == [[float(a), float(b)] for a, b in kept]
    else:
        assert out.batch is None


def two_minibatch_learner(policy):
    """A Learner of 4 prompts x 4 responses with optim.minibatch_size=8, and a batch for it."""
    from creditrl.recipe.resolve import resolve_config
    from creditrl.trainer.update import Learner
    cfg = resolve_config(load_config(None, ["rollout.group_size=4", "rollout.prompts_per_step=4",
                                            "rollout.max_new_tokens=4", "optim.minibatch_size=8"]))
    batch = rollouts(policy, prompts=4, group_size=4)
    batch.rewards = (torch.arange(16) % 3 == 0).float()
    return Learner(policy[2], cfg), batch


def test_a_partial_dynamic_batch_is_split_into_near_equal_minibatches(policy):
    """Dynamic sampling may keep 3 of 4 groups (12 responses); optim.minibatch_size=8, which divides
    the full 16, does not divide 12: two optimizer steps of 6, not 8 and a remainder of 4 that would
    take a full step of its own (the case check_minibatch refuses for full batches)."""
    learner, batch = two_minibatch_learner(policy)
    sizes, accumulate = [], learner.accumulate
    learner.accumulate = lambda b, chunks, *a, **k: (sizes.append(sum(len(c) for c in chunks)),
                                                     accumulate(b, chunks, *a, **k))[1]
    learner.update(select_groups(batch, torch.tensor([True, True, True, False])), torch.Generator().manual_seed(0))
    learner.update(batch, torch.Generator().manual_seed(0))
    assert sizes == [6, 6, 8, 8]


@pytest.mark.parametrize("fail", [(), (1,), (1, 2)], ids=["none", "first", "both"])
def test_a_skipped_minibatch_leaves_the_logged_metrics_of_the_applied_ones(policy, fail):
    """Two optimizer steps; the loss refuses its inputs (NonFiniteError) on the steps ``fail``. The
    logged metrics are the applied steps' (they were divided by every step: kept_frac 0.5 where no
    token was dropped); with none applied, the skipped steps' own values: a NaN loss and grad_norm."""
    from creditrl.utils.validate import NonFiniteError
    learner, batch = two_minibatch_learner(policy)
    loss, calls = learner.loss, []

    class Failing:
        def __getattr__(self, k):
            return getattr(loss, k)

        def __call__(self, *a, **k):
            calls.append(1)
            if len(calls) in fail:
                raise NonFiniteError("logp: NaN (simulated)")
            return loss(*a, **k)
    learner.loss = Failing()
    m = learner.update(batch, torch.Generator().manual_seed(0)).metrics
    assert m["skipped_updates"] == len(fail)
    if len(fail) < 2:
        assert m["kept_frac"] == 1.0 and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    else:
        assert math.isnan(m["loss"]) and math.isnan(m["grad_norm"]) and "kept_frac" not in m


def test_the_signal_is_the_unshaped_reward_unless_a_component_is_named(policy):
    base = rollouts(policy, prompts=2, seed=4, overlong=(4, 1.0))
    base.task_rewards = torch.tensor([1.0, 1.0, 0.0, 1.0])
    base.reward_extras["overlong"] = torch.tensor([0.0, -0.5, 0.0, 0.0], dtype=torch.float64)
    assert uniform_groups(base.reward_signal("reward"), base.group).tolist() == [True, False]
    assert uniform_groups(base.reward_signal("reward/overlong"), base.group).tolist() == [False, True]
    with pytest.raises(ValueError, match=r"rollout.dynamic_sampling.signal: unknown signal 'reward/acc'; this task's "
                                         r"signals are \['reward', 'accuracy', 'reward/overlong'\]"):
        sample_varying_groups(lambda n: base, 2, "reward/acc", 1, pad_id=0)


# ----------------------------------------------------------------------------- refused before any work


@pytest.mark.parametrize("overrides, message", [
    (["rollout.dynamic_sampling.enabled=true", "rollout.group_size=1"],
     r"rollout.dynamic_sampling.enabled: .* needs rollout.group_size >= 2"),
    (["rollout.overlong.buffer=-2"], r"rollout.overlong.buffer: expected an integer >= 0 \(0 = off\), got -2"),
    (["rollout.overlong.buffer=9", "rollout.max_new_tokens=8"], r"rollout.overlong.buffer: expected at most "
                                                                r"rollout.max_new_tokens=8"),
    (["rollout.overlong.penalty=-1"], r"rollout.overlong.penalty: expected a value > 0, got -1"),
    (["rollout.dynamic_sampling.max_rounds=0"], r"rollout.dynamic_sampling.max_rounds: expected an integer >= 1"),
    (["rollout.dynamic_sampling.signal=score"], r"rollout.dynamic_sampling.signal: expected one of \['reward', "
                                                r"'accuracy'\] or 'reward/<name>'"),
    (["algorithm.estimator=rloo", "algorithm.options.scale=batch"],
     r"algorithm.options: unknown option\(s\) \['scale'\]; valid options are \[\]"),
])
def test_bad_sampling_controls_are_refused_naming_the_key(overrides, message):
    from creditrl.recipe.resolve import resolve_config
    with pytest.raises(ConfigError, match=message):
        resolve_config(load_config(None, overrides))


# ----------------------------------------------------------------------------- gdpo's components


def test_reward_terms_reach_gdpo_through_the_learner(tmp_path):
    from creditrl.trainer.update import Batch, advantages
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+{j}=", "answer": str(i + j)}) + "\n"
                            for i in range(4) for j in range(4)))
    task = get_task("jsonl", path=str(path), checker="exact", rewards=[{"checker": "numeric", "weight": 0.5}])
    tok = char_tokenizer(task.alphabet())
    model = tiny_model(tok, TINY, seed=0)
    problems = [Problem("1+2=", "3"), Problem("2+2=", "4")]
    batch = generate_rollouts(model, tok, task, problems, group_size=4, max_new_tokens=2,
                              generator=torch.Generator().manual_seed(0), overlong=(1, 0.2))
    assert batch.component_names == ["exact", "numeric", "overlong"] and batch.components.shape == (8, 3)
    assert batch.component_weights == [1.0, 0.5, 1.0]
    weights = torch.tensor([1.0, 0.5, 1.0], dtype=torch.float64)
    # the rollout's total reward is the components' weighted sum (what compute_advantages checks)
    torch.testing.assert_close(batch.rewards.double(), (batch.components * weights).nansum(1), rtol=4 * 1.2e-7, atol=0)
    batch.components[:, 0] = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1], dtype=torch.float64)   # a spread to see
    batch.rewards = (batch.components * weights).nansum(1).float()
    learner_batch = Batch.from_rollout(batch, torch.device("cpu"))
    mask = learner_batch.mask
    ours = advantages("gdpo", {"eps": 1e-6}, False, learner_batch, None, (None, 2.0))
    expected = compute_advantages("gdpo", rewards=batch.rewards, mask=mask, group=batch.group,
                                  components=batch.components, component_weights=[1.0, 0.5, 1.0])
    torch.testing.assert_close(ours, expected)
    total_only = compute_advantages("gdpo", rewards=batch.rewards, mask=mask, group=batch.group)
    assert not torch.allclose(ours, total_only)


@pytest.mark.parametrize("mode", ["tis", "mis", "seq-tis", "seq-mis", "rs", "geo-rs"])
def test_otb_energies_take_the_factor_the_rollout_correction_puts_on_each_token(mode):
    """OTB's off-policy energies are ŵ_t ρ̄_t² with ρ̄_t the correction's factor on the token's gradient
    (OTB App. D): the mode's weight, 0 where it drops the token (a dropped token's energy once entered
    every baseline of its group at min(ρ, cap)²)."""
    from creditrl.trainer.update import Batch, advantages
    from test_losses import loop_rollout
    gen = torch.Generator().manual_seed(1)
    rows, steps, cap = 8, 5, 1.5
    mask = (torch.arange(steps)[None] < torch.tensor([5, 3, 4, 5, 2, 5, 4, 1])[:, None]).float()
    old_logp = -torch.rand(rows, steps, generator=gen) * 2 * mask
    spread = 0.15 if mode.startswith("seq") else 0.6
    rollout = (old_logp + spread * torch.randn(rows, steps, generator=gen)).clamp(max=0) * mask
    energy = torch.rand(rows, steps, generator=gen) * mask
    group = torch.arange(rows) // 4
    batch = Batch({"group": group}, mask, rollout, torch.rand(rows, generator=gen), 0, torch.zeros(rows, dtype=torch.bool))
    old = TokenStats(old_logp, torch.zeros_like(mask), torch.zeros_like(mask), energy)
    weight, keep = loop_rollout(old_logp.double(), rollout.double(), mask.bool(), mode, cap)
    got = advantages("otb", {}, True, batch, old, (mode, cap))
    expected = compute_advantages("otb", rewards=batch.rewards, mask=mask, group=group, energy=energy,
                                  is_weights=(weight * keep).float())
    torch.testing.assert_close(got, expected)
    if not mode.endswith("tis"):
        assert (mask.bool() & ~keep).any() and keep.any()


# ----------------------------------------------------------------------------- creditrl train


TRAIN = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
         "model.warm_start.max_steps=50", "model.warm_start.eval_every=25", "model.warm_start.eval_size=8",
         "task.options.digits=1", "train.eval_problems=4", "train.eval_samples=2", "logging.progress=false",
         "train.threads=1", "train.steps=2", "rollout.prompts_per_step=3", "rollout.group_size=3",
         "algorithm.estimator=grpo", "train.save_every=0", "rollout.dynamic_sampling.enabled=true",
         "rollout.dynamic_sampling.max_rounds=3", "logging.report_to=[jsonl]", "logging.plots=false"]


@pytest.mark.slow
def test_train_with_dynamic_sampling_trains_on_varying_groups_only(tmp_path, monkeypatch):
    from creditrl.trainer import train
    from creditrl.trainer.update import Learner
    seen = []
    update = Learner.update

    def recording(self, rollout, generator):
        seen.append(rollout)
        return update(self, rollout, generator)

    monkeypatch.setattr(Learner, "update", recording)
    # warm-started to ~30% accuracy so groups vary (as test_trainer's TINY_RUN)
    cfg = load_config(None, TRAIN + [f"train.output_dir={tmp_path}", "train.run_name=ds", "train.steps=3",
                                     "model.warm_start.max_steps=400", "model.warm_start.target_accuracy=0.3",
                                     "model.warm_start.lr=3e-3", "model.warm_start.eval_size=32",
                                     "rollout.overlong.buffer=2", "algorithm.estimator=reinforce_plus_plus_baseline"])
    run = train(cfg)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all({"filtered_frac", "refill_rounds", "refill_tokens", "kept_groups", "reward/overlong"} <= set(m)
               for m in metrics)
    updated = [m for m in metrics if m["kept_groups"] > 0]
    assert len(seen) == len(updated) > 0
    for m, batch in zip(updated, seen):
        assert batch.num_groups == m["kept_groups"] <= 3 and m["refill_rounds"] <= 2
        assert not uniform_groups(batch.reward_signal("reward"), batch.group).any()
        assert m["refill_rounds"] > 0 or m["refill_tokens"] == 0


@pytest.mark.slow
def test_a_step_whose_every_round_is_uniform_makes_no_update_and_says_so(tmp_path, capsys):
    from creditrl.trainer.loop import Trainer
    cfg = load_config(None, TRAIN + [f"train.output_dir={tmp_path}", "train.run_name=uniform", "optim.warmup_steps=4",
                                     "optim.lr=1e-3"])
    trainer = Trainer(cfg, tmp_path / "uniform", progress=False)
    trainer.task.reward = lambda problem, response: 1.0          # every response scores the same
    before = [p.detach().clone() for p in trainer.model.parameters()]
    run = trainer.run()
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["kept_groups"] for m in metrics] == [0, 0] and all(m["filtered_frac"] == 1.0 for m in metrics)
    assert all(m["refill_rounds"] == 2 and m["refill_tokens"] > 0 for m in metrics)
    # the schedule counts steps, updated or not: warmup is 1/4, 2/4 of optim.lr at steps 1, 2
    assert [m["lr"] for m in metrics] == [pytest.approx(1e-3 / 4), pytest.approx(2e-3 / 4)]
    err = capsys.readouterr()
    assert "step 1 made no update: dynamic sampling kept no group in 3 round(s)" in err.out + err.err
    summary = json.loads((run / "summary.json").read_text())
    assert "dynamic sampling kept no group" in summary["warning"] and "no step made an update" in summary["warning"]


def test_sample_metrics_describe_everything_sampled(policy):
    a, b = rollouts(policy, prompts=2, seed=5), rollouts(policy, prompts=3, seed=6)
    joined = concat_rollouts([a, b], pad_id=0)
    metrics = sample_metrics(joined)
    rewards = torch.cat([a.rewards, b.rewards])
    assert metrics["reward_mean"] == pytest.approx(float(rewards.mean()))
    lengths = torch.cat([x.response_mask[:, x.prompt_len:].sum(1) for x in (a, b)]).float()
    assert metrics["response_len"] == pytest.approx(float(lengths.mean()))


def test_a_run_saved_before_the_sampling_controls_reads_with_them_off(tmp_path):
    """Its config.yaml and its checkpoint's config record have no rollout.overlong / dynamic_sampling:
    they ran without them, so they read (and resume) with both off; a config that lacks only one of them
    is incomplete, and a command-line override never resets a YAML file's settings."""
    import yaml
    from creditrl.config import Config, config_to_dict, read_saved_config, resume_changes
    old = config_to_dict(Config())
    for key in ("overlong", "dynamic_sampling"):
        del old["rollout"][key]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(old))
    data = read_saved_config(path)
    assert data["rollout"]["overlong"]["buffer"] == 0 and data["rollout"]["dynamic_sampling"]["enabled"] is False
    assert resume_changes(old, config_to_dict(Config()), 0) == {}
    half = config_to_dict(Config())
    del half["rollout"]["overlong"]
    path.write_text(yaml.safe_dump(half))
    with pytest.raises(ConfigError, match=r"incomplete saved config \(missing rollout.overlong.buffer"):
        read_saved_config(path)
    path.write_text("rollout:\n  overlong:\n    buffer: 3\n")
    assert load_config(path, ["rollout.group_size=4"]).rollout.overlong.buffer == 3
