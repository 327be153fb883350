"""What a config names, built and checked: the estimator and its options, the loss terms, the
task, the device and the policy with its tokenizer.

``resolve_config`` checks everything the library declares (estimator options against the
estimator's signature, loss options against the loss terms' dataclasses, task options against
the task's parameters, and the combinations) before any model loads, and returns the config with
every declared option filled in: the complete record a run saves. Shared by the trainer,
``creditrl eval``, the experiments and ``creditrl diagnose``, so each builds exactly what
``creditrl train`` builds.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from creditrl.config import Config, ConfigError
from creditrl.core.estimators import check_group_size
from creditrl.core.estimators.registry import get_estimator
from creditrl.core.losses import PolicyLoss, get_loss_term, list_loss_terms
from creditrl.runtime.models import adapter_settings, default_lora_modules, is_chat_model, load_policy
from creditrl.runtime.models.tiny import char_tokenizer
from creditrl.tasks import get_task, task_options
from creditrl.tasks.base import ProceduralTask
from creditrl.tasks.chat import check_prompt_lengths, render_task_prompts
from creditrl.utils.options import build, coerce, instantiate

DEFAULT_MAX_NEW_TOKENS = 256   # tasks without reference responses (jsonl): room for a chat answer


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device: 'cuda' requested but no CUDA device is available; use 'cpu' or 'auto'")
    return torch.device(name)


def default_max_new_tokens(task, tokenizer, samples: int = 64) -> int:
    """Built-in tasks: the longest sampled part of the task's reference responses (tool outputs
    excluded) in the model's tokens + 4 (compact format) or x2 + 8 (natural format: chat
    answers vary in wording); other tasks (jsonl): ``DEFAULT_MAX_NEW_TOKENS``."""
    if not isinstance(task, ProceduralTask):
        return DEFAULT_MAX_NEW_TOKENS
    rng = random.Random(0)
    longest = 0
    for _ in range(samples):
        target = task.sft_target(task.sample(rng))
        spans = getattr(task, "tool_output_spans", lambda _: [])(target)
        text = target
        for start, end in reversed(spans):
            text = text[:start] + text[end:]
        longest = max(longest, len(tokenizer.encode(text, add_special_tokens=False)))
    return longest + 4 if task.format == "compact" else 2 * longest + 8


def build_task(cfg: Config):
    """The configured task, its ``format=auto`` resolved for the configured model. An error that
    names one of the task's options (``path: ...``) names its config key (``task.options.path: ...``)."""
    try:
        return get_task(cfg.task.name, chat_model=is_chat_model(cfg.model.name), **cfg.task.options)
    except (ValueError, FileNotFoundError) as err:
        option = str(err).split(":", 1)[0]
        if option not in (task_options(cfg.task.name) or cfg.task.options):
            raise
        raise type(err)(f"task.options.{err}") from None


def load_configured_policy(cfg: Config, task, device, progress: bool, name: str | None = None):
    """``load_policy`` with every ``model.*`` setting (``name`` overrides ``model.name``). Under
    ``train.precision`` bf16/fp16 a LoRA run stores its frozen base in bf16 (autocast computes in
    bf16 anyway); trainable weights stay float32 unless ``model.dtype`` asks otherwise."""
    m = cfg.model
    if (name or m.name) == "builtin:tiny":
        check_tiny_prompts(cfg, task)
    lora = m.lora.settings()
    frozen_bf16 = lora is not None and cfg.train.precision != "fp32"
    return load_policy(name or m.name, task, model_cfg=m.tiny, warm_start=m.warm_start, cache_dir=m.cache_dir,
                       device=device, seed=cfg.train.seed, progress=progress,
                       dtype="bfloat16" if frozen_bf16 else m.dtype,
                       gradient_checkpointing=m.gradient_checkpointing, lora=lora)


# ----------------------------------------------------------------------------- checks

def check_tiny_prompts(cfg: Config, task) -> int:
    """``builtin:tiny``'s character tokenizer is known before its warm start (minutes), so the task's
    prompts are rendered (one sample; every row of a data set) and their lengths checked against
    ``model.tiny.max_position_embeddings`` now: a conversational prompt or a system prompt (which need
    a chat template it lacks) or a prompt too long is a ConfigError before any model work. Returns
    the number of prompts that ``task.options.truncate_prompts`` will truncate."""
    context = cfg.model.tiny.max_position_embeddings
    tokenizer = char_tokenizer(task.alphabet(), model_max_length=context)
    try:
        render_task_prompts(tokenizer, task, [task.sample(random.Random(0)).prompt])
        max_new = cfg.rollout.max_new_tokens or default_max_new_tokens(task, tokenizer)
        return check_prompt_lengths(tokenizer, task, context, max_new)
    except ValueError as err:
        raise ConfigError(f"{err}; here model.name='builtin:tiny' (a character tokenizer without a chat template, "
                          f"context model.tiny.max_position_embeddings={context})") from None


def check_lora_source(cfg: Config) -> None:
    """Training from a LoRA adapter directory (a LoRA run's ``final/``) as ``model.name`` continues
    its adapters: that needs ``model.lora.enabled=true`` with the adapter's own settings (a
    ConfigError names each one that differs; ``target_modules: null`` means peft's default)."""
    name = cfg.model.name
    path = Path(name).expanduser()
    saved = None if name.startswith("builtin:") or not path.is_dir() else adapter_settings(path)
    if saved is None:
        return
    base = saved.pop("base")
    lora = cfg.model.lora
    wanted = " ".join(f"model.lora.{k}={'[' + ','.join(v) + ']' if isinstance(v, list) else v}"
                      for k, v in saved.items())
    if not lora.enabled:
        raise ConfigError(f"model.lora.enabled: model.name {name!r} is a LoRA adapter directory; training goes on "
                          f"with its adapters, which needs model.lora.enabled=true and its settings ({wanted}). To "
                          f"train the full model, give its base model {base!r} as model.name")
    modules = sorted(lora.target_modules) if lora.target_modules else default_lora_modules(Path(base).expanduser())
    ours = {"r": lora.r, "alpha": lora.alpha, "dropout": lora.dropout, "target_modules": modules}
    differ = [f"model.lora.{k}={ours[k]!r} but the adapter has {saved[k]!r}" for k in saved if ours[k] != saved[k]]
    if differ:
        raise ConfigError(f"model.lora: model.name {name!r} is a LoRA adapter directory whose settings differ from "
                          f"the config: {'; '.join(differ)}. Set {wanted} to go on training these adapters")


def estimator_from_config(cfg: Config) -> tuple[str, dict, bool]:
    """(estimator name, its options with defaults filled, whether it needs energies)."""
    try:
        spec = get_estimator(cfg.algorithm.estimator)
    except ValueError as err:
        raise ConfigError(f"algorithm.estimator: {str(err).removeprefix('name: ')}") from None
    specs = spec.option_specs
    options = dict(cfg.algorithm.options) if specs is None else build("algorithm.options", specs,
                                                                       cfg.algorithm.options)
    return cfg.algorithm.estimator, options, spec.needs_energy


def _check_estimator(cfg: Config, options: dict) -> None:
    """Run the estimator on one dummy group of ``rollout.group_size`` so any option/size combination
    it rejects fails now, naming the config keys; a group of 1 that learns nothing is refused."""
    name, g = cfg.algorithm.estimator, cfg.rollout.group_size
    try:
        singles_learn = check_group_size(name, options, g, key="rollout.group_size")
    except ValueError as err:
        message = str(err)
        raise ConfigError(f"algorithm.options.{message}" if message.startswith("k: ") else
                          f"algorithm (estimator={name!r}, options={options}): {message}") from None
    if g == 1 and not singles_learn:
        raise ConfigError(f"rollout.group_size: 1 response per prompt gives estimator {name!r} advantage 0 for "
                          f"every token (it compares responses within a group), so nothing would be learned; use "
                          f"rollout.group_size >= 2 or algorithm.estimator=reinforce")


def _check_task(cfg: Config) -> None:
    """The task's name and options against its declaration (its parameters), before any data is read."""
    try:
        declared = task_options(cfg.task.name)
    except ValueError as err:
        raise ConfigError(f"task.name: {str(err).removeprefix('task: ').removeprefix('task.name: ')}") from None
    if declared is None:                          # a user's factory taking **kwargs: anything goes
        return
    unknown = sorted(set(cfg.task.options) - set(declared))
    if unknown:
        raise ConfigError(f"task.options: unknown option(s) {unknown} for task {cfg.task.name!r}; valid options are "
                          f"{sorted(declared)}")


def _check_combinations(cfg: Config, loss: dict) -> None:
    """Settings that are each valid but do not work together."""
    o, r = cfg.optim, cfg.rollout
    batch = r.prompts_per_step * r.group_size
    minibatch = min(o.minibatch_size or batch, batch)
    if loss.get("stapo", {}).get("enabled") and o.micro_batch_size is not None and o.micro_batch_size < minibatch:
        raise ConfigError(f"optim.micro_batch_size: STAPO's silencing threshold is a quantile over the whole "
                          f"mini-batch ({minibatch} responses), which a micro-batch of {o.micro_batch_size} cannot "
                          f"see; drop optim.micro_batch_size or loss.stapo.enabled")
    if cfg.logging.grad_noise_scale and (o.epochs != 1 or minibatch < batch or r.prompts_per_step < 2):
        raise ConfigError("logging.grad_noise_scale: measured on the on-policy gradient of the whole batch from "
                          "two halves of its groups, so it needs optim.epochs=1, optim.minibatch_size unset and "
                          f"rollout.prompts_per_step >= 2; got epochs={o.epochs}, minibatch_size={o.minibatch_size}, "
                          f"prompts_per_step={r.prompts_per_step}")
    if cfg.train.precision == "fp16" and resolve_device(cfg.train.device).type != "cuda":
        raise ConfigError("train.precision: fp16 needs CUDA (its loss scaling); on a CPU use bf16 (same speed-up, "
                          "no overflow) or fp32")


def resolve_config(cfg: Config) -> Config:
    """``cfg`` with the estimator's options and the loss terms' options checked against their
    declarations and filled with their defaults, and every combination checked (ConfigError
    naming the key). Raises before any model or data is loaded."""
    _, options, _ = estimator_from_config(cfg)
    _check_estimator(cfg, options)
    _check_task(cfg)
    loss = resolve_loss(cfg.loss)
    _check_combinations(cfg, loss)
    try:                                   # terms that cannot combine (two surrogates, a term given twice)
        policy_loss_from_config(dataclasses.replace(cfg, loss=loss))
    except ValueError as err:
        message = str(err).removeprefix("terms: ")
        raise ConfigError(message if message.startswith("loss.") else f"loss: {message}") from None
    return dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, options=options), loss=loss)


# ----------------------------------------------------------------------------- the loss

def builtin_loss_terms() -> list:
    """creditrl's own loss terms (a user's term, even once imported, is configured under
    ``loss.terms`` by its import path, so a saved config never depends on import order)."""
    terms = [get_loss_term(name) for name in list_loss_terms()]
    return [t for t in terms if t.fn.__module__.startswith("creditrl.")]


def _term_values(where: str, term, values: dict) -> dict:
    """One term's options from ``values``: typed, filled with the term's defaults and checked by
    the term's own options class (its ``__post_init__``), errors naming ``where``."""
    return dataclasses.asdict(instantiate(where, term.options, values))


def resolve_loss(loss: dict) -> dict:
    """The ``loss`` section checked against the loss-term registry and completed: the flat terms'
    options directly (``clip_low``, ``agg``, ``kl_coef``, ...), each optional built-in term as a
    section with ``enabled``, and ``terms``: the user's terms by import path, each
    ``{"path": "pkg.module:function", <option>: value}``."""
    loss = dict(loss or {})
    terms = builtin_loss_terms()
    flat = {f.name: term for term in terms if term.flat for f in dataclasses.fields(term.options)}
    sections = {term.name: term for term in terms if not term.flat}
    unknown = sorted(set(loss) - set(flat) - set(sections) - {"terms"})
    if unknown:
        raise ConfigError(f"loss.{unknown[0]}: unknown key; valid keys of loss are "
                          f"{sorted(flat) + sorted(sections) + ['terms']}")
    out = {}
    for term in (t for t in terms if t.flat):
        names = [f.name for f in dataclasses.fields(term.options)]
        out.update(_term_values("loss", term, {k: loss[k] for k in names if k in loss}))
    for name, term in sections.items():
        section = dict(loss.get(name) or {})
        enabled = coerce(f"loss.{name}.enabled", section.pop("enabled", False), bool)
        out[name] = {"enabled": enabled, **_term_values(f"loss.{name}", term, section)}
    out["terms"] = [_user_term(i, spec) for i, spec in enumerate(loss.get("terms") or [])]
    return out


def _user_term(i: int, spec: object) -> dict:
    where = f"loss.terms[{i}]"
    if not isinstance(spec, dict) or not isinstance(spec.get("path"), str):
        raise ConfigError(f"{where}: expected a mapping with 'path' (a registered loss term or "
                          f"'package.module:function') and the term's options, got {spec!r}")
    options = {k: v for k, v in spec.items() if k != "path"}
    return {"path": spec["path"], **_term_values(where, get_loss_term(spec["path"]), options)}


@dataclass(frozen=True)
class ConfiguredLoss:
    """The run's policy loss (``creditrl.core.losses.PolicyLoss``) and the two facts the update
    needs before calling it: whether it needs reference log-probs (KL) and the rollout
    correction (mode or None, cap) whose weights also scale OTB's energies."""
    loss: PolicyLoss
    needs_reference: bool
    rollout_correction: tuple[str | None, float]

    def __call__(self, *args, **kwargs):
        return self.loss(*args, **kwargs)


def policy_loss_from_config(cfg: Config) -> ConfiguredLoss:
    """The composed policy loss of a (resolved or raw) config's ``loss`` section; the
    aggregation's ``max_len`` defaults to ``rollout.max_new_tokens``."""
    loss = resolve_loss(cfg.loss)
    chosen = {}
    for term in builtin_loss_terms():
        if term.flat:
            chosen[term.name] = term.options(**{f.name: loss[f.name] for f in dataclasses.fields(term.options)})
        elif loss[term.name]["enabled"]:
            chosen[term.name] = term.options(**{k: v for k, v in loss[term.name].items() if k != "enabled"})
    for i, spec in enumerate(loss["terms"]):
        term = get_loss_term(spec["path"])
        if term.name in chosen:
            raise ValueError(f"loss.terms[{i}]: loss term {term.name!r} is also on as loss.{term.name}; set it one way")
        chosen[term.name] = term.options(**{k: v for k, v in spec.items() if k != "path"})
    if chosen["aggregation"].max_len is None:
        chosen["aggregation"] = dataclasses.replace(chosen["aggregation"], max_len=cfg.rollout.max_new_tokens)
    return ConfiguredLoss(PolicyLoss(chosen), needs_reference=loss["kl_coef"] > 0,
                          rollout_correction=(loss["rollout_correction"], loss["rollout_cap"]))
