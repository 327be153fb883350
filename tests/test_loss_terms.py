"""The loss-term registry and the composition: registration rules, user terms by import path,
PolicyLoss / policy_loss equivalence, and hypothesis properties of what the loss guarantees."""
from __future__ import annotations

import dataclasses
import inspect
import json
import math
import pathlib
import re
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings, strategies as st

import creditrl
from creditrl import (AggregationOptions, ClipOptions, KLOptions, LossState, PolicyLoss, RolloutCorrectionOptions,
                      StapoOptions, TraceOptions, get_loss_term, list_loss_terms, policy_loss, register_loss_term)
from creditrl.core.losses import METRIC_KEYS, STAGES, compose, resolve_loss_terms
from creditrl.core.losses.clip import ratio_bounds
from creditrl.core.losses.policy import _initial_state
from creditrl.core.losses.terms import _REGISTRY
from tolerances import EPS64, sum_rtol

PLUGINS = pathlib.Path(__file__).parent / "plugins"
USER_TERM = "length_penalty_term:length_penalty"
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
# The batches here are float64: a loss, gradient element or metric is a positive-weighted sum over <= 6 x 11
# tokens of terms of a few (~12) operations each, so two evaluations agree to (66 + 12)·eps64 relative to the
# terms' magnitudes (<= 20: ratios <= e^1.5 clamped at 20, N(0,1) advantages, KL terms) (tests/tolerances.py)
F64_REL = sum_rtol(66 + 12, torch.float64)
F64_ABS = F64_REL * 20


@pytest.fixture(scope="module")
def plugins():
    """The user's module directory on the path, as ``creditrl train`` puts the working directory."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(PLUGINS))
        yield


@pytest.fixture
def registry():
    """Terms registered inside a test are removed after it."""
    before = dict(_REGISTRY)
    yield
    _REGISTRY.clear()
    _REGISTRY.update(before)


def batch(seed, rows=5, length=8, token_adv=False, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, length, generator=gen) > 0.3
    mask[0] = False
    old = -torch.rand(rows, length, generator=gen, dtype=dtype) * 3
    logp = (old + 0.4 * torch.randn(rows, length, generator=gen, dtype=dtype)).clamp(max=0)   # log-probs: <= 0
    adv = torch.randn((rows, length) if token_adv else (rows,), generator=gen, dtype=dtype)
    extra = {"ref_logp": (old + 0.2 * torch.randn(rows, length, generator=gen, dtype=dtype)).clamp(max=0),
             "rollout_logp": (old + 0.3 * torch.randn(rows, length, generator=gen, dtype=dtype)).clamp(max=0),
             "entropy": torch.rand(rows, length, generator=gen, dtype=dtype) * 2}
    return logp, old, adv, mask, extra


def loss_and_grad(logp, *args, fn=policy_loss, **kwargs):
    lp = logp.clone().requires_grad_()
    loss, metrics = fn(lp, *args, **kwargs)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


# ---- registry ---------------------------------------------------------------------------------

def test_built_in_terms_their_stages_and_options():
    from creditrl.core.losses import cispo, covariance, delta_l, dppo, entropy, gmpo, gspo, sapo, truncation
    builtin = [n for n in list_loss_terms() if get_loss_term(n).fn.__module__.startswith("creditrl.")]
    assert builtin == ["rollout_correction", "stapo", "mask_truncated", "top_entropy", "trace", "gspo", "clip", "cispo",
                       "sapo", "geo_mean", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov", "kl", "entropy_bonus",
                       "aggregation", "delta_l_norm"]  # in stage order, then registration order
    expected = {"clip": (ClipOptions, "surrogate", True), "aggregation": (AggregationOptions, "aggregate", True),
                "kl": (KLOptions, "penalty", True), "rollout_correction": (RolloutCorrectionOptions, "keep", True),
                "stapo": (StapoOptions, "keep", False), "trace": (TraceOptions, "ratio", False),
                "mask_truncated": (truncation.MaskTruncatedOptions, "keep", False),
                "top_entropy": (entropy.TopEntropyOptions, "keep", False), "gspo": (gspo.GspoOptions, "ratio", False),
                "cispo": (cispo.CispoOptions, "surrogate", False), "sapo": (sapo.SapoOptions, "surrogate", False),
                "geo_mean": (gmpo.GeoMeanOptions, "surrogate", False),
                "dppo_tv": (dppo.DppoOptions, "surrogate", False), "dppo_kl": (dppo.DppoOptions, "surrogate", False),
                "clip_cov": (covariance.ClipCovOptions, "surrogate", False),
                "kl_cov": (covariance.KLCovOptions, "surrogate", False),
                "entropy_bonus": (entropy.EntropyBonusOptions, "penalty", False),
                "delta_l_norm": (delta_l.DeltaLNormOptions, "aggregate", False)}
    assert set(expected) == set(builtin)
    flat_fields = []
    for name, (options, stage, flat) in expected.items():
        term = get_loss_term(name)
        assert (term.options, term.stage, term.flat) == (options, stage, flat) and term.doc
        for f in dataclasses.fields(options):            # declared once: a default and a help text each
            assert f.default is not dataclasses.MISSING and f.metadata["help"], (name, f.name)
        flat_fields += [f.name for f in dataclasses.fields(options)] if flat else []
    assert sorted(flat_fields) == sorted(["clip_low", "clip_high", "clip_c", "agg", "max_len", "kl_coef",
                                          "kl_estimator", "kl_bias_correction", "rollout_correction", "rollout_cap"])
    # policy_loss's signature spells out every flat option with its default
    params = inspect.signature(policy_loss).parameters
    assert all(params[f.name].default == f.default for o in (ClipOptions, AggregationOptions, KLOptions,
                                                             RolloutCorrectionOptions) for f in dataclasses.fields(o))
    assert params["stapo"].default is None and params["trace"].default is None


def test_active_and_needs():
    assert not get_loss_term("kl").active(KLOptions()) and get_loss_term("kl").active(KLOptions(kl_coef=0.1))
    assert get_loss_term("rollout_correction").active(RolloutCorrectionOptions("tis"))
    assert get_loss_term("stapo").needs == ("entropy",) and get_loss_term("kl").needs == ("ref_logp",)


def test_registration_rules(registry):
    @dataclass(frozen=True)
    class Good:
        coef: float = field(default=1.0, metadata={"help": "h"})

    @dataclass
    class NotFrozen:
        coef: float = 1.0

    @dataclass(frozen=True)
    class Required:
        coef: float

    @dataclass(frozen=True)
    class Clash:
        kl_coef: float = 0.0

    def fn(state, options):
        return state

    with pytest.raises(TypeError, match="options must be a frozen dataclass type"):
        register_loss_term("x", options=NotFrozen, stage="penalty")(fn)
    with pytest.raises(ValueError, match=r"every option needs a default, Required has none for \['coef'\]"):
        register_loss_term("x", options=Required, stage="penalty")(fn)
    with pytest.raises(ValueError, match=r"stage: unknown value 'late'; valid values are \['keep'"):
        register_loss_term("x", options=Good, stage="late")(fn)
    with pytest.raises(ValueError, match=r"flat option name\(s\) \['kl_coef'\] already belong to flat term 'kl'"):
        register_loss_term("x", options=Clash, stage="penalty", flat=True)(fn)
    with pytest.raises(ValueError, match="name: expected a Python identifier"):
        register_loss_term("my-term", options=Good, stage="penalty")(fn)
    with pytest.raises(ValueError, match=r"needs: unknown input\(s\) \['logits'\]"):
        register_loss_term("x", options=Good, stage="penalty", needs=("logits",))(fn)
    register_loss_term("x", options=Good, stage="penalty")(fn)
    register_loss_term("x", options=Good, stage="penalty")(fn)           # the same function again: fine
    with pytest.raises(ValueError, match="loss term 'x' is already registered"):
        register_loss_term("x", options=Good, stage="penalty")(lambda state, options: state)
    with pytest.raises(ValueError, match="loss term 'clip' is already registered"):
        register_loss_term("clip", options=Good, stage="surrogate")(fn)


def test_get_loss_term_by_name_or_import_path(plugins):
    term = get_loss_term(USER_TERM)
    assert term.name == "length_penalty" and term.stage == "penalty" and not term.flat
    assert get_loss_term("length_penalty") is term and term.doc.startswith("Toy length penalty")
    with pytest.raises(ValueError, match=r"loss term: unknown name 'nope'; registered terms are \["):
        get_loss_term("nope")
    with pytest.raises(ValueError, match="loss term: cannot import module 'no_such_module'"):
        get_loss_term("no_such_module:fn")
    with pytest.raises(ValueError, match="is not registered; decorate it with @creditrl.register_loss_term"):
        get_loss_term("length_penalty_term:dataclass")


def test_resolve_loss_terms_forms_and_errors(plugins):
    from length_penalty_term import LengthPenaltyOptions

    want = {"length_penalty": LengthPenaltyOptions(coef=0.5)}
    assert resolve_loss_terms([{"path": USER_TERM, "coef": 0.5}]) == want
    assert resolve_loss_terms([{"name": "length_penalty", "coef": 0.5}]) == want
    assert resolve_loss_terms({USER_TERM: {"coef": 0.5}}) == want
    assert resolve_loss_terms({"length_penalty": LengthPenaltyOptions(0.5)}) == want
    assert resolve_loss_terms({"stapo": None}) == {"stapo": StapoOptions()}
    with pytest.raises(ValueError, match=r"loss term 'length_penalty': unknown option\(s\) \['cof'\]; valid options "
                                         r"are \['coef'\]"):
        resolve_loss_terms([{"path": USER_TERM, "cof": 1.0}])
    with pytest.raises(ValueError, match=r"terms\[0\]: expected exactly one of 'path' or 'name'"):
        resolve_loss_terms([{"coef": 1.0}])
    with pytest.raises(ValueError, match="loss term 'length_penalty' is given twice"):
        resolve_loss_terms([{"path": USER_TERM}, {"name": "length_penalty"}])
    with pytest.raises(TypeError, match=r"terms\[0\]: expected a mapping"):
        resolve_loss_terms(["length_penalty"])
    with pytest.raises(ValueError, match=r"tau_p: expected a value in \(0, 1\)"):
        resolve_loss_terms({"stapo": {"tau_p": 2.0}})


# ---- the composition --------------------------------------------------------------------------

def test_policy_loss_is_policy_loss_object_and_options_are_checked_once():
    logp, old, adv, mask, extra = batch(1)
    kwargs = dict(clip_high=0.28, kl_coef=0.1, stapo=StapoOptions(tau_p=0.2), trace=TraceOptions(lam=0.9))
    loss_fn = PolicyLoss({"clip": {"clip_high": 0.28}, "kl": KLOptions(kl_coef=0.1), "stapo": {"tau_p": 0.2},
                          "trace": TraceOptions(lam=0.9)})
    assert repr(loss_fn) == repr(compose(**kwargs))
    a = loss_and_grad(logp, old, adv, mask, **extra, **kwargs)
    b = loss_and_grad(logp, old, adv, mask, fn=loss_fn, **extra)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]
    with pytest.raises(TypeError, match=r"policy_loss: unknown option 'clip_hi'; valid options are \["):
        policy_loss(logp, old, adv, mask, clip_hi=0.3)
    with pytest.raises(ValueError, match="loss term 'stapo' is given twice"):
        policy_loss(logp, old, adv, mask, stapo=True, terms={"stapo": None}, entropy=extra["entropy"])
    with pytest.raises(ValueError, match="loss term 'clip' is given twice"):
        policy_loss(logp, old, adv, mask, clip_low=0.1, terms={"clip": None})


def written_out_length_penalty(logp, old, adv, mask, coef):
    """token-mean plain PPO loss plus coef·(n_b/T)·r_t over valid tokens, written with loops."""
    total, count = 0.0, 0
    for b in range(logp.shape[0]):
        n_b = int(mask[b].sum())
        for t in range(logp.shape[1]):
            if mask[b, t]:
                r = torch.exp(logp[b, t] - old[b, t])
                total = total + torch.maximum(-adv[b] * r, -adv[b] * r.clamp(0.8, 1.2)) + coef * n_b / mask.shape[1] * r
                count += 1
    return total / count


def test_user_term_by_import_path_matches_its_written_out_value(plugins):
    logp, old, adv, mask, _ = batch(2)
    loss, grad, metrics = loss_and_grad(logp, old, adv, mask, terms=[{"path": USER_TERM, "coef": 0.3}])
    lp = logp.clone().requires_grad_()
    want = written_out_length_penalty(lp, old, adv, mask, 0.3)
    (want_grad,) = torch.autograd.grad(want, lp)
    torch.testing.assert_close(loss, want.detach(), rtol=F64_REL, atol=F64_ABS)
    torch.testing.assert_close(grad, want_grad, rtol=F64_REL, atol=F64_ABS)
    assert set(metrics) == {*METRIC_KEYS, "clip_frac_low", "clip_frac_high", "length_penalty"}
    assert metrics["length_penalty"] == pytest.approx(0.3 * mask.sum(1).double().mean().item() / mask.shape[1],
                                                      rel=F64_REL)


def test_term_stages_run_in_order(registry):
    """A term sees what the earlier stages made, whatever order the terms are given in."""
    seen = []

    @dataclass(frozen=True)
    class Probe:
        tag: str = field(default="", metadata={"help": "h"})

    def probe(state: LossState, options: Probe) -> LossState:
        seen.append((options.tag, state.log_ratio is not None, state.token_loss is not None, state.loss is not None))
        return state
    register_loss_term("probe_keep", options=Probe, stage="keep")(probe)
    register_loss_term("probe_penalty", options=Probe, stage="penalty")(probe)
    logp, old, adv, mask, _ = batch(3)
    policy_loss(logp, old, adv, mask, terms={"probe_penalty": {"tag": "penalty"}, "probe_keep": {"tag": "keep"}})
    assert seen == [("keep", False, False, False), ("penalty", True, True, False)]
    assert STAGES.index("keep") < STAGES.index("penalty")


@pytest.mark.parametrize("shape", [(0, 5), (3, 0)])
def test_empty_batch_gives_zero_attached_to_the_graph(shape):
    logp = torch.zeros(shape, requires_grad=True)
    loss, metrics = policy_loss(logp, logp.detach(), torch.zeros(shape[0]), torch.ones(shape, dtype=torch.bool),
                                trace=TraceOptions(), kl_coef=0.1, ref_logp=logp.detach())
    loss.backward()
    assert loss.item() == 0.0 and logp.grad is not None and logp.grad.shape == shape
    assert metrics == dict.fromkeys(METRIC_KEYS, 0.0)


def test_metrics_reach_the_host_in_one_copy(monkeypatch):
    """One ``tolist`` for every metric and the loss; no ``.item()`` / ``float(tensor)`` per metric."""
    logp, old, adv, mask, extra = batch(4)
    calls = {"item": 0, "float": 0, "tolist": 0}
    for name, attr in (("item", "item"), ("float", "__float__"), ("tolist", "tolist")):
        original = getattr(torch.Tensor, attr)

        def counted(self, *args, _name=name, _original=original):
            calls[_name] += 1
            return _original(self, *args)
        monkeypatch.setattr(torch.Tensor, attr, counted)
    policy_loss(logp, old, adv, mask, **extra, kl_coef=0.1, rollout_correction="mis", stapo=True, trace=TraceOptions())
    assert calls == {"item": 0, "float": 0, "tolist": 1}


# ---- properties -------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(r=st.floats(1e-6, 1e6), a=st.floats(-10, 10), low=st.floats(0.0, 0.99), high=st.floats(0.0, 5.0),
       c=st.one_of(st.none(), st.floats(1.01, 100.0)))
def test_one_clamp_is_the_ppo_clip_with_dual_clip(r, a, low, high, c):
    """PPO eq. 7 / DAPO / dual clip, as written, equals −A·clamp(r, lo, hi) of ``ratio_bounds``."""
    options = ClipOptions(clip_low=low, clip_high=high, clip_c=c)
    lo, hi = ratio_bounds(torch.tensor([[a]], dtype=torch.float64), options)
    got = -a * min(max(r, lo.item()), hi.item())
    want = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
    if c is not None and a < 0:
        want = min(want, -a * c)
    assert got == pytest.approx(want, rel=4 * EPS64, abs=0)   # the same one or two float64 products


def agg_weights(mask, mode, max_len):
    """w_b of each row, written out per aggregation (agg_loss = Σ_b w_b Σ_t ℓ_bt)."""
    n = mask.sum(1).double()
    rows_with_tokens = max(int((n > 0).sum()), 1)
    if mode == "token-mean":
        return torch.full_like(n, 1 / max(n.sum().item(), 1))
    if mode == "seq-mean-token-mean":
        return 1 / (rows_with_tokens * n.clamp(min=1))
    if mode == "seq-mean-token-sum":
        return torch.full_like(n, 1 / rows_with_tokens)
    return torch.full_like(n, 1 / (mask.shape[0] * max_len))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), mode=st.sampled_from(MODES), token_adv=st.booleans(),
       clip_c=st.sampled_from([None, 3.0]))
def test_on_policy_gradient_is_the_policy_gradient(seed, mode, token_adv, clip_c):
    """At π_θ = π_old (r = 1, inside every clip) ∂L/∂log π_t = −A_t·w_b on valid tokens, 0 elsewhere."""
    logp, _, adv, mask, _ = batch(seed, token_adv=token_adv)
    _, grad, metrics = loss_and_grad(logp, logp, adv, mask, agg=mode, max_len=11, clip_c=clip_c, clip_high=0.28)
    a = adv if token_adv else adv[:, None].expand_as(logp)
    want = torch.where(mask, -a * agg_weights(mask, mode, 11)[:, None], 0.0)
    torch.testing.assert_close(grad, want, rtol=F64_REL, atol=F64_ABS)
    assert metrics["clip_frac_low"] == metrics["clip_frac_high"] == metrics["approx_kl"] == 0.0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), mode=st.sampled_from(MODES), split=st.integers(1, 4),
       options=st.sampled_from([{}, {"kl_coef": 0.1}, {"rollout_correction": "tis"}, {"rollout_correction": "mis"},
                                {"trace": TraceOptions(lam=0.9, style="both", floor=0.01)},
                                {"trace": TraceOptions(lam=0.9, update="weight")}]))
def test_micro_batches_weighted_by_agg_count_give_the_batch_gradient(seed, mode, split, options):
    """Σ_i count_i·∇L_i / Σ_i count_i = ∇L of the whole batch (count = the metric agg_count):
    how a trainer accumulates micro-batches exactly (row-local options; not STAPO's batch quantile)."""
    logp, old, adv, mask, extra = batch(seed, rows=6, token_adv=True)
    extra.pop("entropy")
    kwargs = dict(agg=mode, max_len=10, **options)
    _, full_grad, full = loss_and_grad(logp, old, adv, mask, **extra, **kwargs)
    grad, total = torch.zeros_like(logp), 0.0
    for rows in (torch.arange(6)[:split], torch.arange(6)[split:]):
        part = {k: v[rows] for k, v in extra.items()}
        _, g, metrics = loss_and_grad(logp[rows], old[rows], adv[rows], mask[rows], **part, **kwargs)
        grad[rows] = g * metrics["agg_count"]
        total += metrics["agg_count"]
    if total > 0:
        torch.testing.assert_close(grad / total, full_grad, rtol=2 * F64_REL, atol=2 * F64_ABS)   # scaled back: one more
    assert total == full["agg_count"]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), garbage=st.sampled_from([math.nan, math.inf, -math.inf, 1e30]),
       token_adv=st.booleans())
def test_masked_garbage_never_reaches_the_loss_gradient_or_metrics(seed, garbage, token_adv):
    logp, old, adv, mask, extra = batch(seed, token_adv=token_adv)
    kwargs = dict(kl_coef=0.1, rollout_correction="seq-tis", stapo=StapoOptions(tau_p=0.3),
                  trace=TraceOptions(lam=0.8, style="both"), clip_c=3.0)
    clean = loss_and_grad(logp, old, adv, mask, **extra, **kwargs)

    def dirty(x):
        return torch.where(mask, x, garbage)
    got = loss_and_grad(dirty(logp), dirty(old), dirty(adv) if token_adv else adv, mask,
                        **{k: dirty(v) for k, v in extra.items()}, **kwargs)
    assert torch.equal(got[0], clean[0]) and torch.equal(got[1], clean[1]) and got[2] == clean[2]


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), mode=st.sampled_from(MODES))
def test_row_order_does_not_matter(seed, mode):
    logp, old, adv, mask, extra = batch(seed, rows=6)
    kwargs = dict(agg=mode, kl_coef=0.05, stapo=StapoOptions(tau_p=0.3), rollout_correction="mis",
                  trace=TraceOptions(lam=0.9, update="weight"))
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(seed))
    loss, grad, metrics = loss_and_grad(logp, old, adv, mask, **extra, **kwargs)
    p_loss, p_grad, p_metrics = loss_and_grad(logp[perm], old[perm], adv[perm], mask[perm],
                                              **{k: v[perm] for k, v in extra.items()}, **kwargs)
    torch.testing.assert_close(p_loss, loss, rtol=F64_REL, atol=F64_ABS)
    torch.testing.assert_close(p_grad, grad[perm], rtol=F64_REL, atol=F64_ABS)
    assert p_metrics == pytest.approx(metrics, rel=F64_REL, abs=F64_ABS)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_a_term_with_zero_weight_changes_nothing(seed, plugins):
    logp, old, adv, mask, extra = batch(seed)
    plain = loss_and_grad(logp, old, adv, mask)
    with_zero = loss_and_grad(logp, old, adv, mask, ref_logp=extra["ref_logp"], kl_coef=0.0,
                              terms=[{"path": USER_TERM, "coef": 0.0}])
    assert torch.equal(plain[0], with_zero[0]) and torch.equal(plain[1], with_zero[1])
    assert with_zero[2]["ref_kl"] > 0 and with_zero[2]["length_penalty"] == 0.0


def test_public_names():
    for name in ("PolicyLoss", "register_loss_term", "get_loss_term", "list_loss_terms", "LossState", "ClipOptions",
                 "AggregationOptions", "KLOptions", "RolloutCorrectionOptions", "StapoOptions", "TraceOptions"):
        assert getattr(creditrl, name) is getattr(creditrl.core.losses, name)


def test_a_user_term_from_creditrl_train(plugins, tmp_path):
    """The worked example end to end: `creditrl train loss.terms=[{path: ...}]`, creditrl not edited."""
    from creditrl.cli import main
    tiny = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
            "model.warm_start.max_steps=20", "task.options.digits=1", "rollout.prompts_per_step=2",
            "rollout.group_size=4", "rollout.max_new_tokens=6", "train.steps=1", "train.eval_problems=4",
            "train.threads=1", "train.save_every=0", "logging.progress=false", "logging.plots=false"]
    term = '[{path: "length_penalty_term:length_penalty", coef: 0.05}]'
    assert main(["train", "--no-progress", *tiny, f"loss.terms={term}", f"model.cache_dir={tmp_path / 'cache'}",
                 f"train.output_dir={tmp_path}", "train.run_name=lp"]) == 0
    (step,) = [json.loads(line) for line in (tmp_path / "lp" / "metrics.jsonl").read_text().splitlines()]
    share = step["response_len"] / 6          # mean n_b / max_new_tokens <= mean n_b / T (T: the batch's width)
    assert 0.05 * share - 1e-7 <= step["length_penalty"] <= 0.05 + 1e-7 and step["length_penalty"] > 0
    assert "length_penalty_term:length_penalty" in (tmp_path / "lp" / "config.yaml").read_text()


def test_config_loss_terms_each_once_and_not_creditrls_own(plugins, registry):
    """Cases 5 and 23: a term twice in loss.terms would apply only its last entry while config.yaml lists
    both; creditrl's own terms in loss.terms would skip what their keys build (the KL's reference
    model). Both are refused naming the entry and the keys to use; a user's term that needs reference
    log-probs gets the reference built."""
    from creditrl.config import ConfigError, load_config
    from creditrl.recipe.build import policy_loss_from_config
    from creditrl.recipe.resolve import resolve_config

    twice = f'loss.terms=[{{path: "{USER_TERM}", coef: 0.1}}, {{path: "{USER_TERM}", coef: 0.2}}]'
    with pytest.raises(ConfigError, match=r"^loss.terms\[1\]: loss term 'length_penalty' is already given in "
                                          r"loss.terms\[0\]; each term is applied once"):
        resolve_config(load_config(None, [twice]))
    for path, keys in (("kl", "loss.kl_coef, loss.kl_estimator"), ("creditrl.core.losses.kl:kl", "loss.kl_coef")):
        with pytest.raises(ConfigError, match=rf"^loss.terms\[0\]: '{path}' is creditrl's own loss term .* set by its "
                                              rf"keys {keys}"):
            resolve_config(load_config(None, [f'loss.terms=[{{path: "{path}", kl_coef: 0.5}}]']))
    # an optional built-in term by name is its section switched on (issue 34: verl's and TRL's spelling)
    assert resolve_config(load_config(None, ['loss.terms=[{path: stapo, tau_p: 0.01}]'])).loss["stapo"] == \
        resolve_config(load_config(None, ["loss.stapo.enabled=true", "loss.stapo.tau_p=0.01"])).loss["stapo"]

    @dataclasses.dataclass(frozen=True)
    class AnchorOptions:
        coef: float = dataclasses.field(default=0.1, metadata={"help": "weight"})

    @register_loss_term("anchor", options=AnchorOptions, stage="penalty", needs=("ref_logp",))
    def anchor(state, options):
        return state.add_token_loss(options.coef * (state.logp - state.ref_logp).square())

    anchor.__module__, anchor.__qualname__ = "test_loss_terms", "anchor"
    globals()["anchor"] = anchor
    try:
        cfg = resolve_config(load_config(None, ['loss.terms=[{path: "test_loss_terms:anchor"}]']))
        assert policy_loss_from_config(cfg).needs_reference
        assert not policy_loss_from_config(resolve_config(load_config(None, []))).needs_reference
    finally:
        del globals()["anchor"]


def test_a_broken_user_term_or_estimator_is_named(registry):
    """Case 18: a term returning the wrong type, of the wrong signature, or whose state has the wrong
    shape, and an estimator raising KeyError, gave raw AttributeError/TypeError/KeyError. Each is an
    error naming the plug-in (its own error chained); a ValueError (bad input) passes as it is."""
    from creditrl import compute_advantages, register_estimator
    from creditrl.utils.imports import PluginError

    @dataclass(frozen=True)
    class Opts:
        coef: float = field(default=0.1, metadata={"help": "weight"})

    with pytest.raises(TypeError, match=r"^loss term 'two_args': .* must take \(state, options\), its signature is "
                                        r"\(state\)"):
        register_loss_term("two_args", options=Opts, stage="penalty")(lambda state: state)
    register_loss_term("returns_tensor", options=Opts, stage="penalty")(lambda state, options: state.token_loss)
    register_loss_term("wrong_shape", options=Opts, stage="penalty")(
        lambda state, options: dataclasses.replace(state, token_loss=state.token_loss.sum(1)))
    register_loss_term("raises", options=Opts, stage="penalty")(lambda state, options: state.no_such_field)
    register_loss_term("refuses", options=Opts, stage="penalty")(
        lambda state, options: (_ for _ in ()).throw(ValueError("coef: not today")))
    logp, old, adv, mask, _ = batch(1)
    for name, message in (("returns_tensor", r"expected fn\(state, options\) to return a LossState .* got Tensor"),
                          ("wrong_shape", r"expected state.token_loss of shape \[5, 8\] \(\[B,T\]\), got \[5\]"),
                          ("raises", r"raised AttributeError: .*no_such_field")):
        with pytest.raises(PluginError, match=rf"^loss term '{name}' \(test_loss_terms:.*\)[: ]+{message}"):
            policy_loss(logp, old, adv, mask, terms={name: None})
    with pytest.raises(ValueError, match="^coef: not today$"):
        policy_loss(logp, old, adv, mask, terms={"refuses": None})

    @register_estimator("keyerror_estimator")
    def keyerror_estimator(batch):
        return {}["missing"]

    try:
        with pytest.raises(PluginError, match=r"^estimator 'keyerror_estimator' \(test_loss_terms:.*\) raised KeyError: "
                                              r"'missing'") as info:
            compute_advantages("keyerror_estimator", rewards=torch.ones(2), mask=torch.ones(2, 3),
                               group=torch.zeros(2, dtype=torch.long))
        assert isinstance(info.value.__cause__, KeyError)
        with pytest.raises(TypeError, match=r"^estimator 'no_batch': .* must take the batch as its first argument"):
            register_estimator("no_batch")(lambda: None)
    finally:
        from creditrl.core.estimators.registry import _REGISTRY as ESTIMATORS
        ESTIMATORS.pop("keyerror_estimator", None)


NAN_TERM = '''from dataclasses import dataclass, field
from creditrl import register_loss_term

@dataclass(frozen=True)
class Opts:
    coef: float = field(default=0.1, metadata={"help": "weight"})

@register_loss_term("nan_penalty", options=Opts, stage="penalty")
def nan_penalty(state, options):
    return state.add_token_loss(options.coef * state.logp.log())     # log of a log-prob < 0: NaN
'''


def test_a_term_that_produces_nan_is_named(tmp_path, monkeypatch, capsys):
    """Case 19: a loss term producing NaN from finite inputs stopped the run with a message blaming the
    learning rate, rewards or logits. policy_loss names the term (and which of its outputs), and the
    trainer's stop says so instead of the generic causes."""
    from creditrl.cli import main
    from creditrl.utils.validate import NonFiniteError

    (tmp_path / "nan_term.py").write_text(NAN_TERM)
    monkeypatch.syspath_prepend(str(tmp_path))
    import nan_term

    logp, old, adv, mask, _ = batch(2)
    with pytest.raises(NonFiniteError, match=r"^policy_loss: loss term 'nan_penalty' \(nan_term:nan_penalty, coef=0.1\) "
                                             r"produced NaN/inf in token_loss from finite inputs"):
        policy_loss(logp, old, adv, mask, terms={"nan_term:nan_penalty": None})
    tiny = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
            "model.warm_start.max_steps=10", "task.options.digits=1", "rollout.prompts_per_step=2",
            "rollout.group_size=2", "rollout.max_new_tokens=4", "train.steps=3", "train.eval_every=0",
            "train.eval_problems=2", "train.save_every=0", "train.threads=1", "logging.plots=false"]
    code = main(["train", "--no-progress", *tiny, 'loss.terms=[{path: "nan_term:nan_penalty"}]',
                 f"model.cache_dir={tmp_path / 'cache'}", f"train.output_dir={tmp_path}", "train.run_name=nan"])
    err = capsys.readouterr().err
    assert code == 2 and "optim.lr" not in err, err
    assert ("training stopped at step 3: the loss or gradient was NaN/inf for 3 steps in a row, so those updates were "
            "skipped (weights unchanged): loss term 'nan_penalty' (nan_term:nan_penalty, coef=0.1) produced NaN/inf in "
            "token_loss") in err
    assert nan_term.nan_penalty


@pytest.mark.parametrize("coef", ["0.1", True])
def test_a_user_terms_options_are_typed_where_its_class_does_not_check(plugins, coef):
    """Audit #12: a user's options dataclass need not check its types; a string or a bool for a float
    option failed inside torch (a string) or counted as 1 (True). Refused by name, as built-in terms are."""
    logp = -torch.rand(2, 3, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=rf"^length_penalty.coef: expected float, got {re.escape(repr(coef))}"):
        policy_loss(logp, logp.detach(), torch.ones(2), torch.ones(2, 3),
                    terms=[{"path": f"{USER_TERM}", "coef": coef}])


def test_a_metric_given_as_a_pair_is_its_mean_with_its_count():
    """``LossState.with_metrics``: (total, count) -> total / count and the count (tensors or numbers;
    0 where the count is 0); a plain value has no count; a tuple of another length is refused."""
    logp, old, adv, mask, _ = batch(0)
    data = {"logp": logp, "old_logp": old, "ref_logp": None, "rollout_logp": None, "entropy": None, "weights": None}
    state = _initial_state(data, adv, mask)[0]
    paired = state.with_metrics(a=(torch.tensor(3.0), torch.tensor(4)), b=(2.0, 0), c=torch.tensor(0.5))
    assert float(paired.metrics["a"]) == 0.75 and int(paired.metric_counts["a"]) == 4
    assert float(paired.metrics["b"]) == 0.0 and int(paired.metric_counts["b"]) == 0
    assert float(paired.metrics["c"]) == 0.5 and "c" not in paired.metric_counts
    assert "a" not in paired.with_metrics(a=torch.tensor(1.0)).metric_counts      # replaced by a plain value
    with pytest.raises(TypeError, match=r"with_metrics: d: expected a 0-d tensor or a \(total, count\) pair"):
        state.with_metrics(d=(1.0, 2.0, 3.0))
