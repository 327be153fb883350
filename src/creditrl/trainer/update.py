"""One policy update on a rollout batch: old log-probs, advantages, μ epochs of clipped PG.

    old  = token_stats(π_old)                   (no grad: logp, entropy, energy ŵ_t)
    A    = compute_advantages(estimator, R, mask, group, energy, ρ̄)
    for epoch in 1..μ, for each mini-batch:
        loss = policy_loss(logp_θ, old.logp, A, mask, ...)   (clip-higher, KL, TIS/MIS, STAPO, GRPO-λ)
        AdamW step after grad-norm clipping

Only the response columns are scored: prompts are left-padded to a common width P, so the
logits of the last R+1 positions (``logits_to_keep``) predict every response token and the
prompt's logits are never computed.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import asdict

import torch
from torch import Tensor

from creditrl.config import Config, estimator_options
from creditrl.trainer.rollout import RolloutBatch

TENSOR_FIELDS = ("input_ids", "attention_mask", "position_ids", "response_mask", "rollout_logp")


def response_stats(model, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, response_mask: Tensor,
                   prompt_len: int, *, temperature: float, chunk_size: int | None = None):
    """TokenStats of the response tokens (columns ``prompt_len:``, where ``response_mask``), each [B, R].

    Differentiable in ``model``'s parameters; logits are kept in the model's dtype and
    reduced chunk-wise by ``token_stats`` (never a [B,R,V] float32 copy)."""
    from creditrl import token_stats

    response_len = input_ids.shape[1] - prompt_len
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                logits_to_keep=response_len + 1, use_cache=False)
    tokens = input_ids[:, prompt_len:]
    mask = response_mask[:, prompt_len:]
    kwargs = {} if chunk_size is None else {"chunk_size": chunk_size}
    return token_stats(out.logits[:, :-1], tokens, mask, temperature=temperature, **kwargs)


def lr_lambda(cfg: Config):
    """Warmup then constant or cosine (to ``min_lr_ratio``), as a factor of ``optim.lr`` per step."""
    warmup, total, floor = cfg.optim.warmup_steps, cfg.train.steps, cfg.optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def masked_mean_std(x: Tensor, mask: Tensor) -> tuple[float, float]:
    n = mask.sum().clamp(min=1)
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / n
    return float(mean), float(var.sqrt())


class Learner:
    """Owns the policy's optimizer and schedule (and the frozen reference when kl_coef > 0)."""

    def __init__(self, model, cfg: Config, *, ref_model=None):
        self.model, self.ref_model, self.cfg = model, ref_model, cfg
        self.device = next(model.parameters()).device
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                           weight_decay=cfg.optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.estimator_options = estimator_options(cfg)
        from creditrl.estimators.registry import get_estimator
        self.needs_energy = get_estimator(cfg.algorithm.estimator).needs_energy
        self.loss_options = self._loss_options()

    def _loss_options(self) -> dict:
        from creditrl.losses import StapoOptions, TraceOptions

        loss = self.cfg.loss

        def options(section, cls):
            fields = {k: v for k, v in asdict(section).items() if k != "enabled"}
            return cls(**fields) if section.enabled else None

        return dict(clip_low=loss.clip_low, clip_high=loss.clip_high, clip_c=loss.clip_c, agg=loss.agg,
                    max_len=loss.max_len or self.cfg.rollout.max_new_tokens, kl_coef=loss.kl_coef,
                    kl_estimator=loss.kl_estimator, rollout_correction=loss.rollout_correction,
                    rollout_cap=loss.rollout_cap, stapo=options(loss.stapo, StapoOptions),
                    trace=options(loss.trace, TraceOptions))

    def autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def stats(self, model, t: dict, prompt_len: int):
        with self.autocast():
            return response_stats(model, t["input_ids"], t["attention_mask"], t["position_ids"],
                                  t["response_mask"], prompt_len,
                                  temperature=self.cfg.rollout.temperature, chunk_size=self.cfg.train.chunk_size)

    def update(self, batch: RolloutBatch, generator: torch.Generator) -> dict:
        """One train step on ``batch``; returns the step's metrics (floats)."""
        from creditrl import compute_advantages, policy_loss, variance_proxy

        cfg, p = self.cfg, batch.prompt_len
        t = {k: getattr(batch, k).to(self.device) for k in TENSOR_FIELDS}
        mask = t["response_mask"][:, p:]
        rollout_logp = t["rollout_logp"][:, p:]
        rewards, group = batch.rewards.to(self.device), batch.group.to(self.device)

        size = batch.input_ids.shape[0]
        mb = cfg.optim.minibatch_size or size
        # On-policy single pass (μ = 1, one mini-batch): π_old is the current policy, so one
        # forward with grad serves both the old stats (detached) and the loss.
        fused = cfg.optim.epochs == 1 and mb >= size
        self.model.train()
        with torch.set_grad_enabled(fused):
            first = self.stats(self.model, t, p)
        old_logp, entropy, energy = (x.detach().float() for x in (first.logp, first.entropy, first.energy))
        with torch.no_grad():
            ref_logp = self.stats(self.ref_model, t, p).logp.float() if self.ref_model is not None else None
            is_weights = None
            if cfg.loss.rollout_correction is not None:
                is_weights = torch.exp(old_logp - rollout_logp).clamp(max=cfg.loss.rollout_cap) * mask
            advantages = compute_advantages(
                cfg.algorithm.estimator, rewards=rewards, mask=mask, group=group,
                energy=energy if self.needs_energy else None, is_weights=is_weights, **self.estimator_options)
            advantages = advantages.float()

        sums: dict[str, float] = {}
        n_updates = 0
        for _ in range(cfg.optim.epochs):
            order = (torch.arange(size) if fused else torch.randperm(size, generator=generator)).to(self.device)
            for rows in order.split(mb):
                new = first if fused else self.stats(self.model, {k: v[rows] for k, v in t.items()}, p)
                loss, metrics = policy_loss(
                    new.logp.float(), old_logp[rows], advantages[rows], mask[rows],
                    ref_logp=None if ref_logp is None else ref_logp[rows], rollout_logp=rollout_logp[rows],
                    entropy=new.entropy.float(), **self.loss_options)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.max_grad_norm)
                self.optimizer.step()
                metrics = {k: float(v) for k, v in metrics.items()}
                metrics.update(loss=float(loss.detach()), grad_norm=float(grad_norm))
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
                n_updates += 1
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()

        out = {k: v / n_updates for k, v in sums.items()}
        adv_mean, adv_std = masked_mean_std(advantages, mask)
        lengths = mask.sum(-1)
        out.update(
            reward_mean=float(rewards.mean()), reward_std=float(rewards.std(unbiased=False)),
            accuracy=float(batch.correct.float().mean()), response_len=float(lengths.float().mean()),
            entropy=masked_mean_std(entropy, mask)[0], adv_mean=adv_mean, adv_std=adv_std,
            variance_proxy=float(variance_proxy(advantages, energy, mask)), lr=lr)
        return out
