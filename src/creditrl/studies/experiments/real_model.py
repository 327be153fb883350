"""``real-model``: OTB's claims on a real pretrained model, SmolLM2-135M-Instruct, with
chat-templated arithmetic exactly as ``creditrl train --config smollm2-addition`` prompts it.

(a) Energy against length (OTB §6.4, Fig. 11): chat answers vary in length within a group (unlike
    the tiny model's fixed-shape scratchpads). For every sampled response: its total energy
    W = Σ_t ŵ_t (eq. 7) and its length; the within-group Spearman correlation, averaged over groups
    with a length spread, with a bootstrap CI over groups. The paper: longer responses have lower
    energy inside a group, so OPO's length proxy (longer = more variance) is wrong.
(b) Exact gradient variance (OTB §5.2–5.3): per-group gradients of all 135M parameters for
    ``rloo``, ``ogb``, ``otb`` and ``otb_isolated`` on the same responses (paired); ``dr_grpo`` is
    exactly (N−1)/N × ``rloo`` (tested in ``test_dr_grpo_gradient_is_scaled_rloo``), so its
    variance is ((N−1)/N)² × RLOO's and is not recomputed. tr Cov is estimated without bias from
    pairs of i.i.d. groups, ‖g₁ − g₂‖²/2, with g₁ − g₂ taken in one backward (``pair_difference_sq``).

Rules (fixed before the full run): (a) the CI of the mean within-group Spearman below 0
reproduces, above 0 does not, else inconclusive; inconclusive if fewer than 5 groups have a length
spread. (b) per rival a paired bootstrap CI (over pairs) of tr Cov(OTB)/tr Cov(rival) below 1 is a
win, above 1 a loss; all wins reproduces, some partly, none with a loss does not, else inconclusive.

A short learning-curve comparison on this model (OTB N=4 against GRPO N=4 and N=16) is not part of
the preset: on this CPU one GRPO N=16 step of SmolLM2 takes ~25 s, so the 15-minute budget allows
one seed of ~8 steps, which cannot detect any difference (see docs/results.md).

Revision (after seed sets 0 and 200 of the previous design, before the runs reported now): with 8
pairs the two seed sets disagreed on OTB/OGB, 0.907 [0.885, 0.952] against 0.986 [0.926, 1.03]: the
effect (~5%) sat at the interval's resolution. ``pair_difference_sq`` (one forward of both groups
with shared prompts, one backward per estimator) made a pair 1.7× cheaper, and the pairs went
from 8 to 20 in about the same time.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from creditrl.studies import reporting
from creditrl.utils.threads import torch_threads
from creditrl.studies.experiments.grad_variance import estimator_advantages, flat_grad, response_tokens
from creditrl.studies.experiments.proxy_fidelity import spearman

DERIVED = {"dr_grpo": "rloo"}    # estimator -> the one it is an exact multiple of


@dataclass(frozen=True)
class RealModelConfig:
    model: str = "builtin:smollm2-135m"
    task: str = "addition"
    digits: int = 1                      # SmolLM2 solves ~40% of 1-digit sums (2 digits: ~9%, so most groups
                                         # had no correct answer and no gradient)
    group_size: int = 8
    length_groups: int = 48              # (a): forward passes only
    variance_groups: int = 40            # (b): 20 pairs of groups, exact gradients (~27 s per pair here)
    estimators: tuple[str, ...] = ("rloo", "ogb", "otb", "otb_isolated")
    max_new_tokens: int = 48             # 0: the trainer's default (24 here, which cuts a third of the answers)
    temperature: float = 1.0
    bootstrap: int = 2000
    threads: int = 2
    seed: int = 0


PRESETS = {
    "fast": RealModelConfig(model="builtin:tiny", digits=2, length_groups=4, variance_groups=4, group_size=4,
                            estimators=("rloo", "otb"), max_new_tokens=8, bootstrap=100, threads=1),
    "full": RealModelConfig(),
}


def load(cfg: RealModelConfig):
    """(task, model, tokenizer, params, max_new_tokens) configured exactly as ``creditrl train`` does."""
    from creditrl.config import load_config
    from creditrl.runtime.setup import build_task, default_max_new_tokens, load_configured_policy

    train_cfg = load_config(None, [f"model.name={cfg.model}", f"task.name={cfg.task}",
                                   f"task.options.digits={cfg.digits}", f"train.seed={cfg.seed}",
                                   "model.warm_start.max_steps=25"])
    task = build_task(train_cfg)
    model, tokenizer = load_configured_policy(train_cfg, task, "cpu", progress=False)
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    return task, model, tokenizer, params, cfg.max_new_tokens or default_max_new_tokens(task, tokenizer)


def sample(cfg: RealModelConfig, task, model, tokenizer, max_new: int, count: int, rng, gen):
    from creditrl.runtime.rollout import generate_rollouts

    problems = [task.sample(rng) for _ in range(count)]
    return generate_rollouts(model, tokenizer, task, problems, group_size=cfg.group_size,
                             temperature=cfg.temperature, max_new_tokens=max_new, generator=gen)


def energy_vs_length(cfg, task, model, tokenizer, max_new, rng, gen) -> list[reporting.Row]:
    rows = []
    for first in range(0, cfg.length_groups, 8):
        batch = sample(cfg, task, model, tokenizer, max_new, min(8, cfg.length_groups - first), rng, gen)
        with torch.no_grad():
            stats = response_tokens(model, batch, slice(None), cfg.temperature, shared_prompts=True)
        mask = batch.response_mask[:, batch.prompt_len:] > 0
        energy = torch.where(mask, stats.energy.double(), 0.0).sum(1)
        for i in range(mask.shape[0]):
            rows.append({"group": first + int(batch.group[i]), "length": int(mask[i].sum()),
                         "energy": float(energy[i]), "reward": float(batch.rewards[i]),
                         "stopped": int(batch.stopped[i])})
    return rows


def pair_difference_sq(model, params, batch, estimators: tuple[str, ...], temperature: float) -> list[float]:
    """‖g₁ − g₂‖²/2 of each estimator for one batch of two groups (token-mean gradients).

    g₁ − g₂ is itself the gradient of (group 1's loss − group 2's), so each estimator costs one
    backward through one forward of both groups (each prompt runs once)."""
    stats = response_tokens(model, batch, slice(None), temperature, shared_prompts=True)
    mask = batch.response_mask[:, batch.prompt_len:] > 0
    adv = estimator_advantages(batch, stats.energy.detach().float(), mask, estimators, 0)
    tokens = torch.zeros(2).index_add_(0, batch.group, mask.sum(1).float()).clamp(min=1)
    weight = ((1 - 2 * batch.group) / tokens[batch.group])[:, None]  # +1/|group 1|, −1/|group 2| per row
    return [float(flat_grad(stats.logp, params, adv[e] * weight, retain=e < len(estimators) - 1)
                  .double().pow(2).sum()) / 2 for e in range(len(estimators))]


def pair_variances(cfg, task, model, tokenizer, params, max_new, rng, gen) -> list[reporting.Row]:
    """‖g₁ − g₂‖²/2 per estimator for each pair of i.i.d. groups (unbiased tr Cov per pair)."""
    rows = []
    start = time.perf_counter()
    for pair in range(cfg.variance_groups // 2):
        batch = sample(cfg, task, model, tokenizer, max_new, 2, rng, gen)
        sq = pair_difference_sq(model, params, batch, cfg.estimators, cfg.temperature)
        mask = batch.response_mask[:, batch.prompt_len:] > 0
        rewards = batch.rewards.view(2, -1)
        for e, name in enumerate(cfg.estimators):
            rows.append({"pair": pair, "estimator": name, "variance": sq[e], "reward_mean": float(rewards.mean()),
                         "mixed_groups": int(((rewards.min(1).values != rewards.max(1).values)).sum()),
                         "response_len": float(mask.sum() / mask.shape[0])})
        print(f"[real-model] pair {pair + 1}/{cfg.variance_groups // 2} at {time.perf_counter() - start:.0f}s",
              flush=True)
    for derived, base in DERIVED.items():
        scale = ((cfg.group_size - 1) / cfg.group_size) ** 2
        rows += [{**r, "estimator": derived, "variance": r["variance"] * scale} for r in rows if r["estimator"] == base]
    return rows


def run(cfg: RealModelConfig, out_dir: Path) -> dict:
    if cfg.variance_groups < 2 or cfg.variance_groups % 2:
        raise ValueError(f"variance_groups: expected an even number >= 2, got {cfg.variance_groups}")
    out_dir = Path(out_dir)
    with torch.random.fork_rng(devices=[]), torch_threads(cfg.threads):
        torch.manual_seed(cfg.seed)
        task, model, tokenizer, params, max_new = load(cfg)
        rng, gen = random.Random(f"real-model-{cfg.seed}"), torch.Generator().manual_seed(cfg.seed)
        reporting.write_csv(out_dir / "responses.csv", energy_vs_length(cfg, task, model, tokenizer, max_new, rng, gen))
        reporting.write_csv(out_dir / "pairs.csv", pair_variances(cfg, task, model, tokenizer, params, max_new, rng, gen))
    summary = {"config": asdict(cfg), "parameters": sum(p.numel() for p in params), "max_new_tokens": max_new,
               "format": getattr(task, "format", "")}
    reporting.write_json(out_dir / "summary.json", summary)
    plot(out_dir)
    return summary


def group_spearmans(rows: list[reporting.Row]) -> list[float]:
    """Within-group Spearman(energy, length) of every group whose lengths and energies vary."""
    out = []
    for members in reporting.group_rows(rows, "group").values():
        length = torch.tensor([m["length"] for m in members], dtype=torch.float64)
        energy = torch.tensor([m["energy"] for m in members], dtype=torch.float64)
        if length.unique().numel() > 1 and energy.unique().numel() > 1:
            out.append(spearman(energy, length))
    return out


def plot(out_dir: Path) -> Path:
    rows = reporting.read_csv(out_dir / "responses.csv")
    fig, (ax_all, ax_group) = reporting.figure(2, width=4.4)
    ax_all.scatter([r["length"] for r in rows], [r["energy"] for r in rows], s=5, alpha=0.5)
    ax_all.set(xlabel="response length (tokens)", ylabel="total energy Σ_t ŵ_t", title="(a) batch-wide")
    for i, members in enumerate(list(reporting.group_rows(rows, "group").values())[:8]):
        ax_group.plot(*zip(*sorted((m["length"], m["energy"]) for m in members)), marker="o", ms=3, lw=0.8)
    ax_group.set(xlabel="response length (tokens)", ylabel="total energy Σ_t ŵ_t", title="(b) within 8 groups")
    return reporting.save_figure(fig, out_dir / "real_model.png")


def verdicts(out_dir: Path) -> list[reporting.Verdict]:
    out_dir = Path(out_dir)
    cfg = reporting.read_json(out_dir / "summary.json")["config"]
    responses = reporting.read_csv(out_dir / "responses.csv")
    rhos = torch.tensor(group_spearmans(responses), dtype=torch.float64)
    per_token = torch.tensor([r["energy"] / r["length"] for r in responses if r["length"]], dtype=torch.float64)
    clipped = sum(1 - r["stopped"] for r in responses) / max(len(responses), 1)
    n = rhos.numel()
    if n:
        low, high = reporting.bootstrap_ci(lambda idx: rhos[idx].mean(-1), n, n_boot=cfg["bootstrap"],
                                           generator=torch.Generator().manual_seed(0))
        rho = reporting.Estimate(float(rhos.mean()), float(low), float(high), math.nan, n, "groups")
    else:
        rho = reporting.Estimate(math.nan, math.nan, math.nan, math.nan, 0, "groups")
    outcome = "inconclusive" if n < 5 else reporting.interval_outcome(rho, "<")
    out = [reporting.Verdict(
        "Within a group, longer responses carry less total energy (SmolLM2)", "OTB §6.4, Fig. 11",
        "longer sequences possess lower energy inside a group",
        f"mean within-group Spearman(Σŵ, length) {rho} over {n} groups with a length spread",
        "bootstrap CI over groups below 0 reproduces, above 0 does not, else inconclusive; inconclusive with < 5 "
        "groups", outcome, f"{n} groups (of {cfg['length_groups']}); the CI width is the resolution",
        f"The energy per token is nearly constant here (mean {float(per_token.mean()):.2f}, sd "
        f"{float(per_token.std()) if per_token.numel() > 1 else 0.0:.2f} over responses), so the total grows with "
        f"the length; {100 * clipped:.0f}% of responses reached the token cap. The paper's observation is on "
        "reasoning traces of thousands of tokens, a regime this CPU cannot sample.")]
    pairs = reporting.read_csv(out_dir / "pairs.csv")
    by_est = reporting.group_rows(pairs, "estimator")
    if "otb" in by_est:
        rivals = [r for r in ("dr_grpo", "rloo", "ogb") if r in by_est]
        V = {name: torch.tensor([m["variance"] for m in members], dtype=torch.float64)
             for name, members in by_est.items()}
        est = {r: reporting.paired_ratio(V["otb"], V[r], n_boot=cfg["bootstrap"], unit="pairs") for r in rivals}
        informative = sum(1 for m in by_est["otb"] if m["mixed_groups"] > 0)
        outcome = "inconclusive" if informative < 5 else reporting.ratios_below_one(list(est.values()))
        iso = ""
        if "otb_isolated" in V:
            iso = f"; OTB/isolated {float(V['otb'].mean() / V['otb_isolated'].mean()):.3f}"
        out.append(reporting.Verdict(
            "OTB lowers the exact gradient variance on a real model (SmolLM2-135M)", "OTB §5.2–5.3",
            "lower variance than OGB and the group-mean baselines",
            ", ".join(f"OTB/{r} {e}" for r, e in est.items()) + iso,
            "per rival a paired bootstrap CI over pairs of groups below 1 is a win, above 1 a loss; all wins "
            "reproduces, some partly, none with a loss does not, else inconclusive; inconclusive with fewer than 5 "
            "pairs holding a group with mixed rewards (the others have no gradient)", outcome,
            f"{V['otb'].numel()} pairs of groups; only groups with mixed rewards carry signal "
            f"({sum(m['mixed_groups'] for m in by_est['otb'])} of {2 * V['otb'].numel()})"))
    return out


def report(out_dir: Path, figure_path: str) -> str:
    out_dir = Path(out_dir)
    summary = reporting.read_json(out_dir / "summary.json")
    cfg = summary["config"]
    responses = reporting.read_csv(out_dir / "responses.csv")
    pairs = reporting.read_csv(out_dir / "pairs.csv")
    table = []
    for name, members in reporting.group_rows(pairs, "estimator").items():
        v = [m["variance"] for m in members]
        table.append({"estimator": name, "pairs": len(v), "tr Cov": sum(v) / len(v),
                      "derived": f"exactly ((N−1)/N)² × {DERIVED[name]}" if name in DERIVED else "measured"})
    lengths = [r["length"] for r in responses]
    return "\n".join([
        "## A real model: SmolLM2-135M-Instruct (OTB §5.2–5.3, §6.4)\n",
        f"Setting: `{cfg['model']}` ({summary['parameters']:,} parameters) on {cfg['digits']}-digit "
        f"`{cfg['task']}` in the "
        f"`{summary['format']}` format (chat template, as `creditrl train --config smollm2-addition`), N = "
        f"{cfg['group_size']}, temperature {cfg['temperature']}, up to {summary['max_new_tokens']} new tokens; "
        f"(a) {cfg['length_groups']} groups, responses of {min(lengths)}–{max(lengths)} tokens (mean "
        f"{sum(lengths) / len(lengths):.1f}), mean reward {sum(r['reward'] for r in responses) / len(responses):.2f}; "
        f"(b) {cfg['variance_groups']} groups in i.i.d. pairs, exact gradients of all parameters (token-mean "
        "normaliser), the same responses for every estimator. The model is not trained here.\n",
        f"![real model]({figure_path})\n", reporting.markdown_table(table),
        "A learning-curve comparison on this model is not in the preset: one GRPO N=16 step of SmolLM2 takes "
        "~25 s on this CPU, so 15 minutes allow one seed of ~8 steps — no power to detect anything.\n"])
