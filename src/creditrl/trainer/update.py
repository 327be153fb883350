"""One policy update on a rollout batch: old log-probs, advantages, μ epochs of clipped PG.

    old  = token_stats(π_old)                   (no grad: logp, entropy, energy ŵ_t)
    A    = compute_advantages(estimator, R, mask, group, energy, ρ̄)
    for epoch in 1..μ, for each mini-batch:
        for each micro-batch:                  (gradient accumulation)
            loss_i = policy_loss(logp_θ, old.logp, A, mask, ...)   (clip-higher, KL, TIS/MIS, STAPO, GRPO-λ)
            backward(loss_i · count_i)         count_i = agg_denominator of the micro-batch
        grad /= Σ count_i                       = the mini-batch's gradient, exactly
        AdamW step after grad-norm clipping

Only the response columns are scored: prompts are left-padded to a common width P, so the
logits of the last R+1 positions (``logits_to_keep``) predict every response token and the
prompt's logits are never computed. For a RolloutBatch (G rows per prompt) each prompt even
runs once, its KV cache shared by its G rows, and rows are fed in buckets of similar length so
right padding is mostly skipped (``shared_prompt_stats``: same values, ~1/3 less compute).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from dataclasses import asdict

import torch
from torch import Tensor

from creditrl.utils.validate import NonFiniteError
from creditrl.config import Config, estimator_options
from creditrl.runtime.rollout import RolloutBatch
from creditrl.core.losses.diagnostics import masked_mean
from creditrl.core.token_stats import TokenStats
from creditrl.runtime.scoring import response_stats

TENSOR_FIELDS = ("input_ids", "attention_mask", "position_ids", "response_mask", "rollout_logp", "group")


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
    """Mean and (population) std of x over the tokens where mask, as floats for logging."""
    keep = mask.bool()
    mean = masked_mean(x, keep)
    return float(mean), float(masked_mean((x - mean).square(), keep).sqrt())


class Learner:
    """Owns the policy's optimizer and schedule (and the frozen reference when kl_coef > 0)."""

    def __init__(self, model, cfg: Config, *, ref_model=None):
        self.model, self.ref_model, self.cfg = model, ref_model, cfg
        self.device = next(model.parameters()).device
        params = [p for p in model.parameters() if p.requires_grad]
        # fused AdamW (one kernel over all parameters; what TRL/HF Trainer default to as well)
        fused = {"fused": True} if self.device.type in ("cpu", "cuda") else {}
        self.optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                           weight_decay=cfg.optim.weight_decay, **fused)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.estimator_options = estimator_options(cfg)
        from creditrl.core.estimators.registry import get_estimator
        self.needs_energy = get_estimator(cfg.algorithm.estimator).needs_energy
        self.loss_options = self._loss_options()

    def _loss_options(self) -> dict:
        from creditrl.core.losses import StapoOptions, TraceOptions

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
                                  t["response_mask"], prompt_len, temperature=self.cfg.rollout.temperature,
                                  chunk_size=self.cfg.train.chunk_size, group=t["group"])

    def no_grad_stats(self, model, t: dict, prompt_len: int) -> TokenStats:
        """TokenStats of every row without grad, ``optim.micro_batch_size`` rows at a time
        (bounded memory; the whole batch in one forward when it is unset)."""
        size = t["input_ids"].shape[0]
        with torch.no_grad():
            parts = [self.stats(model, {k: v[rows] for k, v in t.items()}, prompt_len)
                     for rows in torch.arange(size, device=self.device).split(self.cfg.optim.micro_batch_size or size)]
        return TokenStats(**{f.name: torch.cat([getattr(x, f.name) for x in parts])
                             for f in dataclasses.fields(TokenStats)})

    def update(self, batch: RolloutBatch, generator: torch.Generator) -> dict:
        """One train step on ``batch``; returns the step's metrics (floats) and stores the
        advantages [B,L] on ``batch.advantages`` (on the learner's device)."""
        from creditrl import compute_advantages, policy_loss, power_proxy
        from creditrl.core.losses.diagnostics import adam_moment_variance

        cfg, p = self.cfg, batch.prompt_len
        t = {k: getattr(batch, k).to(self.device) for k in TENSOR_FIELDS}  # "group" lets prompts be shared
        mask = t["response_mask"][:, p:]
        rollout_logp = t["rollout_logp"][:, p:]
        rewards, group = batch.rewards.to(self.device), batch.group.to(self.device)

        size = batch.input_ids.shape[0]
        mb = min(cfg.optim.minibatch_size or size, size)
        micro = min(cfg.optim.micro_batch_size or mb, mb)
        # On-policy single pass (μ = 1, one mini-batch, one micro-batch): π_old is the current
        # policy, so one forward with grad serves both the old stats (detached) and the loss.
        fused = cfg.optim.epochs == 1 and micro >= size
        self.model.train()
        first = self.stats(self.model, t, p) if fused else self.no_grad_stats(self.model, t, p)
        old_logp, entropy, energy = (x.detach().float() for x in (first.logp, first.entropy, first.energy))
        ref_logp = None if self.ref_model is None else self.no_grad_stats(self.ref_model, t, p).logp.float()
        with torch.no_grad():
            is_weights = None
            if cfg.loss.rollout_correction is not None:
                is_weights = torch.exp(old_logp - rollout_logp).clamp(max=cfg.loss.rollout_cap) * mask
            advantages = compute_advantages(
                cfg.algorithm.estimator, rewards=rewards, mask=mask, group=group,
                energy=energy if self.needs_energy else None, is_weights=is_weights, **self.estimator_options)
            advantages = advantages.float()

        params = [q for q in self.model.parameters() if q.requires_grad]
        sums: dict[str, float] = {}
        n_updates = skipped = 0
        for _ in range(cfg.optim.epochs):
            order = (torch.arange(size) if fused else torch.randperm(size, generator=generator)).to(self.device)
            for rows in order.split(mb):
                self.optimizer.zero_grad(set_to_none=True)
                parts = rows.split(micro)
                weighted: dict[str, float] = {}
                total = 0.0
                try:
                    for micro_rows in parts:
                        new = first if fused else self.stats(self.model, {k: v[micro_rows] for k, v in t.items()}, p)
                        loss, metrics = policy_loss(
                            new.logp.float(), old_logp[micro_rows], advantages[micro_rows], mask[micro_rows],
                            ref_logp=None if ref_logp is None else ref_logp[micro_rows],
                            rollout_logp=rollout_logp[micro_rows], entropy=new.entropy.float(), **self.loss_options)
                        count = metrics["agg_count"] if len(parts) > 1 else 1.0
                        (loss * count if len(parts) > 1 else loss).backward()
                        metrics["loss"] = float(loss.detach())
                        for k, v in metrics.items():
                            weighted[k] = weighted.get(k, 0.0) + float(v) * max(count, 1e-12)
                        total += max(count, 1e-12)
                except NonFiniteError:                # NaN/inf log-probs, advantages or loss: skip
                    weighted, total = {"loss": math.nan}, 1.0
                if len(parts) > 1 and total > 0:
                    for q in params:                  # Σ_i count_i ∇loss_i / Σ_i count_i
                        if q.grad is not None:
                            q.grad.div_(total)
                grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.max_grad_norm)
                if torch.isfinite(grad_norm) and all(math.isfinite(v) for v in weighted.values()):
                    self.optimizer.step()
                else:                                 # a non-finite loss/gradient never reaches the weights
                    self.optimizer.zero_grad(set_to_none=True)
                    skipped += 1
                metrics = {k: v / total for k, v in weighted.items()}
                metrics.update(grad_norm=float(grad_norm))
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
                n_updates += 1
        lr = self.optimizer.param_groups[0]["lr"]
        with warnings.catch_warnings():        # a skipped update is not the misuse torch warns about
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
            self.scheduler.step()

        out = {k: v / n_updates for k, v in sums.items()}
        out.pop("agg_count", None)
        adv_mean, adv_std = masked_mean_std(advantages, mask)
        lengths = mask.sum(-1)
        batch.advantages = torch.nn.functional.pad(advantages, (p, 0))   # stays on the device (completion log)
        out.update(
            reward_mean=float(rewards.mean()), reward_std=float(rewards.std(unbiased=False)),
            accuracy=float(batch.correct.float().mean()), response_len=float(lengths.float().mean()),
            clipped_frac=float(1.0 - batch.stopped.float().mean()), skipped_updates=skipped,
            reward_invalid_frac=0.0 if batch.reward_invalid is None else float(batch.reward_invalid.float().mean()),
            entropy=masked_mean_std(entropy, mask)[0], adv_mean=adv_mean, adv_std=adv_std,
            power_proxy=power_proxy(advantages, energy, mask), adam_variance=adam_moment_variance(self.optimizer),
            lr=lr)
        return out
