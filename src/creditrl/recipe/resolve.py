"""A config checked against everything the library declares, before any model or data loads.

``resolve_config`` checks the estimator's options against its signature, the loss options against
the loss terms' dataclasses, the task's options against its parameters, and the combinations, and
returns the config with every declared option filled in: the complete record a run saves.
``creditrl.recipe.build`` then turns it into components.
"""
from __future__ import annotations

import dataclasses
import re

import torch

from creditrl.config import Config, ConfigError
from creditrl.core.estimators import check_group_size, compute_advantages
from creditrl.core.estimators.labels import label_options
from creditrl.core.estimators.registry import get_estimator
from creditrl.core.losses import PolicyLoss, compose
from creditrl.runtime.precision import UNTIMED_MODELS, Precision
from creditrl.tasks import task_options
from creditrl.utils.options import OptionError


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device: 'cuda' requested but no CUDA device is available; use 'cpu' or 'auto'")
    return torch.device(name)


def precision_of(cfg: Config) -> Precision:
    """The run's ``Precision``, checked against its device. ``auto`` stays unresolved (the trainer
    times the model when a run starts, ``trainer.precision``) except for the models it does not
    time (builtin:tiny: fp32)."""
    name = cfg.train.precision
    precision = Precision("fp32" if name == "auto" and cfg.model.name in UNTIMED_MODELS else name)
    precision.check_device(resolve_device(cfg.train.device))
    return precision


def estimator_from_config(cfg: Config) -> tuple[str, dict, bool]:
    """(estimator name, its options with defaults filled, whether it needs energies)."""
    try:
        spec = get_estimator(cfg.algorithm.estimator)
    except ValueError as err:
        raise ConfigError(f"algorithm.estimator: {str(err).removeprefix('name: ').removeprefix('estimator: ')}"
                          ) from err
    options = spec.resolve_options(cfg.algorithm.options, "algorithm.options", strict=False)
    return cfg.algorithm.estimator, options, spec.needs_energy


def _check_estimator(cfg: Config, options: dict) -> None:
    """Run the estimator on one dummy group of ``rollout.group_size`` so any option/size combination
    it rejects fails now, naming the config keys; a group of 1 that learns nothing is refused."""
    name, g = cfg.algorithm.estimator, cfg.rollout.group_size
    try:
        singles_learn = check_group_size(name, options, g, key="rollout.group_size")
    except ValueError as err:
        message = str(err)
        # an option's own error ("gamma: expected ...", "grpo.eps: expected ...", maybe after the group's context)
        option = re.search(r"(?:^|: )(?:\w+\.)?(\w+): (expected .*)$", message, re.S)
        if option and option.group(1) in options:
            raise ConfigError(f"algorithm.options.{option.group(1)}: {option.group(2)}") from None
        raise ConfigError(f"algorithm.options.{message}" if message.startswith("k: ") else
                          f"algorithm (estimator={name!r}, options={options}): {message}") from None
    if g == 1 and not singles_learn:
        raise ConfigError(f"rollout.group_size: 1 response per prompt gives estimator {name!r} advantage 0 for "
                          f"every token (it compares responses within a group), so nothing would be learned; use "
                          f"rollout.group_size >= 2 or algorithm.estimator=reinforce")
    refusal = overlong_refusal(cfg, name, options)
    if refusal:
        raise ConfigError(f"{refusal}; set rollout.overlong.buffer=0 or choose another estimator")


def overlong_refusal(cfg: Config, name: str, options: dict) -> str | None:
    """Why estimator ``name`` refuses the negative rewards ``rollout.overlong``'s penalty gives (maxrl,
    passk_chen: rewards >= 0 or 0/1), from one dummy group of ``rollout.group_size``; None when it takes
    them or the penalty is off."""
    overlong, g = cfg.rollout.overlong, cfg.rollout.group_size
    if not overlong.buffer:
        return None
    rewards = (torch.arange(g) % 2).float()
    rewards[0] = -overlong.penalty
    try:
        compute_advantages(name, rewards=rewards, mask=torch.ones(g, 2), group=torch.zeros(g, dtype=torch.long),
                           energy=torch.ones(g, 2), **options)
    except ValueError as err:
        return (f"rollout.overlong.buffer={overlong.buffer}: the overlong penalty makes rewards negative (down to "
                f"-{overlong.penalty:g}), which estimator {name!r} refuses ({err})")
    return None


def _check_task(cfg: Config) -> None:
    """The task's name and options against its declaration (its parameters), before any data is read."""
    try:
        declared = task_options(cfg.task.name)
    except ValueError as err:
        raise ConfigError(f"task.name: {str(err).removeprefix('task: ').removeprefix('task.name: ')}") from err
    if declared is None:                          # a user's factory taking **kwargs: anything goes
        return
    unknown = sorted(set(cfg.task.options) - set(declared))
    if unknown:
        raise ConfigError(f"task.options: unknown option(s) {unknown} for task {cfg.task.name!r}; valid options are "
                          f"{sorted(declared)}")


def _check_combinations(cfg: Config, loss: PolicyLoss) -> None:
    """Settings that are each valid but do not work together."""
    o, r = cfg.optim, cfg.rollout
    batch = r.prompts_per_step * r.group_size
    minibatch = min(o.minibatch_size or batch, batch)
    wide = [term.name for term, options in loss.terms if term.batch_wide and term.active(options)]
    if wide and o.micro_batch_size is not None and o.micro_batch_size < minibatch:
        raise ConfigError(f"optim.micro_batch_size: {wide} choose their tokens from the whole mini-batch "
                          f"({minibatch} responses: a quantile, a top-k), which a micro-batch of {o.micro_batch_size} "
                          f"cannot see, so accumulating micro-batches would change the gradient; drop "
                          f"optim.micro_batch_size or those terms")
    if cfg.logging.grad_noise_scale and (o.epochs != 1 or minibatch < batch or r.prompts_per_step < 2):
        raise ConfigError("logging.grad_noise_scale: measured on the on-policy gradient of the whole batch from "
                          "two halves of its groups, so it needs optim.epochs=1, optim.minibatch_size unset and "
                          f"rollout.prompts_per_step >= 2; got epochs={o.epochs}, minibatch_size={o.minibatch_size}, "
                          f"prompts_per_step={r.prompts_per_step}")
    correction = getattr(loss.options_of("rollout_correction"), "rollout_correction", None)
    if correction is not None and r.top_p < 1:
        # the sampler's log-probs are of the renormalised nucleus, the learner's of the whole softmax: their
        # ratio is the nucleus mass (< 1) on every token with no mismatch at all (MIS would drop them all)
        raise ConfigError(f"loss.rollout_correction={correction!r} with rollout.top_p={r.top_p}: top-p sampling is "
                          f"itself the difference between the sampler and the learner, so every ratio "
                          f"pi_old/pi_rollout is the nucleus mass, not a mismatch to correct; set rollout.top_p=1 or "
                          f"loss.rollout_correction=null")
    try:
        precision_of(cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if cfg.logging.diagnose_every:
        _check_diagnosed(cfg)
    elif cfg.logging.diagnose_estimators is not None:
        raise ConfigError(f"logging.diagnose_estimators: given ({cfg.logging.diagnose_estimators}), but the in-training "
                          f"diagnosis is off (logging.diagnose_every=0), so it would do nothing; set "
                          f"logging.diagnose_every > 0, or drop logging.diagnose_estimators")


def _check_diagnosed(cfg: Config) -> None:
    """``logging.diagnose_estimators``: known labels, and K for a max@K one."""
    k = cfg.algorithm.options.get("k")
    for label in cfg.logging.diagnose_estimators or ():
        try:
            name, options = label_options(label, k)
        except ValueError as err:
            raise ConfigError(f"logging.diagnose_estimators: {err}") from None
        if "k" in options and options["k"] is None:
            raise ConfigError(f"logging.diagnose_estimators: {label!r} is a max@K estimator and needs "
                              f"algorithm.options.k")


def resolve_config(cfg: Config) -> Config:
    """``cfg`` with the estimator's options and the loss terms' options checked against their
    declarations and filled with their defaults, and every combination checked (ConfigError
    naming the key). Raises before any model or data is loaded."""
    _, options, _ = estimator_from_config(cfg)
    _check_estimator(cfg, options)
    _check_task(cfg)
    loss = compose_loss(cfg.loss, cfg.rollout.max_new_tokens)      # max_len as the trainer composes it
    _check_combinations(cfg, loss)
    return dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, options=options),
                               loss=loss.to_config())


# ----------------------------------------------------------------------------- the loss

def resolve_loss(loss: dict, max_len: int | None = None) -> dict:
    """The ``loss`` section checked against the loss-term registry and completed
    (``creditrl.core.losses.compose``, the nested spelling): the flat terms' options directly
    (``clip_low``, ``agg``, ``kl_coef``, ...), each optional built-in term as a section with
    ``enabled``, and ``terms``: the user's terms by import path. Terms that cannot combine (two
    surrogates) are refused here, naming the keys."""
    return compose_loss(loss, max_len).to_config()


def compose_loss(loss: dict, max_len: int | None = None) -> PolicyLoss:
    """``resolve_loss`` before it is written back as a section: the composed ``PolicyLoss``."""
    try:
        return compose(dict(loss or {}), max_len=max_len, where="loss")
    except OptionError:
        raise
    except ValueError as err:            # terms that cannot combine (two surrogates, a term given twice)
        message = str(err).removeprefix("terms: ")
        raise ConfigError(message if message.startswith("loss.") else f"loss: {message}") from None
