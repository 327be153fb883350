"""``stapo-census``: how many tokens does STAPO silence, how large are their gradients, and does
silencing them keep entropy stable? (STAPO §3.2, §5.5)

(i) Census. From the warm-started ``builtin:tiny`` (2-digit multiplication with a scratchpad,
~20% accuracy, the checkpoint of ``otb-stability``'s first seed) sample at least
``census_tokens`` response tokens in training-sized batches (``prompts_per_batch`` × N), give
them GRPO advantages and apply the S2T mask exactly as the trainer does (τ_p = 2e-3, bottom 80%
entropy, per batch). Report the silenced ratio (paper ~0.01%, peak 0.03%) with a bootstrap CI
over batches, and the exact per-token gradient norm ‖∇θ log π(y_t)‖ of silenced tokens against
the other tokens of the same responses (paper: +16.7%), computed for every response holding a
silenced token (capped) and for a random sample of responses.

(ii) Training. GRPO with and without STAPO, seed s from the checkpoint of seed s, in the
unstable regime of ``otb-stability`` (lr 3e-4, no clipping), N = 8 as the paper: the change of
the policy entropy from the first to the last 10% of steps, paired by seed.

Rules (fixed before the full run): (a) ratio reproduces if within 10× of 0.01% (0.001–0.1%),
else does not; (b) gradient-norm ratio reproduces if its 95% CI lies above 1, does not if below,
else inconclusive; (c) |entropy change| without − with STAPO: reproduces if its 95% interval lies
above 0, does not if below, else inconclusive. Every rule is inconclusive with fewer than 10
silenced tokens.
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from creditrl.core.estimators import compute_advantages
from creditrl.core.losses import spurious_token_mask
from creditrl.runtime.group_gradients import per_token_grad_sq_norms, rollout_token_stats
from creditrl.runtime.models import load_policy
from creditrl.runtime.rollout import generate_rollouts
from creditrl.tools import tables
from creditrl_research import rules
from creditrl_research import trainer_runs as studies
from creditrl.tools.compare import mean_std_table
from creditrl_research.experiments.registry import Experiment, register_experiment
from creditrl.tasks import get_task
from creditrl.utils.threads import torch_threads

UNSTABLE = studies.UNSTABLE_STUDY

PAPER_RATIO = 1e-4        # ~0.01% of tokens (STAPO §5.5.1)
RUNS = {"grpo": ["algorithm.estimator=grpo"], "grpo+stapo": ["algorithm.estimator=grpo", "loss.stapo.enabled=true"]}


@dataclass(frozen=True)
class StapoCensusConfig:
    census_tokens: int = 1_000_000
    prompts_per_batch: int = 8           # one training batch: the entropy quantile's pool
    group_size: int = 8
    chunk_batches: int = 16              # batches generated together (speed only)
    max_new_tokens: int = 40
    grad_responses: int = 300            # responses holding silenced tokens whose exact gradients are taken
    random_grad_responses: int = 4       # random responses per chunk for the other tokens' norms
    num_seeds: int = 3                   # training study (ii)
    seed: int = 0
    steps: int = 60
    prompts_per_step: int = 8
    eval_every: int = 0
    eval_problems: int = 64
    eval_samples: int = 4
    pass_k: tuple[int, ...] = (1, 4)
    warm_start_max_steps: int = 0
    bootstrap: int = 2000
    threads: int = 1


PRESETS = {
    "fast": StapoCensusConfig(census_tokens=3000, chunk_batches=2, grad_responses=4, random_grad_responses=1,
                              num_seeds=1, steps=2, prompts_per_step=2, eval_problems=4, warm_start_max_steps=25,
                              bootstrap=100),
    "full": StapoCensusConfig(),
}


def census(cfg: StapoCensusConfig, out_dir: Path) -> None:
    """Sample, mask and measure; writes batches.csv (per batch counts) and tokens.csv (exact norms)."""
    checkpoint = studies.seed_checkpoint(UNSTABLE["task"], studies.warm_start_overrides(cfg, UNSTABLE), cfg.seed,
                                           cfg.threads)
    task = get_task(UNSTABLE["task"])
    model, tokenizer = load_policy(str(checkpoint), task, progress=False)
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    rng, gen = random.Random(f"stapo-census-{cfg.seed}"), torch.Generator().manual_seed(cfg.seed)
    pick = random.Random(cfg.seed + 1)
    batch_rows, token_rows, total, grads_left = [], [], 0, cfg.grad_responses
    while total < cfg.census_tokens:
        problems = [task.sample(rng) for _ in range(cfg.prompts_per_batch * cfg.chunk_batches)]
        batch = generate_rollouts(model, tokenizer, task, problems, group_size=cfg.group_size, temperature=1.0,
                                  max_new_tokens=cfg.max_new_tokens, generator=gen)
        with torch.no_grad():
            stats = rollout_token_stats(model, batch, slice(None), 1.0)
        mask = batch.response_mask[:, batch.prompt_len:] > 0
        adv = compute_advantages("grpo", rewards=batch.rewards, mask=mask, group=batch.group)
        per = cfg.prompts_per_batch * cfg.group_size
        silenced = torch.zeros_like(mask)
        for start in range(0, mask.shape[0], per):  # the trainer's pool: one batch
            rows = slice(start, start + per)
            keep = spurious_token_mask(stats.logp[rows].float(), stats.entropy[rows].float(), adv[rows], mask[rows])
            silenced[rows] = mask[rows] & ~keep
            batch_rows.append({"batch": len(batch_rows), "tokens": int(mask[rows].sum()),
                               "positive_tokens": int((mask[rows] & (adv[rows] > 0)).sum()),
                               "silenced": int(silenced[rows].sum())})
        total += int(mask.sum())
        holders = torch.nonzero(silenced.any(1)).flatten().tolist()[:max(grads_left, 0)]
        grads_left -= len(holders)
        others = pick.sample(range(mask.shape[0]), cfg.random_grad_responses)
        for row in sorted(set(holders) | set(others)):
            sq, _ = per_token_grad_sq_norms(model, params, batch, row, 1.0)
            for t in torch.nonzero(mask[row]).flatten().tolist():
                token_rows.append({"response": f"{len(batch_rows)}-{row}", "sampled": int(row in others),
                                   "silenced": int(silenced[row, t]), "advantage": float(adv[row, t]),
                                   "prob": math.exp(float(stats.logp[row, t])), "entropy": float(stats.entropy[row, t]),
                                   "grad_norm": math.sqrt(float(sq[t]))})
    tables.write_csv(out_dir / "batches.csv", batch_rows)
    tables.write_csv(out_dir / "tokens.csv", token_rows)


def run(cfg: StapoCensusConfig, out_dir: Path) -> dict:
    out_dir = Path(out_dir)
    with torch_threads(cfg.threads):
        census(cfg, out_dir)
    seeds = [cfg.seed + i for i in range(cfg.num_seeds)]
    study = {**UNSTABLE, "overrides": [*UNSTABLE["overrides"], f"rollout.group_size={cfg.group_size}"]}
    dirs = studies.run_study(cfg, study, RUNS, seeds, out_dir / "training", "stapo: GRPO with and without STAPO")
    rows = []
    for name, run_dirs in dirs.items():
        for d in run_dirs:
            evals, metrics = studies.read_history(d)
            tenth = max(1, len(metrics) // 10)
            ent = [m["entropy"] for m in metrics]
            rows.append({"run": name, "seed": studies.seed_of(d),
                         "entropy_start": sum(ent[:tenth]) / tenth, "entropy_end": sum(ent[-tenth:]) / tenth,
                         "entropy_change": (sum(ent[-tenth:]) - sum(ent[:tenth])) / tenth,
                         "abs_entropy_change": abs(sum(ent[-tenth:]) - sum(ent[:tenth])) / tenth,
                         "silenced_ratio": sum(m.get("spurious_ratio", 0.0) for m in metrics) / len(metrics),
                         "end_acc": evals[-1]["sampled_acc"], "start_acc": evals[0]["sampled_acc"]})
    tables.write_csv(out_dir / "training.csv", rows)
    summary = {"config": asdict(cfg), "seeds": seeds}
    tables.write_json(out_dir / "summary.json", summary)
    plot(out_dir, dirs)
    return summary


def plot(out_dir: Path, dirs: dict[str, list[Path]]) -> Path:
    tokens = tables.read_csv(out_dir / "tokens.csv")
    fig, (ax_g, ax_e) = tables.figure(2, width=4.4)
    for silenced, label in ((0, "other tokens"), (1, "silenced (spurious)")):
        xs = [r["prob"] for r in tokens if r["silenced"] == silenced]
        ys = [r["grad_norm"] for r in tokens if r["silenced"] == silenced]
        ax_g.scatter(xs, ys, s=3 if silenced == 0 else 9, alpha=0.3 if silenced == 0 else 0.9, label=label)
    ax_g.set(xscale="log", xlabel="π(y_t)", ylabel="‖∇θ log π(y_t)‖", title="(a) exact per-token gradient norm")
    ax_g.legend(fontsize=7)
    for name, run_dirs in dirs.items():
        for i, d in enumerate(run_dirs):
            _, metrics = studies.read_history(d)
            ax_e.plot([m["step"] for m in metrics], [m["entropy"] for m in metrics], lw=0.9,
                      color="C0" if name == "grpo" else "C1", label=name if i == 0 else None)
    ax_e.set(xlabel="step", ylabel="policy entropy", title="(b) entropy, lr 3e-4, no clipping")
    ax_e.legend(fontsize=7)
    return tables.save_figure(fig, out_dir / "stapo_census.png")


def _norm_ratio(tokens: list[tables.Row], n_boot: int) -> rules.Estimate:
    """Mean gradient norm of silenced tokens / of the other tokens (both resampled over tokens)."""
    a = torch.tensor([r["grad_norm"] for r in tokens if r["silenced"]], dtype=torch.float64)
    b = torch.tensor([r["grad_norm"] for r in tokens if not r["silenced"]], dtype=torch.float64)
    if a.numel() == 0 or b.numel() == 0:
        return rules.Estimate(math.nan, math.nan, math.nan, math.nan, int(a.numel()), "silenced tokens")
    gen = torch.Generator().manual_seed(0)
    ia = torch.randint(0, a.numel(), (n_boot, a.numel()), generator=gen)
    ib = torch.randint(0, b.numel(), (n_boot, b.numel()), generator=gen)
    boots = a[ia].mean(-1) / b[ib].mean(-1)
    low, high = torch.quantile(boots, torch.tensor([0.025, 0.975], dtype=torch.float64))
    return rules.Estimate(float(a.mean() / b.mean()), float(low), float(high), math.nan, int(a.numel()),
                              "silenced tokens")


def verdicts(out_dir: Path) -> list[rules.Verdict]:
    out_dir = Path(out_dir)
    cfg = tables.read_json(out_dir / "summary.json")["config"]
    batches = tables.read_csv(out_dir / "batches.csv")
    tokens = tables.read_csv(out_dir / "tokens.csv")
    total = sum(b["tokens"] for b in batches)
    silenced = sum(b["silenced"] for b in batches)
    enough = silenced >= 10
    ratio = rules.paired_ratio([b["silenced"] for b in batches], [b["tokens"] for b in batches],
                                   n_boot=cfg["bootstrap"], unit="batches")
    per_batch = [b["silenced"] / b["tokens"] for b in batches if b["tokens"]]
    why_few = "" if enough else f"Only {silenced} tokens were silenced (rule: inconclusive below 10)."
    out = [rules.Verdict(
        "STAPO silences ~0.01% of tokens", "STAPO §5.5.1", "~0.01% (peak 0.03%)",
        f"{100 * ratio.value:.4f}% [{100 * ratio.low:.4f}, {100 * ratio.high:.4f}]% of {total} tokens "
        f"({silenced} silenced; peak batch {100 * max(per_batch):.3f}%)",
        "reproduces if within 10× of 0.01% (0.001–0.1%), else does not; inconclusive below 10 silenced tokens",
        "inconclusive" if not enough else "reproduces" if 1e-5 <= ratio.value <= 1e-3 else "does not reproduce",
        f"{len(batches)} batches of {cfg['prompts_per_batch']}×{cfg['group_size']} responses; the CI's width bounds "
        "what can be resolved", why_few)]
    norm = _norm_ratio(tokens, cfg["bootstrap"])
    n_sil = sum(r["silenced"] for r in tokens)
    # like for like: silenced tokens against other tokens as improbable (π < τ_p) but high-entropy
    rare = _norm_ratio([r for r in tokens if r["silenced"] or r["prob"] < 2e-3], cfg["bootstrap"])
    kept_rare = sum(1 for r in tokens if not r["silenced"] and r["prob"] < 2e-3)
    magnitude = (f"The magnitude is not the paper's: ‖∇ log π(y_t)‖ grows as π(y_t) falls and every silenced token "
                 f"has π < 2e-3; against the other tokens with π < 2e-3 (kept for their high entropy, "
                 f"{kept_rare} of them) the ratio "
                 f"is {rare}.")
    out.append(rules.Verdict(
        "Silenced tokens have larger gradient norms than the others", "STAPO §3.2, Fig. 2b", "+16.7%",
        f"ratio {norm} ({n_sil} silenced vs {len(tokens) - n_sil} other tokens with exact norms)",
        "CI of the mean-norm ratio above 1 reproduces, below 1 does not, else inconclusive; inconclusive below 10 "
        "silenced tokens", "inconclusive" if n_sil < 10 else rules.interval_outcome(norm, ">", null=1.0),
        "bootstrap over tokens (tokens of one response are correlated: the interval is optimistic)",
        why_few or magnitude))
    training = tables.read_csv(out_dir / "training.csv")
    stable = studies.paired(training, "grpo", "grpo+stapo", "abs_entropy_change")
    acc = studies.paired(training, "grpo+stapo", "grpo", "end_acc")
    fired = sum(studies.by_seed(training, "grpo+stapo", "silenced_ratio").values())
    out.append(rules.Verdict(
        "STAPO keeps the entropy stable", "STAPO §5.2", "avoids late-stage collapse, entropy stays stable",
        f"|entropy change| without − with STAPO {stable}; end accuracy with − without {acc}",
        "95% interval of the paired |entropy change| difference above 0 reproduces, below 0 does not, else "
        "inconclusive", rules.interval_outcome(stable) if fired > 0 else "inconclusive",
        f"{stable.n} seeds; detectable ≥ {tables.fmt(stable.detectable)}",
        "" if fired > 0 else "STAPO silenced nothing during training."))
    return out


def report(out_dir: Path, figure_path: str) -> str:
    out_dir = Path(out_dir)
    cfg = tables.read_json(out_dir / "summary.json")["config"]
    training = tables.read_csv(out_dir / "training.csv")
    return "\n".join([
        "## STAPO: census of spurious tokens and entropy under an unstable learning rate (STAPO §3.2, §5.5)\n",
        f"Setting: (i) ≥ {cfg['census_tokens']} tokens sampled from `builtin:tiny` warm-started to ~20% on 2-digit "
        f"multiplication (the checkpoint of `otb-stability`'s first seed), batches of {cfg['prompts_per_batch']} "
        f"prompts × "
        f"{cfg['group_size']}, GRPO advantages, the trainer's S2T mask (τ_p = 2e-3, bottom 80% entropy); exact "
        "per-token gradients for responses holding silenced tokens and for random responses. (ii) GRPO with and "
        f"without STAPO, N = {cfg['group_size']}, lr 3e-4, no clipping, {cfg['num_seeds']} seeds × {cfg['steps']} "
        "steps, each seed from its own checkpoint (shared with `otb-stability`).\n",
        f"![stapo census]({figure_path})\n", mean_std_table(training, ["entropy_start", "entropy_end",
                                                                      "entropy_change", "silenced_ratio",
                                                                      "start_acc", "end_acc"])])


EXPERIMENT = register_experiment(Experiment("stapo-census", PRESETS, run, verdicts, report))
