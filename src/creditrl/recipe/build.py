"""Config -> components: the task, the device, the policy and its tokenizer, the composed policy
loss, from a config that ``creditrl.recipe.resolve`` has checked. Shared by the trainer,
``creditrl eval``, ``creditrl diagnose`` and the experiments, so each builds exactly what
``creditrl train`` builds."""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from creditrl.config import Config, ConfigError
from creditrl.core.losses import PolicyLoss, compose
from creditrl.recipe.resolve import precision_of
from creditrl.runtime.models import adapter_settings, default_lora_modules, is_chat_model, load_policy
from creditrl.runtime.models.tiny import char_tokenizer
from creditrl.tasks import get_task, task_options
from creditrl.tasks.base import ProceduralTask
from creditrl.tasks.chat import check_prompt_lengths, render_task_prompts

DEFAULT_MAX_NEW_TOKENS = 256   # tasks without reference responses (jsonl): room for a chat answer


def default_max_new_tokens(task, tokenizer, samples: int = 64) -> int:
    """Built-in tasks: the longest sampled part of the task's reference responses (tool outputs
    excluded) in the model's tokens + 4 (compact format) or x2 + 8 (natural format: chat
    answers vary in wording); other tasks (jsonl): ``DEFAULT_MAX_NEW_TOKENS``, at most half the
    tokenizer's ``model_max_length`` where it states one (builtin:tiny's 256-token context)."""
    if not isinstance(task, ProceduralTask):
        context = getattr(tokenizer, "model_max_length", None)
        known = isinstance(context, int) and 2 <= context < 10**6      # HF's "unknown" is ~1e30
        return min(DEFAULT_MAX_NEW_TOKENS, context // 2) if known else DEFAULT_MAX_NEW_TOKENS
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


def rollout_kwargs(cfg: Config, max_new_tokens: int) -> dict:
    """``generate_rollouts``' sampling and scoring keywords from the ``rollout`` section (DAPO's overlong
    penalty included): what training samples, and diagnose with it."""
    r = cfg.rollout
    return {"temperature": r.temperature, "top_p": r.top_p, "max_new_tokens": max_new_tokens,
            "max_tool_tokens": r.max_tool_tokens, "stop_strings": tuple(r.stop),
            "overlong": (r.overlong.buffer, r.overlong.penalty) if r.overlong.buffer else None}


def build_task(cfg: Config):
    """The configured task, its ``format=auto`` resolved for the configured model. An error that
    names one of the task's options (``path: ...``) names its config key (``task.options.path: ...``)."""
    try:
        return get_task(cfg.task.name, chat_model=is_chat_model(cfg.model.name), **cfg.task.options)
    except (ValueError, FileNotFoundError, TypeError) as err:
        option = str(err).split(":", 1)[0]
        if option not in (task_options(cfg.task.name) or cfg.task.options):
            raise
        raise (ConfigError if isinstance(err, TypeError) else type(err))(f"task.options.{err}") from None


def load_configured_policy(cfg: Config, task, device, progress: bool, name: str | None = None):
    """``load_policy`` with every ``model.*`` setting (``name`` overrides ``model.name``). Under
    ``train.precision`` bf16/fp16 a LoRA run stores its frozen base in bf16 (autocast computes in
    bf16 anyway); trainable weights stay float32 unless ``model.dtype`` asks otherwise."""
    m = cfg.model
    if (name or m.name) == "builtin:tiny":
        check_tiny_prompts(cfg, task)
    lora = m.lora.settings()
    frozen_bf16 = lora is not None and precision_of(cfg).frozen_dtype == torch.bfloat16
    return load_policy(name or m.name, task, model_cfg=m.tiny, warm_start=m.warm_start, cache_dir=m.cache_dir,
                       device=device, seed=cfg.train.seed, progress=progress,
                       dtype="bfloat16" if frozen_bf16 else m.dtype,
                       gradient_checkpointing=m.gradient_checkpointing, lora=lora)


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


@dataclass(frozen=True)
class ConfiguredLoss:
    """The run's policy loss (``creditrl.core.losses.PolicyLoss``) and the two facts the update
    needs before calling it: whether a term of it needs reference log-probs (KL) and the rollout
    correction (mode or None, cap) whose weights also scale OTB's energies."""
    loss: PolicyLoss
    needs_reference: bool
    rollout_correction: tuple[str | None, float]

    def __call__(self, *args, **kwargs):
        return self.loss(*args, **kwargs)


def policy_loss_from_config(cfg: Config) -> ConfiguredLoss:
    """The composed policy loss of a (resolved or raw) config's ``loss`` section; the
    aggregation's ``max_len`` defaults to ``rollout.max_new_tokens``."""
    composed = compose(cfg.loss, max_len=cfg.rollout.max_new_tokens)
    correction = composed.options_of("rollout_correction")
    needs_reference = any("ref_logp" in term.needs and term.active(options) for term, options in composed.terms)
    return ConfiguredLoss(composed, needs_reference=needs_reference,
                          rollout_correction=(correction.rollout_correction, correction.rollout_cap))
