"""``horizon``: does OTB's advantage grow with the horizon? A controlled test from 8 to 2,048 tokens on
synthetic autoregressive policies with exact scores and an exact true gradient (OTB §1, §5.3: the
paper's setting is reasoning traces of up to 8k tokens).

Two families of policies (``creditrl_research.synthetic_policy``), parameters shared across positions:

- ``constant``: F = 4 rare forks in the first half (right with probability p) and near-certain tokens
  elsewhere (an error with probability errors/T per position), reward 1 for no error and at least 3
  right forks. Its expected numbers of forks and errors are the same at every T: it asks whether length
  alone (more near-certain tokens) moves the efficiency. It cannot show more decisions at longer T.
- ``density``: a fork every ``spacing`` tokens over the whole response and an error rate per position
  that does not change with T, so forks and errors both grow ∝ T; reward 1 for at most B mistakes,
  B set so the success rate is ~1/2 at every T. At T = 32 it holds the constant family's 4 forks and
  expected errors. This is the family in which a horizon effect can show.

Responses have fixed length T or end by EOS in the second half (``eos``). Each (family, lengths, N, T)
cell measures ``instances`` policies drawn from the family (instance i draws the same fork probability,
error and stop rates at every T and in both families, so instances pair up across cells), each on
``groups`` groups: every group's exact gradient under every estimator on the same responses, with the
exact ∇J as the reference (``creditrl.core.gradients``): raw variance, scale c = <E ĝ, ∇J>/||∇J||²,
cosine, and the relative efficiency at matched signal against RLOO (V_rloo/c_rloo²)/(V_e/c_e²).
``dr_grpo`` is exactly (N−1)/N × RLOO: its efficiency against RLOO is exactly 1.

Rules (fixed in code before the runs reported; their history: docs/evidence-history.md), intervals t
over the instances (log scale):
(a) growth, one verdict per family: per (lengths, N) the efficiency of OTB against RLOO at the longest T
    over that at the shortest T ≥ ``growth_from`` (32: the region every T has; T = 8 has no position
    outside its forks), paired by instance: above 1 reproduces, below 1 does not, else inconclusive;
    over the cells: all reproduce reproduces, some partly, none with a contradiction does not, else
    inconclusive. The step from T = 8 is printed beside it, outside the rule.
(b) level at the longest T, grad-variance's rule shape: OTB against each rival (RLOO ≡ Dr.GRPO, OGB,
    isolated energy, and the leave_one_out forms of OGB and isolated energy) in every (family, lengths,
    N) setting and pooled over the settings (per instance the geometric mean over the settings, then
    t over the instances): a CI below 1 in any setting is a loss, else the pooled CI above 1 a win, else
    a tie; all rivals won reproduces, some partly, none with a loss does not, else inconclusive.
(c) cumulative against isolated energy at the longest T, the same comparison alone: a win reproduces,
    a loss does not, a tie is inconclusive.
The raw variance ratio is printed beside every efficiency, labelled raw.
"""
from __future__ import annotations

import math
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
FAMILIES = ("constant", "density")
EXACT = "exact"            # the true gradient, as a constant pseudo-estimator (the scale reference)
RIVALS = ("rloo", "ogb", "ogb+loo", "otb_isolated", "otb_isolated+loo")   # OTB's rivals in rule (b)


@dataclass(frozen=True)
class HorizonConfig:
    horizons: tuple[int, ...] = (8, 32, 128, 512, 2048)
    group_sizes: tuple[int, ...] = (4, 16)
    modes: tuple[str, ...] = MODES       # fixed lengths T, or EOS-ended (geometric tail)
    families: tuple[str, ...] = FAMILIES
    instances: int = 8                   # policies per cell, drawn from the family (the intervals' units)
    groups: int = 768                    # groups per (family, T, N, mode, instance)
    batch_groups: int = 64               # groups sampled together (speed only)
    folds: int = 10                      # folds of groups within an instance (its own CIs in quality.csv)
    estimators: tuple[str, ...] = ("rloo", "otb", "otb+loo", "otb_isolated", "otb_isolated+loo", "ogb", "ogb+loo")
    # the field's menu, reported in the tables, outside the OTB verdicts; batch-level ones (shrinkage,
    # reinforce_plus_plus*) see a batch of `batch_groups` groups, the batch is their unit (per_unit variances)
    menu: tuple[str, ...] = ("shrinkage", "shrinkage+loo", "maxrl", "reinforce_plus_plus",
                             "reinforce_plus_plus_baseline", "grpo")
    forks: int = 4                       # constant family: forks and right forks needed
    need: int = 3
    spacing: int = 8                     # density family: a fork every `spacing` tokens
    growth_from: int = 32                # rule (a) reads T >= growth_from
    threads: int = 2
    seed: int = 0


PRESETS = {
    "fast": HorizonConfig(horizons=(8, 32, 64), group_sizes=(4,), instances=2, groups=128, batch_groups=32, folds=4),
    "full": HorizonConfig(),
}


def validate(cfg: HorizonConfig) -> None:
    for name, valid in (("modes", MODES), ("families", FAMILIES)):
        given = getattr(cfg, name)
        if not given or any(v not in valid for v in given):
            raise ValueError(f"{name}: expected a non-empty subset of {list(valid)}, got {list(given)}")
    if cfg.groups < 2 * cfg.batch_groups:   # a batch is a unit; c is cross-fitted between units
        raise ValueError(f"groups: expected at least 2 × batch_groups = {2 * cfg.batch_groups}, got {cfg.groups}")
    if not {"rloo", "otb"} <= set(cfg.estimators):
        raise ValueError(f"estimators: expected 'rloo' (the efficiency baseline) and 'otb' among them, got "
                         f"{cfg.estimators}")
    if min(cfg.horizons) < 1 or min(cfg.group_sizes) < 2:
        raise ValueError(f"horizons, group_sizes: expected T >= 1 and N >= 2, got {cfg.horizons}, {cfg.group_sizes}")
    if len({t for t in cfg.horizons if t >= cfg.growth_from}) < 2:
        raise ValueError(f"growth_from: expected at least two horizons >= growth_from (rule (a) compares the "
                         f"longest with the shortest of them), got growth_from={cfg.growth_from} and horizons "
                         f"{list(cfg.horizons)}")
    if cfg.groups < max(2, cfg.folds) or cfg.groups % cfg.batch_groups:
        raise ValueError(f"groups: expected a multiple of batch_groups ({cfg.batch_groups}) and at least max(2, "
                         f"folds) = {max(2, cfg.folds)}, got {cfg.groups}")


def draw_policy(cfg: HorizonConfig, family: str, horizon: int, mode: str, instance: int) -> sp.SyntheticPolicy:
    """Instance ``instance`` of ``family`` at ``horizon`` (the same draws at every T and in both families)."""
    draw = torch.Generator().manual_seed(cfg.seed * 1000 + instance)
    if family == "density":
        return sp.random_density_policy(horizon, draw, eos=mode == "eos", spacing=cfg.spacing)
    return sp.random_policy(horizon, draw, eos=mode == "eos", forks=cfg.forks, need=cfg.need)


def measure_cell(cfg: HorizonConfig, family: str, horizon: int, group_size: int, mode: str,
                 instance: int) -> tuple[GradientStats, dict]:
    """One policy instance's gradient statistics over ``cfg.groups`` groups, and its facts."""
    policy = draw_policy(cfg, family, horizon, mode, instance)
    truth = sp.true_gradient(policy)
    specs = ge.estimator_specs((*cfg.estimators, *cfg.menu))
    moments = GradientMoments((*specs, EXACT), truth.numel(), folds=cfg.folds, dtype=torch.float64)
    # the constant family keeps its stream of earlier reports (its CSVs reproduce byte for byte)
    tag = "" if family == "constant" else f"-{family}"
    gen = torch.Generator().manual_seed(random.Random(f"horizon-{cfg.seed}-{horizon}-{group_size}-{mode}-{instance}"
                                                      f"{tag}").getrandbits(62))
    lengths = rewards = 0.0
    for b in range(cfg.groups // cfg.batch_groups):
        tokens, mask, reward = sp.sample(policy, cfg.batch_groups * group_size, gen)
        grads = sp.group_gradients(policy, tokens, mask, reward, group_size, specs)
        # a batch is one unit: folds never split it (the menu's batch-level rows share its statistics)
        moments.add_many(torch.cat([grads, truth.expand(grads.shape[0], 1, -1)], 1), [b] * grads.shape[0])
        lengths += float(mask.sum())
        rewards += float(reward.sum())
    responses = cfg.groups * group_size
    return ge.with_derived(moments.stats(), group_size), {
        "success": float(sp.success_probability(policy)), "reward_mean": rewards / responses,
        "response_len": lengths / responses, "grad_norm": float(truth.norm()),
        "forks": int((policy.kind == sp.FORK).sum())}


def run(cfg: HorizonConfig, out_dir: Path) -> dict:
    validate(cfg)
    out_dir = Path(out_dir)
    records, rows, start = [], [], time.perf_counter()
    with torch.random.fork_rng(devices=[]), torch_threads(cfg.threads):
        for family in cfg.families:
            for mode in cfg.modes:
                for group_size in cfg.group_sizes:
                    for horizon in cfg.horizons:
                        for instance in range(cfg.instances):
                            stats, facts = measure_cell(cfg, family, horizon, group_size, mode, instance)
                            meta = {"family": family, "mode": mode, "group_size": group_size, "horizon": horizon,
                                    "instance": instance, **facts}
                            records.append({**meta, "stats": stats.to_dict()})
                            rows += [{**r, "per_unit": False} for r in ge.quality_rows(stats, EXACT, "rloo", **meta)
                                     if r["estimator"] != EXACT and r["estimator"] not in cfg.menu]
                            rows += [{**r, "per_unit": True}
                                     for r in ge.quality_rows(stats, EXACT, "rloo", per_unit=True, **meta)
                                     if r["estimator"] in cfg.menu]
                        print(f"[horizon] {family} {mode} N={group_size} T={horizon} done at "
                              f"{time.perf_counter() - start:.0f}s", flush=True)
    tables.write_json(out_dir / "stats.json", records)
    tables.write_csv(out_dir / "quality.csv", rows)
    summary = {"config": asdict(cfg)}
    tables.write_json(out_dir / "summary.json", summary)
    plot(out_dir)
    return summary


Cell = tuple[str, str, int]      # (family, lengths mode, N)


def cells(rows: list[tables.Row], estimator: str, key: str = "efficiency") -> dict[Cell, dict[int, list]]:
    """(family, mode, N) -> T -> the per-instance values of ``key`` for ``estimator`` (instance order)."""
    out: dict[Cell, dict[int, list]] = {}
    for r in sorted(rows, key=lambda r: r["instance"]):
        if r["estimator"] == estimator:
            cell = (r.get("family", "constant"), r["mode"], r["group_size"])
            out.setdefault(cell, {}).setdefault(r["horizon"], []).append(r[key])
    return out


def label(cell: Cell) -> str:
    return f"{cell[0]} {cell[1]} N={cell[2]}"


def efficiency_table(rows: list[tables.Row], key: str = "efficiency") -> str:
    """(family, lengths, N, estimator) × T: over the instances, the geometric mean (ratios) or the mean
    (the scale c) with its t-interval."""
    table = []
    names = list(dict.fromkeys(r["estimator"] for r in rows))
    for name in names:
        for (family, mode, n), by_t in cells(rows, name, key).items():
            row = {"family": family, "lengths": mode, "N": n, "estimator": name}
            row.update({f"T={t}": str(rules.mean_estimate(v, "instances") if key == "scale" else
                                      ge.cluster_efficiency(v, "instances")) for t, v in sorted(by_t.items())})
            table.append(row)
    table.sort(key=lambda r: (FAMILIES.index(r["family"]), r["lengths"], r["N"]))
    return tables.markdown_table(table)


def plot(out_dir: Path) -> Path:
    rows = tables.read_csv(Path(out_dir) / "quality.csv")
    keys = sorted({(r.get("family", "constant"), r["mode"], r["group_size"]) for r in rows},
                  key=lambda k: (FAMILIES.index(k[0]), k[1], k[2]))
    families = list(dict.fromkeys(k[0] for k in keys))
    ncols = len(keys) // len(families)
    fig, axes = tables.figure(ncols, len(families), width=3.6)
    by_name = {name: cells(rows, name) for name in dict.fromkeys(r["estimator"] for r in rows)}
    # more rows than the 10 colours: the menu's rows (per-unit) are dashed with square markers
    menu_rows = {r["estimator"] for r in rows if str(r.get("per_unit")) == "True"}
    for ax, cell in zip(axes, keys):
        for i, (name, name_cells) in enumerate(by_name.items()):
            by_t = name_cells.get(cell, {})
            ts = sorted(by_t)
            ests = [ge.cluster_efficiency(by_t[t], "instances") for t in ts]
            menu = name in menu_rows
            ax.errorbar(ts, [e.value for e in ests], yerr=[[max(e.value - e.low, 0) for e in ests],
                        [max(e.high - e.value, 0) for e in ests]], marker="s" if menu else "o", ms=3, capsize=2,
                        ls="--" if menu else "-", color=f"C{i % 10}", label=name)
        ax.axhline(1.0, color="k", lw=0.8, ls=":")
        ax.set(xscale="log", yscale="log", xlabel="horizon T (tokens)", title=f"{cell[0]}: {cell[1]} lengths, "
               f"N = {cell[2]}")
    axes[0].set_ylabel("efficiency vs RLOO at matched signal")
    axes[0].legend(fontsize=6)
    return tables.save_figure(fig, Path(out_dir) / "horizon.png")


def step_ratio(by_t: dict[int, list], longer: int, shorter: int) -> rules.Estimate:
    """efficiency at T = ``longer`` over that at T = ``shorter``, paired by instance (t over instances)."""
    ratios = [a / b if a > 0 and b > 0 else math.nan for a, b in zip(by_t[longer], by_t[shorter])]
    return rules.cluster_ratio_contrast([ratios], [1.0], unit="instances")


def above_one(estimates) -> str:
    """Rule (a) over the cells: each growth CI above 1 reproduces, below 1 does not; combined."""
    return rules.combined_outcome([rules.interval_outcome(e, ">", null=1.0) for e in estimates.values()])


def growth_verdict(rows, cfg: dict, family: str, power: str) -> rules.Verdict | None:
    otb = {c: v for c, v in cells(rows, "otb").items() if c[0] == family}
    if not otb:
        return None
    ts = sorted(cfg["horizons"])
    start, t_max = min(t for t in ts if t >= cfg["growth_from"]), ts[-1]
    grown = {label(c)[len(family) + 1:]: step_ratio(v, t_max, start) for c, v in otb.items()}
    early = [t for t in ts if t < start]
    outside = ("; ".join(f"{label(c)[len(family) + 1:]}: {step_ratio(v, start, early[0])}" for c, v in otb.items())
               if early else "")
    what = {"constant": "The constant family holds 4 forks and the same expected errors at every T: it tests "
                        "whether length alone moves OTB's efficiency.",
            "density": f"The density family holds a fork every {cfg['spacing']} tokens and a fixed error rate per "
                       "token: its decisions grow ∝ T."}[family]
    claim = {"constant": "OTB's efficiency advantage over RLOO/Dr.GRPO grows with the horizon (synthetic policy, "
                         "constant decisions)",
             "density": "OTB's efficiency advantage over RLOO/Dr.GRPO grows with the horizon when the decisions grow "
                        "with it (synthetic policy, fork density)"}[family]
    return rules.Verdict(
        claim, "OTB §1, §5.3", "variance reduction matters most for long-horizon reasoning (up to 8k tokens)",
        "; ".join(f"{k}: eff(T={t_max}) / eff(T={start}) {g}" for k, g in grown.items()),
        f"per (lengths, N) the paired t-interval over instances (log scale) of the efficiency at T = {t_max} over "
        f"that at T = {start} (the shortest T ≥ {cfg['growth_from']}) above 1 reproduces, below 1 does not, else "
        "inconclusive; all cells reproduce reproduces, some partly, none with a contradiction does not, else "
        "inconclusive", above_one(grown), power,
        what + (f" Outside the rule, from T = {early[0]} to T = {start}: {outside}." if early else ""),
        statistics=grown, decide=above_one)


def comparisons(rows, e: str, rivals, t_max: int) -> dict[str, tuple[dict[str, rules.Estimate], rules.Estimate]]:
    """rival -> (per setting, pooled): the efficiency of ``e`` against the rival at T = ``t_max`` per (family,
    lengths, N) with t over the instances, and pooled over the settings (per instance the geometric mean
    over the settings, then t over the instances: the instances pair up across settings)."""
    mine = {c: v[t_max] for c, v in cells(rows, e).items()}
    out = {}
    for rival in rivals:
        theirs = {c: v[t_max] for c, v in cells(rows, rival).items()}
        ratio = {c: [a / b if a > 0 and b > 0 else math.nan for a, b in zip(mine[c], theirs[c])] for c in mine}
        each = {label(c): ge.cluster_efficiency(r, "instances") for c, r in ratio.items()}
        per_instance = [math.exp(sum(math.log(r[i]) if r[i] > 0 else math.nan for r in ratio.values()) / len(ratio))
                        for i in range(min(len(r) for r in ratio.values()))]
        out[rival] = (each, ge.cluster_efficiency(per_instance, "instances"))
    return out


def unpack(statistics, rivals) -> dict[str, tuple[list[rules.Estimate], rules.Estimate]]:
    """The statistics of rules (b) and (c) by rival: (per-setting estimates, pooled)."""
    return {r: ([e for k, e in statistics.items() if k.startswith(f"{r} | ") and k != f"{r} | pooled"],
                statistics[f"{r} | pooled"]) for r in rivals}


def flatten(compared) -> dict[str, rules.Estimate]:
    return {f"{r} | {k}": e for r, (each, pooled) in compared.items() for k, e in {**each, "pooled": pooled}.items()}


def level_verdict(rows, cfg: dict, names: set, power: str) -> rules.Verdict | None:
    rivals = [r for r in RIVALS if r in names]
    if "otb" not in names or not rivals:
        return None
    t_max = max(cfg["horizons"])
    compared = comparisons(rows, "otb", rivals, t_max)
    raw = cells(rows, "otb", "raw_ratio")

    def decide(statistics) -> str:
        return rules.combined_outcome([rules.pooled_ratio_outcome(each, pooled, claimed=">")
                                       for each, pooled in unpack(statistics, rivals).values()])

    statistics = flatten(compared)
    loo = cells(rows, "otb+loo")
    return rules.Verdict(
        f"OTB is more efficient than RLOO/Dr.GRPO, OGB and isolated energy (and their leave-one-out forms) at "
        f"matched signal at T = {t_max} (synthetic policy)", "OTB §5.2–5.3, App. C.7",
        "lower variance than OGB and the group-mean baselines",
        "; ".join(f"efficiency OTB/{r}: " + ", ".join(f"{k} {e}" for k, e in each.items()) + f", pooled {pooled}"
                  for r, (each, pooled) in compared.items()),
        ge.EFFICIENCY_RULE.format(reference="the exact ∇J", units="the instances; pooled: per instance the "
                                  "geometric mean over the settings", paper="")
        + "; all rivals won reproduces, some partly, none with a loss does not, else inconclusive",
        decide(statistics), power,
        "Dr.GRPO is exactly (N−1)/N × RLOO (efficiency 1 against it). Raw tr Cov ratio OTB/RLOO (raw: not a "
        "quality measure): " + "; ".join(f"{label(c)} {ge.cluster_efficiency(v[t_max], 'instances')}"
                                         for c, v in raw.items())
        + ". OTB's leave_one_out form against RLOO: " + "; ".join(
            f"{label(c)} {ge.cluster_efficiency(v[t_max], 'instances')}" for c, v in loo.items()) + ".",
        statistics=statistics, decide=decide)


def energy_verdict(rows, cfg: dict, names: set, power: str) -> rules.Verdict | None:
    if not {"otb", "otb_isolated"} <= names:
        return None
    t_max = max(cfg["horizons"])
    compared = comparisons(rows, "otb", ["otb_isolated"], t_max)

    def decide(statistics) -> str:
        (each, pooled), = unpack(statistics, ["otb_isolated"]).values()
        return rules.pooled_ratio_outcome(each, pooled, claimed=">")

    statistics = flatten(compared)
    each, pooled = compared["otb_isolated"]
    note = ""
    if {"otb+loo", "otb_isolated+loo"} <= names:
        loo_each, loo_pooled = comparisons(rows, "otb+loo", ["otb_isolated+loo"], t_max)["otb_isolated+loo"]
        note = ("With leave_one_out: efficiency OTB+loo/isolated+loo " + ", ".join(f"{k} {e}" for k, e in
                                                                              loo_each.items())
                + f", pooled {loo_pooled}.")
    return rules.Verdict(
        f"Cumulative energy (OTB) beats isolated per-token energy at matched signal at T = {t_max} (synthetic "
        "policy)", "OTB App. C.7, F.5", "cumulative W_t argued over isolated w_t",
        "efficiency OTB/isolated: " + ", ".join(f"{k} {e}" for k, e in each.items()) + f", pooled {pooled}",
        ge.EFFICIENCY_RULE.format(reference="the exact ∇J", units="the instances; pooled: per instance the "
                                  "geometric mean over the settings", paper="")
        + ": a win reproduces, a loss does not, a tie is inconclusive", decide(statistics), power, note,
        statistics=statistics, decide=decide)


def verdicts(out_dir: Path) -> list[rules.Verdict]:
    out_dir = Path(out_dir)
    cfg = tables.read_json(out_dir / "summary.json")["config"]
    cfg.setdefault("growth_from", min(cfg["horizons"]))
    cfg.setdefault("spacing", 8)
    rows = tables.read_csv(out_dir / "quality.csv")
    names = {r["estimator"] for r in rows}
    power = (f"{cfg['instances']} policy instances per cell (t with {cfg['instances'] - 1} df), {cfg['groups']} "
             "groups each")
    found = [growth_verdict(rows, cfg, family, power) for family in FAMILIES]
    found += [level_verdict(rows, cfg, names, power), energy_verdict(rows, cfg, names, power)]
    return [v for v in found if v]


def report(out_dir: Path, figure_path: str) -> str:
    out_dir = Path(out_dir)
    cfg = tables.read_json(out_dir / "summary.json")["config"]
    rows = tables.read_csv(out_dir / "quality.csv")
    facts = tables.group_rows([{**r, "key": (r.get("family", "constant"), r["mode"], r["horizon"])} for r in rows
                               if r["estimator"] == "rloo"], "key")
    context = [{"family": f, "lengths": m, "T": t, "forks": rs[0].get("forks", cfg.get("forks")),
                "mean length": sum(r["response_len"] for r in rs) / len(rs),
                "success rate": sum(r["success"] for r in rs) / len(rs)} for (f, m, t), rs in facts.items()]
    families = cfg.get("families", ["constant"])
    return "\n".join([
        "## The horizon: OTB against RLOO from 8 to 2,048 tokens (synthetic policy; OTB §1, §5.3)\n",
        "Setting: the synthetic autoregressive policies of `creditrl_research.synthetic_policy` (parameters shared "
        f"across positions, near-certain tokens and rare forks), families {list(families)}: `constant` holds "
        f"{cfg['forks']} forks in the first half and the same expected errors at every T (reward: no error and at "
        f"least {cfg['need']} right forks); `density` holds a fork every {cfg.get('spacing', 8)} tokens and the same "
        "error rate per token at every T, so its decisions grow ∝ T (reward: at most B mistakes, B set for a "
        f"success rate near 1/2). T ∈ {list(cfg['horizons'])}, N ∈ {list(cfg['group_sizes'])}, fixed and EOS-ended "
        f"lengths; {cfg['instances']} policy instances per cell, {cfg['groups']} groups each, every group's exact "
        "gradient under every estimator on the same responses, c against the exact ∇J. The field's menu "
        f"({', '.join(f'`{m}`' for m in cfg.get('menu', ()))}) is reported, outside the verdicts; its variances "
        f"are a batch's ({cfg['batch_groups']} groups, the batch-level estimators' batch) per group. Intervals: 95% "
        "t over the instances (geometric means).\n", f"![horizon]({figure_path})\n",
        "Efficiency against RLOO at matched signal (> 1: fewer groups for the same signal-to-noise):\n",
        efficiency_table(rows), "\nScale c of each mean gradient along ∇J (1 = unbiased):\n",
        efficiency_table(rows, "scale"), "\nRaw tr Cov ratio to RLOO (raw: not a quality measure):\n",
        efficiency_table(rows, "raw_ratio"), "\nThe policies:\n", tables.markdown_table(context)])


EXPERIMENT = register_experiment(Experiment("horizon", PRESETS, run, verdicts, report, validate))
