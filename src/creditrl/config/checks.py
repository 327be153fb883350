"""Checks of the run's own settings (``validate``), each error naming its dotted key; the
estimator's, loss terms' and task's options are checked against their declarations by
``creditrl.recipe.resolve``."""
from __future__ import annotations

import os
from typing import Any

from creditrl.config.schema import (SIGNALS, TEMPERATURE_RANGE, Config, ConfigError, OverlongConfig,
                                    RolloutConfig)


def eval_settings(cfg: Config) -> tuple[int | None, int, list[int]]:
    """(problems, samples per problem, ks) of the held-out eval; automatic values are sized for
    the model: 128 x 8 for builtin:tiny, 64 x 4 for real models."""
    t, tiny = cfg.train, cfg.model.name == "builtin:tiny"
    problems = t.eval_problems if t.eval_problems is not None else (128 if tiny else 64)
    samples = t.eval_samples if t.eval_samples is not None else (8 if tiny else 4)
    ks = t.pass_k if t.pass_k is not None else [k for k in (1, 4, 8) if k <= samples]
    return problems, samples, ks


def _positive(key: str, value: float | None, strict: bool = True) -> None:
    if value is not None and (value <= 0 if strict else value < 0):
        raise ConfigError(f"{key}: expected a value {'>' if strict else '>='} 0, got {value!r}")


def check_run_name(key: str, name: str | None) -> None:
    """A run name is one plain path component: ``..``, ``.``, ``a/b`` or an absolute path would put
    the run (and what ``--overwrite`` deletes) outside ``train.output_dir``."""
    if name is None:
        return
    bad = (not isinstance(name, str) or name in ("", ".", "..") or "\0" in name
           or any(sep and sep in name for sep in ("/", "\\", os.sep, os.altsep)))
    if bad:
        raise ConfigError(f"{key}: expected one plain directory name under train.output_dir (no '/', '\\', '.' "
                          f"or '..'), or null for an automatic name; got {name!r}")


def check_minibatch(size: int | None, batch: int) -> None:
    """``optim.minibatch_size`` divides the step's ``batch`` responses (as verl's ppo_mini_batch_size):
    a remainder mini-batch of a few responses would take a full optimizer step on them."""
    if size is not None and size <= batch and batch % size:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        raise ConfigError(f"optim.minibatch_size: expected a divisor of the {batch} responses per step "
                          f"(rollout.prompts_per_step × rollout.group_size: {divisors}), got {size}: the last "
                          f"mini-batch would hold {batch % size} response(s) and take a full optimizer step on them")


def _check_optim(o) -> None:
    """The optimizer's bounded values: the cosine floor a fraction of the rate, Adam's betas."""
    if o.min_lr_ratio > 1:
        raise ConfigError(f"optim.min_lr_ratio: expected a value in [0, 1] (the cosine schedule's floor as a fraction "
                          f"of optim.lr), got {o.min_lr_ratio!r}")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise ConfigError(f"optim.betas: expected two values in [0, 1), got {o.betas!r}")


def _check_tiny(m) -> None:
    """``builtin:tiny``'s RoPE base and its warm start's optimizer: out of range they fail (a NaN loss,
    torch's unnamed "Invalid learning rate") or learn nothing only once the warm start runs."""
    _positive("model.tiny.rope_theta", m.tiny.rope_theta)
    _positive("model.warm_start.lr", m.warm_start.lr)
    _positive("model.warm_start.weight_decay", m.warm_start.weight_decay, strict=False)
    _positive("model.warm_start.warmup_steps", m.warm_start.warmup_steps, strict=False)


def validate(cfg: Config) -> None:
    """Reject invalid values of the run's own settings, naming the key. The estimator's, the loss
    terms' and the task's options are checked against their declarations when the run starts
    (``creditrl.recipe.resolve.resolve_config``)."""
    r, o, t = cfg.rollout, cfg.optim, cfg.train
    check_run_name("train.run_name", t.run_name)
    for key, value in [("rollout.group_size", r.group_size), ("rollout.prompts_per_step", r.prompts_per_step),
                       ("rollout.max_new_tokens", r.max_new_tokens), ("rollout.temperature", r.temperature),
                       ("optim.lr", o.lr), ("optim.epochs", o.epochs), ("optim.minibatch_size", o.minibatch_size),
                       ("optim.max_grad_norm", o.max_grad_norm), ("train.steps", t.steps),
                       ("optim.micro_batch_size", o.micro_batch_size), ("train.keep_last", t.keep_last),
                       ("train.eval_samples", t.eval_samples), ("train.eval_problems", t.eval_problems),
                       ("train.threads", t.threads), ("train.chunk_size", t.chunk_size)]:
        _positive(key, value)
    for key, value in [("rollout.max_tool_tokens", r.max_tool_tokens), ("optim.weight_decay", o.weight_decay),
                       ("optim.warmup_steps", o.warmup_steps), ("train.save_every", t.save_every),
                       ("train.eval_every", t.eval_every), ("logging.completions", cfg.logging.completions),
                       ("optim.min_lr_ratio", o.min_lr_ratio)]:
        _positive(key, value, strict=False)
    _check_optim(o)
    _check_tiny(cfg.model)
    if not TEMPERATURE_RANGE[0] <= r.temperature <= TEMPERATURE_RANGE[1]:
        raise ConfigError(f"rollout.temperature: expected a value in [{TEMPERATURE_RANGE[0]}, {TEMPERATURE_RANGE[1]}] "
                          f"(sampling RL needs a real distribution: below it the policy is ~greedy and log-ratios "
                          f"overflow), got {r.temperature!r}")
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"rollout.top_p: expected a value in (0, 1], got {r.top_p!r}")
    batch = r.prompts_per_step * r.group_size
    for key, value, limit, what in (("optim.minibatch_size", o.minibatch_size, batch, "responses per step"),
                                    ("optim.micro_batch_size", o.micro_batch_size, o.minibatch_size or batch,
                                     "responses per mini-batch")):
        if value is not None and value > limit:
            raise ConfigError(f"{key}: expected at most {limit} ({what}: rollout.prompts_per_step × "
                              f"rollout.group_size{', or optim.minibatch_size' if 'micro' in key else ''}), got {value}")
    check_minibatch(o.minibatch_size, batch)
    for key, seed in (("train.seed", t.seed), ("model.warm_start.seed", cfg.model.warm_start.seed)):
        if not 0 <= seed < 2**32:
            raise ConfigError(f"{key}: expected an integer in [0, 2**32 - 1] (numpy's seed range), got {seed}")
    for i, stop in enumerate(r.stop):
        if not stop:
            raise ConfigError(f"rollout.stop[{i}]: expected a non-empty string, got {stop!r} (an empty stop string "
                              f"matches at the start of every response and would cut each one to nothing)")
    validate_sampling_controls(r)
    samples = eval_settings(cfg)[1]
    for k in t.pass_k or []:
        if not 1 <= k <= samples:
            raise ConfigError(f"train.pass_k: each k must be in [1, train.eval_samples={samples}], got {k}")
    _distinct({"train.pass_k": t.pass_k, "logging.report_to": cfg.logging.report_to})
    if cfg.logging.diagnose_every < 0:
        raise ConfigError(f"logging.diagnose_every: expected an integer >= 0, got {cfg.logging.diagnose_every}")
    if cfg.logging.diagnose_window < 2:
        raise ConfigError(f"logging.diagnose_window: expected an integer >= 2 (its intervals are over the window's "
                          f"diagnosed steps, undefined for one), got {cfg.logging.diagnose_window}")
    if cfg.logging.diagnose_every and r.group_size < 2:
        raise ConfigError(f"logging.diagnose_every: in-training diagnosis compares estimators within each group, "
                          f"which needs rollout.group_size >= 2, got {r.group_size}")
    if cfg.logging.diagnose_every and r.prompts_per_step < 2:
        raise ConfigError(f"logging.diagnose_every: the mean gradient is estimated from pairs of a step's groups, "
                          f"which needs rollout.prompts_per_step >= 2, got {r.prompts_per_step}")
    _check_labels("logging.diagnose_estimators", cfg.logging.diagnose_estimators)


def _distinct(lists: dict[str, list | None]) -> None:
    for key, values in lists.items():
        if values and len(set(values)) != len(values):
            raise ConfigError(f"{key}: expected distinct values, got {values}")


def _check_labels(key: str, labels: list | None) -> None:
    if labels is not None and (not labels or len(set(labels)) != len(labels)):
        raise ConfigError(f"{key}: expected a non-empty list of distinct estimator names or null, got {labels}")


SWITCHES = {"model.lora": ("enabled", "model.lora.enabled=true"),
            "rollout.dynamic_sampling": ("enabled", "rollout.dynamic_sampling.enabled=true"),
            "rollout.overlong": ("buffer", "rollout.overlong.buffer > 0")}


def check_switches(layers: list[Any], cfg: Config) -> None:
    """A section that is off unless its switch is set (``SWITCHES``; the loss terms' sections:
    ``creditrl.core.losses.compose``) refuses options given while the switch is neither given in
    any layer nor on: they would do nothing. Giving the switch, even off, is an ablation and
    passes (a run's config.yaml gives every switch)."""
    for key, (switch, how) in SWITCHES.items():
        sections = [section for layer in layers if isinstance(section := _section(layer, key), dict)]
        options = [name for section in sections for name in section if name != switch]
        if options and not any(switch in section for section in sections) and not _on(cfg, key, switch):
            raise ConfigError(f"{key}.{options[0]}: given, but {key} is off ({key}.{switch} is not set), so it would "
                              f"do nothing; switch it on with {how}, or drop {key}.{options[0]}")


def _section(layer: Any, key: str) -> Any:
    for part in key.split("."):
        layer = layer.get(part) if isinstance(layer, dict) else None
    return layer


def _on(cfg: Config, key: str, switch: str) -> bool:
    section = cfg
    for part in key.split("."):
        section = getattr(section, part)
    return bool(getattr(section, switch))


def validate_sampling_controls(r: RolloutConfig) -> None:
    """rollout.overlong and rollout.dynamic_sampling (the buffer against an automatic
    max_new_tokens is checked once the tokenizer has resolved it, ``check_overlong``)."""
    o, d = r.overlong, r.dynamic_sampling
    if o.buffer < 0:
        raise ConfigError(f"rollout.overlong.buffer: expected an integer >= 0 (0 = off), got {o.buffer}")
    if not o.penalty > 0:
        raise ConfigError(f"rollout.overlong.penalty: expected a value > 0, got {o.penalty!r}")
    check_overlong(o, r.max_new_tokens)
    if d.max_rounds < 1:
        raise ConfigError(f"rollout.dynamic_sampling.max_rounds: expected an integer >= 1 (the first round "
                          f"included), got {d.max_rounds}")
    if d.signal == "reward/overlong" and not o.buffer:
        raise ConfigError("rollout.dynamic_sampling.signal: 'reward/overlong' is the overlong penalty, which is off "
                          "(rollout.overlong.buffer=0); expected another signal or rollout.overlong.buffer > 0")
    if d.signal not in SIGNALS and not (d.signal.startswith("reward/") and len(d.signal) > len("reward/")):
        raise ConfigError(f"rollout.dynamic_sampling.signal: expected one of {list(SIGNALS)} or 'reward/<name>' (a "
                          f"reward component as logged), got {d.signal!r}")
    if d.enabled and r.group_size < 2:
        raise ConfigError(f"rollout.dynamic_sampling.enabled: drops the groups whose signal does not vary, which "
                          f"needs rollout.group_size >= 2 (a group of 1 never varies, so every group would be "
                          f"dropped); got rollout.group_size={r.group_size}")


def check_overlong(o: OverlongConfig, max_new_tokens: int | None) -> None:
    """The overlong buffer fits in the response budget (verl: max_resp_len >= overlong_buffer.len)."""
    if o.buffer and max_new_tokens is not None and o.buffer > max_new_tokens:
        raise ConfigError(f"rollout.overlong.buffer: expected at most rollout.max_new_tokens={max_new_tokens} (the "
                          f"penalty starts max_new_tokens - buffer tokens in), got {o.buffer}")


def run_inputs(cfg: Config) -> dict[str, Any]:
    """What a run reads from disk, by config key: the model (a local directory), the model cache and
    every task option (a data file; values that name no path are skipped by the caller)."""
    return {"model.name": cfg.model.name, "model.cache_dir": cfg.model.cache_dir,
            **{f"task.options.{k}": v for k, v in cfg.task.options.items()}}
