"""The runtime objects a config names: the device, the task, the policy and its tokenizer.

Shared by the trainer, ``creditrl eval``, the experiments and ``creditrl diagnose``, so each
builds a model exactly as ``creditrl train`` does.
"""
from __future__ import annotations

import dataclasses
import random

import torch

from creditrl.config import Config
from creditrl.runtime.models import LoraSettings, is_chat_model, load_policy
from creditrl.tasks import get_task
from creditrl.tasks.base import ProceduralTask

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
    """The configured task, its ``format=auto`` resolved for the configured model."""
    return get_task(cfg.task.name, chat_model=is_chat_model(cfg.model.name), **cfg.task.options)


def load_configured_policy(cfg: Config, task, device, progress: bool, name: str | None = None):
    """``load_policy`` with every ``model.*`` setting (``name`` overrides ``model.name``)."""
    m = cfg.model
    lora = LoraSettings(**{k: v for k, v in dataclasses.asdict(m.lora).items() if k != "enabled"}) \
        if m.lora.enabled else None
    return load_policy(name or m.name, task, model_cfg=m.tiny, warm_start=m.warm_start, cache_dir=m.cache_dir,
                       device=device, seed=cfg.train.seed, progress=progress, dtype=m.dtype,
                       gradient_checkpointing=m.gradient_checkpointing, lora=lora)
