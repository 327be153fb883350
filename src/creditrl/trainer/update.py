"""One policy update on a rollout batch, as its named steps:

    old   = statistics(π_θ, batch)                logp, entropy, energy ŵ_t per response token
    A     = advantages(estimator, batch, old)     compute_advantages with R, mask, group, ŵ, ρ̄
    for epoch in 1..μ, for each mini-batch:
        accumulate(micro-batches)               .grad = Σ_i count_i ∇loss_i / Σ_i count_i (exact)
        optimizer_step()                        AdamW after grad-norm clipping; a non-finite loss
                                                or gradient skips the step
In the on-policy single pass (μ = 1, one mini-batch, no micro-batching) the loss's own forward
gives the old statistics (detached), as verl and TRL do: no separate π_old forward.

Precision (``train.precision``, one ``Precision``): trainable weights stay float32; forward and
backward run under bf16 autocast (or fp16 with loss scaling, CUDA only); ``token_stats`` upcasts
one vocabulary chunk at a time, so no [B,T,V] float32 copy of the logits exists.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from creditrl.config import Config
from creditrl.core.estimators import compute_advantages
from creditrl.core.estimators.registry import get_estimator
from creditrl.core.gradients.noise_scale import NoiseScale
from creditrl.core.losses import EntropyControl, power_proxy
from creditrl.core.losses.diagnostics import adam_moment_variance, masked_mean
from creditrl.core.losses.rollout_correction import correction_weights
from creditrl.core.token_stats import TokenStats
from creditrl.runtime.rollout import RolloutBatch, sample_metrics
from creditrl.runtime.precision import Precision
from creditrl.runtime.scoring import response_stats
from creditrl.recipe.resolve import estimator_from_config, precision_of
from creditrl.recipe.build import ConfiguredLoss, policy_loss_from_config
from creditrl.utils.validate import NonFiniteError

@dataclass(frozen=True)
class Batch:
    """A RolloutBatch's tensors on the learner's device; responses are the columns from P on.

    tensors: model inputs [B, P+R] (input_ids, attention_mask, position_ids, response_mask) and
    ``group`` [B]; mask [B,R] float (trained-on tokens); rollout_logp [B,R]; rewards [B];
    components [B,K] and component_weights [K]: the reward terms' own values (None for one); truncated [B]
    bool (the response hit ``rollout.max_new_tokens`` without stopping)."""
    tensors: dict[str, Tensor]
    mask: Tensor
    rollout_logp: Tensor
    rewards: Tensor
    prompt_len: int
    truncated: Tensor
    components: Tensor | None = None
    component_weights: list[float] | None = None

    @classmethod
    def from_rollout(cls, batch: RolloutBatch, device: torch.device) -> "Batch":
        names = ("input_ids", "attention_mask", "position_ids", "response_mask", "group")
        tensors = {k: getattr(batch, k).to(device) for k in names}
        p = batch.prompt_len
        components = None if batch.components is None else batch.components.to(device)
        return cls(tensors, tensors["response_mask"][:, p:], batch.rollout_logp[:, p:].to(device),
                   batch.rewards.to(device), p, ~batch.stopped.to(device), components, batch.component_weights)

    @property
    def size(self) -> int:
        return self.mask.shape[0]

    @property
    def group(self) -> Tensor:
        return self.tensors["group"]


@dataclass(frozen=True)
class Update:
    """One update's result: metrics (floats) and the advantages [B,R] it trained on."""
    metrics: dict[str, float]
    advantages: Tensor


def statistics(model, batch: Batch, rows: Tensor | None, cfg: Config, precision: Precision) -> TokenStats:
    """TokenStats [n, R] of ``rows`` (all when None) under ``precision``; each group's prompt
    runs once per pack of rows (``packed_prompt_stats``). Differentiable unless called under no_grad."""
    t = batch.tensors if rows is None else {k: v[rows] for k, v in batch.tensors.items()}
    with precision.autocast(model):
        return response_stats(model, t["input_ids"], t["attention_mask"], t["position_ids"], t["response_mask"],
                              batch.prompt_len, temperature=cfg.rollout.temperature,
                              chunk_size=cfg.train.chunk_size, group=t["group"])


def statistics_no_grad(model, batch: Batch, cfg: Config, precision: Precision) -> TokenStats:
    """Detached TokenStats of every row, ``optim.micro_batch_size`` rows per forward."""
    chunks = torch.arange(batch.size, device=batch.mask.device).split(cfg.optim.micro_batch_size or batch.size)
    with torch.no_grad():
        return TokenStats.cat([statistics(model, batch, rows, cfg, precision) for rows in chunks]).detach()


def advantages(estimator: str, options: dict, needs_energy: bool, batch: Batch, old: TokenStats,
               correction: tuple[str | None, float]) -> Tensor:
    """[B,R] float32 advantages of ``estimator`` from the rewards, the groups and (OTB/OGB) the
    energies ŵ_t of π_old, times ρ̄_t² under a rollout correction, ρ̄_t the factor the correction puts
    on the token's gradient (its weight, 0 where it drops the token; OTB App. D, eq. 58-60).
    ``correction``: (mode or None, cap). An estimator that reads the reward components (gdpo) gets
    the batch's ``components``."""
    mode, cap = correction
    with torch.no_grad():
        is_weights = None
        if mode is not None and needs_energy:
            is_weights = correction_weights(old.logp - batch.rollout_logp, batch.mask, mode, cap)
        parts = {}
        if batch.components is not None and get_estimator(estimator).reward_components:
            parts = dict(components=batch.components, component_weights=batch.component_weights)
        return compute_advantages(estimator, rewards=batch.rewards, mask=batch.mask, group=batch.group,
                                  energy=old.energy if needs_energy else None, is_weights=is_weights,
                                  **parts, **options).float()


def micro_batches(rows: Tensor, micro: int, halves: int | None) -> list[Tensor]:
    """``rows`` in order, cut into micro-batches of at most ``micro`` rows; with ``halves`` (the
    row where the second half of the groups starts) no micro-batch crosses that row."""
    if halves is None:
        return list(rows.split(micro))
    return [*rows[:halves].split(micro), *rows[halves:].split(micro)]


def half_point(group: Tensor) -> int | None:
    """The first row of the second half of the groups (rows are grouped contiguously), or None
    with fewer than 2 groups."""
    starts = torch.nonzero(torch.diff(group, prepend=group[:1] - 1)).flatten()
    return None if starts.numel() < 2 else int(starts[starts.numel() // 2])


def optimizer_step(optimizer, params: list[Tensor], max_grad_norm: float, finite: bool,
                   scaler=None) -> tuple[float, bool]:
    """Clip and step; a non-finite loss or gradient never reaches the weights. Returns (gradient
    norm before clipping, whether the step was skipped)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    ok = finite and bool(torch.isfinite(grad_norm))
    if scaler is not None:
        if ok:
            scaler.step(optimizer)
        scaler.update()
    elif ok:
        optimizer.step()
    if not ok:                                  # no non-finite gradient is left lying around
        optimizer.zero_grad(set_to_none=True)
    return float(grad_norm), not ok


def mean_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """Each metric's mean over the optimizer steps that reported it."""
    keys = dict.fromkeys(k for step in steps for k in step)
    return {k: sum(step[k] for step in steps if k in step) / sum(k in step for step in steps) for k in keys}


# half a float32 ulp, relative: a change below it of a weight that size is rounded away
RESOLUTION = 2.0 ** -24


class WeightSample:
    """A fixed, evenly strided sample of the trainable weights (up to ``PER_TENSOR`` elements of each
    tensor, each standing for numel/k of its tensor's weights), read before and after a train step
    at the cost of a few thousand copied floats: the update-to-weight ratio and whether the step
    moved any weight beyond float32 resolution (a tiny ``optim.lr`` or ``optim.max_grad_norm``
    moves none; LoRA's B, starting at 0, takes a step of that tiny size)."""
    PER_TENSOR = 64

    def __init__(self, params: list[Tensor]):
        self.params = params
        counts = [min(p.numel(), self.PER_TENSOR) for p in params]
        # integer strides: a float32 linspace rounds positions past 2^24 (an embedding's) out of bounds
        self.index = [torch.arange(k, device=p.device) * (p.numel() - 1) // max(k - 1, 1)
                      for p, k in zip(params, counts)]
        self.weight = torch.cat([torch.full((k,), p.numel() / k, dtype=torch.float64, device=p.device)
                                 for p, k in zip(params, counts)])

    def read(self) -> Tensor:
        return torch.cat([p.detach().reshape(-1)[i] for p, i in zip(self.params, self.index)]).double()

    def update(self, before: Tensor) -> dict[str, float]:
        """Since ``before`` (an earlier ``read``), in float64, each sampled weight weighted by the share
        of its tensor it stands for: ``update_ratio`` ||Δθ|| / ||θ||, and ``moved_frac``, the share of
        weights whose change exceeds ``RESOLUTION`` times the larger of their own size and the model's
        RMS weight (0: the step moved no sampled weight beyond float32 resolution). One host read."""
        delta, w = self.read() - before, self.weight
        norm2 = (w * before.square()).sum()
        moved = delta.abs() > RESOLUTION * torch.maximum(before.abs(), (norm2 / w.sum()).sqrt())
        ratio = ((w * delta.square()).sum() / norm2.clamp_min(torch.finfo(torch.float64).tiny)).sqrt()
        ratio, frac = torch.stack([ratio, (w * moved).sum() / w.sum()]).tolist()
        return {"update_ratio": ratio, "moved_frac": frac}


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


def batch_metrics(rollout: RolloutBatch, batch: Batch, old: TokenStats, adv: Tensor) -> dict[str, float]:
    """What the step sampled (``sample_metrics``: rewards, the share of invalid ones and of groups
    whose rewards are all equal, accuracy, lengths) and what it trained on: entropy, advantages,
    power proxy."""
    mask = batch.mask
    adv_mean, adv_std = masked_mean_std(adv, mask)
    return dict(sample_metrics(rollout), entropy=masked_mean_std(old.entropy, mask)[0], adv_mean=adv_mean,
                adv_std=adv_std, power_proxy=power_proxy(adv, old.energy, mask))


class Learner:
    """Owns the optimizer and schedule, the loss, and the reference policy of a KL term: a frozen
    model, or (LoRA) the policy itself with its adapters disabled — no second copy."""

    def __init__(self, model, cfg: Config, loss: ConfiguredLoss | None = None, *, ref_model=None):
        self.model, self.ref_model, self.cfg = model, ref_model, cfg
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.sample = WeightSample(self.params)
        fused = {"fused": True} if self.params[0].device.type in ("cpu", "cuda") else {}
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                           weight_decay=cfg.optim.weight_decay, **fused)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.precision = precision_of(cfg).require_resolved()     # auto: resolved by the Trainer first
        self.scaler = torch.amp.GradScaler("cuda") if self.precision.scales_loss else None
        self.estimator, self.estimator_options, self.needs_energy = estimator_from_config(cfg)
        self.loss = loss if loss is not None else policy_loss_from_config(cfg)   # the Trainer composes it once
        self.noise = NoiseScale() if cfg.logging.grad_noise_scale else None
        self.skip_error: NonFiniteError | None = None   # why the loss was last non-finite (policy_loss names it)
        bonus = self.loss.loss.options_of("entropy_bonus")        # the configured options (adaptive: β₀, target)
        self.entropy_options = bonus if bonus is not None and bonus.adaptive else None
        self.entropy_control = None if self.entropy_options is None else EntropyControl(bonus.coef)

    def follow_config(self) -> None:
        """Point the optimizer and the schedule at this config's ``optim.lr``, ``weight_decay`` and
        schedule at the scheduler's step (after loading a checkpoint, whose states carry the values
        they were saved with)."""
        lr, factor = self.cfg.optim.lr, lr_lambda(self.cfg)(self.scheduler.last_epoch)
        self.scheduler.base_lrs = [lr] * len(self.optimizer.param_groups)
        for group in self.optimizer.param_groups:
            group.update(initial_lr=lr, lr=lr * factor, weight_decay=self.cfg.optim.weight_decay)

    def apply_entropy_control(self) -> None:
        """Adaptive entropy bonus: the loss applies the controller's β for the coming optimizer step."""
        if self.entropy_control is not None:
            applied = self.entropy_control.loss_options(self.entropy_options)
            self.loss = dataclasses.replace(self.loss, loss=self.loss.loss.with_options("entropy_bonus", applied))

    def observe_entropy(self, metrics: dict[str, float], skipped: bool) -> None:
        """After an optimizer step: the controller reads the step's mean entropy over the bonus's
        tokens (a skipped step changes nothing)."""
        if self.entropy_control is not None and not skipped and "bonus_entropy" in metrics:
            self.entropy_control = self.entropy_control.update(metrics["bonus_entropy"], self.entropy_options)

    def reference_logp(self, batch: Batch) -> Tensor | None:
        """log π_ref [B,R] for the KL term (None without one)."""
        if not self.loss.needs_reference:
            return None
        if self.ref_model is not None:
            return statistics_no_grad(self.ref_model, batch, self.cfg, self.precision).logp
        with self.model.disable_adapter():
            return statistics_no_grad(self.model, batch, self.cfg, self.precision).logp

    def old_statistics(self, batch: Batch, chunks: list[Tensor], fused: bool) -> tuple[TokenStats, list]:
        """π_old's statistics (detached) and, in the fused single pass, each chunk's statistics
        with grad (reused by the loss); otherwise one no-grad pass and no reusable chunks."""
        if not fused:
            return statistics_no_grad(self.model, batch, self.cfg, self.precision), [None] * len(chunks)
        live = [statistics(self.model, batch, rows if len(chunks) > 1 else None, self.cfg, self.precision) for rows in chunks]
        return TokenStats.cat(live).detach(), live

    def update(self, rollout: RolloutBatch, generator: torch.Generator) -> Update:
        """One train step on ``rollout`` (module docstring); returns the metrics and advantages."""
        cfg, batch = self.cfg, Batch.from_rollout(rollout, self.params[0].device)
        mb = min(cfg.optim.minibatch_size or batch.size, batch.size)
        micro = min(cfg.optim.micro_batch_size or mb, mb)
        single_pass = cfg.optim.epochs == 1 and mb == batch.size
        halves = half_point(batch.group) if self.noise is not None and single_pass else None
        first = micro_batches(torch.arange(batch.size, device=batch.mask.device), micro, halves)
        self.model.train()
        old, live = self.old_statistics(batch, first, fused=single_pass and micro == batch.size)
        adv = advantages(self.estimator, self.estimator_options, self.needs_energy, batch, old,
                         self.loss.rollout_correction)
        ref_logp = self.reference_logp(batch)
        applied, rejected = [], []       # each optimizer step's metrics, by whether it changed the weights
        before = self.sample.read()
        for _ in range(cfg.optim.epochs):
            order = torch.arange(batch.size) if single_pass else torch.randperm(batch.size, generator=generator)
            # near-equal mini-batches: a dynamic-sampling batch that kept fewer groups need not divide
            # minibatch_size, and a remainder of a few responses must not take a full optimizer step
            for rows in order.to(batch.mask.device).tensor_split(math.ceil(batch.size / mb)):
                chunks = first if single_pass else micro_batches(rows, micro, None)
                self.optimizer.zero_grad(set_to_none=True)
                self.apply_entropy_control()
                metrics = self.accumulate(batch, chunks, live if single_pass else [None] * len(chunks),
                                          old, adv, ref_logp, halves)
                grad_norm, skip = optimizer_step(self.optimizer, self.params, cfg.optim.max_grad_norm,
                                                 all(math.isfinite(v) for v in metrics.values()), self.scaler)
                self.observe_entropy(metrics, skip)
                raised = set(metrics) == {"loss"}            # the loss refused its inputs: no gradient made
                (rejected if skip else applied).append({**metrics, "grad_norm": math.nan if raised else grad_norm})
        lr = self.step_schedule()
        out = mean_metrics(applied or rejected)     # the updates made; only when none was, the skipped ones
        out.update(batch_metrics(rollout, batch, old, adv), skipped_updates=len(rejected), lr=lr,
                   **self.sample.update(before),
                   adam_variance=adam_moment_variance(self.optimizer), **(self.noise.metrics() if self.noise else {}))
        return Update(out, adv)

    def step_schedule(self) -> float:
        """Advance the learning-rate schedule by one training step, updated or not (a step whose
        dynamic sampling kept no group too: the schedule counts ``train.steps``); returns the lr
        the step had."""
        lr = self.optimizer.param_groups[0]["lr"]
        with warnings.catch_warnings():        # a skipped update is not the misuse torch warns about
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
            self.scheduler.step()
        return lr

    def accumulate(self, batch: Batch, chunks: list[Tensor], live: list, old: TokenStats, adv: Tensor,
                   ref_logp: Tensor | None, halves: int | None) -> dict[str, float]:
        """``.grad`` = Σ_i count_i ∇loss_i / Σ_i count_i over the micro-batches ``chunks`` (count_i
        their aggregation counts): the mini-batch's exact gradient. ``live``: each chunk's
        statistics with grad when the old-statistics forward already made them. With ``halves``
        (the first row of the second half of the groups, a chunk boundary) the two halves'
        gradients also feed the noise scale. Returns the loss metrics of the mini-batch: each micro-batch's
        weighted by the count its mean is over (``LossMetrics.counts``), else by its aggregation count."""
        weighted, weights, total, first_half = {}, {}, 0.0, None
        for rows, stats in zip(chunks, live):
            stats = stats if stats is not None else statistics(self.model, batch, rows, self.cfg, self.precision)
            try:
                loss, metrics = self.loss(stats.logp.float(), old.logp[rows], adv[rows], batch.mask[rows],
                                          ref_logp=None if ref_logp is None else ref_logp[rows],
                                          rollout_logp=batch.rollout_logp[rows], entropy=stats.entropy.float(),
                                          truncated=batch.truncated[rows])
            except NonFiniteError as err:        # NaN/inf log-probs, advantages or a term's output: skip
                self.skip_error = err
                return {"loss": math.nan}
            count = max(metrics.pop("agg_count"), 1e-12) if len(chunks) > 1 else 1.0
            scaled = loss * count
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            for k, v in {**metrics, "loss": float(loss.detach())}.items():
                weight = metrics.counts.get(k, count) if len(chunks) > 1 else 1.0
                weighted[k], weights[k] = weighted.get(k, 0.0) + v * weight, weights.get(k, 0.0) + weight
            total += count
            if halves is not None and int(rows[-1]) + 1 == halves:
                first_half = ([None if p.grad is None else p.grad.detach().clone() for p in self.params], total)
        if first_half is not None:
            self.observe_noise(*first_half, total, batch.group, halves)
        if len(chunks) > 1:
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(total)
        out = {k: v / weights[k] if weights[k] > 0 else 0.0 for k, v in weighted.items()}
        return {**out, "agg_count": total} if len(chunks) > 1 else out   # Σ_i count_i: the mini-batch's

    def observe_noise(self, first: list, count_a: float, total: float, group: Tensor, halves: int) -> None:
        """Feed the noise scale with the two halves' mean gradients g_A = S_A/c_A and
        g_B = (S − S_A)/c_B, S the accumulated Σ count_i ∇loss_i (loss-scaled under fp16), as means
        over their n_A and n_B groups."""
        scale = self.scaler.get_scale() if self.scaler is not None else 1.0
        count_b = total - count_a
        pairs = [(p, s) for p, s in zip(self.params, first) if p.grad is not None or s is not None]
        grads_a = [torch.zeros_like(p) if s is None else s / (count_a * scale) for p, s in pairs]
        grads_b = [(p.grad - (0 if s is None else s)) / (count_b * scale) for p, s in pairs]
        n_a, n_b = group[:halves].unique().numel(), group[halves:].unique().numel()
        self.noise.update(grads_a, grads_b, n_a, n_b)
