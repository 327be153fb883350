"""``horizon``: does OTB's advantage grow with the horizon? A controlled test from 8 to 2,048 tokens on
a synthetic autoregressive policy with exact scores and an exact true gradient (OTB §1, §5.3: the
paper's setting is reasoning traces of up to 8k tokens).

The policy (``creditrl_research.synthetic_policy``): parameters shared across positions (pre / fork /
tail rows), mostly near-certain tokens (an error with probability errors/T per position) and F = 4
rare forks (right with probability p), a terminal reward 1 for no error and at least 3 right forks
(a success rate of ~0.2–0.5), responses of fixed length T or ended by EOS in the tail (``eos``).
Each (T, N, lengths) cell measures ``instances`` policies drawn from the family (fork probability,
error and stop rates; instance i draws the same at every T, so instances pair up across T), each on
``groups`` groups: every group's exact gradient under every estimator on the same responses, with the
exact grad J as the reference (``creditrl.core.gradients``): raw variance, scale c = <E ĝ, ∇J>/||∇J||²,
cosine, and the relative efficiency at matched signal against RLOO (V_rloo/c_rloo²)/(V_e/c_e²).
``dr_grpo`` is exactly (N−1)/N × RLOO: its efficiency against RLOO is exactly 1.

Rules (fixed in code before the runs reported), per lengths mode and N, intervals t over the instances
(log scale): (a) growth: efficiency(OTB/RLOO) at the longest T over that at the shortest, paired by
instance, above 1 reproduces, below 1 does not, else inconclusive; (b) level: OTB's efficiency
against RLOO (≡ Dr.GRPO) at the longest T above 1 a win, below 1 a loss. Each claim over the four
(lengths, N) cells: all reproduce reproduces, some partly, none with a contradiction does not, else
inconclusive. The raw variance ratio is printed beside every efficiency, labelled raw.
"""
from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from creditrl.core.gradients import GradientMoments, GradientStats
from creditrl_research import gradient_evidence as ge
from creditrl.tools import tables
from creditrl_research import rules
from creditrl_research import synthetic_policy as sp
from creditrl_research.experiments.registry import Experiment, register_experiment
from creditrl.utils.threads import torch_threads

MODES = ("fixed", "eos")
EXACT = "exact"            # the true gradient, as a constant pseudo-estimator (the scale reference)


@dataclass(frozen=True)
class HorizonConfig:
    horizons: tuple[int, ...] = (8, 32, 128, 512, 2048)
    group_sizes: tuple[int, ...] = (4, 16)
    modes: tuple[str, ...] = MODES       # fixed lengths T, or EOS-ended (geometric tail)
    instances: int = 8                   # policies per cell, drawn from the family (the intervals' units)
    groups: int = 768                    # groups per (T, N, mode, instance)
    batch_groups: int = 64               # groups sampled together (speed only)
    folds: int = 10                      # folds of groups within an instance (its own CIs in quality.csv)
    estimators: tuple[str, ...] = ("rloo", "otb", "otb+loo", "otb_isolated", "otb_isolated+loo", "ogb")
    forks: int = 4
    need: int = 3
    threads: int = 2
    seed: int = 0


PRESETS = {
    "fast": HorizonConfig(horizons=(8, 64), group_sizes=(4,), instances=2, groups=128, batch_groups=32, folds=4),
    "full": HorizonConfig(),
}


def validate(cfg: HorizonConfig) -> None:
    bad = [m for m in cfg.modes if m not in MODES]
    if bad or not cfg.modes:
        raise ValueError(f"modes: expected a non-empty subset of {list(MODES)}, got {list(cfg.modes)}")
    if "rloo" not in cfg.estimators:
        raise ValueError(f"estimators: expected 'rloo' among them (the efficiency baseline), got {cfg.estimators}")
    if min(cfg.horizons) < 1 or min(cfg.group_sizes) < 2:
        raise ValueError(f"horizons, group_sizes: expected T >= 1 and N >= 2, got {cfg.horizons}, {cfg.group_sizes}")
    if cfg.groups < max(2, cfg.folds) or cfg.groups % cfg.batch_groups:
        raise ValueError(f"groups: expected a multiple of batch_groups ({cfg.batch_groups}) and at least max(2, "
                         f"folds) = {max(2, cfg.folds)}, got {cfg.groups}")


def measure_cell(cfg: HorizonConfig, horizon: int, group_size: int, mode: str, instance: int) -> tuple[GradientStats,
                                                                                                        dict]:
    """One policy instance's gradient statistics over ``cfg.groups`` groups, and its facts."""
    draw = torch.Generator().manual_seed(cfg.seed * 1000 + instance)
    policy = sp.random_policy(horizon, draw, eos=mode == "eos", forks=cfg.forks, need=cfg.need)
    truth = sp.true_gradient(policy)
    specs = ge.estimator_specs(cfg.estimators)
    moments = GradientMoments((*specs, EXACT), truth.numel(), folds=cfg.folds, dtype=torch.float64)
    gen = torch.Generator().manual_seed(random.Random(f"horizon-{cfg.seed}-{horizon}-{group_size}-{mode}-{instance}")
                                        .getrandbits(62))
    lengths = rewards = 0.0
    for _ in range(cfg.groups // cfg.batch_groups):
        tokens, mask, reward = sp.sample(policy, cfg.batch_groups * group_size, gen)
        grads = sp.group_gradients(policy, tokens, mask, reward, group_size, specs)
        moments.add_many(torch.cat([grads, truth.expand(grads.shape[0], 1, -1)], 1))
        lengths += float(mask.sum())
        rewards += float(reward.sum())
    responses = cfg.groups * group_size
    return ge.with_derived(moments.stats(), group_size), {
        "success": float(sp.success_probability(policy)), "reward_mean": rewards / responses,
        "response_len": lengths / responses, "grad_norm": float(truth.norm())}


def run(cfg: HorizonConfig, out_dir: Path) -> dict:
    validate(cfg)
    out_dir = Path(out_dir)
    records, rows, start = [], [], time.perf_counter()
    with torch.random.fork_rng(devices=[]), torch_threads(cfg.threads):
        for mode in cfg.modes:
            for group_size in cfg.group_sizes:
                for horizon in cfg.horizons:
                    for instance in range(cfg.instances):
                        stats, facts = measure_cell(cfg, horizon, group_size, mode, instance)
                        meta = {"mode": mode, "group_size": group_size, "horizon": horizon, "instance": instance,
                                **facts}
                        records.append({**meta, "stats": stats.to_dict()})
                        rows += [r for r in ge.quality_rows(stats, EXACT, "rloo", **meta) if r["estimator"] != EXACT]
                    print(f"[horizon] {mode} N={group_size} T={horizon} done at {time.perf_counter() - start:.0f}s",
                          flush=True)
    tables.write_json(out_dir / "stats.json", records)
    tables.write_csv(out_dir / "quality.csv", rows)
    summary = {"config": asdict(cfg)}
    tables.write_json(out_dir / "summary.json", summary)
    plot(out_dir)
    return summary


def cells(rows: list[tables.Row], estimator: str, key: str = "efficiency") -> dict[tuple, dict[int, list]]:
    """(mode, N) -> T -> the per-instance values of ``key`` for ``estimator`` (instance order)."""
    out: dict[tuple, dict[int, list]] = {}
    for r in sorted(rows, key=lambda r: r["instance"]):
        if r["estimator"] == estimator:
            out.setdefault((r["mode"], r["group_size"]), {}).setdefault(r["horizon"], []).append(r[key])
    return out


def efficiency_table(rows: list[tables.Row], key: str = "efficiency") -> str:
    """(lengths, N, estimator) × T: over the instances, the geometric mean (ratios) or the mean (the
    scale c) with its t-interval."""
    table = []
    names = list(dict.fromkeys(r["estimator"] for r in rows))
    for name in names:
        for (mode, n), by_t in cells(rows, name, key).items():
            row = {"lengths": mode, "N": n, "estimator": name}
            row.update({f"T={t}": str(rules.mean_estimate(v, "instances") if key == "scale" else
                                      ge.cluster_efficiency(v, "instances")) for t, v in sorted(by_t.items())})
            table.append(row)
    table.sort(key=lambda r: (r["lengths"], r["N"]))
    return tables.markdown_table(table)


def plot(out_dir: Path) -> Path:
    rows = tables.read_csv(Path(out_dir) / "quality.csv")
    keys = sorted({(r["mode"], r["group_size"]) for r in rows})
    fig, axes = tables.figure(len(keys), width=3.6)
    for ax, (mode, n) in zip(axes, keys):
        for name in dict.fromkeys(r["estimator"] for r in rows):
            by_t = cells(rows, name).get((mode, n), {})
            ts = sorted(by_t)
            ests = [ge.cluster_efficiency(by_t[t], "instances") for t in ts]
            ax.errorbar(ts, [e.value for e in ests], yerr=[[max(e.value - e.low, 0) for e in ests],
                        [max(e.high - e.value, 0) for e in ests]], marker="o", ms=3, capsize=2, label=name)
        ax.axhline(1.0, color="k", lw=0.8, ls=":")
        ax.set(xscale="log", yscale="log", xlabel="horizon T (tokens)", title=f"{mode} lengths, N = {n}")
    axes[0].set_ylabel("efficiency vs RLOO at matched signal")
    axes[0].legend(fontsize=6)
    return tables.save_figure(fig, Path(out_dir) / "horizon.png")


def growth(by_t: dict[int, list]) -> rules.Estimate:
    """efficiency at the longest T over that at the shortest, paired by instance (t over instances)."""
    ts = sorted(by_t)
    ratios = [a / b if a > 0 and b > 0 else float("nan") for a, b in zip(by_t[ts[-1]], by_t[ts[0]])]
    return rules.cluster_ratio_contrast([ratios], [1.0], unit="instances")


def verdicts(out_dir: Path) -> list[rules.Verdict]:
    out_dir = Path(out_dir)
    cfg = tables.read_json(out_dir / "summary.json")["config"]
    rows = tables.read_csv(out_dir / "quality.csv")
    otb, raw = cells(rows, "otb"), cells(rows, "otb", "raw_ratio")
    t_min, t_max = min(cfg["horizons"]), max(cfg["horizons"])
    power = (f"{cfg['instances']} policy instances per cell (t with {cfg['instances'] - 1} df), {cfg['groups']} "
             "groups each")
    grown = {k: growth(v) for k, v in otb.items()}
    level = {k: ge.cluster_efficiency(v[t_max], "instances") for k, v in otb.items()}
    label = {k: f"{k[0]} lengths N={k[1]}" for k in otb}
    loo = cells(rows, "otb+loo")
    return [
        rules.Verdict(
            "OTB's efficiency advantage over RLOO/Dr.GRPO grows with the horizon (synthetic policy)", "OTB §1, §5.3",
            "variance reduction matters most for long-horizon reasoning (up to 8k tokens)",
            "; ".join(f"{label[k]}: eff(T={t_max}) / eff(T={t_min}) {g}" for k, g in grown.items()),
            "per (lengths, N) the paired t-interval over instances (log scale) above 1 reproduces, below 1 does not, "
            "else inconclusive; all cells reproduce reproduces, some partly, none with a contradiction does not, "
            "else inconclusive", rules.combined_outcome([rules.interval_outcome(g, ">", null=1.0)
                                                             for g in grown.values()]), power),
        rules.Verdict(
            f"OTB is more efficient than RLOO/Dr.GRPO at matched signal at T = {t_max} (synthetic policy)",
            "OTB §5.2–5.3", "lower variance than the group-mean baselines",
            "; ".join(f"{label[k]}: efficiency {e} (raw tr Cov ratio, raw: "
                      f"{ge.cluster_efficiency(raw[k][t_max], 'instances')})" for k, e in level.items()),
            "per (lengths, N) the t-interval over instances (log scale) of OTB's efficiency against RLOO above 1 is a "
            "win, below 1 a loss; all wins reproduces, some partly, none with a loss does not, else inconclusive",
            rules.combined_outcome([rules.interval_outcome(e, ">", null=1.0) for e in level.values()]), power,
            "Dr.GRPO is exactly (N−1)/N × RLOO (efficiency 1 against it). With leave_one_out: " + "; ".join(
                f"{label[k]}: {ge.cluster_efficiency(v[t_max], 'instances')}" for k, v in loo.items()) + ".")]


def report(out_dir: Path, figure_path: str) -> str:
    out_dir = Path(out_dir)
    cfg = tables.read_json(out_dir / "summary.json")["config"]
    rows = tables.read_csv(out_dir / "quality.csv")
    facts = tables.group_rows([{**r, "key": (r["mode"], r["horizon"])} for r in rows if r["estimator"] == "rloo"],
                                 "key")
    context = [{"lengths": m, "T": t, "mean length": sum(r["response_len"] for r in rs) / len(rs),
                "success rate": sum(r["success"] for r in rs) / len(rs)} for (m, t), rs in facts.items()]
    scale = efficiency_table(rows, "scale")
    return "\n".join([
        "## The horizon: OTB against RLOO from 8 to 2,048 tokens (synthetic policy; OTB §1, §5.3)\n",
        f"Setting: the synthetic autoregressive policy of `creditrl_research.synthetic_policy` (parameters shared "
        f"across positions; near-certain tokens with {cfg['forks']} rare forks; reward 1 for no error and at least "
        f"{cfg['need']} right forks), T ∈ {list(cfg['horizons'])}, N ∈ {list(cfg['group_sizes'])}, fixed and "
        f"EOS-ended lengths; {cfg['instances']} policy instances per cell, {cfg['groups']} groups each, every group's "
        "exact gradient under every estimator on the same responses, c against the exact ∇J. Intervals: 95% t over "
        "the instances (geometric means).\n", f"![horizon]({figure_path})\n",
        "Efficiency against RLOO at matched signal (> 1: fewer groups for the same signal-to-noise):\n",
        efficiency_table(rows), "\nScale c of each mean gradient along ∇J (1 = unbiased):\n", scale,
        "\nRaw tr Cov ratio to RLOO (raw: not a quality measure):\n", efficiency_table(rows, "raw_ratio"),
        "\nThe policies:\n", tables.markdown_table(context)])


EXPERIMENT = register_experiment(Experiment("horizon", PRESETS, run, verdicts, report))
