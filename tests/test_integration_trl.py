"""CreditGRPOTrainer on a tiny local Llama (char tokenizer, no download): 2 steps per method.

Checks, per run: the advantages entering the loss equal ``creditrl.compute_advantages`` on the
same rewards and groups; the rollout energy equals ``token_stats`` on the same logits; the
parameters change; creditrl's metrics reach TRL's log.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import warnings

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl.trainer import grpo_trainer  # noqa: E402

import creditrl  # noqa: E402
from creditrl import ClipOptions, KLOptions, RolloutCorrectionOptions, StapoOptions, TraceOptions  # noqa: E402
from creditrl.core.estimators.registry import get_estimator  # noqa: E402
from creditrl.integrations.trl import CreditGRPOConfig, CreditGRPOTrainer  # noqa: E402
from creditrl.runtime.models.tiny import TinyModelConfig, char_tokenizer, tiny_model  # noqa: E402
from tolerances import EPS32, sum_rtol  # noqa: E402

ALPHABET = "abcdefgh0123456789+= "
NUM_GENERATIONS = 4
# The rollout's energy (TRL's forward, ŵ = 1 − 2π_y + Σπ² from its log-probs and fused log Σπ²) against
# token_stats on a separate forward of the same model: the logits differ by the forward's float32 rounding,
# a chain of sums over the hidden (32), MLP (64), vocabulary (22) and positions (<= 10) widths, within
# 128·eps32 of logits |z| <= 4; ŵ moves by at most 2·|Δz| (|∂ŵ/∂z| <= 2), and the 1 − 2π_y + Σπ² form
# cancels to 4·eps32 absolute (tests/tolerances.py)
ENERGY_ATOL = 2 * sum_rtol(128) * 4 + 4 * EPS32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    tokenizer = char_tokenizer(ALPHABET)
    cfg = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=64)
    tiny_model(tokenizer, cfg, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def count_digits(completions, **kwargs):
    return [float(sum(c.isdigit() for c in text)) for text in completions]


def count_letters(completions, **kwargs):
    return [float(sum(c.isalpha() for c in text)) for text in completions]


def run_trainer(model_dir, tmp_path, monkeypatch, reward_funcs=count_digits, **options):
    # Keep TRL's generation order so the loss batch is the rollout batch row for row.
    monkeypatch.setattr(grpo_trainer, "shuffle_sequence_dict", lambda batch: batch)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    dataset = Dataset.from_dict({"prompt": ["ab", "cd", "12", "ef", "34", "gh"] * 2})
    args = CreditGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2 * NUM_GENERATIONS, num_generations=NUM_GENERATIONS,
        max_completion_length=8, max_steps=options.pop("max_steps", 2), learning_rate=5e-2, logging_steps=1, report_to="none",
        use_cpu=True, bf16=False, save_strategy="no", seed=0, temperature=1.0, **options)
    trainer = CreditGRPOTrainer(model=model, reward_funcs=reward_funcs, args=args, train_dataset=dataset,
                                processing_class=tokenizer)
    records = {"rollouts": [], "loss_inputs": [], "masks": []}
    generate, compute_loss = trainer._generate_and_score_completions, trainer._compute_loss
    pending = []

    def recording_generate(inputs):
        output = generate(inputs)
        pending.append(reference_energy(trainer, output))
        return output

    def recording_loss(model, inputs):
        loss = compute_loss(model, inputs)
        # the advantages the loss used: computed at rollout time, or in this loss forward when
        # the energy comes from it (then TRL's inputs hold a placeholder)
        used = trainer.last_rollout["advantages"] if "creditrl_group" in inputs else inputs["advantages"]
        records["loss_inputs"].append(used.detach().clone())
        records["masks"].append(inputs["completion_mask"].detach().clone())
        if pending:
            records["rollouts"].append((dict(trainer.last_rollout), pending.pop(0)))
        return loss

    monkeypatch.setattr(trainer, "_generate_and_score_completions", recording_generate)
    monkeypatch.setattr(trainer, "_compute_loss", recording_loss)
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.train()
    changed = any(not torch.equal(before[k], v) for k, v in trainer.model.named_parameters())
    return trainer, records, changed


def zero_reward(completions, **kwargs):
    return [0.0 for _ in completions]


def no_reward(completions, **kwargs):
    return [None for _ in completions]


@pytest.mark.parametrize("reward, cause", [
    (zero_reward, "the rewards held no difference for 'grpo' to learn from"),
    (no_reward, "no completion was scored or kept"), (count_digits, None)])
def test_a_run_without_reward_signal_says_so(reward, cause, model_dir, tmp_path, monkeypatch):
    """NO_SIGNAL_BATCHES generation batches in a row with every advantage 0 (every reward 0, or no
    reward at all) give one warning that the run learns nothing, naming why; rewards that differ
    give none."""
    warns = cause is not None
    from creditrl.integrations.trl import NO_SIGNAL_BATCHES
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _, _ = run_trainer(model_dir, tmp_path, monkeypatch, reward_funcs=reward,
                                    max_steps=NO_SIGNAL_BATCHES + 1)
    said = [str(w.message) for w in caught if "learns nothing from its task" in str(w.message)]
    assert len(said) == (1 if warns else 0), said
    if warns:
        assert f"every advantage was 0 in {NO_SIGNAL_BATCHES} generation batches in a row" in said[0]
        assert cause in said[0]
    logged = [e["creditrl/advantage_abs_mean"] for e in trainer.state.log_history if "creditrl/advantage_abs_mean" in e]
    assert len(logged) == NO_SIGNAL_BATCHES + 1 and (max(logged) == 0) == warns


@torch.no_grad()
def reference_energy(trainer, output):
    """token_stats on the plain (unfused) logits of the same model at rollout time."""
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    steps = output["completion_ids"].size(1)
    logits = trainer.model(input_ids=ids, attention_mask=attention).logits[:, -steps - 1:-1]
    stats = creditrl.token_stats(logits, output["completion_ids"], output["completion_mask"],
                                 temperature=trainer.temperature)
    return stats.energy


CASES = {
    "otb": dict(advantage_estimator="otb"),
    "maxpo_k2": dict(advantage_estimator="maxpo", maxk_k=2),
    "maxpo_options": dict(advantage_estimator="maxpo", estimator_options={"k": 2}),
    "user_term": dict(advantage_estimator="grpo", trace=True,
                      loss_terms=[{"path": "length_penalty_term:length_penalty", "coef": 0.05}]),
    "stapo": dict(advantage_estimator="grpo", stapo=True, stapo_tau_p=0.5, stapo_high_entropy_fraction=0.5),
    "eps_trace": dict(advantage_estimator="rloo", trace_lam=0.9, loss_type="bnpo"),
    "cispo_gspo_entropy": dict(advantage_estimator="grpo", cispo=True, gspo=True, entropy_bonus_coef=0.05,
                               top_entropy_quantile=0.5, beta=0.01),
    "sapo_adaptive_entropy": dict(advantage_estimator="grpo", sapo=True, entropy_bonus_adaptive=True,
                                  entropy_bonus_target=10.0, delta_l_norm=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_steps(case, model_dir, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent / "plugins"))
    options = CASES[case]
    trainer, records, changed = run_trainer(model_dir, tmp_path, monkeypatch, **options)
    assert changed, "parameters did not change"
    assert len(records["rollouts"]) == 2 and len(records["loss_inputs"]) == 2
    kwargs = trainer.args.estimator_kwargs()
    for (rollout, ref_energy), loss_adv in zip(records["rollouts"], records["loss_inputs"]):
        energy = rollout["energy"]
        if options["advantage_estimator"] == "otb":
            torch.testing.assert_close(energy, ref_energy, atol=ENERGY_ATOL, rtol=0)
        # the advantages the loss used are compute_advantages of the rollout's own tensors: the same
        # float32 computation on the same inputs
        expected = creditrl.compute_advantages(
            options["advantage_estimator"], rewards=rollout["rewards"], mask=rollout["estimator_mask"],
            group=torch.arange(len(rollout["rewards"])) // NUM_GENERATIONS, energy=energy, **kwargs)
        assert torch.equal(loss_adv, expected)
        assert loss_adv.shape == rollout["mask"].shape
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert {"creditrl/kept_frac", "creditrl/advantage_abs_mean"} <= logged
    if case == "otb":
        assert "creditrl/power_proxy" in logged
    if case == "stapo":
        assert "creditrl/spurious_ratio" in logged
    if case == "user_term":
        assert "creditrl/length_penalty" in logged
    if case == "cispo_gspo_entropy":
        assert {"creditrl/high_entropy_frac", "creditrl/bonus_entropy", "creditrl/seq_log_ratio_abs"} <= logged
    if case == "sapo_adaptive_entropy":          # TRL's controller state: β grew by δ per step (entropy < target)
        assert trainer.entropy_coef == pytest.approx(2 * 0.005) and trainer._last_world_entropy < 10.0


@pytest.mark.slow
def test_energy_reuses_trls_old_logps_forward(model_dir, tmp_path, monkeypatch):
    """When TRL runs its own old-log-prob forward (here: steps_per_generation=2 with one
    gradient-accumulation step), the energy comes from that forward's fused log Σπ²: no extra
    forward, and the same energy as token_stats on the plain logits."""
    def no_extra_forward(self, output, batch_size):
        raise AssertionError("CreditGRPOTrainer ran its own energy forward although TRL ran one")

    monkeypatch.setattr(CreditGRPOTrainer, "_rollout_energy", no_extra_forward)
    trainer, records, changed = run_trainer(model_dir, tmp_path, monkeypatch, advantage_estimator="otb",
                                            steps_per_generation=2, gradient_accumulation_steps=1)
    assert changed and records["rollouts"]
    for rollout, ref_energy in records["rollouts"]:
        torch.testing.assert_close(rollout["energy"], ref_energy, atol=ENERGY_ATOL, rtol=0)


def trl_advantages(model_dir, tmp_path, monkeypatch, **options):
    """TRL's own GRPOTrainer, one step: its rewards per function and the advantages it computed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=3 * NUM_GENERATIONS,
                      num_generations=NUM_GENERATIONS, max_completion_length=8, max_steps=1, report_to="none",
                      use_cpu=True, bf16=False, save_strategy="no", seed=0, reward_weights=[1.0, 0.5], **options)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=[count_digits,
                          count_letters], args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": ["ab", "cd", "12", "ef", "34", "gh"] * 2}))
    seen = {}
    calculate, generate = trainer._calculate_rewards, trainer._generate_and_score_completions

    def capture_rewards(*args):
        seen["rewards_per_func"] = calculate(*args)
        return seen["rewards_per_func"]

    def capture_output(inputs):
        output = generate(inputs)
        seen["advantages"] = output["advantages"].clone()
        return output

    monkeypatch.setattr(trainer, "_calculate_rewards", capture_rewards)
    monkeypatch.setattr(trainer, "_generate_and_score_completions", capture_output)
    trainer.train()
    return seen["rewards_per_func"], seen["advantages"]


@pytest.mark.slow
def test_trls_own_metrics_are_logged_under_trls_names_with_trls_values(model_dir, tmp_path):
    """The same run with plain GRPOTrainer and with CreditGRPOTrainer (grpo at TRL's eps, SGD, two
    iterations per generation so the ratio leaves 1, a KL term): TRL's loss metrics (entropy, kl,
    clip_ratio/*) are in both logs, equal up to the float32 rounding of two implementations of the
    same step (the updates agree to ~1e-6 relative); a clip fraction may differ by a token at the edge."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    logs = {}
    for name, config, trainer_class, own in (("trl", GRPOConfig, GRPOTrainer, {}),
                                             ("credit", CreditGRPOConfig, CreditGRPOTrainer,
                                              {"advantage_estimator": "grpo", "estimator_options": {"eps": 1e-4}})):
        args = config(output_dir=str(tmp_path / name), per_device_train_batch_size=2 * NUM_GENERATIONS,
                      num_generations=NUM_GENERATIONS, max_completion_length=8, max_steps=2, num_iterations=2,
                      loss_type="dapo", optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", beta=0.1,
                      epsilon=0.05, max_grad_norm=1e9, logging_steps=1, report_to="none", use_cpu=True, bf16=False,
                      save_strategy="no", seed=0, **own)
        trainer = trainer_class(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=count_digits,
                                args=args, processing_class=AutoTokenizer.from_pretrained(model_dir),
                                train_dataset=Dataset.from_dict({"prompt": ["ab", "12", "cd", "34"] * 4}))
        trainer.train()
        logs[name] = [entry for entry in trainer.state.log_history if "loss" in entry]
    keys = ("entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
            "clip_ratio/low_min", "clip_ratio/high_max")
    assert len(logs["trl"]) == len(logs["credit"]) == 2
    tokens = 2 * NUM_GENERATIONS * 8
    assert any(entry["clip_ratio/region_mean"] > 0 for entry in logs["trl"])      # the clip metrics are exercised
    for theirs, ours in zip(logs["trl"], logs["credit"]):
        assert set(keys) <= set(theirs) and set(keys) <= set(ours)
        assert ours["entropy"] == pytest.approx(theirs["entropy"], rel=1e-4)
        assert ours["kl"] == pytest.approx(theirs["kl"], rel=1e-3, abs=1e-7)
        for key in keys[2:]:
            assert abs(ours[key] - theirs[key]) <= 2 / tokens + 1e-6, key


@pytest.mark.slow
def test_grpo_batch_scale_equals_trls_scale_rewards_batch(model_dir, tmp_path, monkeypatch):
    per_func, theirs = trl_advantages(model_dir, tmp_path, monkeypatch, scale_rewards="batch")
    rewards = (per_func * torch.tensor([1.0, 0.5])).nansum(1)
    assert rewards.std() > 0 and len(set(rewards.tolist())) > 2
    ours = creditrl.compute_advantages("grpo", rewards=rewards, mask=torch.ones(len(rewards), 1),
                                       group=torch.arange(len(rewards)) // NUM_GENERATIONS, scale="batch", eps=1e-4)
    torch.testing.assert_close(ours[:, 0], theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_gdpo_equals_trls_normalize_then_sum(model_dir, tmp_path, monkeypatch):
    per_func, theirs = trl_advantages(model_dir, tmp_path, monkeypatch, multi_objective_aggregation="normalize_then_sum")
    group = torch.arange(per_func.shape[0]) // NUM_GENERATIONS
    rewards = (per_func * torch.tensor([1.0, 0.5])).nansum(1)            # TRL's total: the weighted sum
    ours = creditrl.compute_advantages("gdpo", rewards=rewards, mask=torch.ones(per_func.shape[0], 1),
                                       group=group, components=per_func, component_weights=[1.0, 0.5], eps=1e-4)
    torch.testing.assert_close(ours[:, 0], theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_credit_trainer_hands_gdpo_the_reward_functions(model_dir, tmp_path, monkeypatch):
    trainer, records, changed = run_trainer(model_dir, tmp_path, monkeypatch, reward_funcs=[count_digits, count_letters],
                                            reward_weights=[1.0, 0.5], advantage_estimator="gdpo",
                                            multi_objective_aggregation="normalize_then_sum")
    assert changed
    for (rollout, _), loss_adv in zip(records["rollouts"], records["loss_inputs"]):
        assert rollout["components"].shape == (len(rollout["rewards"]), 2)
        expected = creditrl.compute_advantages(
            "gdpo", rewards=rollout["rewards"], mask=rollout["estimator_mask"],
            group=torch.arange(len(rollout["rewards"])) // NUM_GENERATIONS, components=rollout["components"],
            component_weights=[1.0, 0.5])
        torch.testing.assert_close(loss_adv, expected, atol=1e-5, rtol=1e-5)


def half_uniform(prompts, completions, **kwargs):
    """Digits for the prompts that start with a digit; 1.0 for every other completion (uniform groups)."""
    return [float(sum(c.isdigit() for c in text)) if p[0].isdigit() else 1.0 for p, text in zip(prompts, completions)]


@pytest.mark.slow
def test_dynamic_sampling_takes_uniform_groups_out_of_the_loss(model_dir, tmp_path, monkeypatch):
    scored = []

    def recorded(prompts, completions, **kwargs):
        scored.append(half_uniform(prompts, completions))
        return scored[-1]

    with pytest.warns(UserWarning, match="dynamic_sampling: every group of this generation batch had the same reward"):
        trainer, records, changed = run_trainer(model_dir, tmp_path, monkeypatch, reward_funcs=recorded,
                                                advantage_estimator="reinforce_plus_plus_baseline",
                                                dynamic_sampling=True)
    assert changed
    for (rollout, _), given in zip(records["rollouts"], scored, strict=True):   # last_rollout keeps every reward
        torch.testing.assert_close(rollout["rewards"], torch.tensor(given), rtol=0, atol=0)
    for (rollout, _), loss_adv, mask in zip(records["rollouts"], records["loss_inputs"], records["masks"]):
        group = torch.arange(len(rollout["rewards"])) // NUM_GENERATIONS
        uniform = creditrl.core.groups.uniform_groups(rollout["rewards"].double(), group)[group]
        assert uniform.any() and torch.all(mask[uniform] == 0) and torch.all(loss_adv[uniform] == 0)
        kept = ~uniform
        expected = creditrl.compute_advantages("reinforce_plus_plus_baseline", rewards=rollout["rewards"][kept],
                                               mask=rollout["estimator_mask"][kept], group=group[kept])
        torch.testing.assert_close(loss_adv[kept], expected, atol=1e-5, rtol=1e-5)
    logged = [entry["creditrl/filtered_frac"] for entry in trainer.state.log_history if "creditrl/filtered_frac" in entry]
    assert len(logged) == 2 and 0 < logged[0] < 1 and logged[1] == 1.0    # step 2: two letter prompts, uniform


def test_trainer_refuses_a_filter_on_a_shaped_reward(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.rewards import get_soft_overlong_punishment

    def build(**options):
        args = CreditGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                                max_completion_length=4, use_cpu=True, bf16=False, report_to="none",
                                dynamic_sampling=True, **options)
        return CreditGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir),
                                 reward_funcs=[count_digits, get_soft_overlong_punishment(4, 2)], args=args,
                                 train_dataset=Dataset.from_dict({"prompt": ["ab"] * 4}),
                                 processing_class=AutoTokenizer.from_pretrained(model_dir))

    with pytest.raises(ValueError, match=r"dynamic_sampling_signal: 'reward' sums \['soft_overlong_punishment_reward'\], "
                                         r"a length shaping.*\['count_digits'\]"):
        build()
    with pytest.raises(ValueError, match=r"dynamic_sampling_signal: expected 'reward' or a reward function's name"):
        build(dynamic_sampling_signal="accuracy")
    assert build(dynamic_sampling_signal="count_digits").filter_signal == 0


@pytest.mark.parametrize("name", creditrl.list_estimators())
def test_every_registered_estimator_is_an_advantage_estimator_of_the_plugin(tmp_path, name):
    options = {"maxk_k": 2} if get_estimator(name).k_range is not None else {}
    args = CreditGRPOConfig(output_dir=str(tmp_path), advantage_estimator=name, use_cpu=True, bf16=False, **options)
    assert args.advantage_estimator == name


def test_config_rejects_bad_options(tmp_path):
    with pytest.raises(ValueError, match="advantage_estimator"):
        CreditGRPOConfig(output_dir=str(tmp_path), advantage_estimator="nope", use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="loss_type"):
        CreditGRPOConfig(output_dir=str(tmp_path), loss_type="cispo", use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="lam"):
        CreditGRPOConfig(output_dir=str(tmp_path), trace_lam=1.5, use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match=r"estimator_options: unknown option\(s\) \['k'\]"):
        CreditGRPOConfig(output_dir=str(tmp_path), advantage_estimator="otb", estimator_options={"k": 2},
                         use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match=r"estimator_options.leave_one_out: expected bool, got 'false' \(str\)"):
        CreditGRPOConfig(output_dir=str(tmp_path), advantage_estimator="otb", estimator_options='{"leave_one_out": "false"}',
                         use_cpu=True, bf16=False)
    with pytest.raises(TypeError, match=r"stapo: expected True, False or None .* got str 'false'"):
        CreditGRPOConfig(output_dir=str(tmp_path), stapo="false", use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="maxk_k: an alias of estimator_options"):
        CreditGRPOConfig(output_dir=str(tmp_path), advantage_estimator="maxpo", maxk_k=2,
                         estimator_options={"k": 3}, use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="stapo_tau_p: set while stapo=False"):
        CreditGRPOConfig(output_dir=str(tmp_path), stapo=False, stapo_tau_p=0.1, use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="loss term: unknown name 'nope'"):
        CreditGRPOConfig(output_dir=str(tmp_path), loss_terms=json.dumps([{"name": "nope"}]), use_cpu=True,
                         bf16=False)
    with pytest.raises(ValueError, match=r"k: maxpo needs 1 <= k < num_generations \(=4\)"):
        CreditGRPOConfig(output_dir=str(tmp_path), advantage_estimator="maxpo", maxk_k=4, num_generations=4,
                         per_device_train_batch_size=4, use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match=r"clip_c: expected a value in \(1, inf\]"):
        CreditGRPOConfig(output_dir=str(tmp_path), clip_c=1.0, use_cpu=True, bf16=False)


@pytest.mark.parametrize("options, message", [
    ({"advantage_estimator": "maxpo", "maxk_k": 4, "num_generations": 4, "per_device_train_batch_size": 4},
     r"k: maxpo needs 1 <= k < num_generations \(=4\)"),
    ({"advantage_estimator": "otb", "estimator_options": {"gamma": 2.0}}, r"gamma: expected a value in \[0, 1\], got 2.0"),
    ({"estimator_options": {"gamma": 0.9}}, r"estimator_options: unknown option\(s\) \['gamma'\].*grpo uses the total reward R"),
    ({"advantage_estimator": "otb", "estimator_options": {"leave_one_out": "false"}},
     r"estimator_options.leave_one_out: expected bool, got 'false'"),
    ({"advantage_estimator": "pkpo", "maxk_k": 1}, r"k: pkpo needs 2 <= k <= num_generations \(=8\)"),
    ({"temperature": 0.0}, r"temperature: expected a value > 0 .*got 0.0"),
    ({"temperature": -1.0}, r"temperature: expected a value > 0 .*got -1.0"),
    ({"estimator_options": "{bad"}, r"estimator_options: expected a dict or its JSON text, got '\{bad', which is not"),
    ({"estimator_options": "[1]"}, r"estimator_options: expected a dict .*\(a JSON list\)"),
    ({"loss_terms": "[{bad"}, r"loss_terms: expected a list or its JSON text, got '\[\{bad', which is not valid"),
    ({"advantage_estimator": "rloo", "scale_rewards": "batch"},
     r"scale_rewards: TRL's reward scaling is grpo's `scale` option, and advantage_estimator='rloo' has none"),
    ({"scale_rewards": "batch", "estimator_options": {"scale": "none"}}, r"scale_rewards: 'batch' and "
                                                                         r"estimator_options\['scale'\]='none' disagree"),
    ({"multi_objective_aggregation": "normalize_then_sum"},
     r"multi_objective_aggregation: 'normalize_then_sum' .* advantage_estimator='gdpo'; expected 'sum_then_normalize'"),
    ({"advantage_estimator": "gdpo", "estimator_options": {"scale": "batch"}},
     r"estimator_options: unknown option\(s\) \['scale'\]"),
    # errors name the field the user set (TRL's or the generated one), not creditrl's option
    ({"trace_lam": 1.5}, r"^trace_lam: expected a value in \[0, 1\], got 1.5"),
    ({"delta_l_norm_alpha": 3}, r"^delta_l_norm_alpha: expected a value in \[0, 1\], got 3"),
    ({"top_entropy_quantile": 1.5}, r"^top_entropy_quantile: expected a value in \(0, 1\], got 1.5"),
    ({"top_entropy_quantile": 0.0}, r"^top_entropy_quantile: expected a value in \(0, 1\], got 0"),
    ({"epsilon": -1.0}, r"^epsilon: expected a value in \[0, 1\), got -1"),
    ({"beta": -1.0}, r"^beta: expected a value in \[0, inf\], got -1"),
    ({"advantage_estimator": "maxpo", "maxk_k": 0}, r"^maxk_k: maxpo needs 1 <= k"),
])
def test_config_refuses_each_bad_setting_at_construction(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        CreditGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **options)


def test_config_fields_come_from_the_loss_term_registry(tmp_path):
    """Every loss option TRL has no name for is a field with the term's default and help; TRL's own
    epsilon/beta/loss_type map through TRL_NATIVE; a term is on when set or when one of its fields is."""
    fields = {f.name: f for f in dataclasses.fields(CreditGRPOConfig)}
    for cls in (ClipOptions, KLOptions, RolloutCorrectionOptions):
        for f in dataclasses.fields(cls):
            if f.name in ("clip_low", "clip_high", "kl_coef", "kl_bias_correction"):
                assert f.name not in fields                 # epsilon, epsilon_high, beta, use_bias_correction_kl
            else:
                assert fields[f.name].default == f.default and fields[f.name].metadata["help"] == f.metadata["help"]
    for prefix, cls in (("stapo", StapoOptions), ("trace", TraceOptions)):
        assert fields[prefix].default is None
        assert all(fields[f"{prefix}_{f.name}"].default is None for f in dataclasses.fields(cls))
    args = CreditGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, epsilon=0.1, epsilon_high=0.3,
                            beta=0.02, loss_type="dr_grpo", max_completion_length=12, trace_lam=0.5, clip_c=2.0)
    terms = args.policy_loss_terms()
    assert terms["clip"] == ClipOptions(clip_low=0.1, clip_high=0.3, clip_c=2.0)
    assert terms["kl"] == KLOptions(kl_coef=0.02, kl_bias_correction=True) and terms["trace"] == TraceOptions(lam=0.5)
    assert terms["aggregation"].agg == "seq-mean-token-sum-norm" and terms["aggregation"].max_len == 12
    assert "stapo" not in terms
    assert "stapo" in CreditGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False,
                                       stapo=True).policy_loss_terms()


def test_config_maps_trls_own_fields_and_the_new_terms(tmp_path):
    """TRL's top_entropy_quantile and use_bias_correction_kl drive creditrl's top_entropy and
    kl_bias_correction (TRL's defaults: off, on); the surrogates and entropy terms are fields; TRL's
    loss_type cispo/sapo and creditrl's mask_truncated (TRL masks truncated completions itself)
    are refused with what to set instead."""
    from creditrl.core.losses import EntropyBonusOptions, SapoOptions, TopEntropyOptions

    def terms(**options):
        return CreditGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **options).policy_loss_terms()
    default = terms()
    assert "top_entropy" not in default and default["kl"].kl_bias_correction is True
    assert terms(top_entropy_quantile=0.2)["top_entropy"] == TopEntropyOptions(quantile=0.2)
    assert terms(use_bias_correction_kl=False)["kl"].kl_bias_correction is False
    chosen = terms(sapo_tau_neg=2.0, entropy_bonus_coef=0.01, gspo=True)
    assert chosen["sapo"] == SapoOptions(tau_neg=2.0) and chosen["gspo"] is not None
    assert chosen["entropy_bonus"] == EntropyBonusOptions(coef=0.01)
    assert "cispo" in terms(loss_terms=[{"path": "cispo"}])
    with pytest.raises(ValueError, match=r"loss_type: CreditGRPOTrainer takes the surrogate .* set cispo=True"):
        terms(loss_type="cispo")
    with pytest.raises(ValueError, match="mask_truncated: TRL masks truncated completions itself"):
        terms(mask_truncated=True)
    with pytest.raises(ValueError, match=r"quantile: expected a value in \(0, 1\], got 0.0"):
        terms(top_entropy_quantile=0.0)


def test_trls_fused_entropy_carries_the_gradient_an_entropy_bonus_needs(model_dir, tmp_path):
    """The entropies TRL's fused LM head returns are on the graph: creditrl's entropy bonus moves
    the weights through them (the loss gets them undetached when a term differentiates them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = CreditGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                            max_completion_length=4, use_cpu=True, bf16=False, report_to="none",
                            entropy_bonus_coef=0.1)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = CreditGRPOTrainer(model=model, reward_funcs=count_digits, args=args,
                                train_dataset=Dataset.from_dict({"prompt": ["ab"] * 4}),
                                processing_class=AutoTokenizer.from_pretrained(model_dir))
    assert trainer.policy_loss.entropy_grad
    ids = torch.randint(3, 10, (2, 7))
    _, entropy, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids), 3,
                                                                compute_entropy=True)
    entropy.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.model.parameters())


def test_config_parses_from_the_command_line(monkeypatch):
    """HfArgumentParser reads the generated fields (types and help from the options dataclasses)."""
    from transformers import HfArgumentParser

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent / "plugins"))
    (args,) = HfArgumentParser(CreditGRPOConfig).parse_args_into_dataclasses(
        ["--output_dir", "out", "--use_cpu", "true", "--bf16", "false", "--stapo", "true", "--stapo_tau_p", "0.01",
         "--kl_estimator", "k2", "--estimator_options", '{"eps": 0.001}', "--advantage_estimator", "grpo",
         "--loss_terms", '[{"path": "length_penalty_term:length_penalty", "coef": 0.1}]'])
    assert args.stapo is True and args.stapo_tau_p == 0.01 and args.kl_estimator == "k2"
    assert args.estimator_kwargs() == {"eps": 0.001}
    assert args.loss_terms == [{"path": "length_penalty_term:length_penalty", "coef": 0.1}]


def test_trainer_rejects_trl_only_loss_options(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = CreditGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                            max_completion_length=4, use_cpu=True, bf16=False, report_to="none",
                            importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="importance_sampling_level: .* not implement TRL's sequence-level ratio "
                                         r"\(creditrl's: gspo=True"):
        CreditGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=count_digits, args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["ab"] * 4}),
                          processing_class=AutoTokenizer.from_pretrained(model_dir))
    args = CreditGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                            max_completion_length=4, use_cpu=True, bf16=False, report_to="none",
                            rollout_correction="tis")
    with pytest.raises(ValueError, match="rollout_correction: 'tis' corrects .* set use_vllm=True .*got use_vllm=False"):
        CreditGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=count_digits, args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["ab"] * 4}),
                          processing_class=AutoTokenizer.from_pretrained(model_dir))


@pytest.mark.slow
def test_reasoning_gym_example_with_a_trl_reward_function(tmp_path, monkeypatch):
    """examples/trl_reasoning_gym.py: reasoning-gym data, a TRL-style reward function reading the
    dataset's ``index`` column, one CreditGRPOTrainer step on the tiny model (CPU, fp32)."""
    import importlib.util
    from pathlib import Path

    pytest.importorskip("reasoning_gym")
    path = Path(__file__).resolve().parents[1] / "examples" / "trl_reasoning_gym.py"
    spec = importlib.util.spec_from_file_location("trl_reasoning_gym", path)
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, example)   # its dataclasses look their module up
    spec.loader.exec_module(example)
    script = example.ScriptArguments(dataset="basic_arithmetic", num_prompts=8,
                                     dataset_config='{"min_terms": 2, "max_terms": 2, "max_digits": 1}')
    dataset, data = example.build_dataset(script, seed=0)
    reward = example.make_reward(data)
    right = [[{"role": "assistant", "content": f"<answer>{data[i]['answer']}</answer>"}] for i in (0, 1)]
    assert reward(dataset["prompt"][:2], right, index=[0, 1]) == [1.0, 1.0]
    assert reward(dataset["prompt"][:1], [[{"role": "assistant", "content": "no tags"}]], index=[0]) == [0.0]
    trainer = example.main(["--output_dir", str(tmp_path), "--num_prompts", "8", "--max_steps", "1",
                            "--dataset_config", '{"min_terms": 2, "max_terms": 2, "max_digits": 1}',
                            "--per_device_train_batch_size", "4", "--num_generations", "4",
                            "--max_completion_length", "8", "--use_cpu", "true", "--bf16", "false",
                            "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1",
                            "--advantage_estimator", "rloo"])
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert "rewards/reasoning_gym_reward/mean" in logged


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("with_energy", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_rollout_metrics_from_per_row_values_equal_the_token_loop(seed, with_energy, compiled, monkeypatch):
    """The hook's metrics from an estimator's per-row values (no pass over A) and from the [B,T]
    advantages (the energy's sums fused, or eager where compiling fails), each with the caller's row
    counts or without, equal a loop over rows and tokens: Σ|A| / tokens, Σw / tokens, (1/B) Σ_i Σ_t A² w."""
    import creditrl.utils.fused as fused_module
    from creditrl.integrations.trl import rollout_metrics
    if not compiled:
        monkeypatch.setattr(fused_module, "_EAGER_REASON", ["forced by the test"])
    g = torch.Generator().manual_seed(seed)
    rows, steps = [(7, 9), (3, 1), (2, 9), (7, 9)][seed]           # one step: a [B,1] sum per row
    mask = torch.rand(rows, steps, generator=g) < 0.7
    mask[seed % rows] = False                                       # a row with no valid token
    per_row = torch.randn(rows, generator=g)
    advantages = torch.where(mask, per_row[:, None], 0.0)
    energy = torch.where(mask, torch.rand(rows, steps, generator=g) * 2, 0.0) if with_energy else None
    tokens = abs_sum = w_sum = power = 0.0
    for i in range(rows):
        for t in range(steps):
            if mask[i, t]:
                tokens, abs_sum = tokens + 1, abs_sum + abs(float(advantages[i, t]))
                if with_energy:
                    w_sum += float(energy[i, t])
                    power += float(advantages[i, t]) ** 2 * float(energy[i, t]) / rows
    expected = {"advantage_abs_mean": abs_sum / tokens}
    if with_energy:
        expected.update(energy_mean=w_sum / tokens, power_proxy=power)
    counts = mask.sum(1)
    for got in (rollout_metrics(advantages, energy, mask, per_row), rollout_metrics(advantages, energy, mask, per_row, counts),
                rollout_metrics(advantages, energy, mask), rollout_metrics(advantages, energy, mask, None, counts)):
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=sum_rtol(rows * steps), abs=EPS32)


def test_rollout_metrics_of_every_small_shape_stay_under_dynamos_recompile_limit(monkeypatch):
    """Through ``torch.compile`` (a GPU, or where the standalone graphs do not apply) the energy's sums
    (and Σ|A| without energies) of batches with B and T in {0, 1, more} keep under dynamo's recompile
    limit, so a later shape still runs compiled: empty batches take no graph (dynamo specialises sizes
    0 and 1 on each axis, and those nine shapes alone went past the limit of 8). Values: a float64 loop's."""
    import creditrl.utils.fused as fused_module
    from creditrl.integrations.trl import rollout_metrics
    monkeypatch.setattr(fused_module, "signature", lambda args: None)        # every call through torch.compile
    rollout_metrics(torch.ones(2, 3), torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool))
    if fused_module._EAGER_REASON:
        pytest.skip(f"torch.compile fails here ({fused_module._EAGER_REASON[0]})")
    torch._dynamo.reset()
    given_up = []                      # where a compile fails, ``fused`` gives up compiling: here, for this test only
    monkeypatch.setattr(fused_module, "_EAGER_REASON", given_up)
    g = torch.Generator().manual_seed(0)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=8):
        for rows, steps in [(b, t) for b in (0, 1, 2) for t in (0, 1, 3)] + [(5, 7), (6, 11)]:
            mask = torch.rand(rows, steps, generator=g) < 0.6
            advantages = torch.where(mask, torch.randn(rows, steps, generator=g), 0.0)
            energy = torch.where(mask, torch.rand(rows, steps, generator=g), 0.0)
            got = rollout_metrics(advantages, energy, mask)
            tokens = max(int(mask.sum()), 1)
            a, w = advantages.double(), energy.double()
            assert got["advantage_abs_mean"] == pytest.approx(float(a.abs().sum()) / tokens, rel=sum_rtol(rows * steps))
            assert got["energy_mean"] == pytest.approx(float(w.sum()) / tokens, rel=sum_rtol(rows * steps))
            assert got["power_proxy"] == pytest.approx(float((a * a * w).sum()) / max(rows, 1),
                                                       rel=sum_rtol(rows * steps), abs=EPS32)
            plain = rollout_metrics(advantages, None, mask)              # Σ|A| alone (``_abs_sum``)
            assert plain["advantage_abs_mean"] == pytest.approx(float(a.abs().sum()) / tokens, rel=sum_rtol(rows * steps))
    if given_up and "recompile" not in given_up[0].lower():     # inductor's own failure (ATEN_CPU_CAPABILITY=default)
        pytest.skip(f"torch.compile fails here ({given_up[0]}): the eager values were checked")
    assert not given_up


@pytest.mark.parametrize("name, options", [("grpo", {}), ("pkpo", {"k": 2}), ("maxk_bon", {"k": 2}), ("shrinkage", {})])
def test_hook_leaves_rows_no_reward_scored_out_of_the_estimator(name, options):
    """A row no reward function scored stays out of its group's statistics (TRL's nanmean/nanstd leave it
    out too; as a group member with the group's mean reward it once shrank grpo's std by √((N-2)/(N-1))
    and rloo's baseline toward its own reward): advantage 0, the other rows' advantages those of their
    groups without it, and the logged Σ|A| / tokens the returned advantages' (counted over this
    process's mask, that row's tokens included)."""
    from types import MethodType, SimpleNamespace
    trainer = SimpleNamespace(estimator=name, estimator_kwargs=options, args=SimpleNamespace(log_completions=False),
                              accelerator=SimpleNamespace(process_index=0, num_processes=1), logged={})
    trainer._gather_rows = lambda x: x
    trainer._log_creditrl = lambda mode, metrics: trainer.logged.update(metrics) or metrics
    trainer._watch_reward_signal = lambda *args: None
    trainer._estimate = MethodType(CreditGRPOTrainer._estimate, trainer)
    mask = torch.ones(8, 5, dtype=torch.bool)
    group = torch.arange(8) // 4
    rewards = torch.tensor([1.0, 0.0, 1.0, 2 / 3, 0.0, 1.0, 0.0, 1.0])    # row 3: the group-mean stand-in
    scorable = torch.tensor([True, True, True, False, True, True, True, True])
    advantages = CreditGRPOTrainer._advantages(trainer, "train", rewards, group, scorable, mask, None)
    assert not advantages[3].any()
    alone = creditrl.compute_advantages(name, rewards=rewards[scorable], mask=mask[scorable], group=group[scorable],
                                        **options)
    assert torch.equal(advantages[scorable], alone)
    if name == "grpo":                              # TRL's own: (r − nanmean) / (nanstd + eps) over the scored rows
        from trl.trainer.utils import nanstd
        grouped = torch.where(scorable, rewards, torch.nan).view(2, 4)
        trl = (grouped - grouped.nanmean(1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True) + 1e-6)
        torch.testing.assert_close(advantages[:, 0], trl.flatten().nan_to_num(0.0))
    expected = float(advantages.abs().sum()) / mask.sum().item()
    assert trainer.logged["advantage_abs_mean"] == pytest.approx(expected, rel=sum_rtol(40), abs=EPS32)


@pytest.mark.parametrize("all_scorable", [True, False])
@pytest.mark.parametrize("name", ["grpo", "otb"])
def test_hook_advantages_of_the_second_of_two_processes(name, all_scorable):
    """Process 1 of 2: the estimator runs on both processes' rows (gathered, process 0's completions
    longer, so process 1's are zero-padded on the right), and the hook returns process 1's rows at its
    own length: ``compute_advantages`` of the gathered batch, sliced; the logged Σ|A| / tokens counts
    process 1's own mask (a row no reward scored gets A = 0)."""
    from types import MethodType, SimpleNamespace
    g = torch.Generator().manual_seed(2)
    rows, steps, long = 4, 5, 7
    trainer = SimpleNamespace(estimator=name, estimator_kwargs={}, args=SimpleNamespace(log_completions=False),
                              accelerator=SimpleNamespace(process_index=1, num_processes=2), logged={})
    first = {torch.bool: torch.rand(rows, long, generator=g) < 0.8, torch.float32: torch.rand(rows, long, generator=g)}
    first[torch.float32] = torch.where(first[torch.bool], first[torch.float32], 0.0)
    trainer._gather_rows = lambda x: torch.cat([first[x.dtype], torch.nn.functional.pad(x, (0, long - steps))])
    trainer._log_creditrl = lambda mode, metrics: trainer.logged.update(metrics) or metrics
    trainer._watch_reward_signal = lambda *args: None
    trainer._estimate = MethodType(CreditGRPOTrainer._estimate, trainer)
    mask = torch.rand(rows, steps, generator=g) < 0.7
    mask[:, 0] = True
    energy = torch.where(mask, torch.rand(rows, steps, generator=g), 0.0) if name == "otb" else None
    group, rewards = torch.arange(2 * rows) // 4, torch.rand(2 * rows, generator=g)
    scorable = torch.ones(2 * rows, dtype=torch.bool)
    scorable[rows + 1] = all_scorable
    got = CreditGRPOTrainer._advantages(trainer, "train", rewards, group, scorable, mask, energy)
    all_mask = trainer._gather_rows(mask)
    all_energy = None if energy is None else trainer._gather_rows(energy)
    expected = torch.zeros(all_mask.shape)              # a row no reward scored is no member of its group
    expected[scorable] = creditrl.compute_advantages(name, rewards=rewards[scorable], mask=all_mask[scorable],
                                                     group=group[scorable],
                                                     energy=None if energy is None else all_energy[scorable])
    assert torch.equal(got, expected[rows:, :steps])
    if not all_scorable:
        assert not got[1].any()
    loop = sum(abs(float(got[i, t])) for i in range(rows) for t in range(steps) if mask[i, t]) / int(mask.sum())
    assert trainer.logged["advantage_abs_mean"] == pytest.approx(loop, rel=sum_rtol(rows * steps), abs=EPS32)


@pytest.mark.parametrize("name", ["grpo", "rloo", "otb"])
def test_hook_advantages_leave_the_mask_as_given(name):
    """The hook hands the estimator's [B] values to the batch's own float32 mask copy (its last
    use): the bool mask TRL passes stays as it was, the advantages are ``compute_advantages``'
    bit for bit, and the logged Σ|A| / tokens counts the rows' valid tokens."""
    from types import MethodType, SimpleNamespace
    g = torch.Generator().manual_seed(1)
    trainer = SimpleNamespace(estimator=name, estimator_kwargs={}, accelerator=SimpleNamespace(process_index=0, num_processes=1),
                              args=SimpleNamespace(log_completions=False), logged={})
    trainer._gather_rows = lambda x: x
    trainer._log_creditrl = lambda mode, metrics: trainer.logged.update(metrics) or metrics
    trainer._watch_reward_signal = lambda *args: None
    trainer._estimate = MethodType(CreditGRPOTrainer._estimate, trainer)
    mask = torch.rand(8, 6, generator=g) < 0.7
    mask[:, 0] = True
    given = mask.clone()
    group, rewards = torch.arange(8) // 4, torch.rand(8, generator=g)
    energy = torch.where(mask, torch.rand(8, 6, generator=g), 0.0) if name == "otb" else None
    scorable = torch.ones(8, dtype=torch.bool)
    got = CreditGRPOTrainer._advantages(trainer, "train", rewards, group, scorable, mask, energy)
    assert torch.equal(mask, given)
    expected = creditrl.compute_advantages(name, rewards=rewards, mask=given, group=group, energy=energy)
    assert torch.equal(got, expected)
    loop = sum(abs(float(expected[i, t])) for i in range(8) for t in range(6) if given[i, t]) / int(given.sum())
    assert trainer.logged["advantage_abs_mean"] == pytest.approx(loop, rel=sum_rtol(48), abs=EPS32)


@pytest.mark.parametrize("name", ["rloo", "otb"])
def test_completions_table_shows_the_advantages_trained_on(name):
    """With ``log_completions`` TRL's table (``_logs["advantages"]``) holds creditrl's advantage of each
    completion of the batch, not the GRPO z-score TRL logged (rloo's [B] values; otb's mean over each row's
    tokens); a row no reward scored shows 0, and entries of earlier batches stay."""
    from collections import deque
    from types import MethodType, SimpleNamespace
    g = torch.Generator().manual_seed(3)
    trainer = SimpleNamespace(estimator=name, estimator_kwargs={}, accelerator=SimpleNamespace(process_index=0, num_processes=1),
                              args=SimpleNamespace(log_completions=True), logged={},
                              _logs={"advantages": deque([9.0] * 3 + [-7.0] * 8, maxlen=12)})
    trainer._gather_rows = lambda x: x
    trainer._log_creditrl = lambda mode, metrics: metrics
    trainer._watch_reward_signal = lambda *args: None
    trainer._estimate = MethodType(CreditGRPOTrainer._estimate, trainer)
    trainer._log_completion_advantages = MethodType(CreditGRPOTrainer._log_completion_advantages, trainer)
    mask = torch.rand(8, 6, generator=g) < 0.7
    mask[:, 0] = True
    group, rewards = torch.arange(8) // 4, torch.rand(8, generator=g)
    energy = torch.where(mask, torch.rand(8, 6, generator=g), 0.0) if name == "otb" else None
    scorable = torch.ones(8, dtype=torch.bool)
    scorable[5] = False
    got = CreditGRPOTrainer._advantages(trainer, "train", rewards, group, scorable, mask, energy)
    table = list(trainer._logs["advantages"])
    assert table[:3] == [9.0] * 3 and len(table) == 11
    for b in range(8):
        tokens = [float(got[b, t]) for t in range(6) if mask[b, t] and scorable[b]]
        assert table[3 + b] == pytest.approx(sum(tokens) / max(len(tokens), 1), rel=1e-6, abs=1e-7)
    assert table[3 + 5] == 0.0 and any(abs(v) > 0.1 for v in table[3:])
