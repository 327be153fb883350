"""``off-policy``: CISPO against PPO-clip on stale data, at matched signal (MiniMax-M1 §3.1).

CISPO clips the importance weight under a stop-gradient, −sg(clip(r_t, 1 − ε_low, 1 + ε_high))·A_t·log π_θ,
so a token whose ratio r_t = π_θ/π_old left the trust region still passes A_t·∇log π_θ (scaled by the
bound), where PPO's clipped surrogate max(−A_t r_t, −A_t clip(r_t, ·)) passes 0. The claim: on stale data
CISPO's gradient is the better estimate of the same direction.

Setting. A behaviour policy θ_old: ``builtin:tiny`` warm-started on multiplication with a scratchpad
(``digits``; ``checkpoints`` independent warm starts, seeds seed, seed + 1, ...). The current policy θ:
θ_old after ``rl_steps`` AdamW steps (lr ``rl_lr``) of the plain RLOO policy gradient on fresh groups sampled
from the moving policy, so that θ drifts as a trainer's does between a rollout and a late mini-batch. Groups
of N responses are drawn from θ_old, θ_old's log-probs go to ``batch.rollout_logp``, and each group's exact
gradient at θ (``group_gradients(..., off_policy=True)``: sum over tokens, mean over responses, all
parameters) is taken of three losses on RLOO's advantages A [N, R], token-mean aggregation, and beside them,
on as many groups drawn from θ itself, the plain on-policy RLOO gradient at θ (``on-policy``):

    ppo-clip   −∇ Σ_t max(−A_t r_t, −A_t clip(r_t, 1 − ε_low, 1 + ε_high))   (the flat clip_low / clip_high)
    cispo      Σ_t clip(r_t, 1 − ε_low, 1 + ε_high) A_t ∇log π_θ(y_t)         (the registered ``cispo`` term)
    is         Σ_t r_t A_t ∇log π_θ(y_t) = ∇ Σ_t r_t A_t                         (unclipped)
    on-policy  Σ_t A_t ∇log π_θ(y_t), y ~ π_θ                                   (reference)

The reference is the on-policy gradient: unbiased for ∇J(θ), the gradient every off-policy row tries to
estimate from stale samples, so c and the cosine say how much of it each keeps. ``is`` is the unclipped
token-level importance-weighted surrogate, of which both PPO-clip and CISPO are truncations (they agree with
it wherever no bound binds), measured as ``cispo`` with bounds that never bind (weight = r_t whenever the
±20 log-ratio clamp does not); token-level IS is not the unbiased sequence-level gradient either (that
weight is Π_t r_t). It was the reference as first written; a 48-group probe before any full run left its
mean gradient unresolved (0.4 standard errors: a few tokens with large r_t dominate its noise), so no
efficiency against it was defined (docs/evidence-history.md).

Statistics per checkpoint (``creditrl.core.gradients``, folds of groups): the fraction of valid tokens where
PPO's clip binds (r outside its sign-dependent bounds, ``clip.ratio_bounds``: the token's gradient is 0) and
where CISPO's cap binds (r outside [1 − ε_low, 1 + ε_high]); each row's scale c and cosine against ``on-policy``;
the efficiency at matched signal (V_b/c_b²)/(V_e/c_e²) against ``on-policy`` and CISPO's against PPO-clip; the raw
variance ratio, labelled raw (not a quality measure). Intervals: 95% t over the checkpoints.

Rule (``cispo_outcome``, fixed in code and in docs/evidence-history.md before any full run): the
per-checkpoint efficiency CISPO/PPO-clip, geometric mean with a t-interval over the checkpoints (log
scale): CI above 1 reproduces, below 1 does not, else inconclusive; precondition: PPO's clip binds on
≥ ``MIN_CLIP_FRACTION`` of valid tokens (mean over checkpoints), else inconclusive (the setting did not
produce the condition the claim is about).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from creditrl.core.estimators import compute_advantages
from creditrl.core.gradients import GradientMoments, GradientStats, gradient_quality
from creditrl.core.losses import PolicyLoss
from creditrl.core.losses.clip import ClipOptions, ratio_bounds
from creditrl.core.losses.diagnostics import clamp_log_ratio
from creditrl.runtime.group_gradients import group_gradients, rollout_token_stats
from creditrl.tools import tables
from creditrl.utils.threads import torch_threads
from creditrl_research import gradient_evidence as ge
from creditrl_research import rules
from creditrl_research.experiments.registry import Experiment, register_experiment
from creditrl_research.fixed_policy import load_tiny_checkpoint, sample_groups

REFERENCE = "on-policy"
OFF_ROWS = ("ppo-clip", "cispo", "is")           # measured at θ on groups drawn from θ_old
ROWS = (*OFF_ROWS, REFERENCE)
MIN_CLIP_FRACTION = 0.01     # the precondition: PPO's clip binds on at least 1% of valid tokens
# bounds that never bind: the ±20 log-ratio clamp keeps r in [2.1e-9, 4.9e8], inside [1e-9, 1 + 1e9]
WIDE_CLIP = {"clip_low": 1.0 - 1e-9, "clip_high": 1e9}
CLAIM = "CISPO is more efficient than PPO-clip on stale (off-policy) data at matched signal"


@dataclass(frozen=True)
class OffPolicyConfig:
    task: str = "multiplication"
    digits: int = 1                      # ~13-token responses (grad-variance's short length)
    warm_start_accuracy: float = 0.3
    warm_start_max_steps: int = 800
    checkpoints: int = 4                 # independent warm starts (θ_old), each with its own θ
    group_size: int = 8
    groups: int = 192                    # per checkpoint (~0.2–0.45 s per group at 1 thread on a busy 2-core CPU)
    batch_groups: int = 8                # prompts sampled together (speed only)
    folds: int = 8
    # staleness: θ = θ_old after rl_steps AdamW steps of the plain RLOO gradient, rl_groups groups each
    # (6 steps at lr 3e-4 made PPO's clip bind on 13–16% of tokens in a 32-group probe; the claim is about
    # a few %, so the full preset takes fewer, smaller steps)
    rl_steps: int = 4
    rl_lr: float = 1e-4
    rl_groups: int = 8
    clip_low: float = 0.2                # the flat clip bounds of PPO-clip and CISPO (ClipOptions' defaults)
    clip_high: float | None = None       # None: clip_low
    max_new_tokens: int = 80
    temperature: float = 1.0
    threads: int = 2
    seed: int = 0


PRESETS = {
    "fast": OffPolicyConfig(checkpoints=2, group_size=4, groups=16, batch_groups=4, folds=2, rl_steps=4, rl_lr=1e-3,
                            rl_groups=4, max_new_tokens=16, threads=1),
    "full": OffPolicyConfig(),
}


def validate(cfg: OffPolicyConfig) -> None:
    ClipOptions(cfg.clip_low, cfg.clip_high)           # out-of-range bounds raise, naming the field
    if cfg.checkpoints < 2:
        raise ValueError(f"checkpoints: expected an int >= 2 (the t-interval is over checkpoints), got {cfg.checkpoints}")
    if cfg.groups < 2 * cfg.batch_groups or cfg.groups % cfg.batch_groups:
        raise ValueError(f"groups: expected a multiple of batch_groups ({cfg.batch_groups}) of at least two batches, "
                         f"got {cfg.groups}")
    if cfg.rl_steps < 0 or not cfg.rl_lr >= 0:
        raise ValueError(f"rl_steps, rl_lr: expected rl_steps >= 0 and rl_lr >= 0, got {cfg.rl_steps}, {cfg.rl_lr}")


def row_losses(cfg: OffPolicyConfig) -> dict[str, PolicyLoss]:
    """label -> loss of the three rows (module docstring), token-mean aggregation."""
    clip = {"clip_low": cfg.clip_low, "clip_high": cfg.clip_high}
    return {"ppo-clip": PolicyLoss({"clip": clip}), "cispo": PolicyLoss({"cispo": None, "clip": clip}),
            "is": PolicyLoss({"cispo": None, "clip": WIDE_CLIP})}


def binding_counts(ratio: Tensor, advantages: Tensor, mask: Tensor, clip: ClipOptions) -> tuple[int, int, int]:
    """(tokens where PPO's clip binds, where CISPO's cap binds, valid tokens) over [B, R] ratios r,
    advantages A and the valid-token mask. PPO's clip binds where r is outside its sign-dependent
    bounds (``ratio_bounds``: A > 0 above 1 + ε_high, A < 0 below 1 − ε_low; the gradient is then 0);
    CISPO's cap binds where r is outside [1 − ε_low, 1 + ε_high], whatever the sign of A."""
    lo, hi = ratio_bounds(advantages, clip)
    ppo = ((ratio < lo) | (ratio > hi)) & mask
    cispo = ((ratio < 1.0 - clip.clip_low) | (ratio > 1.0 + clip.high)) & mask
    return int(ppo.sum()), int(cispo.sum()), int(mask.sum())


def advance(model, task, tokenizer, cfg: OffPolicyConfig, rng: random.Random, generator: torch.Generator) -> None:
    """θ_old → θ in place: ``rl_steps`` AdamW steps on −Σ A_t log π_θ / (valid tokens) of fresh groups
    sampled from the moving policy (RLOO's advantages; token-mean, as the default loss at ratio 1)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.rl_lr)
    for _ in range(cfg.rl_steps):
        batch = sample_groups(task, model, tokenizer, cfg.rl_groups, cfg.group_size, temperature=cfg.temperature,
                              max_new_tokens=cfg.max_new_tokens, rng=rng, generator=generator)
        mask = batch.response_mask[:, batch.prompt_len:] > 0
        adv = compute_advantages("rloo", rewards=batch.rewards, mask=mask, group=batch.group)
        logp = rollout_token_stats(model, batch, slice(None), cfg.temperature).logp
        loss = -(adv * logp * mask).sum() / mask.sum().clamp(min=1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    opt.zero_grad(set_to_none=True)


def with_behaviour(old_model, batch, temperature: float):
    """``batch`` with θ_old's log-probs of its sampled tokens in ``rollout_logp`` [B, L] (0 elsewhere)."""
    with torch.no_grad():
        logp = rollout_token_stats(old_model, batch, slice(None), temperature).logp
    mask = batch.response_mask[:, batch.prompt_len:] > 0
    full = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    full[:, batch.prompt_len:] = torch.where(mask, logp.float(), 0.0)
    return dataclasses.replace(batch, rollout_logp=full)


def measure_checkpoint(cfg: OffPolicyConfig, seed: int) -> tuple[GradientStats, dict]:
    """One checkpoint's gradient statistics of the rows at θ over ``cfg.groups`` groups drawn from θ_old,
    and its facts (clip counts, response length, reward, parameters)."""
    task, old_model, tokenizer, _ = load_tiny_checkpoint(cfg.task, cfg.digits, cfg.warm_start_accuracy, seed,
                                                         cfg.warm_start_max_steps)
    torch.manual_seed(seed)
    rng, generator = random.Random(f"off-policy-{seed}"), torch.Generator().manual_seed(seed)
    model = copy.deepcopy(old_model)       # the cached warm start stays θ_old
    advance(model, task, tokenizer, cfg, rng, generator)
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    losses = row_losses(cfg)
    specs = {label: ("rloo", {}) for label in OFF_ROWS}
    clip = ClipOptions(cfg.clip_low, cfg.clip_high)
    moments = GradientMoments(ROWS, sum(p.numel() for p in params), folds=cfg.folds)
    facts = dict.fromkeys(("ppo_binds", "cispo_binds", "tokens", "responses", "reward"), 0.0)
    start = time.perf_counter()
    for b in range(cfg.groups // cfg.batch_groups):
        batch = sample_groups(task, old_model, tokenizer, cfg.batch_groups, cfg.group_size,
                              temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, rng=rng,
                              generator=generator)
        batch = with_behaviour(old_model, batch, cfg.temperature)
        draws = group_gradients(model, batch, specs, temperature=cfg.temperature, params=params,
                                shared_prompts=False, losses=losses, dedupe=True, off_policy=True)
        # the reference: RLOO's plain gradient at θ on groups drawn from θ itself (independent of the
        # rows above: c and the cosine are cross-fitted between units anyway)
        fresh = sample_groups(task, model, tokenizer, cfg.batch_groups, cfg.group_size, temperature=cfg.temperature,
                              max_new_tokens=cfg.max_new_tokens, rng=rng, generator=generator)
        on = group_gradients(model, fresh, {REFERENCE: ("rloo", {})}, temperature=cfg.temperature, params=params,
                             shared_prompts=False)
        # groups are independent draws (RLOO is group-level): each group is its own unit
        moments.add_many(torch.cat([draws.grads, on.grads], dim=1),
                         list(range(b * cfg.batch_groups, (b + 1) * cfg.batch_groups)))
        mask = batch.response_mask[:, batch.prompt_len:] > 0
        with torch.no_grad():   # the ratios at θ, for the clip counts (a forward; the gradients' own is inside)
            logp = rollout_token_stats(model, batch, slice(None), cfg.temperature).logp
        ratio = clamp_log_ratio(logp.double() - batch.rollout_logp[:, batch.prompt_len:].double()).exp()
        adv = compute_advantages("rloo", rewards=batch.rewards, mask=mask, group=batch.group)
        ppo, cispo, tokens = binding_counts(ratio, adv, mask, clip)
        facts["ppo_binds"] += ppo
        facts["cispo_binds"] += cispo
        facts["tokens"] += tokens
        facts["responses"] += mask.shape[0]
        facts["reward"] += float(batch.rewards.sum())
    print(f"[off-policy] seed {seed}: {cfg.groups} groups in {time.perf_counter() - start:.0f}s", flush=True)
    return moments.stats(), {"parameters": moments.dim, **facts}


def run(cfg: OffPolicyConfig, out_dir: Path) -> dict:
    validate(cfg)
    out_dir = Path(out_dir)
    records, rows = [], []
    for c in range(cfg.checkpoints):
        with torch.random.fork_rng(devices=[]), torch_threads(cfg.threads):
            stats, facts = measure_checkpoint(cfg, cfg.seed + c)
        meta = {"checkpoint": c, "ppo_clip_fraction": facts["ppo_binds"] / max(facts["tokens"], 1),
                "cispo_cap_fraction": facts["cispo_binds"] / max(facts["tokens"], 1),
                "response_len": facts["tokens"] / max(facts["responses"], 1),
                "reward_mean": facts["reward"] / max(facts["responses"], 1)}
        records.append({**meta, "parameters": facts["parameters"], "stats": stats.to_dict()})
        rows += ge.quality_rows(stats, REFERENCE, **meta)
        rows += [r for r in ge.quality_rows(stats, REFERENCE, "ppo-clip", **meta) if r["estimator"] == "cispo"]
    tables.write_json(out_dir / "stats.json", records)
    tables.write_csv(out_dir / "quality.csv", rows)
    summary = {"config": asdict(cfg), "parameters": records[0]["parameters"]}
    tables.write_json(out_dir / "summary.json", summary)
    plot(out_dir)
    return summary


def plot(out_dir: Path) -> Path:
    rows = [r for r in tables.read_csv(Path(out_dir) / "quality.csv") if r["baseline"] == REFERENCE]
    fig, (ax_eff, ax_cos) = tables.figure(2, width=5.0)
    for name, members in tables.group_rows(rows, "estimator").items():
        xs = [m["ppo_clip_fraction"] for m in members]
        ax_eff.plot(xs, [m["efficiency"] for m in members], "o", ms=4, label=name)
        ax_cos.plot(xs, [m["cosine"] for m in members], "o", ms=4, label=name)
    ax_eff.axhline(1.0, color="k", lw=0.8, ls=":")
    ax_eff.set(yscale="log", xlabel="fraction of tokens where PPO's clip binds", title="(a) efficiency vs on-policy")
    ax_cos.set(xlabel="fraction of tokens where PPO's clip binds", title="(b) cosine with the on-policy mean gradient")
    ax_eff.legend(fontsize=6)
    return tables.save_figure(fig, Path(out_dir) / "off_policy.png")


def cispo_outcome(statistics) -> str:
    """The rule on the efficiency CISPO/PPO-clip (geometric mean, t-interval over the checkpoints):
    CI above 1 reproduces, below 1 does not, else inconclusive."""
    return rules.interval_outcome(statistics["efficiency CISPO/PPO-clip"], ">", null=1.0)


def cispo_verdict(efficiencies: list[float], clip_fractions: list[float], raw: list[float] | None = None,
                  note: str = "") -> rules.Verdict:
    """The pre-registered verdict from the per-checkpoint efficiencies CISPO/PPO-clip and the fractions of
    valid tokens where PPO's clip binds (module docstring). Undefined efficiencies (a mean gradient not
    resolved above its noise) are left out and counted in the text."""
    finite = [v for v in efficiencies if v > 0 and math.isfinite(v)]
    eff = (ge.cluster_efficiency(finite, "checkpoints") if len(finite) >= 2
           else rules.Estimate(math.nan, math.nan, math.nan, math.nan, len(finite), "checkpoints"))
    frac = sum(clip_fractions) / max(len(clip_fractions), 1)
    met = frac >= MIN_CLIP_FRACTION
    statistics = {"efficiency CISPO/PPO-clip": eff}
    ours = f"efficiency CISPO/PPO-clip {eff} over {len(efficiencies)} checkpoints"
    if raw:
        ours += f" (raw tr Cov ratio, raw: {ge.cluster_efficiency(raw, 'checkpoints')})"
    ours += f"; PPO's clip binds on {100 * frac:.1f}% of valid tokens (mean over checkpoints)"
    if len(finite) < len(efficiencies):
        ours += f"; undefined at {len(efficiencies) - len(finite)} checkpoint(s)"
    why = ("" if met else f"The setting did not produce the condition: PPO's clip bound on {100 * frac:.2f}% < "
           f"{100 * MIN_CLIP_FRACTION:.0f}% of tokens, so the clip's zero gradient cannot matter. ")
    return rules.Verdict(
        CLAIM, "MiniMax-M1 §3.1", "CISPO keeps every token's gradient and matched DAPO's performance in 50% "
        "of the steps (Qwen2.5-32B, AIME); no variance figure", ours,
        "per checkpoint the efficiency at matched signal (V_b/c_b²)/(V_e/c_e²) of CISPO against PPO-clip, c against "
        "the on-policy gradient at θ; geometric mean with a 95% t-interval over the checkpoints (log "
        "scale): above 1 reproduces, below 1 does not, else inconclusive; precondition: PPO's clip binds on ≥ "
        f"{100 * MIN_CLIP_FRACTION:.0f}% of valid tokens (mean over checkpoints), else inconclusive",
        cispo_outcome(statistics) if met else "inconclusive",
        f"{len(efficiencies)} checkpoints: a t-interval over them resolves only effects large against the spread "
        "between warm starts", why + note, statistics=statistics, decide=cispo_outcome, condition_met=met)


def verdicts(out_dir: Path) -> list[rules.Verdict]:
    records = ge.load_stats(out_dir)
    eff, raw = [], []
    for r in records:
        q = gradient_quality(r["stats"], REFERENCE, "ppo-clip")["cispo"]
        eff.append(q.efficiency.value)
        raw.append(q.raw_ratio.value)
    raw = [v for v in raw if v > 0 and math.isfinite(v)]
    steps = tables.read_json(Path(out_dir) / "summary.json")["config"]
    note = (f"θ is θ_old after {steps['rl_steps']} AdamW steps (lr {steps['rl_lr']}); the reference is the "
            "on-policy RLOO gradient at θ (unbiased for ∇J(θ)).")
    return [cispo_verdict(eff, [r["ppo_clip_fraction"] for r in records], raw if len(raw) >= 2 else None, note)]


def report(out_dir: Path, figure_path: str) -> str:
    out_dir = Path(out_dir)
    rows = tables.read_csv(out_dir / "quality.csv")
    summary = tables.read_json(out_dir / "summary.json")
    cfg = summary["config"]
    high = cfg["clip_low"] if cfg["clip_high"] is None else cfg["clip_high"]
    table = []
    for (name, baseline), members in tables.group_rows(
            [{**r, "key": (r["estimator"], r["baseline"])} for r in rows], "key").items():
        cells = {k: ge.cluster_efficiency([m[k] for m in members if m[k] > 0 and math.isfinite(m[k])], "checkpoints")
                 if sum(m[k] > 0 and math.isfinite(m[k]) for m in members) >= 2 else "undefined"
                 for k in ("efficiency", "raw_ratio")}
        table.append({"row": name, "against": baseline, "efficiency": str(cells["efficiency"]),
                      "scale c": str(rules.mean_estimate([m["scale"] for m in members], "checkpoints")),
                      "cosine": str(rules.mean_estimate([m["cosine"] for m in members], "checkpoints")),
                      "raw tr Cov ratio (raw)": str(cells["raw_ratio"])})
    per = tables.group_rows([r for r in rows if r["estimator"] == REFERENCE and r["baseline"] == REFERENCE],
                            "checkpoint")
    clip_rows = [{"checkpoint": c, "PPO clip binds": f"{100 * m[0]['ppo_clip_fraction']:.2f}%",
                  "CISPO cap binds": f"{100 * m[0]['cispo_cap_fraction']:.2f}%",
                  "response length": f"{m[0]['response_len']:.1f}", "reward": f"{m[0]['reward_mean']:.3f}"}
                 for c, m in per.items()]
    lines = ["## CISPO against PPO-clip on stale data, at matched signal (MiniMax-M1 §3.1)\n",
             (f"Setting: `builtin:tiny` ({summary['parameters']:,} parameters) warm-started on `{cfg['task']}` with a "
             f"scratchpad at {cfg['digits']} digit(s) to sampled accuracy {cfg['warm_start_accuracy']}: θ_old, "
             f"{cfg['checkpoints']} independent warm starts (seeds {cfg['seed']}–{cfg['seed'] + cfg['checkpoints'] - 1}); "
             f"θ = θ_old after {cfg['rl_steps']} AdamW steps (lr {cfg['rl_lr']}, {cfg['rl_groups']} groups each) of "
             f"the RLOO policy gradient. {cfg['groups']} groups of N = {cfg['group_size']} per checkpoint drawn from "
             f"θ_old, each group's exact gradient at θ (all parameters, RLOO's advantages, token-mean) under "
             f"PPO-clip and CISPO (ε_low = {cfg['clip_low']}, ε_high = {high}) and the unclipped token-level IS "
             "surrogate Σ r_t A_t ∇log π (what both truncate), against the reference: RLOO's on-policy gradient at θ "
             "on as many groups drawn from θ (unbiased for ∇J(θ)). Intervals: 95% t over the checkpoints.\n"),
             f"![off policy]({figure_path})\n",
             "Per checkpoint, the fraction of valid tokens where each bound binds:\n", tables.markdown_table(clip_rows),
             ("\nEfficiency at matched signal (> 1: fewer groups for the same signal-to-noise), scale c and cosine "
              "against the on-policy reference; the raw ratio is not a quality measure:\n"), tables.markdown_table(table)]
    return "\n".join(lines) + "\n"


EXPERIMENT = register_experiment(Experiment("off-policy", PRESETS, run, verdicts, report, validate))
