"""``grad-variance``: each estimator's exact per-group policy gradient on a fixed policy, compared at
matched signal (OTB §5.2–5.3, §6; MaxPO §3.2).

At fixed warm-started ``builtin:tiny`` checkpoints for 1- and 2-digit multiplication with a scratchpad
(responses of ~13 and ~33 tokens; ``checkpoints`` independent warm starts per length, seeds seed,
seed + 1, ..., each measured on an equal share of the groups), at N = 8: draw groups (one fresh prompt,
N responses) and compute every estimator's exact group gradient on the *same* responses
(``creditrl.runtime.group_gradients``: sum over tokens, mean over responses, all parameters). From the
streaming statistics of each checkpoint (``creditrl.core.gradients``): the raw variance tr Cov(ĝ), the
scale c and cosine of each mean gradient against RLOO's (unbiased, cross-fitted between groups), and
the relative efficiency at matched signal (V_b/c_b²)/(V_e/c_e²). ``dr_grpo`` is exactly (N−1)/N × RLOO
(tested), so it is added from RLOO's statistics: same efficiency, c = (N−1)/N. MaxPO and EI estimate
the max@K gradient; their reference is EI (unbiased for it).

Rules (fixed in code before the runs reported; ``gradient_evidence.EFFICIENCY_RULE``): each comparison
"e is more efficient than b" takes the per-checkpoint efficiency at each length and its geometric mean
over the lengths, with t-intervals over the checkpoints (log scale, Welch df): a CI below 1 anywhere
is a loss, else the pooled CI above 1 a win, else a tie. OTB against RLOO (≡ Dr.GRPO at matched
signal) and OGB: all wins reproduces, some partly, none with a loss does not, else inconclusive.
Cumulative against isolated energy, and MaxPO against EI (where a CI below the paper's 1/0.226 also
counts as a loss: MaxPO and EI share their expected gradient, so the paper's raw 77.4% reduction,
against PKPO = (K/N)·EI, is read as an efficiency of 4.4): a win reproduces, a loss does not, a tie
is inconclusive. OTB's advantage grows with the length: efficiency(OTB/RLOO) at the longest length
over that at the shortest, t-interval over the checkpoints of both, above 1 reproduces, below 1 does
not. The raw variance ratio is printed beside every efficiency, labelled raw: it is not a quality
measure.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from creditrl.core.gradients import GradientMoments, GradientStats, gradient_quality
from creditrl.core.losses import PolicyLoss, get_loss_term, list_loss_terms
from creditrl.runtime.group_gradients import group_gradients
from creditrl_research import gradient_evidence as ge
from creditrl.tools import tables
from creditrl_research import rules
from creditrl_research.experiments.registry import Experiment, register_experiment
from creditrl_research.fixed_policy import load_tiny_checkpoint, sample_groups
from creditrl_research.papers import PAPER_MAXPO_VARIANCE_RATIO
from creditrl.utils.threads import torch_threads

REFERENCE = "rloo"
OTB_RIVALS = ("rloo", "ogb")    # like-for-like baselines on the reward's scale (dr_grpo ≡ rloo at matched signal)
# The field's menu (docs/evidence-history.md, "menu verdicts"): batch-level estimators are measured over each
# sampled batch of ``batch_groups`` prompts (a training step's batch), and every menu comparison reads the
# variance of a batch's sum per group (``gradient_quality(per_unit=True)``: the batch is the unit).
GRPO_BATCH = "grpo@batch"
MENU_ESTIMATORS = ("shrinkage", "shrinkage+loo", "maxrl", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                   "grpo", GRPO_BATCH)
LABEL_OPTIONS = {GRPO_BATCH: ("grpo", {"scale": "batch"})}   # labels with options beyond +loo
LOSS_ROW = " · "            # a loss row's label: "rloo · <loss>", rloo's advantages under that loss at ratio 1
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
DELTA_L = "delta_l_norm"
COSINE_UNBIASED = 0.95      # "unbiased" read as cosine ≈ 1: the cosine's CI above 0.95
COSINE_SAME = 0.99          # MaxRL: a cosine CI above 0.99 is a direction indistinguishable from ∇J's


@dataclass(frozen=True)
class GradVarianceConfig:
    task: str = "multiplication"         # the scratchpad makes the response length grow with the digits
    # ~13- and ~33-token responses. 3 digits (~60 tokens): builtin:tiny reaches 1% sampled accuracy after
    # 800 warm-start steps, so ~90% of its groups would have no correct response and no gradient
    digits: tuple[int, ...] = (1, 2)
    warm_start_accuracy: tuple[float, ...] = (0.3, 0.3)  # per digits
    warm_start_max_steps: int = 800
    checkpoints: int = 3                 # independent warm starts per length; groups split evenly
    group_size: int = 8
    estimators: tuple[str, ...] = ("rloo", "ogb", "ogb+loo", "otb", "otb+loo", "otb_isolated", "otb_isolated+loo",
                                   "maxpo", "ei", *MENU_ESTIMATORS)
    # loss rows (rloo's advantages under each loss, ratio 1): the aggregations, ΔL (α = 1) and every
    # registered surrogate/ratio term (None: all of them, from the loss registry)
    loss_terms: tuple[str, ...] | None = None
    k: int = 4                           # K of maxpo / ei (needs K <= N-1)
    # per length, most at the long one (heavy-tailed group gradients); halved from (384, 1152) when the menu's
    # rows came in (~2.5x the per-group cost measured at threads=1, see docs/evidence-history.md)
    groups: tuple[int, ...] = (192, 576)
    batch_groups: int = 8                # prompts sampled together (speed only)
    folds: int = 8                       # folds of groups within a checkpoint (the tables' within-checkpoint CIs)
    max_new_tokens: int = 80
    temperature: float = 1.0
    threads: int = 2                     # torch CPU threads (see creditrl.utils.threads.torch_threads)
    seed: int = 0


PRESETS = {
    "fast": GradVarianceConfig(digits=(1,), warm_start_accuracy=(0.3,), checkpoints=2, group_size=4, k=2,
                               groups=(16,), batch_groups=4, folds=2, max_new_tokens=16,
                               estimators=("rloo", "otb", "otb+loo", "otb_isolated", "maxpo", "ei", *MENU_ESTIMATORS),
                               loss_terms=("cispo", "gspo"), threads=1),
    "full": GradVarianceConfig(),
}


def validate(cfg: GradVarianceConfig) -> None:
    for label in cfg.loss_terms or ():
        get_loss_term(label)                  # unknown names raise, naming the registered terms
    if {"maxpo", "ei"} & set(cfg.estimators) and not 2 <= cfg.k <= cfg.group_size - 1:
        raise ValueError(f"k: maxpo/ei need 2 <= k <= group_size-1 (={cfg.group_size - 1}), got {cfg.k}")
    if REFERENCE not in cfg.estimators:
        raise ValueError(f"estimators: expected {REFERENCE!r} among them (the unbiased reference), "
                         f"got {cfg.estimators}")
    if cfg.checkpoints < 1:
        raise ValueError(f"checkpoints: expected an int >= 1, got {cfg.checkpoints}")
    if len(set(cfg.digits)) != len(cfg.digits):  # rows are keyed by digits: a repeat would merge two lengths
        raise ValueError(f"digits: expected distinct entries, got {cfg.digits}")
    for field in ("warm_start_accuracy", "groups"):
        if len(getattr(cfg, field)) != len(cfg.digits):
            raise ValueError(f"{field}: expected one entry per digits entry ({len(cfg.digits)}), "
                             f"got {len(getattr(cfg, field))}")
    if min(cfg.groups) < 2 * cfg.checkpoints * cfg.batch_groups:
        raise ValueError(f"groups: expected at least 2 × checkpoints × batch_groups = "
                         f"{2 * cfg.checkpoints * cfg.batch_groups} per length, got {cfg.groups}")


def takes_k(label: str) -> bool:
    """Whether a row is a max@K estimator's (loss rows and option labels are not)."""
    return LOSS_ROW not in label and label not in LABEL_OPTIONS and ge.takes_k(label)


def loss_rows(cfg: GradVarianceConfig) -> dict[str, PolicyLoss]:
    """label -> loss of the loss rows: each aggregation, ΔL normalisation, and each surrogate/ratio term of
    the loss registry (``cfg.loss_terms``; None: every non-flat one) over the default aggregation."""
    terms = cfg.loss_terms if cfg.loss_terms is not None else tuple(
        n for n in list_loss_terms() if get_loss_term(n).stage in ("ratio", "surrogate") and not get_loss_term(n).flat)
    losses = {f"agg={a}": PolicyLoss({"aggregation": {"agg": a}}) for a in AGGREGATIONS}
    losses[DELTA_L] = PolicyLoss({DELTA_L: {"alpha": 1.0}})
    losses.update({t: PolicyLoss({t: None}) for t in terms})
    return {f"{REFERENCE}{LOSS_ROW}{name}": loss for name, loss in losses.items()}


def row_specs(cfg: GradVarianceConfig) -> tuple[dict[str, tuple[str, dict]], dict[str, PolicyLoss]]:
    """(label -> (estimator, options), label -> loss) of every row: the estimators, then the loss rows."""
    specs = {label: LABEL_OPTIONS[label] if label in LABEL_OPTIONS else ge.label_options(label, cfg.k)
             for label in cfg.estimators}
    losses = loss_rows(cfg)
    return {**specs, **{label: (REFERENCE, {}) for label in losses}}, losses


def measure_checkpoint(cfg: GradVarianceConfig, digits: int, groups: int, seed: int) -> tuple[GradientStats, dict]:
    """One checkpoint's gradient statistics over ``groups`` fresh-prompt groups, and its facts (mean
    response length and reward, and the sums behind ``baseline_summary``)."""
    task, model, tokenizer, params = load_tiny_checkpoint(cfg.task, digits, cfg.warm_start_accuracy[
        cfg.digits.index(digits)], seed, cfg.warm_start_max_steps)
    specs, losses = row_specs(cfg)
    moments = GradientMoments(tuple(specs), sum(p.numel() for p in params), folds=cfg.folds)
    rng, generator = random.Random(f"grad-variance-{seed}-{digits}"), torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    sums = dict.fromkeys(("RW", "W", "R", "n", "W_correct", "n_correct", "tokens"), 0.0)
    start = time.perf_counter()
    backward = 0
    for b in range(groups // cfg.batch_groups):
        batch = sample_groups(task, model, tokenizer, cfg.batch_groups, cfg.group_size, temperature=cfg.temperature,
                              max_new_tokens=cfg.max_new_tokens, rng=rng, generator=generator)
        draws = group_gradients(model, batch, specs, temperature=cfg.temperature, params=params, shared_prompts=False,
                                losses=losses, dedupe=True)
        # the batch is the unit: batch-level estimators' groups share its statistics, so a fold (and the
        # cross-fitted signal) must never split a batch
        moments.add_many(draws.grads, [b] * draws.grads.shape[0])
        backward += draws.backward
        add_baseline_sums(sums, draws.rewards.double(), draws.response_energy, draws.lengths)
    print(f"[grad-variance] digits={digits} seed {seed}: {groups} groups in {time.perf_counter() - start:.0f}s "
          f"({backward / max(groups, 1):.1f} backward passes per group)", flush=True)
    return moments.stats(), {"parameters": moments.dim, **sums}


def add_baseline_sums(sums: dict, rewards, energy, lengths) -> None:
    correct = rewards > 0.5
    sums["RW"] += float((rewards * energy).sum())
    sums["W"] += float(energy.sum())
    sums["R"] += float(rewards.sum())
    sums["n"] += rewards.numel()
    sums["W_correct"] += float(energy[correct].sum())
    sums["n_correct"] += int(correct.sum())
    sums["tokens"] += int(lengths.sum())


def baseline_summary(sums: dict) -> dict:
    """The variance-optimal sequence baseline b* = ΣRW/ΣW (OTB App. A.2, eq. 21, pooled over all
    groups) against the mean reward, and the gradient energy of incorrect vs correct responses."""
    wrong = sums["n"] - sums["n_correct"]
    mean_w_correct = sums["W_correct"] / sums["n_correct"] if sums["n_correct"] else float("nan")
    mean_w_wrong = (sums["W"] - sums["W_correct"]) / wrong if wrong else float("nan")
    return {"b_star": sums["RW"] / sums["W"] if sums["W"] > 0 else float("nan"),
            "reward_mean_pooled": sums["R"] / max(sums["n"], 1),
            "energy_wrong_over_correct": mean_w_wrong / mean_w_correct if mean_w_correct else float("nan")}


def run(cfg: GradVarianceConfig, out_dir: Path) -> dict:
    validate(cfg)
    out_dir = Path(out_dir)
    records, rows, baselines = [], [], {}
    for length, digits in enumerate(cfg.digits):
        pooled = dict.fromkeys(("RW", "W", "R", "n", "W_correct", "n_correct", "tokens"), 0.0)
        for c in range(cfg.checkpoints):
            with torch.random.fork_rng(devices=[]), torch_threads(cfg.threads):
                stats, facts = measure_checkpoint(cfg, digits, cfg.groups[length] // cfg.checkpoints, cfg.seed + c)
            stats = ge.with_derived(stats, cfg.group_size)
            meta = {"digits": digits, "checkpoint": c, "response_len": facts["tokens"] / facts["n"],
                    "reward_mean": facts["R"] / facts["n"]}
            records.append({**meta, "parameters": facts["parameters"], "stats": stats.to_dict()})
            rows += ge.quality_rows(stats, REFERENCE, **meta)
            if "ei" in stats.names:
                rows += [r for r in ge.quality_rows(stats, "ei", **meta) if takes_k(r["estimator"])]
            pooled = {k: pooled[k] + facts[k] for k in pooled}
        baselines[str(digits)] = baseline_summary(pooled)
    tables.write_json(out_dir / "stats.json", records)
    tables.write_csv(out_dir / "quality.csv", rows)
    summary = {"config": asdict(cfg), "parameters": records[0]["parameters"], "baselines": baselines}
    tables.write_json(out_dir / "summary.json", summary)
    plot(out_dir)
    return summary


def efficiencies(records: list[dict], e: str, b: str, reference: str = REFERENCE,
                 per_unit: bool = False) -> dict[int, list[float]]:
    """digits -> the per-checkpoint efficiency of ``e`` against ``b`` (scale against ``reference``;
    ``per_unit``: the variance of a batch's sum, ``gradient_quality(per_unit=True)``)."""
    out: dict[int, list[float]] = {}
    for r in records:
        q = gradient_quality(r["stats"], reference, b, per_unit=per_unit)[e]
        out.setdefault(r["digits"], []).append(q.efficiency.value)
    return out


def raw_ratios(records: list[dict], e: str, b: str, per_unit: bool = False) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for r in records:
        q = gradient_quality(r["stats"], b, b, per_unit=per_unit)[e]
        out.setdefault(r["digits"], []).append(q.raw_ratio.value)
    return out


def plot(out_dir: Path) -> Path:
    rows = [r for r in tables.read_csv(Path(out_dir) / "quality.csv") if r["reference"] == REFERENCE]
    fig, (ax_eff, ax_raw) = tables.figure(2, width=5.0)
    for name, members in tables.group_rows(rows, "estimator").items():
        by_len = tables.group_rows(members, "digits")
        xs = [sum(m["response_len"] for m in ms) / len(ms) for ms in by_len.values()]
        for ax, key in ((ax_eff, "efficiency"), (ax_raw, "raw_ratio")):
            ests = [ge.cluster_efficiency([m[key] for m in ms], "checkpoints") for ms in by_len.values()]
            ax.errorbar(xs, [e.value for e in ests], yerr=[[e.value - e.low for e in ests], [e.high - e.value
                        for e in ests]], marker="o", ms=3, capsize=2, label=name)
    for ax, title in ((ax_eff, "(a) efficiency vs RLOO at matched signal"), (ax_raw, "(b) raw tr Cov ratio (raw)")):
        ax.axhline(1.0, color="k", lw=0.8, ls=":")
        ax.set(yscale="log", xlabel="mean response length (tokens)", title=title)
    ax_eff.legend(fontsize=6, ncol=2)
    return tables.save_figure(fig, Path(out_dir) / "grad_variance.png")


def comparison(records: list[dict], e: str, b: str, label: str, lengths: dict, reference: str = REFERENCE,
               paper: float | None = None) -> tuple[str, str]:
    """(text, outcome) of the claim "e is more efficient than b", with the raw ratio beside it."""
    text, statistics = compared(records, e, b, label, lengths, reference)
    return text, outcome_of(statistics, paper)


def outcome_of(statistics: dict[str, rules.Estimate], paper: float | None = None) -> str:
    """The matched-signal rule on one comparison's statistics (its lengths and their geometric mean)."""
    each = [est for key, est in statistics.items() if not key.endswith("| pooled")]
    pooled = next(est for key, est in statistics.items() if key.endswith("| pooled"))
    return rules.pooled_ratio_outcome(each, pooled, paper=paper, claimed=">")


def compared(records: list[dict], e: str, b: str, label: str, lengths: dict,
             reference: str = REFERENCE, per_unit: bool = False) -> tuple[str, dict[str, rules.Estimate]]:
    """(text, statistics) of the claim "e is more efficient than b": the efficiency per length (keyed by
    digits, the same in every seed set) and pooled over the lengths, with the raw ratio in the text."""
    per = efficiencies(records, e, b, reference, per_unit)
    each, pooled = ge.pooled_efficiency(per, "checkpoints")
    raw_each, raw_pooled = ge.pooled_efficiency(raw_ratios(records, e, b, per_unit), "checkpoints")
    names = {d: f"{lengths[d]:.0f} tokens" for d in each}
    text = (ge.efficiency_text(f"efficiency {label}", each, pooled, names)
            + f" (raw tr Cov ratio, raw: {ge.efficiency_text('', raw_each, raw_pooled, names).lstrip(': ')})")
    undefined = {d: sum(not (v > 0 and math.isfinite(v)) for v in vs) for d, vs in per.items()}
    if any(undefined.values()):   # the efficiency needs both mean gradients resolved above their noise
        text += ("; undefined where " + ", ".join(f"{n} of {len(per[d])} checkpoints at {names[d]}"
                                                   for d, n in undefined.items() if n)
                 + f" had {reference}'s mean gradient (the scale's reference) not resolved above its noise "
                 "(cross-fitted signal ≤ 0), so the rule reads the lengths that are defined")
    statistics = {f"{label} | {d} digits": est for d, est in each.items()}
    return text, {**statistics, f"{label} | pooled": pooled}


def verdicts(out_dir: Path) -> list[rules.Verdict]:
    out_dir = Path(out_dir)
    cfg = tables.read_json(out_dir / "summary.json")["config"]
    records = ge.load_stats(out_dir)
    lengths = {d: sum(r["response_len"] for r in records if r["digits"] == d)
               / sum(r["digits"] == d for r in records) for d in cfg["digits"]}
    names = set(records[0]["stats"].names)
    power = (f"{cfg['checkpoints']} checkpoint(s) per length, " + ", ".join(f"{g} groups at {lengths[d]:.0f} tokens"
             for g, d in zip(cfg["groups"], cfg["digits"])) + ": t-intervals over the checkpoints (df 2 with 3) "
             "resolve only effects large against the spread between warm starts")
    out = [v for v in (otb_verdict(records, names, lengths, power), horizon_verdict(records, names, lengths, power),
                       energy_verdict(records, names, lengths, power), maxpo_verdict(records, names, lengths, power,
                                                                                      out_dir),
                       shrinkage_verdict(records, names, lengths, power), delta_l_verdict(records, names, lengths, power),
                       maxrl_verdict(records, names, lengths, power)) if v]
    return out


def rule(reference: str, paper: str = "") -> str:
    return ge.EFFICIENCY_RULE.format(reference=reference, units="the checkpoints", paper=paper)


def otb_verdict(records, names, lengths, power) -> rules.Verdict | None:
    rivals = [r for r in OTB_RIVALS if r in names]
    if "otb" not in names or not rivals:
        return None
    found = {r: compared(records, "otb", r, f"OTB/{r}", lengths) for r in rivals}
    loo = [comparison(records, f"{e}+loo", "rloo", f"{e}+loo/rloo", lengths)[0] for e in ("otb", "ogb")
           if f"{e}+loo" in names]
    scales = "; ".join(f"c(OTB) at {lengths[d]:.0f} tokens {ge.cluster_efficiency(v, 'checkpoints')}"
                       for d, v in scale_values(records, "otb").items())
    statistics = {k: est for _, stats in found.values() for k, est in stats.items()}

    def decide(statistics) -> str:   # every rival's comparison, combined
        return rules.combined_outcome([outcome_of({k: e for k, e in statistics.items() if k.startswith(f"OTB/{r} |")})
                                       for r in rivals])

    return rules.Verdict(
        "OTB is more efficient than RLOO/Dr.GRPO and OGB at matched signal", "OTB §5.2–5.3",
        "lower variance than OGB and the group-mean baselines", "; ".join(t for t, _ in found.values()),
        rule("RLOO") + "; all rivals won reproduces, some partly, none with a loss does not, else inconclusive",
        decide(statistics), power,
        f"Dr.GRPO is exactly (N−1)/N × RLOO, so its efficiency equals RLOO's. OTB's mean gradient is shrunk: {scales}. "
        "With leave_one_out (unbiased): " + "; ".join(loo) + ".", statistics=statistics, decide=decide)


def scale_values(records: list[dict], e: str, reference: str = REFERENCE) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for r in records:
        out.setdefault(r["digits"], []).append(gradient_quality(r["stats"], reference)[e].scale.value)
    return out


def horizon_verdict(records, names, lengths, power) -> rules.Verdict | None:
    digits = sorted(lengths)
    if not {"otb", "rloo"} <= names or len(digits) < 2:
        return None
    per = efficiencies(records, "otb", "rloo")
    grow = rules.cluster_ratio_contrast([per[digits[-1]], per[digits[0]]], [1.0, -1.0])
    return rules.Verdict(
        "OTB's efficiency advantage grows with the response length", "OTB §5.3",
        "the gain of token-level baselines grows with the horizon",
        f"(efficiency OTB/RLOO at {lengths[digits[-1]]:.0f} tokens) / (at {lengths[digits[0]]:.0f} tokens) = {grow}",
        "95% t-interval over the checkpoints of both lengths (log scale, Welch df) above 1 reproduces, below 1 does "
        "not, else inconclusive", growth_outcome({"growth": grow}), power,
        "Two lengths of 13 and 33 tokens; the `horizon` experiment tests the claim from 8 to thousands of tokens.",
        statistics={"growth": grow}, decide=growth_outcome)


def growth_outcome(statistics) -> str:
    return rules.interval_outcome(statistics["growth"], ">", null=1.0)


def energy_verdict(records, names, lengths, power) -> rules.Verdict | None:
    if not {"otb", "otb_isolated"} <= names:
        return None
    text, statistics = compared(records, "otb", "otb_isolated", "OTB/isolated", lengths)
    note = ""
    if {"otb+loo", "otb_isolated+loo"} <= names:
        note = "With leave_one_out: " + comparison(records, "otb+loo", "otb_isolated+loo", "OTB+loo/isolated+loo",
                                                    lengths)[0] + "."
    return rules.Verdict(
        "Cumulative energy (OTB) beats isolated per-token energy at matched signal", "OTB App. C.7, F.5",
        "cumulative W_t argued over isolated w_t", text,
        rule("RLOO") + ": a win reproduces, a loss does not, a tie is inconclusive", outcome_of(statistics), power,
        note, statistics=statistics, decide=outcome_of)


def maxpo_verdict(records, names, lengths, power, out_dir) -> rules.Verdict | None:
    if not {"maxpo", "ei"} <= names:
        return None
    paper = 1 / PAPER_MAXPO_VARIANCE_RATIO
    text, statistics = compared(records, "maxpo", "ei", "MaxPO/EI", lengths, reference="ei")

    def decide(statistics) -> str:
        return outcome_of(statistics, paper)

    summary = tables.read_json(Path(out_dir) / "summary.json")
    stars = "; ".join(f"{lengths[int(d)]:.0f} tokens: b* {b['b_star']:.3f} vs mean reward "
                      f"{b['reward_mean_pooled']:.3f}" for d, b in summary["baselines"].items())
    return rules.Verdict(
        "MaxPO (EI − L2O) is more efficient than raw EI", "MaxPO §3.2, §5.2.3",
        "77.4% lower Adam-moment proxy than PKPO = (K/N)·EI, its 'EI-only variant' (Llama-3.2-3B): a raw "
        "proxy, read here as efficiency 4.4 against EI", text,
        rule("EI", f" or below the paper's {paper:.2f}") + ": a win reproduces, a loss does not, a tie is inconclusive",
        decide(statistics), power, f"The variance-optimal baseline b* = ΣRW/ΣW against the mean reward — {stars}: a "
        "baseline built from rewards alone (L2O) sits above b* when incorrect responses carry most of the gradient "
        "energy.", statistics=statistics, decide=decide)


def cosine_values(records: list[dict], e: str, reference: str = REFERENCE) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for r in records:
        out.setdefault(r["digits"], []).append(gradient_quality(r["stats"], reference, per_unit=True)[e].cosine.value)
    return out


def cosine_statistics(records: list[dict], e: str, label: str) -> dict[str, rules.Estimate]:
    """The cosine of ``e``'s mean gradient with RLOO's per length and pooled (per checkpoint index the
    mean over the lengths), t-intervals over the checkpoints."""
    per = cosine_values(records, e)
    out = {f"{label} | {d} digits": rules.mean_estimate(v, "checkpoints") for d, v in per.items()}
    count = min(len(v) for v in per.values())
    pooled = [sum(v[c] for v in per.values()) / len(per) for c in range(count)]
    return {**out, f"{label} | pooled": rules.mean_estimate(pooled, "checkpoints")}


def menu_rule(reference: str) -> str:
    return (rule(reference) + "; the variance is a sampled batch's (the batch is the unit: batch-level estimators' "
            "groups share its statistics, so V is tr Cov of the batch's sum per group)")


def shrinkage_outcome(statistics) -> str:
    """Both comparisons (the paper's leave-one-out form against RLOO, the leave-in form against the group
    mean ≡ RLOO at matched signal), each by the matched-signal rule, combined."""
    return rules.combined_outcome([outcome_of({k: e for k, e in statistics.items() if k.startswith(prefix)})
                                   for prefix in ("shrinkage+loo/rloo |", "shrinkage/dr_grpo |")])


def shrinkage_verdict(records, names, lengths, power) -> rules.Verdict | None:
    if not {"shrinkage", "shrinkage+loo", "rloo"} <= names:
        return None
    loo_text, loo = compared(records, "shrinkage+loo", "rloo", "shrinkage+loo/rloo", lengths, per_unit=True)
    # dr_grpo ≡ (N−1)/N rloo: at matched signal its efficiency is rloo's, so the leave-in form is compared to rloo
    text, leave_in = compared(records, "shrinkage", "rloo", "shrinkage/dr_grpo", lengths, per_unit=True)
    statistics = {**loo, **leave_in}
    scales = "; ".join(f"c(shrinkage+loo) at {lengths[d]:.0f} tokens {rules.mean_estimate(v, 'checkpoints')}"
                       for d, v in scale_values(records, "shrinkage+loo").items())
    return rules.Verdict(
        "The James–Stein shrinkage baseline is more efficient than RLOO and the group mean at matched signal",
        "Shrinkage baselines, arXiv 2511.03710", "provably lower-variance policy gradient than the per-prompt mean "
        "(RLOO) baseline; \"consistently outperform\" (no single number in the abstract)", f"{loo_text}; {text}",
        menu_rule("RLOO") + "; the leave-one-out form (the paper's, unbiased) against RLOO and the leave-in form "
        "against the group mean (Dr.GRPO ≡ RLOO at matched signal): both won reproduces, one partly, none with a "
        "loss does not, else inconclusive", shrinkage_outcome(statistics), power,
        f"The batch is each sampled batch of prompts (the shrinkage pulls each prompt's mean toward the batch's). "
        f"Scale: {scales}.", statistics=statistics, decide=shrinkage_outcome)


def delta_l_outcome(statistics) -> str:
    """ΔL against token-mean and against seq-mean-token-mean (each by the matched-signal rule), and its
    cosine with the unbiased reference above ``COSINE_UNBIASED`` (per length and pooled: a CI below it
    anywhere does not reproduce, else the pooled CI above it reproduces), combined."""
    cos = {k: e for k, e in statistics.items() if k.startswith("cos(ΔL) |")}
    each = [e for k, e in cos.items() if not k.endswith("| pooled")]
    cos_outcome = ("does not reproduce" if any(rules.interval_outcome(e, ">", null=COSINE_UNBIASED) ==
                                               "does not reproduce" for e in each)
                   else rules.interval_outcome(cos["cos(ΔL) | pooled"], ">", null=COSINE_UNBIASED))
    return rules.combined_outcome([outcome_of({k: e for k, e in statistics.items() if k.startswith(prefix)})
                                   for prefix in ("ΔL/token-mean |", "ΔL/seq-mean-token-mean |")] + [cos_outcome])


def delta_l_verdict(records, names, lengths, power) -> rules.Verdict | None:
    rows = {key: f"{REFERENCE}{LOSS_ROW}{key}" for key in (DELTA_L, "agg=token-mean", "agg=seq-mean-token-mean")}
    if not set(rows.values()) <= names:
        return None
    t1, s1 = compared(records, rows[DELTA_L], rows["agg=token-mean"], "ΔL/token-mean", lengths, per_unit=True)
    t2, s2 = compared(records, rows[DELTA_L], rows["agg=seq-mean-token-mean"], "ΔL/seq-mean-token-mean", lengths,
                      per_unit=True)
    cos = cosine_statistics(records, rows[DELTA_L], "cos(ΔL)")
    statistics = {**s1, **s2, **cos}
    cos_text = ", ".join(f"{k.split('| ')[1]} {e}" for k, e in cos.items())
    return rules.Verdict(
        "ΔL (VL) normalisation is unbiased and has the lowest variance among the aggregations", "ΔL Normalization, "
        "arXiv 2509.07558", "unbiased, minimum variance among unbiased aggregations; up to 2.67× faster convergence "
        "(DAPO + VL Norm, CountDown)", f"{t1}; {t2}; cosine with the unbiased sum's mean gradient: {cos_text}",
        menu_rule("the plain sum (RLOO)") + f"; unbiasedness read as the cosine's CI above {COSINE_UNBIASED} (a CI "
        f"below it at any length does not reproduce); ΔL against token-mean, against seq-mean-token-mean and the "
        "cosine: all reproduce reproduces, some partly, none with a contradiction does not, else inconclusive",
        delta_l_outcome(statistics), power,
        "All rows use RLOO's advantages at ratio 1 (α = 1). Measured group by group, token-mean's and seq-mean-token-sum's "
        "count · L is the group's token sum, the plain gradient: the step-wide token count that divides token-mean is "
        "a constant to first order here, so its own variance across steps is not in this comparison. ΔL's weights "
        "n_b^−α depend on the sampled lengths, so its expected gradient is ∇J's only where the lengths carry no "
        "information about the reward: the cosine reads that.", statistics=statistics, decide=delta_l_outcome)


def maxrl_outcome(statistics) -> str:
    """MaxRL's direction differs from ∇J's: the pooled cosine's CI below 1 reproduces, above ``COSINE_SAME``
    does not (indistinguishable directions), else inconclusive."""
    pooled = statistics["cos(MaxRL) | pooled"]
    if rules.interval_outcome(pooled, ">", null=COSINE_SAME) == "reproduces":
        return "does not reproduce"
    return rules.interval_outcome(pooled, "<", null=1.0)


def maxrl_verdict(records, names, lengths, power) -> rules.Verdict | None:
    if not {"maxrl", "rloo"} <= names:
        return None
    cos = cosine_statistics(records, "maxrl", "cos(MaxRL)")
    eff_text, _ = compared(records, "maxrl", "rloo", "MaxRL/rloo", lengths, per_unit=True)
    scales = "; ".join(f"{lengths[d]:.0f} tokens {rules.mean_estimate(v, 'checkpoints')}"
                       for d, v in scale_values(records, "maxrl").items())
    cos_text = ", ".join(f"{k.split('| ')[1]} {e}" for k, e in cos.items())
    return rules.Verdict(
        "MaxRL estimates a different gradient from RLOO's (∇ of the truncated log pass rate, not of the pass rate)",
        "MaxRL, arXiv 2602.02710", "A = (R − p̂)/p̂ is the unbiased gradient of the order-N truncated maximum-"
        "likelihood objective (a prompt weighs ≈ 1/p); Pareto-dominates GRPO, 7.9–19.2× test-time-scaling efficiency "
        "(Qwen3-4B); no variance claim against ∇J", f"cosine with RLOO's mean gradient: {cos_text}",
        f"the cosine per checkpoint (t-interval over the checkpoints, pooled: per checkpoint the mean over the "
        f"lengths): the pooled CI below 1 reproduces (its direction differs, as its objective says), above "
        f"{COSINE_SAME} does not (indistinguishable from ∇J's), else inconclusive", maxrl_outcome(cos), power,
        f"Not ranked against RLOO: their expected gradients differ, so an efficiency is no quality comparison. "
        f"Printed for the record — {eff_text}; scale c against RLOO: {scales}.", statistics=cos, decide=maxrl_outcome)


def quality_table(rows: list[tables.Row], reference: str) -> str:
    """estimator × length: efficiency [CI over checkpoints], c, cosine, raw ratio (labelled raw)."""
    rows = [r for r in rows if r["reference"] == reference]
    table = []
    for (name, digits), members in tables.group_rows(
            [{**r, "key": (r["estimator"], r["digits"])} for r in rows], "key").items():
        length = sum(m["response_len"] for m in members) / len(members)
        cells = {k: ge.cluster_efficiency([m[k] for m in members], "checkpoints") for k in ("efficiency", "raw_ratio")}
        scale = rules.mean_estimate([m["scale"] for m in members], "checkpoints")
        cosine = rules.mean_estimate([m["cosine"] for m in members], "checkpoints")
        table.append({"estimator": name, "length": f"{length:.0f} tokens", "efficiency": str(cells["efficiency"]),
                      "scale c": str(scale), "cosine": str(cosine), "raw tr Cov ratio (raw)": str(cells["raw_ratio"])})
    return tables.markdown_table(table)


def report(out_dir: Path, figure_path: str) -> str:
    out_dir = Path(out_dir)
    rows = tables.read_csv(out_dir / "quality.csv")
    summary = tables.read_json(out_dir / "summary.json")
    cfg = summary["config"]
    lines = ["## Exact policy gradients at matched signal, against the response length (OTB §5.3, §6; MaxPO §3.2)\n",
             f"Setting: `builtin:tiny` ({summary['parameters']:,} parameters) warm-started on `{cfg['task']}` with a "
             f"scratchpad at digits {list(cfg['digits'])} to sampled accuracy {list(cfg['warm_start_accuracy'])} "
             f"(warm start capped at {cfg['warm_start_max_steps']} steps) and held fixed, {cfg['checkpoints']} "
             f"independent warm starts (seeds {cfg['seed']}–{cfg['seed'] + cfg['checkpoints'] - 1}) per length; "
             f"N = {cfg['group_size']}, "
             f"{list(cfg['groups'])} groups per length (an equal share per checkpoint), each group's exact gradient "
             "of all parameters (sum over tokens, mean over responses) under every estimator on the same responses. "
             f"`+loo` rows are the `leave_one_out=True` forms; `dr_grpo` is exactly (N−1)/N × RLOO; max@K rows with "
             f"K = {cfg['k']} against EI. Intervals: 95% t over the checkpoints.\n",
             f"![grad variance]({figure_path})\n",
             "Against RLOO (efficiency > 1: fewer groups for the same signal-to-noise; c: scale of the mean gradient "
             "along RLOO's, 1 = unbiased; the raw ratio is not a quality measure):\n",
             quality_table(rows, REFERENCE), "\nmax@K estimators against EI:\n", quality_table(
                 [r for r in rows if takes_k(r["estimator"])], "ei")]
    for d, b in summary["baselines"].items():
        lines.append(f"- {d} digits: b* = ΣRW/ΣW = {b['b_star']:.3f} against the mean reward "
                     f"{b['reward_mean_pooled']:.3f}; incorrect responses carry {b['energy_wrong_over_correct']:.1f}× "
                     "the gradient energy Ŵ of correct ones.")
    return "\n".join(lines) + "\n"


EXPERIMENT = register_experiment(Experiment("grad-variance", PRESETS, run, verdicts, report, validate))
