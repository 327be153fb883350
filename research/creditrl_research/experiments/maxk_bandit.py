"""``maxk-bandit``: bias and variance of max@K policy gradients on softmax bandits (MaxPO §5.1, App. G.1).

Instance: n actions with rewards r ~ N(0,1) and logits θ ~ N(0,1), policy π = softmax(θ).
Objective J(θ) = E[max of K i.i.d. rewards]. With actions sorted by reward (r_(1) < … < r_(n))
and F_j = Σ_{i≤j} π_(i), P(max = r_(j)) = F_j^K − F_{j−1}^K, so J = Σ_j r_(j) (F_j^K − F_{j−1}^K)
exactly; ∇_θ J comes from autograd on that closed form (the truth, no sampling).

Estimators from one group of N i.i.d. actions y_1..y_N (score s_i = e_{y_i} − π):
  g = (K/N) Σ_i A_i s_i,  since ∇J = E[(K/N) Σ_i μ_i s_i] and μ_i = EI_i + (a term free of y_i),
with A_i = EI_i (EI), EI_i − b_i^{L2O} = μ_i − ν_i (EI+L2O, MaxPO eq. 6/11) or
EI_i − mean_{j≠i} EI_j on the full pool (EI+L1O: EI_j uses y_i as a comparator, so the
baseline depends on y_i and the estimator is biased). Everything is vectorised over
instances × batches × group members through ``creditrl.maxk_quantities``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from creditrl.core.estimators.maxk import maxk_quantities
from creditrl.tools import tables
from creditrl_research import rules
from creditrl_research.experiments.registry import Experiment, register_experiment
from creditrl.utils.threads import torch_threads

ESTIMATORS = ("EI", "EI+L2O", "EI+L1O")


@dataclass(frozen=True)
class BanditConfig:
    seeds: int = 20                      # independent instances (r, θ); results are mean ± SE over them
    num_actions: int = 32                # n for the bias plot and the K sweep
    group_size: int = 16                 # N, actions per batch (group)
    k: int = 4                           # K for the bias plot and the n sweep
    bias_batches: tuple[int, ...] = (1, 3, 10, 30, 100, 300, 1000, 3000, 10000, 30000)
    variance_batches: int = 2000         # batches per variance estimate
    actions_sweep: tuple[int, ...] = (2, 8, 32, 128, 512)
    k_sweep: tuple[int, ...] = (1, 2, 4, 8, 12, 15)
    seed: int = 0
    chunk_elements: int = 4_000_000      # bound on S·M·n per vectorised draw (memory)
    threads: int = 1                     # torch CPU threads (see creditrl.utils.threads.torch_threads)


PRESETS = {
    "fast": BanditConfig(seeds=8, num_actions=16, group_size=8, k=3,
                         bias_batches=(10, 100, 1000, 10000, 40000), variance_batches=300,
                         actions_sweep=(2, 16, 128), k_sweep=(1, 3, 7)),
    "full": BanditConfig(),
}


def sample_instances(seeds: int, num_actions: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Rewards and logits [S, n], float64, i.i.d. N(0, 1) (MaxPO App. G.1 eq. 109)."""
    rewards = torch.randn(seeds, num_actions, generator=generator, dtype=torch.float64)
    logits = torch.randn(seeds, num_actions, generator=generator, dtype=torch.float64)
    return rewards, logits


def maxk_objective(rewards: Tensor, logits: Tensor, k: int) -> Tensor:
    """Exact J = E[max of K i.i.d. draws] per instance, [S]; differentiable in ``logits``."""
    order = rewards.argsort(dim=-1)
    probs = torch.softmax(logits, dim=-1).gather(-1, order)
    cdf = probs.cumsum(dim=-1).clamp(max=1.0)
    cdf_before = torch.cat([torch.zeros_like(cdf[..., :1]), cdf[..., :-1]], dim=-1)
    return (rewards.gather(-1, order) * (cdf.pow(k) - cdf_before.pow(k))).sum(dim=-1)


def true_gradient(rewards: Tensor, logits: Tensor, k: int) -> Tensor:
    """∇_θ J [S, n] by autograd through ``maxk_objective`` (instances are independent)."""
    theta = logits.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(maxk_objective(rewards, theta, k).sum(), theta)
    return grad


def gradient_estimates(rewards: Tensor, logits: Tensor, actions: Tensor, k: int) -> dict[str, Tensor]:
    """Per-batch PG estimates g = (K/N) Σ_i A_i (e_{y_i} − π) for each estimator.

    rewards, logits: [S, n]; actions: [S, M, N] int64 (M batches of N actions per instance).
    Returns {estimator: [S, M, n] float64}.
    """
    S, M, N = actions.shape
    n = rewards.shape[-1]
    r = rewards.gather(-1, actions.reshape(S, M * N)).reshape(-1)
    group = torch.arange(S * M).repeat_interleave(N)
    stats = maxk_quantities(r, group, k)
    ei = stats.ei.reshape(S, M, N)
    ei_sum = ei.sum(dim=-1, keepdim=True)
    advantages = {
        "EI": ei,
        "EI+L2O": (stats.mu - stats.nu).reshape(S, M, N),
        "EI+L1O": ei - (ei_sum - ei) / (N - 1),
    }
    probs = torch.softmax(logits, dim=-1)[:, None, :]  # [S, 1, n]
    out = {}
    for name, adv in advantages.items():
        onehot_part = torch.zeros(S, M, n, dtype=torch.float64).scatter_add_(-1, actions, adv)
        out[name] = (k / N) * (onehot_part - adv.sum(dim=-1, keepdim=True) * probs)
    return out


def sample_actions(logits: Tensor, batches: int, group_size: int, generator: torch.Generator) -> Tensor:
    """[S, M, N] i.i.d. actions from softmax(logits) per instance."""
    S = logits.shape[0]
    probs = torch.softmax(logits, dim=-1)
    flat = torch.multinomial(probs, batches * group_size, replacement=True, generator=generator)
    return flat.reshape(S, batches, group_size)


def _chunks(total: int, size: int):
    done = 0
    while done < total:
        step = min(size, total - done)
        yield step
        done += step


def estimate_moments(rewards: Tensor, logits: Tensor, k: int, group_size: int, batches: int,
                     generator: torch.Generator, chunk_elements: int,
                     checkpoints: tuple[int, ...] = ()) -> dict[str, dict[str, Tensor]]:
    """Sum and sum of squares of ``batches`` estimates per estimator, in memory-bounded chunks.

    Returns {estimator: {"sum": [S,n], "sumsq": [S,n], "prefix": [len(checkpoints), S, n]}}
    where prefix[c] is the sum of the first checkpoints[c] estimates (running-mean curves).
    """
    S, n = rewards.shape
    per_chunk = max(1, chunk_elements // (S * n * group_size))
    bounds = sorted(set(checkpoints) | {batches})
    acc = {e: {"sum": torch.zeros(S, n, dtype=torch.float64), "sumsq": torch.zeros(S, n, dtype=torch.float64),
               "prefix": []} for e in ESTIMATORS}
    done = 0
    for bound in bounds:  # loop over checkpoints/chunks, never over batches or actions
        for step in _chunks(bound - done, per_chunk):
            actions = sample_actions(logits, step, group_size, generator)
            for name, g in gradient_estimates(rewards, logits, actions, k).items():
                acc[name]["sum"] += g.sum(dim=1)
                acc[name]["sumsq"] += g.pow(2).sum(dim=1)
        done = bound
        if bound in checkpoints:
            for name in ESTIMATORS:
                acc[name]["prefix"].append(acc[name]["sum"].clone())
    for name in ESTIMATORS:
        acc[name]["prefix"] = torch.stack(acc[name]["prefix"]) if acc[name]["prefix"] else torch.empty(0, S, n)
    return acc


def total_variance(moments: dict[str, Tensor], batches: int) -> Tensor:
    """Trace of the sample covariance of the estimates per instance, [S] (App. G.1 eq. 111)."""
    mean = moments["sum"] / batches
    return ((moments["sumsq"] - batches * mean.pow(2)) / (batches - 1)).sum(dim=-1)


def bias_curve(cfg: BanditConfig, generator: torch.Generator) -> list[tables.Row]:
    """‖(1/M) Σ_m g_m − ∇J‖ against M (eq. 110), mean ± SE over instances."""
    rewards, logits = sample_instances(cfg.seeds, cfg.num_actions, generator)
    truth = true_gradient(rewards, logits, cfg.k)
    Ms = tuple(sorted(cfg.bias_batches))
    acc = estimate_moments(rewards, logits, cfg.k, cfg.group_size, Ms[-1], generator, cfg.chunk_elements, Ms)
    rows = []
    for name in ESTIMATORS:
        for c, M in enumerate(Ms):
            err = (acc[name]["prefix"][c] / M - truth).norm(dim=-1)
            mean, se = rules.mean_se(err)
            rows.append({"estimator": name, "batches": M, "error": mean, "error_se": se})
    return rows


def variance_sweep(cfg: BanditConfig, generator: torch.Generator, *, over: str) -> list[tables.Row]:
    """Total variance of one batch's estimate against n (``over='actions'``) or K (``over='k'``)."""
    values = cfg.actions_sweep if over == "actions" else cfg.k_sweep
    rows = []
    shared = sample_instances(cfg.seeds, cfg.num_actions, generator) if over == "k" else None
    for value in values:  # the K sweep reuses the same instances, so its points are paired
        n, k = (value, cfg.k) if over == "actions" else (cfg.num_actions, value)
        rewards, logits = shared if shared is not None else sample_instances(cfg.seeds, n, generator)
        acc = estimate_moments(rewards, logits, k, cfg.group_size, cfg.variance_batches, generator,
                               cfg.chunk_elements)
        var = {name: total_variance(acc[name], cfg.variance_batches) for name in ESTIMATORS}
        ei_mean = float(var["EI"].mean())
        for name in ESTIMATORS:
            mean, se = rules.mean_se(var[name])
            rows.append({"estimator": name, "num_actions": n, "k": k, "variance": mean, "variance_se": se,
                         "ratio_to_ei": mean / ei_mean,
                         "instances": " ".join(f"{v:.9g}" for v in var[name].tolist())})  # paired CIs
    return rows


def validate(cfg: BanditConfig) -> None:
    if not 1 <= cfg.k <= cfg.group_size - 1:
        raise ValueError(f"k: expected 1 <= k <= group_size-1 = {cfg.group_size - 1} (L2O needs K <= N-1), got {cfg.k}")
    bad = [k for k in cfg.k_sweep if not 1 <= k <= cfg.group_size - 1]
    if bad:
        raise ValueError(f"k_sweep: expected values in [1, {cfg.group_size - 1}] (K <= N-1), got {list(cfg.k_sweep)}")
    if cfg.variance_batches < 2:
        raise ValueError(f"variance_batches: expected >= 2, got {cfg.variance_batches}")
    for key, values in (("num_actions", (cfg.num_actions,)), ("actions_sweep", cfg.actions_sweep)):
        if any(n < 2 for n in values):      # one action: every estimator's gradient is 0 (nothing to compare)
            raise ValueError(f"{key}: expected action counts >= 2 (with one action every gradient is 0), got "
                             f"{values[0] if key == 'num_actions' else list(values)}")


def run(cfg: BanditConfig, out_dir: Path) -> dict:
    """Run the three measurements; write bias.csv, variance_actions.csv, variance_k.csv, the PNG, summary.json."""
    validate(cfg)
    out_dir = Path(out_dir)
    generator = torch.Generator().manual_seed(cfg.seed)
    with torch_threads(cfg.threads):
        bias = bias_curve(cfg, generator)
        var_n = variance_sweep(cfg, generator, over="actions")
        var_k = variance_sweep(cfg, generator, over="k")
    tables.write_csv(out_dir / "bias.csv", bias)
    tables.write_csv(out_dir / "variance_actions.csv", var_n)
    tables.write_csv(out_dir / "variance_k.csv", var_k)
    summary = summarize(out_dir, cfg)
    plot(out_dir)
    return summary


def summarize(out_dir: Path, cfg: BanditConfig | None = None) -> dict:
    """Headline numbers from the CSVs: decay slopes, L1O plateau, variance ratios."""
    bias = tables.group_rows(tables.read_csv(out_dir / "bias.csv"), "estimator")
    var_n = tables.group_rows(tables.read_csv(out_dir / "variance_actions.csv"), "estimator")
    var_k = tables.group_rows(tables.read_csv(out_dir / "variance_k.csv"), "estimator")
    summary: dict = {"config": asdict(cfg) if cfg else None, "slope": {}, "last_decade_slope": {},
                     "final_error": {}}
    for name, rows in bias.items():
        Ms, errs = [r["batches"] for r in rows], [r["error"] for r in rows]
        summary["slope"][name] = rules.loglog_slope(Ms, errs)
        tail = [i for i, M in enumerate(Ms) if M >= Ms[-1] / 10]
        summary["last_decade_slope"][name] = rules.loglog_slope([Ms[i] for i in tail], [errs[i] for i in tail])
        summary["final_error"][name] = errs[-1]
    summary["l2o_ratio_vs_actions"] = {r["num_actions"]: r["ratio_to_ei"] for r in var_n["EI+L2O"]}
    summary["l2o_ratio_vs_k"] = {r["k"]: r["ratio_to_ei"] for r in var_k["EI+L2O"]}
    summary["l1o_ratio_vs_k"] = {r["k"]: r["ratio_to_ei"] for r in var_k["EI+L1O"]}
    if cfg is not None:
        tables.write_json(out_dir / "summary.json", summary)
    return summary


def plot(out_dir: Path) -> Path:
    fig, (ax_bias, ax_n, ax_k) = tables.figure(3)
    bias = tables.group_rows(tables.read_csv(out_dir / "bias.csv"), "estimator")
    for name, rows in bias.items():
        Ms = [r["batches"] for r in rows]
        ax_bias.errorbar(Ms, [r["error"] for r in rows], yerr=[r["error_se"] for r in rows], marker="o",
                         ms=3, label=name, capsize=2)
    first = bias["EI"][0]
    Ms = [r["batches"] for r in bias["EI"]]
    ax_bias.plot(Ms, [first["error"] * (M / Ms[0]) ** -0.5 for M in Ms], "k:", label="∝ M^-1/2")
    ax_bias.set(xscale="log", yscale="log", xlabel="number of batches M", ylabel="‖mean ĝ − ∇J‖",
                title="(a) error of the MC mean")
    for ax, file, key, label in ((ax_n, "variance_actions.csv", "num_actions", "number of actions n"),
                                 (ax_k, "variance_k.csv", "k", "K")):
        for name, rows in tables.group_rows(tables.read_csv(out_dir / file), "estimator").items():
            ax.errorbar([r[key] for r in rows], [r["variance"] for r in rows], yerr=[r["variance_se"] for r in rows],
                        marker="o", ms=3, label=name, capsize=2)
        ax.set(yscale="log", xlabel=label, ylabel="total variance tr Cov(ĝ)")
        if key == "num_actions":
            ax.set_xscale("log", base=2)
    ax_n.set_title("(b) variance vs n")
    ax_k.set_title("(c) variance vs K")
    ax_bias.legend(fontsize=7)
    return tables.save_figure(fig, out_dir / "maxk_bandit.png")


def ratio_to_ei(rows: list[tables.Row], key: str, value: int, name: str, n_boot: int) -> rules.Estimate:
    """Var(name)/Var(EI) at ``key = value`` with a paired bootstrap CI over instances."""
    pick = {r["estimator"]: r for r in rows if r[key] == value}
    a = torch.tensor([float(v) for v in str(pick[name]["instances"]).split()], dtype=torch.float64)
    b = torch.tensor([float(v) for v in str(pick["EI"]["instances"]).split()], dtype=torch.float64)
    return rules.paired_ratio(a, b, n_boot=n_boot, unit="instances")


def verdicts(out_dir: Path) -> list[rules.Verdict]:
    """The three claims, decided from the CSVs by the fixed rules stated in each verdict."""
    out_dir = Path(out_dir)
    summary = summarize(out_dir)
    cfg = tables.read_json(out_dir / "summary.json").get("config") or {}
    slope, tail, final = summary["slope"], summary["last_decade_slope"], summary["final_error"]
    unbiased_fall = all(slope[e] < -0.4 for e in ("EI", "EI+L2O"))
    l1o_plateau = tail["EI+L1O"] > -0.25 and final["EI+L1O"] > 2 * final["EI+L2O"]
    outcome = "reproduces" if unbiased_fall and l1o_plateau else "partly" if (unbiased_fall or l1o_plateau) else "does not reproduce"
    bias = {r["estimator"]: r for r in tables.read_csv(out_dir / "bias.csv") if r["batches"] == max(
        r2["batches"] for r2 in tables.read_csv(out_dir / "bias.csv"))}
    out = [rules.Verdict(
        "L2O keeps the max@K gradient unbiased, L1O biases it", "MaxPO §5.1, App. G.1",
        "L2O unbiased, L1O biased",
        f"error-decay slopes EI {slope['EI']:.2f}, EI+L2O {slope['EI+L2O']:.2f} (unbiased: −0.5); EI+L1O last-decade "
        f"slope {tail['EI+L1O']:.2f}, final error {final['EI+L1O']:.3g} ± {2 * bias['EI+L1O']['error_se']:.2g} vs "
        f"{final['EI+L2O']:.3g} ± {2 * bias['EI+L2O']['error_se']:.2g} (±2 SE over instances)",
        "EI/L2O slope < −0.4 and L1O tail slope > −0.25 with final error > 2× L2O's; one of the two: partly",
        outcome, f"{cfg.get('seeds')} instances × up to {max(cfg.get('bias_batches') or [0])} batches")]
    n_boot = 2000
    var_n = tables.read_csv(out_dir / "variance_actions.csv")
    ns = sorted({r["num_actions"] for r in var_n})
    by_n = {n: ratio_to_ei(var_n, "num_actions", n, "EI+L2O", n_boot) for n in ns}
    above = [n for n in ns if by_n[n].low > 1]
    statistics = {f"n={n}": e for n, e in by_n.items()}
    out.append(rules.Verdict(
        "L2O lowers the variance versus EI, more so with more actions", "MaxPO §5.1, App. G.1",
        "variance ratios consistently below 1 (maze G.2.2)",
        "Var(EI+L2O)/Var(EI) " + ", ".join(f"n={n}: {by_n[n]}" for n in ns),
        "paired bootstrap CIs over instances: below 1 at every n > 2 and the largest n's CI below the smallest n's "
        "reproduces; below 1 somewhere: partly; nowhere and above 1 somewhere: does not; else inconclusive",
        fewer_with_actions(statistics), f"{cfg.get('seeds')} instances × {cfg.get('variance_batches')} batches per "
        "point", "" if not above else f"L2O raises the variance at n = {', '.join(map(str, above))}: with few "
        "actions most batches repeat the same actions and EI has little variance to remove.",
        statistics=statistics, decide=fewer_with_actions))
    var_k = tables.read_csv(out_dir / "variance_k.csv")
    ks = sorted({r["k"] for r in var_k})
    by_k = {k: ratio_to_ei(var_k, "k", k, "EI+L2O", n_boot) for k in ks}
    # K = 1 is degenerate (L2O is then RLOO against REINFORCE: centring of the raw reward, not the
    # max@K comparator), so "moderate" is judged on K >= 2 only
    sweep = [k for k in ks if k >= 2]
    best = min(sweep, key=lambda k: by_k[k].value)
    raises = [k for k in ks if by_k[k].low > 1]
    statistics = {f"K={k}": e for k, e in by_k.items()}
    out.append(rules.Verdict(
        "L2O helps most at moderate K", "MaxPO §5.1", "L2O is most effective for moderate K",
        "Var(EI+L2O)/Var(EI) " + ", ".join(f"K={k}: {by_k[k]}" for k in ks) + f"; smallest over K ≥ 2 at K={best}",
        "over K ≥ 2 (K = 1 is degenerate): the smallest ratio at an interior K with its CI below 1 and both end "
        "ratios' CIs above it reproduces; interior but not separated: partly; at an end of the sweep: does not; "
        "inconclusive without an interior K (fewer than 3 values of K ≥ 2)",
        best_at_moderate_k(statistics), f"{cfg.get('seeds')} paired instances × {cfg.get('variance_batches')} "
        "batches per K",
        (f"L2O raises the variance above EI at K = {', '.join(map(str, raises))} (CI above 1). " if raises else "")
        + ("At K=1 L2O is RLOO against REINFORCE, so that point measures centring of the raw reward and is left "
           "out of the rule." if ks[0] == 1 else ""), statistics=statistics, decide=best_at_moderate_k))
    return out


def fewer_with_actions(statistics) -> str:
    """Rule (b) on {"n=…": Var(EI+L2O)/Var(EI)}, n ascending."""
    by_n = {int(k[2:]): e for k, e in statistics.items()}
    ns = sorted(by_n)
    below = [n for n in ns if by_n[n].high < 1]
    above = [n for n in ns if by_n[n].low > 1]
    grows = by_n[ns[-1]].high < by_n[ns[0]].low
    return ("reproduces" if len(below) == len(ns) - (ns[0] <= 2) and grows else "partly" if below else
            "does not reproduce" if above else "inconclusive")


def best_at_moderate_k(statistics) -> str:
    """Rule (c) on {"K=…": Var(EI+L2O)/Var(EI)}: over K ≥ 2 (K = 1 is degenerate); inconclusive for a
    sweep with no interior K (fewer than 3 values ≥ 2), where the best K can only lie at an end."""
    by_k = {int(k[2:]): e for k, e in statistics.items()}
    sweep = sorted(k for k in by_k if k >= 2)
    if len(sweep) < 3:
        return "inconclusive"
    best = min(sweep, key=lambda k: by_k[k].value)
    interior = sweep[0] < best < sweep[-1] and by_k[best].high < 1
    fades = all(by_k[k].low > by_k[best].high for k in (sweep[0], sweep[-1]))
    return ("reproduces" if interior and fades else "partly" if interior else
            "does not reproduce" if best in (sweep[0], sweep[-1]) else "inconclusive")


def report(out_dir: Path, figure_path: str) -> str:
    """The Markdown section of docs/results.md, built from the CSVs in ``out_dir``."""
    cfg = tables.read_json(Path(out_dir) / "summary.json").get("config") or {}
    lines = ["## MaxPO: bias and variance of max@K gradients on softmax bandits (MaxPO §5.1, App. G.1)\n",
             f"Setting: {cfg.get('seeds')} random instances (rewards, logits ~ N(0,1)), N = {cfg.get('group_size')} "
             f"actions per batch, K = {cfg.get('k')}, n = {cfg.get('num_actions')} actions for (a) and (c); "
             f"{cfg.get('variance_batches')} batches per variance estimate. The truth ∇J is exact (closed form of "
             "P(max = a) = F(a)^K − F(a−)^K through autograd). Mean ± standard error over instances.\n",
             f"![maxk bandit]({figure_path})\n"]
    bias = tables.read_csv(Path(out_dir) / "bias.csv")
    lines.append(tables.pivot_table(bias, "batches", "estimator", "error"))
    lines.append("\nTotal variance (ratio to EI) against the number of actions n and against K:\n")
    for file, key in (("variance_actions.csv", "num_actions"), ("variance_k.csv", "k")):
        lines.append(tables.pivot_table(tables.read_csv(Path(out_dir) / file), key, "estimator", "ratio_to_ei"))
        lines.append("")
    return "\n".join(lines)


EXPERIMENT = register_experiment(Experiment("maxk-bandit", PRESETS, run, verdicts, report, validate))
