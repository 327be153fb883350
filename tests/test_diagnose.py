"""`creditrl diagnose` on builtin:tiny: its measurement against the grad-variance experiment and
against itself with a count sketch, the rows read from the registries (a throwaway estimator and a
throwaway loss term appear with no list to edit), the loss it measures (exactly the configured
loss's gradient on the enumerable policy), the Adam column, its refusals before any sampling, the
cases of issue 30 it owns, its atomic report without a "nan" anywhere, the CLI end to end and the
TRL-style function. Its calibration (null runs, coverage) is in test_diagnose_calibration.py."""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import re
import warnings

import pytest
import torch

import creditrl
from creditrl.cli import main
from creditrl.config import load_diagnose_config
from creditrl.core.estimators import register_estimator
from creditrl.core.estimators.registry import _REGISTRY as ESTIMATORS
from creditrl.core.gradients import CountSketch, Interval, moments_from_draws
from creditrl.core.losses import PolicyLoss, register_loss_term
from creditrl.core.losses.terms import _REGISTRY as TERMS, LossState
from creditrl.core.token_stats import TokenStats
from creditrl.recipe.build import build_task, default_max_new_tokens, load_configured_policy
from creditrl.recipe.resolve import resolve_config
from creditrl.runtime.gradient_space import choose_space
from creditrl.runtime.group_gradients import group_gradients, row_cotangents, select_parameters
from creditrl.tasks.rewards import score_terms
from creditrl.tools.diagnose import recommend as rc
from creditrl.tools.diagnose import report
from creditrl.tools.diagnose.api import DatasetTask
from creditrl.tools.diagnose.command import make_plan
from creditrl.tools.diagnose.measure import Accumulator, Measurement, ModelSource, measure
from creditrl.tools.diagnose.plan import REF
from creditrl.utils.threads import torch_threads
from creditrl_research.experiments import grad_variance as gv
from diagnose_sim import Clock, GaussianSource, sim_plan, simulate
from enumerable_policy import (GROUP, STEPS, THETA, enumerate_policy, estimator_output, policy_logits, reward,
                               true_gradient)

# a tiny model warm-started to ~30% on 1-digit addition in a few seconds (the same as test_trainer's, cached)
TINY = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
        "model.warm_start.max_steps=400", "model.warm_start.eval_every=25", "model.warm_start.eval_size=32",
        "model.warm_start.target_accuracy=0.3", "model.warm_start.lr=3e-3", "task.options.digits=1", "train.threads=1"]


def within(value: float, iv) -> bool:
    """``value`` in ``iv`` up to the float32 rounding of the gradients both come from (eps 6e-8 per
    element, a few roundings each): an exact relation's interval has width 0 (se 0)."""
    slack = 1e-6 * max(abs(iv.value), 1e-3)
    return iv.low - slack <= value <= iv.high + slack


def configs(extra: list[str]):
    cfg, d = load_diagnose_config(None, [*TINY, *extra])
    return resolve_config(cfg), d


def tiny_plan(extra: list[str]):
    return make_plan(*configs(["rollout.group_size=4", *extra]))


# ---------------------------------------------------------------- builtin:tiny


@pytest.fixture(scope="module")
def tiny():
    """The checkpoint, with one torch thread (as the command uses for builtin:tiny)."""
    cfg, _ = configs([])
    task = build_task(cfg)
    with torch_threads(1):
        model, tokenizer = load_configured_policy(cfg, task, "cpu", progress=False)
        model.eval()
        yield task, model, tokenizer


def rollout_of(task, tokenizer) -> dict:
    return {"temperature": 1.0, "top_p": 1.0, "max_tool_tokens": 16, "stop_strings": (),
            "max_new_tokens": default_max_new_tokens(task, tokenizer)}


@pytest.fixture(scope="module")
def tiny_measured(tiny):
    """diagnose's measurement on the checkpoint (48 prompts × 2 groups of 8, two rounds, plain
    gradients of rloo / grpo / otb / otb+loo / dr_grpo), its draws also fed, count-sketched (d = 4096), through the
    same accumulation."""
    task, model, tokenizer = tiny
    plan = dataclasses.replace(tiny_plan(["rollout.group_size=8", "diagnose.estimators=[rloo,otb,otb+loo,dr_grpo]",
                                          "diagnose.prompts=24", "diagnose.folds=8", "algorithm.estimator=rloo"]),
                               budget_s=1e9, target_width=1e-6)
    space = choose_space(model, None, len(plan.rows), plan.folds, plan.groups_per_prompt, 2.0, 4096)
    assert space.kind == "all"
    sketch = CountSketch([(space.dim,)], 4096, seed=0)
    sketched = Accumulator(plan, 4096, adam=False)

    class Tee(Accumulator):
        def add(self, draws):
            grads = torch.stack([torch.stack([sketch([g]) for g in group]) for group in draws.grads])
            sketched.add(dataclasses.replace(draws, grads=grads))
            super().add(draws)

    class TwoRounds(ModelSource):
        def prompts(self, count):
            return super().prompts(count) if len(self.draw.seen) < 48 else []

    with torch_threads(1):
        source = TwoRounds(model, tokenizer, task, plan, space, rollout_of(task, tokenizer))
        flat = measure(source, plan, Tee(plan, space.dim, adam=False))
    assert flat.prompts == 48 and flat.stop == "exhausted"
    rows = {r["row"]: r for r in rc.rows(flat, plan)}
    return plan, flat, rows, {r["row"]: r for r in rc.rows(sketched.finish(), plan)}


def test_ranking_agrees_with_the_grad_variance_experiment(tiny, tiny_measured, monkeypatch):
    task, model, tokenizer = tiny
    plan, _, ours, _ = tiny_measured
    params = [p for p in model.parameters() if p.requires_grad]
    monkeypatch.setattr(gv, "load_tiny_checkpoint", lambda *a, **k: (task, model, tokenizer, params))
    cfg = gv.GradVarianceConfig(task="addition", digits=(1,), warm_start_accuracy=(0.3,), checkpoints=1, group_size=8,
                                estimators=("rloo", "otb"), groups=(96,), batch_groups=8, folds=8,
                                max_new_tokens=rollout_of(task, tokenizer)["max_new_tokens"], threads=1, seed=1)
    with torch_threads(1):
        stats, _ = gv.measure_checkpoint(cfg, 1, 96, 1)
    theirs = gv.gradient_quality(stats, "rloo")
    # the raw variance ratio is defined on any checkpoint; the efficiency needs the reference's mean
    # gradient above 0, which this tiny setting's ~50 prompts resolve on some checkpoints (some CPUs) only
    pairs = [(ours["otb"]["raw_ratio_vs_rloo"], theirs["otb"].raw_ratio)]
    a, b = ours["otb"]["efficiency_vs_rloo"], theirs["otb"].efficiency
    if a.defined and b.defined:
        pairs.append((a, b))
    for a, b in pairs:
        assert a.defined and b.defined, (a, b)
        assert a.low <= b.high and b.low <= a.high, (a, b)                         # the intervals overlap
        assert not ((a.low > 1 and b.high < 1) or (a.high < 1 and b.low > 1)), (a, b)   # no opposite ranking


def test_sketch_efficiencies_agree_with_exact_ones(tiny_measured):
    _, _, exact, sketched = tiny_measured
    for name in ("otb", "otb+loo", "grpo", "dr_grpo"):
        for key in ("raw_variance", "raw_ratio_vs_rloo", "efficiency_vs_rloo", "scale"):
            e, s = exact[name][key], sketched[name][key]
            if key.startswith("raw"):     # defined on any checkpoint; the others where the reference's ‖μ̂‖² > 0
                assert e.defined and s.defined, (name, key, e, s)
            if e.defined and s.defined:
                assert within(e.value, s) and within(s.value, e), (name, key, e, s)


def test_dr_grpo_is_exactly_a_multiple_of_rloo_and_needs_no_backward(tiny_measured):
    plan, meas, rows, _ = tiny_measured
    assert rows["dr_grpo"]["raw_ratio_vs_rloo"].value == pytest.approx((7 / 8) ** 2, rel=1e-5)
    if rows["dr_grpo"]["scale"].defined:        # the reference's ‖μ̂‖² > 0 on this checkpoint
        assert rows["dr_grpo"]["scale"].value == pytest.approx(7 / 8, rel=1e-5)
        assert rows["dr_grpo"]["efficiency_vs_rloo"].value == pytest.approx(1.0, rel=1e-5)
    # rows: reference, rloo, grpo, otb, otb+loo, dr_grpo: the reference, rloo (token-mean at ratio 1 has rloo's
    # cotangent) and dr_grpo ((N−1)/N × it) share one backward; a group without reward spread needs none
    informative = sum(g["informative"] for g in meas.groups)
    assert 0 < meas.backward <= 4 * informative


# ---------------------------------------------------------------- the registries: no list to edit


def test_a_registered_estimator_and_loss_term_appear_in_the_plan(monkeypatch):
    @register_estimator("throwaway_mean_baseline")
    def throwaway(batch, leave_one_out: bool = False):
        """R minus the group mean (a test-only estimator)."""
        return batch.rewards - batch.groups.gather(batch.groups.sum(batch.rewards) / batch.groups.sizes)

    @dataclasses.dataclass(frozen=True)
    class ThrowawayOptions:
        coef: float = dataclasses.field(default=0.1, metadata={"help": "penalty per token"})

    def throwaway_penalty(state: LossState, options: ThrowawayOptions) -> LossState:
        """A test-only per-token penalty."""
        return state.add_token_loss(options.coef * torch.exp(state.logp - state.old_logp))

    throwaway_penalty.__module__ = "creditrl.core.losses.throwaway"     # as if a built-in module declared it
    try:
        register_loss_term("throwaway_penalty", options=ThrowawayOptions, stage="penalty")(throwaway_penalty)
        plan = tiny_plan(["loss.throwaway_penalty.enabled=true", "loss.throwaway_penalty.coef=0.2",
                          "diagnose.losses=[{throwaway_penalty: {enabled: false}, name: plain}]"])
        assert {"throwaway_mean_baseline", "throwaway_mean_baseline+loo"} <= set(plan.estimators)
        assert "throwaway_penalty(coef=0.2)" in plan.losses[0].text
        assert "throwaway_penalty" not in plan.losses[1].text and plan.losses[1].name == "plain"
        assert "throwaway_mean_baseline · plain" in plan.rows
    finally:
        ESTIMATORS.pop("throwaway_mean_baseline", None)
        TERMS.pop("throwaway_penalty", None)


def test_a_term_that_depends_on_the_whole_mini_batch_is_named():
    plan = tiny_plan(["loss.stapo.enabled=true"])
    assert any("`stapo` cannot be measured group by group" in note for note in plan.losses[0].notes)
    assert not tiny_plan([]).losses[0].notes


# ---------------------------------------------------------------- the loss measured: exact on the enumerable policy


def enumerated_group(theta):
    """Every outcome of a group of 3 (EOS-ended lengths): its rows' log-probs [O·N, T] (float64, with
    their per-token scores [O·N, T, P]), rewards, mask, energies and probabilities [O]."""
    rows = enumerate_policy(theta, True)
    index = torch.tensor(list(itertools.product(range(len(rows)), repeat=GROUP))).flatten()
    lengths = torch.tensor([len(r[0]) for r in rows])[index]
    mask = torch.arange(STEPS)[None, :] < lengths[:, None]
    logp = torch.zeros(len(rows), STEPS, dtype=torch.float64)
    for i, (seq, _, _, _) in enumerate(rows):
        for t, y in enumerate(seq):
            logp[i, t] = torch.log_softmax(policy_logits(theta, seq[t - 1] if t else 3, t, True), -1)[y]
    rewards = torch.tensor([reward(r[0]) for r in rows])[index].float()
    scores = torch.stack([r[2] for r in rows])[index]
    energy = torch.stack([r[3] for r in rows])[index].float()
    probs = torch.stack([r[1] for r in rows])[index].view(-1, GROUP).prod(1)
    return logp[index] * mask, scores, rewards, mask, energy, probs


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_the_measured_gradient_is_the_configured_loss(agg):
    """E over every outcome of diagnose's group draw (``row_cotangents`` through the policy's scores)
    equals the exact gradient of that loss, written out here: at ratio 1 the clipped surrogate's
    token loss is −A_t·π/π_old, aggregated as configured; the draw is −(1/N)∇(count · L).

    The 3,375 outcomes go through one call as that many groups (count · L is a sum over groups for
    these aggregations); a few outcomes' own one-group calls, as diagnose makes them, equal their rows."""
    theta = THETA * 0.8
    logp, scores, rewards, mask, energy, probs = enumerated_group(theta)
    outcomes, rows = probs.numel(), mask.shape[0]
    group = torch.arange(outcomes).repeat_interleave(GROUP)
    specs = {"rloo": ("rloo", {}), "otb": ("otb", {})}
    loss = PolicyLoss({"aggregation": {"agg": agg, "max_len": 5}, "clip": {"clip_high": 0.28}})

    def draw(part: slice) -> torch.Tensor:
        """[E, n, T] the cotangents of the rows in ``part``, each group's draw (/ N, not / n)."""
        batch = type("B", (), {"response_mask": mask[part].float(), "prompt_len": 0, "rewards": rewards[part],
                               "group": group[part] - group[part][0], "rollout_logp": logp[part].float()})()
        stats = TokenStats(logp=logp[part], entropy=torch.zeros_like(logp[part]), sum_p2=torch.zeros_like(logp[part]),
                           energy=energy[part].double())
        n = part.stop - part.start
        return row_cotangents(batch, slice(0, n), stats, specs, {"rloo": loss, "otb": loss}).double() * (n / GROUP)

    cot = draw(slice(0, rows))
    for o in (0, 1, outcomes // 2, outcomes - 1):                     # diagnose's own one-group calls
        part = slice(o * GROUP, (o + 1) * GROUP)
        torch.testing.assert_close(draw(part), cot[:, part], rtol=1e-6, atol=1e-6 * float(cot.abs().max()))
    weight_rows = probs.repeat_interleave(GROUP)
    got = torch.einsum("ebt,b,btp->ep", cot, weight_rows, scores)
    n = mask.sum(1).double()
    # d(ℓ_t)/d logp_t = −A_t at ratio 1; count · L per aggregation, differentiated by hand
    per_token = {"token-mean": torch.ones_like(n), "seq-mean-token-mean": 1 / n,
                 "seq-mean-token-sum-norm": torch.full_like(n, 1 / 5)}[agg]
    want = torch.stack([
        torch.einsum("bt,b,btp->p", estimator_output(name, dict(rewards=rewards, mask=mask, group=group, energy=energy))
                     * mask * per_token[:, None], weight_rows, scores) / GROUP
        for name, _ in specs.values()])
    # advantages are float32 (compute_advantages' contract): agreement to float32 rounding, 1e-6 relative
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * scale)
    assert not torch.allclose(want[0], want[1], rtol=1e-3)                  # the two estimators differ
    if agg == "token-mean":   # the sum over tokens: rloo's mean draw is the exact gradient of E[R]
        torch.testing.assert_close(got[0], true_gradient(theta, True), rtol=1e-6, atol=1e-6 * scale)


# ---------------------------------------------------------------- the Adam column


def test_adam_column_equals_the_plain_one_under_a_constant_v(tiny):
    """With v̂ constant the preconditioned draws are the plain ones times a constant: every statistic
    scales by its square, so the Adam column's efficiencies equal the plain ones; a varying v̂ changes them."""
    task, model, tokenizer = tiny
    from creditrl.runtime.rollout import generate_rollouts
    plan = tiny_plan(["diagnose.estimators=[rloo,otb,grpo]", "algorithm.estimator=otb"])
    params = select_parameters(model)
    constant = [torch.full_like(p, 3.0) for p in params]
    varying = [torch.rand(p.shape, generator=torch.Generator().manual_seed(i)) * 4 + 0.1 for i, p in enumerate(params)]
    accs = {"constant": Accumulator(plan, sum(p.numel() for p in params), adam=True),
            "varying": Accumulator(plan, sum(p.numel() for p in params), adam=True)}
    with torch_threads(1):
        for i in range(16):
            batch = generate_rollouts(model, tokenizer, task, [task.sample(random.Random(i))] * 2, group_size=4,
                                      max_new_tokens=6, generator=torch.Generator().manual_seed(i))
            batch.rewards = (torch.arange(8) % 3 == i % 3).float()
            for name, factors in (("constant", constant), ("varying", varying)):
                draws = group_gradients(model, batch, plan.rows, temperature=1.0, params=params,
                                        losses=plan.row_losses, precondition=factors, dedupe=True)
                accs[name].add(draws)
    flat = torch.cat([f.reshape(-1) for f in varying])
    torch.testing.assert_close(draws.preconditioned, draws.grads * flat, rtol=1e-6, atol=1e-9)
    meas = accs["constant"].finish()
    # float32 draws: the products of g·3 and of g agree to float32 rounding, ~1e-6 relative
    torch.testing.assert_close(meas.adam.cross, 9 * meas.stats.cross, rtol=1e-5, atol=1e-8 * float(meas.stats.cross.abs().max()))
    varying_meas = accs["varying"].finish()
    plain_rows = rc.rows(meas, plan)
    # whatever the sample path (on some CPU kernels the 16 groups leave the reference unresolved and every
    # efficiency undefined): the two columns are defined together and equal where defined
    assert len(plain_rows) >= 3
    for row in plain_rows:
        a, b = row["efficiency_vs_configured"], row["adam_vs_configured"]
        assert a.defined == b.defined, row["row"]
        if a.defined:
            assert (a.value, a.low, a.high) == pytest.approx((b.value, b.low, b.high), rel=1e-4), row["row"]
    # a varying v̂ is no common factor: the Adam statistics are not one multiple of the plain ones
    ratio = (varying_meas.adam.cross / varying_meas.stats.cross)[varying_meas.stats.cross.abs() > 0]
    assert float(ratio.max() - ratio.min()) > 0.01 * float(ratio.abs().max())


# ---------------------------------------------------------------- refusals before any work


def test_bad_input_is_refused_before_any_work(tiny, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"diagnose.estimators: unknown estimator 'nope'; expected one of \["):
        tiny_plan(["diagnose.estimators=[rloo,nope]"])
    with pytest.raises(ValueError, match=r"diagnose.estimators: unknown estimator 'rloo\+loo'"):
        tiny_plan(["diagnose.estimators=[rloo+loo]"])
    with pytest.raises(ValueError, match=r"diagnose.k: estimator 'maxpo' needs K"):
        tiny_plan(["diagnose.estimators=[maxpo]"])
    with pytest.raises(ValueError, match=r"diagnose.losses\[0\].nope: unknown key; valid keys of loss are"):
        tiny_plan(["diagnose.losses=[{nope: {enabled: true}}]"])
    with pytest.raises(ValueError, match=r"^diagnose.losses\[0\].terms\[0\].path: unknown name 'no_such_term'"):
        tiny_plan(["diagnose.losses=[{terms: [{path: no_such_term}]}]"])
    with pytest.raises(ValueError, match=r"^diagnose.losses\[0\].agg: unknown value"):      # the key, named once
        tiny_plan(["diagnose.losses=[{agg: bogus}]"])
    # a repeated label would overwrite the other loss's rows (one loss silently never measured)
    with pytest.raises(ValueError, match=r"diagnose.losses\[1\]: its label 'a' is already diagnose.losses\[0\]'s"):
        tiny_plan(["diagnose.losses=[{name: a, agg: seq-mean-token-mean}, {name: a, kl_coef: 0.05}]"])
    with pytest.raises(ValueError, match=r"diagnose.losses\[1\]: its label 'agg=seq-mean-token-mean' is already"):
        tiny_plan(["diagnose.losses=[{agg: seq-mean-token-mean}, {agg: seq-mean-token-mean}]"])
    with pytest.raises(ValueError, match=r"diagnose.losses\[0\]: its label 'configured' is already the configured"):
        tiny_plan(["diagnose.losses=[{name: configured, agg: seq-mean-token-mean}]"])
    assert len(tiny_plan(["diagnose.losses=[{name: a, agg: seq-mean-token-mean}, {name: b, kl_coef: 0.05}]"]).losses) == 3
    with pytest.raises(ValueError, match=r"diagnose.k: K of the max@K estimators, but none is measured .*maxpo"):
        tiny_plan(["diagnose.k=4", "diagnose.estimators=[rloo]"])                  # k would do nothing
    assert "maxpo" in tiny_plan(["diagnose.k=2", "diagnose.estimators=[rloo, maxpo]"]).estimators
    with pytest.raises(ValueError, match=r"^diagnose.k: estimator 'maxpo' with options \{'k': 100\}"):
        tiny_plan(["diagnose.k=100", "diagnose.estimators=[maxpo]"])              # the key the user set
    with pytest.raises(ValueError, match=r"diagnose.target_width: expected a number below 1 .*got 1"):
        load_diagnose_config(None, ["diagnose.target_width=1"])               # ×(1 − w) would reach 0
    for key, value in (("target_width", "0"), ("target_width", "-0.1"), ("budget_min", "0"), ("budget_min", "-2")):
        with pytest.raises(ValueError, match=rf"diagnose.{key}: expected a value > 0, got"):
            load_diagnose_config(None, [f"diagnose.{key}={value}"])
    with pytest.raises(ValueError, match=r"logging.diagnose_every: .* needs rollout.group_size >= 2, got 1"):
        load_diagnose_config(None, ["logging.diagnose_every=2", "rollout.group_size=1", "algorithm.estimator=reinforce"])
    _, model, _ = tiny
    with pytest.raises(ValueError, match=r"diagnose.max_memory_gb: expected at least 0.\d+ GB \(a count sketch of "
                                         r"dimension 65536 .* got 1e-05"):
        choose_space(model, None, 3, 8, 3, 1e-5, 65536)
    with pytest.raises(ValueError, match=r"diagnose.params: expected prefixes of trainable parameter names"):
        choose_space(model, ["nothing."], 3, 8, 3, 1e-3, 16)
    assert choose_space(model, ["lm_head", "model.norm"], 3, 8, 3, 1e-3, 16).kind == "subset"
    assert choose_space(model, None, 3, 8, 3, 1e-3, 16).kind == "sketch"
    with pytest.raises(ValueError, match=r"diagnose.folds: expected at most diagnose.prompts=4"):
        load_diagnose_config(None, ["diagnose.prompts=4", "diagnose.folds=5"])


def test_an_optimizer_state_from_another_model_is_refused_before_sampling(tmp_path, monkeypatch):
    from creditrl.tools.diagnose import command
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    cfg, d = configs(["model.tiny.hidden_size=48"])
    from creditrl.config import save_config
    save_config(cfg, run / "config.yaml")
    ours, d = load_diagnose_config(None, [*TINY, f"diagnose.optimizer_state={run}", f"train.output_dir={tmp_path}"])
    monkeypatch.setattr(command, "build_task", lambda cfg: pytest.fail("the task was built"))
    with pytest.raises(ValueError, match=r"diagnose.optimizer_state: the run at .* trained a model with other "
                                         r"model.tiny settings \(hidden_size=48\)"):
        command.run_command(ours, d, progress=False)
    other, d = load_diagnose_config(None, [*TINY, "model.name=/no/such/model", f"diagnose.optimizer_state={run}"])
    with pytest.raises(ValueError, match=r"trained model.name='builtin:tiny', but this config diagnoses"):
        from creditrl.tools.diagnose.optimizer_state import check_run
        check_run(str(run), other)
    with pytest.raises(ValueError, match=r"diagnose.optimizer_state: expected a creditrl training run directory"):
        check_run(str(tmp_path / "nothing"), other)


def test_an_optimizer_state_whose_parameters_differ_is_refused(tiny, tmp_path):
    from creditrl.tools.diagnose.optimizer_state import from_checkpoint
    from creditrl.trainer.checkpoint import save_checkpoint
    _, model, _ = tiny
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    weights = {n: p.detach() for n, p in named[:-1]}                     # one tensor fewer
    save_checkpoint(tmp_path, 1, weights, {"optimizer": {"state": {}, "param_groups": [{"betas": (0.9, 0.999)}]}}, 1)
    space = choose_space(model, None, 3, 8, 2, 2.0, 64)
    with pytest.raises(ValueError, match=r"diagnose.optimizer_state: the run at .* trained a different model"):
        from_checkpoint(tmp_path, model, space)
    exp = {i: {"step": torch.tensor(4.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.full_like(p, 0.5)}
           for i, (_, p) in enumerate(named)}
    save_checkpoint(tmp_path, 2, {n: p.detach() for n, p in named},
                    {"optimizer": {"state": exp, "param_groups": [{"betas": (0.9, 0.5)}]}}, 1)
    vhat = from_checkpoint(tmp_path, model, space)
    assert len(vhat) == len(named) and float(vhat[0].flatten()[0]) == pytest.approx(0.5 / (1 - 0.5 ** 4))


# ---------------------------------------------------------------- issue 30's cases, and impossible values


def test_keyword_arguments_are_checked_as_the_cli_checks_them(tiny):
    _, model, tokenizer = tiny
    rows = [{"prompt": "1+1="}]

    def call(**kwargs):
        return creditrl.diagnose(model, tokenizer, rows, lambda prompts, completions, **kw: [0.0] * len(prompts),
                                 progress=False, **kwargs)

    for kwargs, message in (({"max_new_tokens": 0}, r"max_new_tokens: expected a value > 0, got 0"),
                            ({"max_new_tokens": -3}, r"max_new_tokens: expected a value > 0, got -3"),
                            ({"top_p": 0}, r"top_p: expected a value in \(0, 1\], got 0"),
                            ({"prompts": "3"}, r"prompts: expected int, got '3' \(str\)"),
                            ({"reward_weights": [math.nan, 1]}, r"reward_weights: expected a list of 1 finite"),
                            ({"reward_weights": [1.0, 2.0]}, r"reward_weights: expected a list of 1 finite"),
                            ({"estimator": "nope"}, r"estimator: unknown estimator 'nope'"),
                            ({"target_width": 0}, r"target_width: expected a value > 0"),
                            ({"budget_min": -1}, r"budget_min: expected a value > 0"),
                            ({"group_size": 1}, r"^group_size: expected at least 2"),
                            ({"temperature": 0.0}, r"^temperature: expected a value > 0"),
                            ({"temperature": 20.0}, r"^temperature: expected a value in \[0.05, 10.0\]")):
        with pytest.raises(ValueError, match=message):
            call(**kwargs)


def test_one_reward_function_keeps_its_weight():
    task = DatasetTask([{"prompt": "a"}], lambda prompts, completions, **kw: [1.0, None][:len(prompts)], [5.0])
    scores = task.score([task.problems[0]] * 2, ["x", "y"])
    assert scores.rewards[0] == 5.0 and math.isnan(scores.rewards[1])
    assert score_terms(task._terms, [task.problems[0]], ["x"]).rewards == [5.0]


def test_fewer_distinct_prompts_than_asked_uses_each_once_and_says_so(tiny, tmp_path, capsys):
    task, model, tokenizer = tiny
    rows = [{"prompt": p.prompt, "answer": p.answer} for p in (task.sample(random.Random(i)) for i in range(40))]
    rows = [dict(r) for r in {r["prompt"]: r for r in rows}.values()][:6]

    def correct(prompts, completions, answer, **kwargs):
        return [float(c.strip() == a) + 0.1 * len(c) for c, a in zip(completions, answer)]

    with torch_threads(1):
        result = creditrl.diagnose(model, tokenizer, rows * 3, correct, group_size=4, prompts=24, estimators=["rloo"],
                                   max_new_tokens=6, progress=False, adam_warmup=0, output_dir=tmp_path / "r")
    assert result["setting"]["prompts"] == 6 and result["measurement"]["exhausted"]
    assert result["setting"]["groups"] == 12
    text = (tmp_path / "r" / "diagnose.md").read_text()
    assert "ran out of distinct prompts after 6" in text and "6 distinct prompts" in text
    assert "ETA none (the task's distinct prompts ran out)" in capsys.readouterr().out   # no time for prompts that do not exist


def test_every_reward_invalid_is_said_so(tiny, tmp_path):
    task, model, tokenizer = tiny
    rows = [{"prompt": task.sample(random.Random(i)).prompt} for i in range(8)]
    for func, why in ((lambda prompts, completions, **kw: [None] * len(prompts), r"returned None, NaN or inf"),
                      (lambda prompts, completions, **kw: ["1"] * len(prompts), r"returned a str, not a number"),
                      (lambda prompts, completions, **kw: 1 / 0, r"raised ZeroDivisionError")):
        with pytest.raises(ValueError, match=rf"reward: every reward was invalid \(\d+ of \d+ completions.*{why}"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                creditrl.diagnose(model, tokenizer, rows, func, group_size=2, prompts=4, estimators=["rloo"],
                                  max_new_tokens=4, progress=False, adam_warmup=0, output_dir=tmp_path / "run")
    assert not (tmp_path / "run" / "diagnose.md").exists()
    with pytest.raises(ValueError, match=r"every group is uninformative .* raise the temperature"):
        creditrl.diagnose(model, tokenizer, rows, lambda prompts, completions, **kw: [0.0] * len(prompts),
                          group_size=2, prompts=4, estimators=["rloo"], max_new_tokens=4, progress=False,
                          adam_warmup=0)


def test_impossible_values_are_never_reported():
    """A share outside [0, 1], a doubling gain below 1 or a cosine above 1 is an estimate of a
    bounded quantity: reported clamped into its range, with the raw estimate named."""
    gen = torch.Generator().manual_seed(3)
    names = ("reference", "rloo", "otb")
    grads = torch.randn(40, 3, 6, generator=gen, dtype=torch.float64) + 0.05
    stats = moments_from_draws(names, grads, units=[i // 2 for i in range(40)], folds=5)
    meas = Measurement(stats=stats, groups=[{"informative": True}] * 40, nonzero=dict.fromkeys(names, 40))
    plan = type("P", (), {"configured": "otb", "batch": 8})()
    out = rc.noise(meas, plan)
    for key, (low, high) in rc.BOUNDS.items():
        iv = out[key]
        for x in (iv.value, iv.low, iv.high):
            assert not math.isfinite(x) or low <= x <= high, (key, iv)
    assert Interval(1.3, 0.9, 1.7, 5).clamped(-1, 1) == Interval(1.0, 0.9, 1.0, 5)
    assert str(Interval(math.nan, math.nan, math.nan, 5)) == "undefined"
    assert "nan" not in str(Interval(2.0, math.nan, math.nan, 5))


# ---------------------------------------------------------------- outputs, CLI, TRL function


def no_nan(text: str) -> bool:
    return re.search(r"\bnan\b|\bNaN\b|\binf\b|Infinity", text) is None


def test_cli_end_to_end_and_the_report_is_never_half_written(tmp_path, monkeypatch, capsys):
    args = ["diagnose", "--no-progress", *TINY, "rollout.group_size=4", "diagnose.prompts=4",
            "diagnose.estimators=[rloo,otb,otb+loo]", f"train.output_dir={tmp_path}", "diagnose.budget_min=0.1",
            "diagnose.run_name=d", "diagnose.max_memory_gb=0.001", "diagnose.sketch_dim=512", "diagnose.adam_warmup=8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "gradient space: a count sketch of dimension 512" in out and "in rounds of 4 prompts × 2 groups of 4" in out
    run = tmp_path / "d"
    text = (run / "diagnose.md").read_text()
    for part in ("## Recommendation", "efficiency vs configured", "Adam: vs configured", "**Power:**",
                 "Var<Sa, Sb> ≤ 2‖a‖²‖b‖²/d", "raw tr Cov (raw)", "B_simple", "Doubling the group size",
                 "The labels and the recommendation read the **plain** column", "## The loss measured",
                 "clip(clip_high=0.28) + aggregation(agg='token-mean')", "precision fp32 (train.precision=auto chose"):
        assert part in text, part
    raw = (run / "diagnose.json").read_text()
    assert no_nan(text) and no_nan(raw)
    data = json.loads(raw)
    assert {r["row"] for r in data["rows"]} == {"rloo", "grpo", "otb", "otb+loo"}
    assert data["setting"]["precision"].startswith("fp32") and data["setting"]["folds"] <= data["setting"]["prompts"]
    assert (run / "diagnose.png").stat().st_size > 1000
    assert main(args) == 2 and "diagnose.run_name: the run directory" in capsys.readouterr().err
    monkeypatch.setattr(report, "markdown", lambda result: (_ for _ in ()).throw(OSError("disk full")))
    assert main([*args, "--overwrite"]) == 2
    assert (run / "diagnose.md").read_text() == text           # the old report stays until a new one is complete
    assert not list(run.glob(".*tmp*")) and not list(tmp_path.glob(".tmp*"))


def test_a_config_file_with_a_diagnose_section_serves_both_commands(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text("rollout:\n  group_size: 4\ndiagnose:\n  prompts: 12\n  target_width: 0.2\n")
    cfg, d = load_diagnose_config(path, ["diagnose.prompts=48"])
    assert d.prompts == 48 and d.target_width == 0.2 and cfg.rollout.group_size == 4
    from creditrl.config import config_from_dict, config_to_dict, load_config
    assert not hasattr(load_config(path), "diagnose") and "diagnose" not in config_to_dict(cfg)
    old = {**config_to_dict(cfg), "diagnose": {"prompts": 6, "groups_per_prompt": 3}}     # an old config.yaml
    assert config_from_dict(old).rollout.group_size == 4


def test_trl_style_function_on_builtin_tiny(tiny, tmp_path):
    task, model, tokenizer = tiny
    rng = random.Random(0)
    rows = [{"prompt": p.prompt, "answer": p.answer} for p in (task.sample(rng) for _ in range(64))]

    def correct(prompts, completions, answer, **kwargs):
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    with torch_threads(1):
        result = creditrl.diagnose(model, tokenizer, rows, correct, group_size=4, prompts=8, budget_min=0.2,
                                   estimators=["rloo", "otb"], estimator="otb", max_new_tokens=6, progress=False,
                                   adam_warmup=8, losses={"seq": {"agg": "seq-mean-token-mean"}},
                                   output_dir=tmp_path / "r")
    assert result["informative_fraction"] > 0 and (tmp_path / "r" / "diagnose.md").is_file()
    assert {r["row"] for r in result["rows"]} == {"rloo", "grpo", "otb", "rloo · seq", "grpo · seq", "otb · seq"}
    assert result["recommendation"]["text"] and result["rows"][0]["adam_vs_configured"] is not None
    assert no_nan((tmp_path / "r" / "diagnose.md").read_text())


@pytest.mark.parametrize("budget, end, prompts", [(100.0, 93.0, 72), (80.0, 80.0, 59)])
def test_the_rounds_stop_before_work_that_would_end_past_the_budget(budget, end, prompts):
    """Sampling a round costs 7 s and each prompt 1 s (a simulated clock): no round is started, and no
    prompt measured, that would end past the budget; the rounds end at most one prompt's cost early."""
    class SlowSampling(GaussianSource):
        def sample(self, problems):
            self.clock.now += 7.0
            return problems

    plan = dataclasses.replace(sim_plan(["grpo", "rloo"], "grpo", target_width=1e-9), budget_s=budget)
    clock = Clock()
    out = simulate(plan, SlowSampling(list(plan.rows), [1.0] * len(plan.rows), clock, seed=0), clock)["measurement"]
    assert (clock.now, out.prompts, out.stop) == (end, prompts, "budget")


class ExactMultiples(GaussianSource):
    """A ``GaussianSource`` where, as in a real run, the rloo row is the reference's draws and dr_grpo's
    are exactly 7/8 of them (dr_grpo = (N−1)/N · rloo)."""

    def draws(self, sampled, index):
        out = super().draws(sampled, index)
        # rloo's own float path: the same gradient up to float32 rounding, as in a real run
        out.grads[:, self.names.index("rloo")] = out.grads[:, self.names.index(REF)] * (1 + 2 ** -22)
        out.grads[:, self.names.index("dr_grpo")] = out.grads[:, self.names.index(REF)] * 0.875
        return out


class GrpoExactToo(ExactMultiples):
    """As at N = 2 with 0/1 rewards: grpo's gradient is exactly 1/√2 of rloo's as well."""

    def draws(self, sampled, index):
        out = super().draws(sampled, index)
        out.grads[:, self.names.index("grpo")] = out.grads[:, self.names.index(REF)] * 0.5 ** 0.5
        return out


def test_the_stopping_rule_reads_a_row_that_is_no_exact_multiple():
    """rloo configured and grpo an exact multiple of it too (0/1 rewards at N = 2): their intervals are
    1 by construction, so the stopping rule reads the next ranked row's (otb's), whose interval is a
    measurement; it once read grpo's ±0% and stopped as soon as the reference was resolved."""
    plan = sim_plan(["rloo", "grpo", "dr_grpo", "otb"], "rloo")
    clock = Clock()
    out = simulate(plan, GrpoExactToo(list(plan.rows), [1.3 if n == "otb" else 1.0 for n in plan.rows], clock,
                                      seed=0, signal=0.25), clock)
    rows = {r["row"]: r for r in out["rows"]}
    assert str(rows["grpo"]["efficiency_vs_rloo"]) == "1 [1, 1]"
    assert out["reference"]["width_row"] == "otb" and out["reference"]["width"] > 1e-3


def test_configured_rloo_reads_grpos_interval_and_exact_multiples_are_no_tests():
    """rloo configured: its efficiency against the reference (itself, up to float32 rounding) is 1
    exactly, so the stopping rule reads grpo's interval (as documented), and dr_grpo, an exact multiple
    of rloo, is none of Holm's m comparisons and outside the power range (efficiency 1 by construction).
    With no signal (the reference unresolved, every estimate undefined) the identities still read
    exactly, not as "1 [interval undefined]" measurements, and name no reason to be undefined."""
    plan = sim_plan(["rloo", "grpo", "dr_grpo", "otb"], "rloo")
    for signal in (0.25, 0.0):
        clock = Clock()
        source = ExactMultiples(list(plan.rows), [1.3 if n == "otb" else 1.0 for n in plan.rows], clock, seed=0,
                                signal=signal)
        out = simulate(plan, source, clock)
        assert out["reference"]["resolved"] == (signal > 0)
        rows = {r["row"]: r for r in out["rows"]}
        for row, scale in (("rloo", 1.0), ("dr_grpo", 0.875)):
            cells = [rows[row][key] for key in ("efficiency_vs_configured", "efficiency_vs_rloo", "scale", "cosine")]
            assert [str(iv) for iv in cells] == ["1 [1, 1]", "1 [1, 1]", f"{scale:.3g} [{scale:.3g}, {scale:.3g}]",
                                                 "1 [1, 1]"], row
            assert rows[row]["undefined"] is None
        assert out["reference"]["width_row"] == "grpo"
        assert out["reference"]["width"] > 1e-3 if signal else not out["reference"]["width"] < math.inf
        rec = out["recommendation"]
        assert rec["m"] == 2 and "dr_grpo" not in rec["better"] + rec["worse"]
        assert out["power"]["comparisons"] == (2 if signal else 0)      # no power while unresolved


def test_a_max_k_configured_row_is_not_ranked_against():
    """max@K rows target another objective: with maxpo configured no row is compared with it (m = 0,
    no power), and the recommendation keeps it, saying why."""
    plan = sim_plan(["rloo", "grpo", "maxpo"], "maxpo")
    assert not plan.ranked("maxpo")
    clock = Clock()
    out = simulate(plan, GaussianSource(list(plan.rows), [1.0, 1.0, 1.0, 3.0], clock, seed=0), clock)
    rec = out["recommendation"]
    assert (rec["m"], rec["better"], rec["worse"], rec["choice"]) == (0, [], [], "maxpo")
    assert out["power"]["comparisons"] == 0
    assert ("targets the max@K objective" if out["reference"]["resolved"] else "not resolved") in rec["text"]


def test_the_trend_names_no_prompt_count_while_the_signal_is_not_positive():
    """A non-positive ‖μ̂‖² has no level to extrapolate: the prompts needed are unknown (inf), not the
    upper 95% bound's optimistic count; a positive one gives P·(3·se/‖μ̂‖²)²."""
    from creditrl.tools.diagnose.measure import needed_prompts
    width = Interval(1.0, 0.99, 1.01, 16, 1e-3, log=True)
    assert needed_prompts(10, Interval(-10.0, -46.0, 26.0, 16, 17.0), width, 0.1) == math.inf
    assert needed_prompts(10, Interval(0.0, -1.0, 1.0, 16, 0.5), width, 0.1) == math.inf
    assert needed_prompts(10, Interval(10.0, 6.0, 14.0, 16, 2.0), width, 0.1) == pytest.approx(10 * (3 * 2 / 10) ** 2)


def test_a_budget_shorter_than_a_prompt_still_measures_two():
    """The first two prompts always run (no statistic exists before them), even when the budget is
    spent before the first: the run ends with a defined result, not an internal error."""
    plan = dataclasses.replace(sim_plan(["grpo", "rloo"], "grpo"), budget_s=0.5)
    clock = Clock()
    out = simulate(plan, GaussianSource(list(plan.rows), [1.0] * len(plan.rows), clock, seed=0), clock)
    assert (out["measurement"].prompts, out["measurement"].stop) == (2, "budget")
    assert out["recommendation"]["choice"] == "grpo"
    # the round sampled all its 24 prompts' groups; the per-group sampling time divides by those
    assert (out["measurement"].sampled_groups, len(out["measurement"].groups)) == (24 * 2, 2 * 2)


def test_the_plot_draws_no_point_without_its_interval():
    """An efficiency whose interval is undefined is left out of the plot (and marked there), not drawn
    as a bare point that reads like an exact value; an exact one (the configured row) is drawn."""
    exact, measured = Interval(1.0, 1.0, 1.0, 16, 0.0, log=True), Interval(1.2, 1.0, 1.4, 16, 0.1, log=True)
    loose = Interval(0.67, math.nan, math.nan, 16, math.nan, log=True)
    rows = [{"efficiency_vs_configured": iv, "adam_vs_configured": None} for iv in (exact, measured, loose)]
    assert report.plot_points(rows, "efficiency_vs_configured") == [(0, exact), (1, measured)]


def test_the_plot_writes_the_holm_labels_not_only_per_comparison_intervals(tmp_path):
    """diagnose.png marks the rows the Holm-adjusted labels name (better / worse, biased direction), so an
    interval clear of 1 that Holm does not keep is not read as a finding; the figure is written with them."""
    exact, clear = Interval(1.0, 1.0, 1.0, 16, 0.0, log=True), Interval(1.2, 1.05, 1.4, 16, 0.07, log=True)
    rows = [{"row": name, "efficiency_vs_configured": iv, "adam_vs_configured": None}
            for name, iv in (("grpo", exact), ("otb", clear), ("rloo", clear), ("maxrl", clear))]
    labels = {"better": ["otb"], "worse": ["maxrl"], "biased": ["maxrl"], "m": 3}
    assert report.holm_marks(rows, labels) == [(1, "better"), (3, "worse, biased direction")]
    assert report.holm_marks(rows, None) == []                 # rloo: clear of 1, yet not kept by Holm: no mark
    assert report.plot(rows, tmp_path / "d.png", labels).stat().st_size > 1000


def test_the_pace_counts_the_status_between_rounds_and_reserves_it(monkeypatch):
    """The status computed after each round costs 5 s here (a simulated clock; on flat gradient spaces
    it is seconds): the next round's forecast counts it, and every prompt reserves it for the closing
    statistics, so no round is sampled that measures no prompt and the run ends within the budget
    (before, the status was not forecast: a round was sampled past the budget and the end overran)."""
    from creditrl.tools.diagnose import measure as measure_module
    clock = Clock()
    real = measure_module.status

    def slow_status(*args):
        clock.now += 5.0
        return real(*args)

    class SlowSampling(GaussianSource):
        def sample(self, problems):
            self.clock.now += 7.0
            return problems

    monkeypatch.setattr(measure_module, "status", slow_status)
    for budget in (60.0, 75.0, 100.0, 130.0):
        clock.now = 0.0
        plan = dataclasses.replace(sim_plan(["grpo", "rloo"], "grpo", target_width=1e-9), budget_s=budget)
        out = simulate(plan, SlowSampling(list(plan.rows), [1.0] * len(plan.rows), clock, seed=0), clock)["measurement"]
        measured = [r["prompts"] for r in out.rounds]
        assert measured == sorted(set(measured)), measured           # every round measured a prompt
        assert clock.now <= budget and out.stop == "budget"


def test_the_pace_reserves_the_closing_statistics_over_every_row(monkeypatch):
    """The statistics cost ∝ E² (the folds' cross Gram), 0.2·E² s on a simulated clock: 0.8 s for the
    status's 2 rows between rounds, 5 s for the closing statistics over all 5 rows. Each check reserves
    the closing statistics forecast as (5/2)² × the status, so the run ends within the budget (before,
    the reserve was one status: the closing statistics ran past the deadline)."""
    from creditrl.core.gradients import moments
    clock = Clock()
    real = moments.GradientMoments.stats

    def costly_stats(self, names=None):
        clock.now += 0.2 * len(names or self.names) ** 2
        return real(self, names)

    monkeypatch.setattr(moments.GradientMoments, "stats", costly_stats)
    overrun = []
    for budget in (20.0, 27.0, 33.0, 41.0, 50.0, 64.0):
        clock.now = 0.0
        plan = dataclasses.replace(sim_plan(["grpo", "rloo", "dr_grpo", "otb"], "grpo", prompts=4, target_width=1e-9),
                                   budget_s=budget)
        out = simulate(plan, GaussianSource(list(plan.rows), [1.0] * len(plan.rows), clock, seed=0), clock)
        assert out["measurement"].stop == "budget"
        overrun.append(clock.now - budget)
    assert max(overrun) <= 0, overrun


def test_a_rounds_reward_counts_cover_its_measured_prompts_only():
    """A round cut by the budget after 2 of its 3 prompts: the invalid-reward count (and its total)
    covers those 2 prompts' responses (rows are prompt-major), as the report's prompt count does."""
    from types import SimpleNamespace
    from creditrl.tools.diagnose.measure import note_round
    out = Measurement()
    invalid = torch.tensor([0, 1, 0, 0,  1, 1, 0, 0,  1, 1, 1, 1], dtype=torch.bool)    # 3 prompts x 4 responses
    note_round(SimpleNamespace(), SimpleNamespace(reward_invalid=invalid), out, measured=2, count=3)
    assert (out.responses, out.invalid) == (8, 3)


@pytest.mark.parametrize("prompts, step, sizes", [(24, 16, [8, 16]), (24, 64, [24]), (32, 16, [16]), (10, 8, [2, 8])])
def test_batch_level_rows_say_when_their_steps_are_smaller_than_trainings(prompts, step, sizes):
    """A round of ``prompts`` cut into training steps of ``step`` prompts: the steps measured and the
    report's note. Only a multiple of the step gives steps as in training; otherwise the note says
    the batch statistics came from fewer prompts (it had said "as in training" for every size)."""
    from types import SimpleNamespace

    from creditrl.tools.diagnose.report import batch_level_notes
    from creditrl.tools.diagnose.run import step_sizes
    plan = SimpleNamespace(prompts=prompts, groups_per_prompt=2, batch=step)
    assert step_sizes(plan) == sizes
    note = "".join(batch_level_notes({"batch_level": ["shrinkage"], "step": step, "step_sizes": sizes,
                                      "prompts_per_round": prompts}))
    assert ("as in training" in note) == (sizes == [step])
    assert ("**not" in note) == (sizes != [step])


# ---------------------------------------------------------------- the training setting, as trained


def test_diagnose_samples_the_rewards_training_samples():
    """The overlong penalty reaches diagnose's rollouts (it once scored plain 0/1 rewards where training's
    were penalised), maxrl, which refuses the negative rewards the penalty gives, is left out of the default
    rows and refused by name, and a run with dynamic sampling says what diagnose does not reproduce."""
    from creditrl.config import ConfigError
    from creditrl.tools.diagnose.command import rollout_settings, setting_notes
    overlong = ["rollout.max_new_tokens=7", "rollout.overlong.buffer=6", "rollout.overlong.penalty=1"]
    cfg, d = configs(overlong)
    task = build_task(cfg)
    assert rollout_settings(cfg, task, None)["overlong"] == (6, 1.0)
    assert "maxrl" not in make_plan(cfg, d).estimators and "otb" in make_plan(cfg, d).estimators
    with pytest.raises(ConfigError, match=r"diagnose.estimators: rollout.overlong.buffer=6: the overlong penalty .* "
                                          r"estimator 'maxrl' refuses .*leave 'maxrl' out"):
        make_plan(*configs([*overlong, "diagnose.estimators=[maxrl,otb]"]))
    with pytest.raises(ConfigError, match=r"rollout.overlong.buffer=6: the overlong penalty makes rewards negative "
                                          r"\(down to -1\), which estimator 'maxrl' refuses"):
        configs([*overlong, "algorithm.estimator=maxrl"])          # as train refuses it
    plain, _ = configs(["rollout.max_new_tokens=7"])
    assert rollout_settings(plain, task, None)["overlong"] is None and setting_notes(plain) == []
    dynamic, _ = configs(["rollout.dynamic_sampling.enabled=true"])
    assert "diagnose measures every sampled group" in setting_notes(dynamic)[0]


@pytest.mark.parametrize("entry, message", [
    ("[{stapo: {tau_p: 0.01}}]", r"diagnose.losses\[0\].stapo.tau_p: given, but stapo is off in the configured loss"),
    ("[{}]", r"diagnose.losses\[0\]: \{\} composes the configured loss itself"),
    ("[{agg: token-mean}]", r"diagnose.losses\[0\]: \{'agg': 'token-mean'\} composes the configured loss itself"),
])
def test_a_further_loss_that_would_do_nothing_is_refused(entry, message):
    """An entry whose options change nothing once merged over the configured loss gave rows labelled as if
    it did (STAPO's options without its switch read as 'STAPO changes nothing')."""
    from creditrl.config import ConfigError
    with pytest.raises(ConfigError, match=message):
        tiny_plan([f"diagnose.losses={entry}"])
    plan = tiny_plan(["diagnose.losses=[{stapo: {enabled: true, tau_p: 0.01}}, {kl_coef: 0.05}]"])
    assert [loss.name for loss in plan.losses][1:] == ["stapo={'enabled': True, 'tau_p': 0.01}", "kl_coef=0.05"]
    assert any("`kl` pulls toward the reference policy" in note for note in plan.losses[2].notes)
