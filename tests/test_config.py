"""Config: defaults, YAML + dotted overrides, typed values, clear errors, invalid combinations."""
from __future__ import annotations

import dataclasses
import random
import re
import sys
from importlib import resources

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from creditrl.config import (Config, ConfigError, config_from_dict, config_to_dict, flat_items, load_config,
                             parse_override, save_config)
from creditrl.recipe.resolve import resolve_config


def resolved(overrides=(), path=None):
    return resolve_config(load_config(path, list(overrides)))


def test_packaged_default_yaml_equals_declared_defaults():
    """Every key at its declared default, the diagnose section's too, and the file is what
    `creditrl config --yaml` prints (so a new key cannot be left out of it)."""
    from creditrl.config import DiagnoseConfig, load_diagnose_config
    from creditrl.recipe.reference import default_yaml

    path = resources.files("creditrl") / "configs" / "default.yaml"
    assert config_to_dict(resolved(path=str(path))) == config_to_dict(resolve_config(Config()))
    assert load_diagnose_config(str(path))[1] == DiagnoseConfig()
    assert path.read_text() == default_yaml(), "regenerate it: creditrl config --yaml > src/creditrl/configs/default.yaml"
    data = yaml.safe_load(path.read_text())
    assert data["algorithm"]["options"] == {}   # another estimator would refuse the default one's options
    assert set(data["loss"]) >= {"entropy_bonus", "cispo", "gspo", "sapo", "top_entropy", "delta_l_norm", "terms"}
    assert set(data["logging"]) == {f.name for f in dataclasses.fields(Config().logging)}
    again = resolve_config(load_config(str(path), ["algorithm.estimator=grpo"]))   # the copy-and-edit case
    assert again.algorithm.estimator == "grpo"


@pytest.mark.parametrize("override, message", [
    ("loss.entropy_bonus.coef=0.1", r"loss.entropy_bonus.coef: given, but the entropy_bonus term is off "
                                    r"\(loss.entropy_bonus.enabled is not set\), so it would do nothing; switch it on "
                                    r"with loss.entropy_bonus.enabled=true, or drop loss.entropy_bonus.coef"),
    ("loss.trace.lam=0.5", r"loss.trace.lam: given, but the trace term is off"),
    ("model.lora.r=8", r"model.lora.r: given, but model.lora is off \(model.lora.enabled is not set\)"),
    ("rollout.dynamic_sampling.max_rounds=3", r"rollout.dynamic_sampling.max_rounds: given, but "
                                              r"rollout.dynamic_sampling is off"),
    ("rollout.overlong.penalty=2", r"rollout.overlong.penalty: given, but rollout.overlong is off "
                                   r"\(rollout.overlong.buffer is not set\), so it would do nothing; switch it on "
                                   r"with rollout.overlong.buffer > 0"),
])
def test_options_of_a_section_never_switched_on_are_refused(override, message, tmp_path):
    """Case (audit): `loss.entropy_bonus.coef=0.1` ran with no bonus and config.yaml said coef 0.0.
    An option of a section whose switch is neither given nor on does nothing, so it is refused, from
    the command line and from a YAML file alike. Switched on, the same option is taken; an explicit
    switch off over it (an ablation: compare's or diagnose's rows, a run's config.yaml) passes."""
    with pytest.raises(ConfigError, match=message):
        resolved([override])
    key, value = override.split("=")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(load_nested(key, yaml.safe_load(value))))
    with pytest.raises(ConfigError, match=message):
        resolved(path=str(path))
    section = key.rsplit(".", 1)[0]
    on, off = ("buffer=2", "buffer=0") if "overlong" in key else ("enabled=true", "enabled=false")
    resolved([f"{section}.{on}", override])
    resolved([f"{section}.{off}"], path=str(path))
    resolved([f"{section}.{off}", override])
    resolved([override, f"{section}.{off}"])     # the layer order does not matter


def load_nested(key: str, value) -> dict:
    """``a.b.c`` and its value as the nested mapping a YAML file would hold."""
    out = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def test_packaged_reasoning_gym_config_loads_and_builds_its_task():
    """``--config smollm2-reasoning-gym`` resolves, and its task builds (no model is loaded): a held-out
    set of exactly the evaluated problems, prompts ending in the prefill, training problems off it."""
    pytest.importorskip("reasoning_gym")
    from creditrl.recipe.build import build_task

    cfg = resolve_config(load_config("smollm2-reasoning-gym"))
    assert cfg.model.name == "builtin:smollm2-135m" and cfg.task.name == "reasoning_gym"
    assert cfg.task.options["dataset"] == "basic_arithmetic" and cfg.rollout.stop == ["</answer>"]
    assert cfg.train.precision == "auto" and cfg.rollout.max_new_tokens == 12
    task = build_task(cfg)
    test = task.test_set()
    assert len(test) == cfg.task.options["test_size"] == cfg.train.eval_problems
    assert all(p.meta["dataset"] == "basic_arithmetic" for p in test)
    assert test[0].prompt[-1] == {"role": "assistant", "content": "<answer>"}   # chat prompt, reply prefilled
    held_out = {p.meta["question"] for p in test}
    rng = random.Random(0)
    assert not any(task.sample(rng).meta["question"] in held_out for _ in range(200))
    right = test[0]
    assert task.reward(right, f"{right.answer}</answer>") == 1.0 and task.reward(right, "x</answer>") == 0.0


def test_overrides_are_typed_and_nested():
    cfg = resolved(["optim.lr=1e-5", "rollout.group_size=4", "train.pass_k=[1,2]",
                    "loss.stapo.enabled=true", "loss.stapo.tau_p=1e-3", "task.options.digits=3", "loss.clip_c=3",
                    "algorithm.estimator=maxpo", "algorithm.options.k=2", "algorithm.options.normalize=std"])
    assert cfg.optim.lr == 1e-5 and isinstance(cfg.optim.lr, float)
    assert cfg.rollout.group_size == 4 and cfg.train.pass_k == [1, 2]
    assert cfg.loss["stapo"]["enabled"] is True and cfg.loss["stapo"]["tau_p"] == 1e-3
    assert cfg.task.options == {"digits": 3}
    assert cfg.loss["clip_c"] == 3.0 and isinstance(cfg.loss["clip_c"], float)
    assert cfg.algorithm.options == {"k": 2, "normalize": "std", "eps": 1e-6}     # no gamma: maxpo reads R


def test_old_algorithm_keys_are_read_as_options():
    """Configs and run directories written before ``algorithm.options`` keep working."""
    cfg = load_config(None, ["algorithm.estimator=maxpo", "algorithm.k=3", "algorithm.eps=null"])
    assert cfg.algorithm.options == {"k": 3}
    old = config_to_dict(Config())
    old["algorithm"] = {"estimator": "grpo", "gamma": None, "eps": 1e-4, "k": None, "normalize": None}
    assert config_from_dict(old).algorithm.options == {"eps": 1e-4}


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 3.0e-5\ntrain:\n  steps: 7\n")
    cfg = load_config(path, ["train.steps=9"])
    assert cfg.optim.lr == 3e-5 and cfg.train.steps == 9


def test_saved_config_round_trips(tmp_path):
    cfg = resolved(["loss.trace.enabled=true", "loss.trace.lam=0.5", "rollout.max_new_tokens=12"])
    save_config(cfg, tmp_path / "config.yaml")
    again = config_from_dict(yaml.safe_load((tmp_path / "config.yaml").read_text()))
    assert config_to_dict(again) == config_to_dict(cfg) == config_to_dict(resolve_config(again))


@pytest.mark.parametrize("override, message", [
    ("optim.lrr=1", "optim.lrr: unknown key; valid keys of optim are ['lr'"),
    ("nope.x=1", "nope: unknown key; valid keys of config are ['model'"),
    ("loss.agg=mean", "loss.agg: unknown value 'mean'; valid values are ['token-mean'"),
    ("loss.bogus=1", "loss.bogus: unknown key; valid keys of loss are"),
    ("loss.stapo.bogus=1", "loss.stapo: unknown option(s) ['bogus']"),
    ("algorithm.options.k=2", "algorithm.options: unknown option(s) ['k']; valid options are ['gamma', 'leave_one_out']"),
    ("optim.schedule=linear", "optim.schedule: unknown value 'linear'; valid values are ['constant', 'cosine']"),
    ("optim.lr=fast", "optim.lr: expected float, got 'fast'"),
    ("rollout.group_size=2.5", "rollout.group_size: expected int, got 2.5"),
    ("train.deterministic=maybe", "train.deterministic: expected bool"),
    ("rollout.group_size=0", "rollout.group_size: expected a value > 0, got 0"),
    ("rollout.top_p=0", "rollout.top_p: expected a value in (0, 1]"),
    ("optim.lr=-1", "optim.lr: expected a value > 0"),
    ("loss.clip_c=0.5", "loss.clip_c: expected a value in (1, inf], got 0.5"),
    ("loss.stapo.pool=all", "loss.stapo.pool: unknown value 'all'"),
    ("loss.trace.lam=2", "loss.trace.lam: expected a value in [0, 1]"),
    ("model.tiny.num_heads=3", "model.tiny.num_heads: expected a divisor of hidden_size"),
    ("train.pass_k=[1,16]", "train.pass_k: each k must be in [1, train.eval_samples=8], got 16"),
    ("task.name=sudoku", "task.name: unknown task 'sudoku'; valid tasks are ['addition'"),
    ("algorithm.estimator=ppo", "algorithm.estimator: unknown estimator 'ppo'; valid estimators are"),
    ("algorithm.k=2", "algorithm.options: unknown option(s) ['k']"),
    ("train.device=tpu", "train.device: unknown value 'tpu'; valid values are ['auto', 'cpu', 'cuda']"),
    ("optim.lr", "expected key=value"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises((ConfigError, ValueError)) as err:
        resolved([override])
    assert message in str(err.value)


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.estimator=maxpo"], "algorithm.options.k: required"),
    (["algorithm.estimator=maxpo", "algorithm.options.k=8"], "maxpo needs 1 <= k < rollout.group_size (=8)"),
    (["algorithm.estimator=maxpo", "algorithm.options.k=4", "rollout.group_size=4"],
     "maxpo needs 1 <= k < rollout.group_size (=4)"),
    (["algorithm.estimator=pkpo", "algorithm.options.k=9"], r"algorithm.options.k: pkpo needs 2 <= k <= rollout.group_size"),
    (["algorithm.estimator=maxk_bon", "algorithm.options.k=2", "algorithm.options.normalize=std"],
     "algorithm.options: unknown option(s) ['normalize']"),
    (["loss.stapo.enabled=true", "optim.micro_batch_size=4"], "optim.micro_batch_size: ['stapo'] choose their tokens"),
    (["loss.top_entropy.enabled=true", "optim.micro_batch_size=4"], "['top_entropy'] choose their tokens from the whole"),
    (["loss.kl_cov.enabled=true", "optim.micro_batch_size=8"], "['kl_cov'] choose their tokens from the whole mini-batch "
     "(64 responses"),
    (["loss.clip_cov.enabled=true", "optim.micro_batch_size=8"], "['clip_cov'] choose their tokens"),
    (["logging.grad_noise_scale=true", "optim.epochs=2"], "logging.grad_noise_scale: measured on the on-policy"),
    (["train.precision=fp16", "train.device=cpu"], "train.precision: fp16 needs CUDA"),
    (["optim.minibatch_size=7"], "optim.minibatch_size: expected a divisor of the 64 responses per step "
     "(rollout.prompts_per_step × rollout.group_size: [1, 2, 4, 8, 16, 32, 64]), got 7: the last mini-batch would "
     "hold 1 response(s)"),
    (["optim.minibatch_size=65"], "optim.minibatch_size: expected at most 64"),
    (["algorithm.estimator=grpo", "algorithm.options.gamma=0.9"], "grpo uses the total reward R"),
    (["algorithm.estimator=opo", 'algorithm.options.leave_one_out="false"'], "algorithm.options.leave_one_out: expected bool"),
    (["algorithm.estimator=otb", "algorithm.options.leave_one_out=1"], "algorithm.options.leave_one_out: expected bool"),
])
def test_invalid_combinations(overrides, message):
    with pytest.raises(ConfigError) as err:
        resolved(overrides)
    assert message in str(err.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "cdir").mkdir()
    with pytest.raises(ConfigError, match=r"config file: '.*cdir' is a directory, not a YAML file"):
        load_config(tmp_path / "cdir")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(listy)


def test_config_reference_is_generated_from_the_declarations():
    """docs/config.md is exactly `creditrl config`'s output, which lists every key and option."""
    from pathlib import Path

    from creditrl.recipe import reference
    doc = Path(__file__).resolve().parents[1] / "docs" / "config.md"
    text = reference.markdown()
    assert doc.read_text() == text, "docs/config.md is stale: regenerate it with `creditrl config > docs/config.md`"
    missing = [key for key, _, _ in flat_items(Config()) if f"`{key}`" not in text]
    assert not missing and "`loss.stapo.tau_p`" in text and "`algorithm.options.leave_one_out`" in text


def test_every_key_has_help_and_is_listed_for_help():
    from creditrl.recipe import reference
    keys = {key: (default, text) for key, default, text in flat_items(Config())}
    assert keys["optim.lr"][0] == Config().optim.lr and "model.warm_start.target_accuracy" in keys
    assert not [k for k, (_, text) in keys.items() if not text], "every config key needs its help text"
    lines = "\n".join(reference.help_lines())
    assert "loss.trace.lam" in lines and "algorithm.options.* (maxpo)" in lines


@settings(max_examples=30, deadline=None)
@given(lr=st.floats(1e-9, 1.0), steps=st.integers(1, 10_000), estimator=st.sampled_from(["grpo", "rloo", "otb"]))
def test_override_values_round_trip(lr, steps, estimator):
    cfg = load_config(None, [f"optim.lr={lr!r}", f"train.steps={steps}", f"algorithm.estimator={estimator}"])
    assert (cfg.optim.lr, cfg.train.steps, cfg.algorithm.estimator) == (lr, steps, estimator)


def test_parse_override_builds_nested_mapping():
    assert parse_override("a.b.c=5") == {"a": {"b": {"c": 5}}}
    assert parse_override("a=hello world") == {"a": "hello world"}
    assert parse_override("a=") == {"a": None}


def test_a_user_module_that_raises_on_import_is_named_with_its_key(tmp_path, monkeypatch):
    """Case 17: a user's module that raises on import (estimator, loss term, checker, task) gave a raw
    traceback. The error names the config key and the import path and keeps the module's own error
    (type, message, file and line; chained for CREDITRL_DEBUG)."""
    from creditrl.recipe.build import build_task
    from creditrl.recipe.resolve import resolve_config

    (tmp_path / "broken_plugin.py").write_text("import math\nraise RuntimeError('no GPU found')\n")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    own = (r"importing module 'broken_plugin' of 'broken_plugin:fn' raised RuntimeError: no GPU found \(at .*broken_plugin.py:2\)$")
    for overrides, key in ((["algorithm.estimator=broken_plugin:fn"], "algorithm.estimator"),
                           (['loss.terms=[{path: "broken_plugin:fn"}]'], r"loss.terms\[0\].path"),
                           (["task.name=broken_plugin:fn"], "task.name"),
                           (["task.name=jsonl", f"task.options.path={data}", "task.options.checker=broken_plugin:fn"],
                            "task.options.checker")):
        with pytest.raises(ValueError, match=rf"^{key}: {own}") as info:
            build_task(resolve_config(load_config(None, overrides)))
        causes, err = [], info.value
        while err is not None:
            causes, err = causes + [err], err.__cause__
        assert isinstance(causes[-1], RuntimeError), key       # the module's own error, in the chain
        sys.modules.pop("broken_plugin", None)


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.options.gamma=2"], r"^algorithm.options.gamma: expected a value in \[0, 1\], got 2.0$"),
    (["algorithm.estimator=grpo", "algorithm.options.eps=0"], r"^algorithm.options.eps: expected a value in \(0, "),
    (["algorithm.estimator=maxpo", "algorithm.options.k=3", "rollout.group_size=2"],
     r"^algorithm.options.k: maxpo needs 1 <= k < rollout.group_size \(=2\), got k=3$"),
    (["optim.min_lr_ratio=5"], r"^optim.min_lr_ratio: expected a value in \[0, 1\] .*got 5.0$"),
    (["rollout.dynamic_sampling.enabled=true", "rollout.dynamic_sampling.signal=reward/overlong"],
     r"^rollout.dynamic_sampling.signal: 'reward/overlong' is the overlong penalty, which is off"),
    (["logging.report_to=[jsonl,wandb]", "logging.tensorboard=true"],
     r"^logging.tensorboard: set together with logging.report_to; keep only report_to$"),
])
def test_values_that_would_misbehave_are_refused_naming_their_key(overrides, message):
    """From an independent audit: an estimator option's error names algorithm.options.<key> (it read as
    rollout.group_size's), a cosine floor above the rate raised it 4.6x, a dynamic-sampling signal of a
    penalty that is off failed after the step-0 eval, and the legacy tensorboard flag in a later layer
    silently replaced report_to (wandb dropped)."""
    with pytest.raises(ConfigError, match=message):
        resolve_config(load_config(None, overrides))


def test_an_unset_max_len_is_recorded_as_the_trainer_composes_it():
    """seq-mean-token-sum-norm's M is rollout.max_new_tokens where max_len is unset: config.yaml records
    it, so the loss composed from the record is the one trained (it said null, i.e. the padded length)."""
    from creditrl.core.losses import compose
    from creditrl.recipe.build import policy_loss_from_config
    cfg = resolve_config(load_config(None, ["loss.agg=seq-mean-token-sum-norm", "rollout.max_new_tokens=20"]))
    assert cfg.loss["max_len"] == 20
    assert compose(cfg.loss) == policy_loss_from_config(cfg).loss
    assert resolve_config(load_config(None, ["loss.agg=seq-mean-token-sum-norm", "rollout.max_new_tokens=20",
                                             "loss.max_len=8"])).loss["max_len"] == 8


@pytest.mark.parametrize("override, message", [
    ("model.tiny.rope_theta=0", "model.tiny.rope_theta: expected a value > 0, got 0.0"),
    ("model.warm_start.lr=-1", "model.warm_start.lr: expected a value > 0, got -1.0"),
    ("model.warm_start.lr=0", "model.warm_start.lr: expected a value > 0, got 0.0"),
    ("model.warm_start.weight_decay=-1", "model.warm_start.weight_decay: expected a value >= 0, got -1.0"),
    ("model.warm_start.warmup_steps=-5", "model.warm_start.warmup_steps: expected a value >= 0, got -5"),
    ("train.pass_k=[1,1]", "train.pass_k: expected distinct values, got [1, 1]"),
    ("logging.report_to=[jsonl,jsonl]", "logging.report_to: expected distinct values, got ['jsonl', 'jsonl']"),
    ("train.steps=3.0", "train.steps: expected int, got 3.0; write 3"),
    ("rollout.group_size=4.5", "rollout.group_size: expected int, got 4.5"),
])
def test_the_tiny_model_warm_start_and_whole_number_floats_are_refused_naming_the_key(override, message):
    """Caught here, before the warm start: there a zero RoPE base diverged under another key's name,
    a negative rate raised torch's unnamed error and a zero one trained 2,000 steps for nothing."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolved([override])


def test_an_estimators_int_option_refuses_a_float():
    with pytest.raises(ValueError, match=r"algorithm.options.k: expected int, got 4.0; write 4"):
        resolved(["algorithm.estimator=maxpo", "algorithm.options.k=4.0"])


@pytest.mark.parametrize("raw", ["007", "2024-01-01", "on", "1.10", "0x1F", "1_000", "+1", ".5"])
def test_a_string_key_keeps_the_text_as_typed_on_the_command_line(raw):
    assert load_config(None, [f"train.run_name={raw}"]).train.run_name == raw
    assert load_config(None, [f"model.name={raw}"]).model.name == raw
    assert load_config(None, ["train.run_name=null"]).train.run_name is None
    assert load_config(None, ["train.steps=7"]).train.steps == 7            # an int key reads YAML as before


def test_a_yaml_file_value_that_is_no_string_for_a_string_key_asks_for_quotes(tmp_path):
    (tmp_path / "c.yaml").write_text("train:\n  run_name: 1.10\n")
    with pytest.raises(ConfigError, match=r"train.run_name: expected a string, got 1.1 \(float\); quote it to keep "
                                          r"the text as written: run_name: \"...\" in YAML"):
        load_config(tmp_path / "c.yaml")
    (tmp_path / "c.yaml").write_text("train:\n  run_name: '007'\n")
    assert load_config(tmp_path / "c.yaml").train.run_name == "007"


def test_yaml_merge_keys_are_defaults_the_mappings_own_keys_override(tmp_path):
    (tmp_path / "c.yaml").write_text("train:\n  <<: {steps: 7, seed: 3}\n  steps: 2\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert (cfg.train.steps, cfg.train.seed) == (2, 3)
    (tmp_path / "c.yaml").write_text("train:\n  <<: {steps: 7}\n  steps: 2\n  steps: 3\n")
    with pytest.raises(ConfigError, match="key 'steps' appears twice"):
        load_config(tmp_path / "c.yaml")


def test_an_option_under_its_old_and_current_name_at_once_is_refused(tmp_path):
    """algorithm.gamma (the old place) beside algorithm.options.gamma: the old one silently won."""
    (tmp_path / "c.yaml").write_text("algorithm: {gamma: 0.5, options: {gamma: 0.9}}\n")
    with pytest.raises(ConfigError, match=r"algorithm.gamma: set together with algorithm.options.gamma"):
        load_config(tmp_path / "c.yaml")
    (tmp_path / "c.yaml").write_text("algorithm: {gamma: 0.5}\n")
    assert load_config(tmp_path / "c.yaml").algorithm.options == {"gamma": 0.5}


def test_the_reference_gives_every_run_settings_type():
    from creditrl.recipe.reference import config_section, diagnose_section
    rows = [line for line in (config_section() + diagnose_section()).splitlines() if line.startswith("| `")]
    untyped = [row.split("|")[1] for row in rows if not row.split("|")[3].strip()]
    assert len(rows) > 80 and not untyped, untyped
    assert "| `optim.betas` | `[0.9, 0.999]` | list of float |" in config_section()


@pytest.mark.parametrize("argv, message", [
    (["--train.steps=5"], "unrecognized argument --train.steps=5: config keys take no dashes; write train.steps=5"),
    (["--optim.lr"], "write optim.lr=VALUE"),
])
def test_the_command_line_names_a_dashed_config_key(argv, message, capsys):
    from creditrl.cli import main
    with pytest.raises(SystemExit) as stop:
        main(["train", *argv])
    assert stop.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("raw, value, base", [("010", 8, "octal"), ("-012", -10, "octal"), ("1:30", 90, "base 60")])
def test_a_yaml_11_integer_that_reads_as_another_number_is_refused(raw, value, base, tmp_path):
    """YAML 1.1 reads train.steps=010 as 8 and 1:30 as 90: refused, naming both; a string key keeps the text."""
    message = f"YAML 1.1 reads {raw} as {value} ({base}); write {value}"
    with pytest.raises(ConfigError, match=re.escape(f"train.steps: {message}")):
        load_config(None, [f"train.steps={raw}"])
    (tmp_path / "c.yaml").write_text(f"train:\n  steps: {raw}\n")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(tmp_path / "c.yaml")
    assert load_config(None, [f"train.run_name={raw.replace(':', '-')}"]).train.run_name == raw.replace(":", "-")
    assert load_config(None, ["train.steps=0x1F"]).train.steps == 31         # hexadecimal says what it is


def test_a_merged_mapping_that_merges_another_is_no_key_named_twice(tmp_path):
    """b merges a, which merges its own defaults: flattening b rewrites a's node before a is built."""
    from creditrl.config import read_yaml
    import yaml as pyyaml
    text = "outer:\n  a: &o {<<: {k: 1}, k: 2}\nb: {<<: *o}\n"
    (tmp_path / "c.yaml").write_text(text)
    assert read_yaml(tmp_path / "c.yaml") == pyyaml.safe_load(text)
