"""``compose``: the three spellings of a loss (the config's nested section, the library's keywords, a
framework's flat fields) give the same PolicyLoss, and ``to_config`` writes it back."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from creditrl.core.losses import Fields, PolicyLoss, StapoOptions, TraceOptions, compose
from creditrl.utils.options import OptionError

# one loss, three ways: clip bounds, token-sum aggregation, a k1 KL, STAPO and a GRPO-λ trace
NESTED = {"clip_low": 0.1, "clip_high": 0.3, "agg": "seq-mean-token-sum", "kl_coef": 0.05, "kl_estimator": "k1",
          "stapo": {"enabled": True, "tau_p": 0.01}, "trace": {"enabled": True, "lam": 0.9}}
KEYWORDS = dict(clip_low=0.1, clip_high=0.3, agg="seq-mean-token-sum", kl_coef=0.05, kl_estimator="k1",
                stapo=StapoOptions(tau_p=0.01), trace=TraceOptions(lam=0.9))
FIELDS = {"clip_low": 0.1, "clip_high": 0.3, "agg": "seq-mean-token-sum", "kl_coef": 0.05, "kl_estimator": "k1",
          "stapo": True, "stapo_tau_p": 0.01, "trace_lam": 0.9}


def test_the_three_spellings_give_one_loss():
    nested, keywords, fields = compose(NESTED), compose(**KEYWORDS), compose(Fields(FIELDS.get))
    assert nested.chosen == keywords.chosen == fields.chosen
    assert [t.name for t, _ in nested.terms] == [t.name for t, _ in fields.terms]
    assert nested.options_of("stapo") == StapoOptions(tau_p=0.01)
    # "the same PolicyLoss" (README): equal by value, with equal hashes, and unequal on any option
    assert nested == keywords == fields and len({nested, keywords, fields}) == 1
    assert nested != compose({**NESTED, "clip_high": 0.31}) and nested != compose() and nested != "loss"


def test_to_config_round_trips_and_lists_every_builtin_key():
    loss = compose(NESTED)
    config = loss.to_config()
    assert compose(config).chosen == loss.chosen
    assert config["stapo"]["enabled"] is True and config["cispo"]["enabled"] is False
    assert config["clip_low"] == 0.1 and config["terms"] == []


@settings(max_examples=40, deadline=None)
@given(low=st.floats(0.01, 0.5), high=st.floats(0.01, 0.5), lam=st.floats(0.0, 1.0),
       stapo=st.booleans(), agg=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]))
def test_spellings_agree_for_any_options(low, high, lam, stapo, agg):
    nested = {"clip_low": low, "clip_high": high, "agg": agg, "trace": {"enabled": True, "lam": lam},
              "stapo": {"enabled": stapo}}
    keywords = dict(clip_low=low, clip_high=high, agg=agg, trace=TraceOptions(lam=lam), stapo=stapo)
    fields = {"clip_low": low, "clip_high": high, "agg": agg, "trace_lam": lam, "stapo": stapo}
    a, b, c = compose(nested), compose(**keywords), compose(Fields(fields.get))
    assert a.chosen == b.chosen == c.chosen and a == b == c and hash(a) == hash(c)
    assert compose(a.to_config()) == a


def test_a_trace_without_clamp_round_trips_through_yaml():
    """trace.adv_clamp is finite in every spelling (no clamp in effect: -1e30): the saved config reads back."""
    import yaml
    nested = compose({"trace": {"enabled": True, "lam": 0.5, "adv_clamp": -1e30}})
    assert nested.chosen == compose(trace=TraceOptions(lam=0.5, adv_clamp=-1e30)).chosen == \
        compose(Fields({"trace_lam": 0.5, "trace_adv_clamp": -1e30}.get)).chosen
    assert compose(yaml.safe_load(yaml.safe_dump(nested.to_config()))).chosen == nested.chosen


def test_an_optional_builtin_term_by_name_is_its_section():
    listed = compose({"terms": [{"path": "cispo"}]})
    assert listed.chosen == compose({"cispo": {"enabled": True}}).chosen == compose(terms=[{"path": "cispo"}]).chosen
    assert listed.to_config()["cispo"]["enabled"] is True and listed.to_config()["terms"] == []


def test_max_len_fills_only_an_unset_aggregation_length():
    assert compose({}, max_len=64).options_of("aggregation").max_len == 64
    assert compose({"max_len": 8}, max_len=64).options_of("aggregation").max_len == 8


def test_errors_name_the_spelling_and_key():
    with pytest.raises(OptionError, match=r"^loss.stapo: expected a mapping of the term's options \(switch it on "
                                          r"with loss.stapo.enabled=true\), got True"):
        compose({"stapo": True})
    with pytest.raises(OptionError, match=r"^loss.clip_lo: unknown key; valid keys of loss are"):
        compose({"clip_lo": 0.2})
    with pytest.raises(OptionError, match=r"^loss.trace.lam"):
        compose({"trace": {"enabled": True, "lam": "high"}})
    with pytest.raises(OptionError, match=r"^loss.terms\[0\]: 'clip' is creditrl's own loss term 'clip', always "
                                          r"part of the loss and set by its keys loss.clip_low"):
        compose({"terms": [{"path": "clip"}]})
    with pytest.raises(OptionError, match=r"^loss.terms\[0\]: loss term 'cispo' is also on as loss.cispo.enabled"):
        compose({"terms": [{"path": "cispo"}], "cispo": {"enabled": True}})
    with pytest.raises(TypeError, match=r"^compose: expected one spelling of the loss"):
        compose({"clip_low": 0.1}, clip_high=0.2)
    with pytest.raises(TypeError, match=r"^policy_loss: unknown option 'clip_lo'"):
        compose(clip_lo=0.1)
    with pytest.raises(ValueError, match=r"^stapo_tau_p: set while stapo=False"):
        compose(Fields({"stapo": False, "stapo_tau_p": 0.1}.get))
    with pytest.raises(TypeError, match=r"^stapo: expected True, False or None"):
        compose(Fields({"stapo": "false"}.get))


def test_an_empty_spelling_is_the_default_loss():
    assert compose().chosen == compose({}).chosen == PolicyLoss().chosen == compose(Fields(lambda key: None)).chosen
