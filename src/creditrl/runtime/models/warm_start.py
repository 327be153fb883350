"""Warm start of ``builtin:tiny``: supervised training on the task's own generator
(prompt -> ``task.sft_target``) until *sampled* accuracy (temperature 1) on a fixed slice of
the same training stream reaches ``target_accuracy``, or ``max_steps``. The slice is not held
out: a finite data set's training rows are what it trains on (a small one can be memorised,
so its accuracy there overstates the run's held-out eval). The default target (0.4) leaves clear
headroom for RL. Loss covers the response and EOS, never the prompt or tool outputs. The
accuracy is the task's mean reward, an invalid reward counted as 0 (as in RL); a reward invalid
for every reference response is refused before any training.
"""
from __future__ import annotations

import math
import random
import time
import warnings
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from creditrl.config import WarmStartConfig
from creditrl.runtime.sampling import decode_responses, generate
from creditrl.tasks.chat import render_task_prompts
from creditrl.utils.threads import torch_threads
from creditrl.tasks.base import Problem


@dataclass
class WarmStartResult:
    steps: int
    accuracy: float
    seconds: float
    history: list[dict] = field(default_factory=list)


def response_mask(task, response: str) -> list[int]:
    """Per-character loss mask of a response: 0 inside environment tool outputs."""
    mask = [1] * len(response)
    for start, end in getattr(task, "tool_output_spans", lambda _: [])(response):
        mask[start:end] = [0] * (end - start)
    return mask


def sft_batch(task, tokenizer, problems: list[Problem]) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``/``attention_mask``/``labels`` (-100 off the loss) for SFT.
    Character-level: one character of the response is one token, so the mask aligns. Prompts keep
    their last ``task.max_prompt_tokens`` tokens when that is set, as in rollouts."""
    rows, labels = [], []
    limit = getattr(task, "max_prompt_tokens", None)   # set by task.options.truncate_prompts
    for p in problems:
        target = task.sft_target(p)
        prompt_ids = tokenizer.encode(p.prompt, add_special_tokens=False)[-limit if limit else 0:]
        target_ids = tokenizer.encode(target, add_special_tokens=False) + [tokenizer.eos_token_id]
        mask = response_mask(task, target) + [1]
        if len(mask) != len(target_ids):
            raise ValueError("sft_batch: the tokenizer is not character-level; cannot mask tool outputs")
        rows.append(prompt_ids + target_ids)
        labels.append([-100] * len(prompt_ids) + [t if m else -100 for t, m in zip(target_ids, mask)])
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
        "labels": torch.tensor([r + [-100] * (width - len(r)) for r in labels]),
    }


@torch.no_grad()
def sampled_accuracy(model, tokenizer, task, problems: list[Problem], *, max_new_tokens: int,
                     temperature: float = 1.0, seed: int = 0) -> float:
    """Mean reward of one sampled response per problem, decoded by the trainer's own sampler
    (``creditrl.runtime.sampling.generate``: same stopping and tool protocol as RL rollouts)."""

    was_training = model.training
    model.eval()
    out = generate(model, tokenizer, render_task_prompts(tokenizer, task, [p.prompt for p in problems]),
                   temperature=temperature, max_new_tokens=max_new_tokens, task=task,
                   max_tool_tokens=max_new_tokens, generator=torch.Generator().manual_seed(seed))
    model.train(was_training)
    p = out.prompt_len
    responses = decode_responses(tokenizer, out.input_ids[:, p:], out.attention_mask[:, p:])
    rewards = [task.reward(q, r) for q, r in zip(problems, responses)]
    return sum(r for r in rewards if math.isfinite(r)) / len(problems)   # an invalid reward counts 0, as in RL


def check_reward_of_targets(task, problems: list[Problem]) -> None:
    """Refuse, before any training, a task whose reward is invalid (None, NaN, a raise, a wrong type)
    for every reference response (``task.sft_target``): the warm start measures its sampled accuracy
    with that reward and could never reach its target, caching a model trained for ``max_steps``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rewards = [task.reward(p, task.sft_target(p)) for p in problems]
    if any(math.isfinite(r) for r in rewards):
        return
    key = "task.options.checker" if "checker" in getattr(task, "options", {}) else "task.name"
    why = f": {caught[0].message}" if caught else " (it returned None or NaN)"
    raise ValueError(f"{key}: the task's reward is invalid for all {len(problems)} reference responses of "
                     f"builtin:tiny's warm start (its own answers){why}. The warm start measures its sampled accuracy "
                     f"with this reward, so it could not tell when to stop; fix the checker, or train a model that "
                     f"needs no warm start (model.name=builtin:smollm2-135m or a model directory)")


def check_problems(task, cfg: WarmStartConfig) -> list[Problem]:
    """The fixed slice the warm start measures accuracy on: ``eval_size`` draws from ONE seeded
    stream of the task's training generator (never test prompts; not held out from training)."""
    rng = random.Random(f"creditrl-warm-start-eval-{cfg.seed}")
    return [task.sample(rng) for _ in range(cfg.eval_size)]


def warm_start(model, tokenizer, task, cfg: WarmStartConfig = WarmStartConfig(), *,
               progress: bool = True) -> WarmStartResult:
    """Train ``model`` in place on ``task``'s generator; see module docstring. Deterministic
    for a given ``cfg.seed`` on CPU (the global torch RNG and thread count are restored).

    One CPU thread by default: a ~1M-parameter model's matmuls are too small to gain from
    intra-op threads, and on a busy 2-core machine 2 threads measured ~9x slower than 1.
    """

    rng = random.Random(f"creditrl-warm-start-{cfg.seed}")
    checked = check_problems(task, cfg)
    check_reward_of_targets(task, checked)
    longest = max(len(tokenizer.encode(task.sft_target(p), add_special_tokens=False)) for p in checked)
    max_new_tokens = longest + 8
    history: list[dict] = []
    start = time.perf_counter()
    bar = tqdm(total=cfg.max_steps, desc=f"warm start {task.name}", disable=not progress, leave=False)
    try:
        with torch_threads(cfg.num_threads):
            _train(model, tokenizer, task, cfg, rng, checked, max_new_tokens, bar, history)
    finally:
        bar.close()
    model.eval()
    last = history[-1] if history else {"step": 0, "accuracy": 0.0}
    return WarmStartResult(steps=last["step"], accuracy=last["accuracy"], seconds=time.perf_counter() - start,
                           history=history)


def _train(model, tokenizer, task, cfg: WarmStartConfig, rng: random.Random, checked: list[Problem],
           max_new_tokens: int, bar, history: list[dict]) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps)))
    step, start = 0, time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model.train()
        while step < cfg.max_steps:
            batch = sft_batch(task, tokenizer, [task.sample(rng) for _ in range(cfg.batch_size)])
            loss = model(**{k: v.to(model.device) for k, v in batch.items()}).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step, loss_value = step + 1, loss.item()
            bar.update(1)
            if not math.isfinite(loss_value):
                raise RuntimeError(f"warm start diverged at step {step} (loss {loss_value}); lower lr={cfg.lr}")
            if step % cfg.eval_every == 0 or step == cfg.max_steps:
                accuracy = sampled_accuracy(model, tokenizer, task, checked, max_new_tokens=max_new_tokens,
                                            seed=cfg.seed + step)
                history.append({"step": step, "loss": loss_value, "accuracy": accuracy,
                                "seconds": time.perf_counter() - start})
                bar.set_postfix(loss=f"{loss_value:.3f}", acc=f"{accuracy:.2f}")
                if accuracy >= cfg.target_accuracy:
                    break
