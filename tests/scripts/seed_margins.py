"""The evidence behind the suite's statistical assertions: each one's statistic over many seeds.

A test that asserts a sampled statistic (an interval covering the truth, a slope in a range, a
warm start reaching its target) passes on its own seed. That it is not a lucky seed, and that
another CPU's rounding (which moves the sample path) cannot make it fail, is shown here: the same
statistic over many seeds, with the number of seeds that would fail the test's threshold and the
worst margin. Each test quotes this script's numbers in a comment.

    PYTHONPATH=src python tests/scripts/seed_margins.py [CHECK ...] [--seeds N]

A check prints: name, seeds, failures (seeds whose statistic misses the test's threshold), the
threshold and the worst value over the seeds. Run it under the heavy lock (minutes).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the tests' helpers


def report(name: str, values: list[float], ok, threshold: str, worst) -> None:
    fails = sum(not ok(v) for v in values)
    print(f"{name:34s} seeds {len(values):5d}  failures {fails:4d}  threshold {threshold:28s} worst {worst(values):.4g}",
          flush=True)


def sampled_quality(seeds: int) -> None:
    """test_gradient_quality.test_sampled_quality_is_near_the_exact_values: 4000 draws, 20 folds; the
    relative error of each statistic (worst over the estimators) against the test's bound ``SAMPLED_REL``."""
    from test_gradient_quality import NAMES, SAMPLED_REL, SPECS, sample_stats
    from enumerable_policy import THETA, outcome_gradients
    from creditrl.core.gradients import exact_quality, gradient_quality

    for eos in (False, True):
        grads, probs = outcome_gradients(THETA, eos, SPECS)
        exact = exact_quality(NAMES, grads, probs, reference="rloo")
        errors = {key: [] for key in SAMPLED_REL}
        for seed in range(seeds):
            got = gradient_quality(sample_stats(grads, probs, 4000, 20, seed=seed), reference="rloo")
            for key in SAMPLED_REL:
                errors[key].append(max(abs(getattr(got[n], key).value / getattr(exact[n], key).value - 1)
                                       for n in NAMES if not (n == "rloo" and key != "variance" and key != "cosine")))
        for key, bound in SAMPLED_REL.items():
            report(f"sampled_quality {key} eos={eos}", errors[key], lambda v, b=bound: v <= b, f"rel err <= {bound}", max)


def coverage(seeds: int) -> None:
    """test_gradient_quality.test_efficiency_intervals_cover_at_about_their_rate: 200 reps of 600 groups."""
    from test_gradient_quality import NAMES, SPECS, sample_stats
    from enumerable_policy import THETA, outcome_gradients
    from creditrl.core.gradients import exact_quality, gradient_quality

    grads, probs = outcome_gradients(THETA, True, SPECS)
    exact = exact_quality(NAMES, grads, probs, reference="rloo")["otb"]
    from test_gradient_quality import COVERAGE_REPS, COVERAGE_MIN

    lowest, total = [], dict.fromkeys(("efficiency", "scale", "variance"), 0)
    for block in range(seeds):
        hits = dict.fromkeys(total, 0)
        for rep in range(COVERAGE_REPS):
            q = gradient_quality(sample_stats(grads, probs, 600, 20, seed=100 + COVERAGE_REPS * block + rep))["otb"]
            for key in hits:
                iv = getattr(q, key)
                hits[key] += iv.low <= getattr(exact, key).value <= iv.high
        lowest.append(min(hits.values()) / COVERAGE_REPS)
        total = {k: total[k] + hits[k] for k in total}
    print("coverage over all blocks:", {k: round(v / (seeds * COVERAGE_REPS), 4) for k, v in total.items()})
    report(f"coverage (lowest of 3, {COVERAGE_REPS} reps)", lowest, lambda v: v >= COVERAGE_MIN,
           f">= {COVERAGE_MIN}", min)


def noise_scale(seeds: int) -> None:
    """test_gradient_quality.test_noise_scale_recovers_a_known_gaussian_problem."""
    from creditrl.core.gradients import NoiseScale

    errors = []
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        G = torch.tensor([1.0, -0.5, 0.25, 0.0], dtype=torch.float64)
        scales = torch.tensor([2.0, 1.0, 0.5, 3.0], dtype=torch.float64)
        truth = float(scales.square().sum() / G.square().sum())
        smoother = NoiseScale(decay=0.999)
        for _ in range(4000):
            draws = G + scales * torch.randn(16, 4, generator=gen, dtype=torch.float64)
            value = smoother.update(draws[:8].mean(0), draws[8:].mean(0), 8, 8)
        errors.append(abs(value / truth - 1))
    report("noise_scale |rel err|", errors, lambda v: v <= 0.25, "<= 0.25", max)


def count_sketch(seeds: int) -> None:
    """test_gradient_quality.test_count_sketch_matches_its_definition_and_is_unbiased."""
    from creditrl.core.gradients import CountSketch

    shapes = [(3, 4), (5,)]
    z_mean, rel_var = [], []
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        x = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
        y = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
        flat_x, flat_y = torch.cat([t.reshape(-1) for t in x]), torch.cat([t.reshape(-1) for t in y])
        dots = torch.tensor([float(CountSketch(shapes, 4, s)(x) @ CountSketch(shapes, 4, s)(y))
                             for s in range(4000 * seed, 4000 * seed + 4000)])
        exact = float(flat_x @ flat_y)
        var = (float(flat_x @ flat_x) * float(flat_y @ flat_y) + exact ** 2
               - 2 * float((flat_x ** 2 * flat_y ** 2).sum())) / 4
        z_mean.append(abs(float(dots.mean()) - exact) / math.sqrt(var / 4000))
        rel_var.append(abs(float(dots.var()) / var - 1))
    report("count_sketch |z| of the mean", z_mean, lambda v: v < 5, "< 5", max)
    report("count_sketch |rel err| of var", rel_var, lambda v: v <= 0.15, "<= 0.15", max)


def tail_index(seeds: int) -> None:
    """test_evidence_rules.test_tail_index_recovers_a_pareto_tail."""
    from creditrl.tools import tables  # noqa: F401
    from creditrl_research import rules  # noqa: F401

    for alpha in (1.2, 3.0):
        errors = []
        for seed in range(seeds):
            u = torch.rand(200_000, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
            errors.append(abs(rules.tail_index(u.pow(-1 / alpha), 0.1) / alpha - 1))
        report(f"tail_index alpha={alpha} |rel err|", errors, lambda v: v <= 0.04, "<= 0.04", max)


def synthetic_sampling(seeds: int) -> None:
    """test_synthetic_policy.test_sampling_matches_the_exact_probabilities."""
    from test_synthetic_policy import log_prob, responses
    from creditrl_research import synthetic_policy as sp

    policy = sp.make_policy(6, eos=True, errors=0.9, stop=1.2, forks=2, need=1)
    J = float(sp.success_probability(policy))
    wanted = [(seq, float(log_prob(policy, policy.theta, seq).exp())) for seq in responses(policy)[:6]]
    worst = []
    for seed in range(seeds):
        tokens, mask, rewards = sp.sample(policy, 200_000, torch.Generator().manual_seed(seed))
        z = [abs(float(rewards.mean()) - J) / math.sqrt(J * (1 - J) / 200_000)]
        for seq, want in wanted:
            row = torch.tensor(list(seq) + [0] * (6 - len(seq)))
            hit = float(((tokens == row).all(1) & (mask.sum(1) == len(seq))).double().mean())
            z.append(abs(hit - want) / math.sqrt(want * (1 - want) / 200_000))
        worst.append(max(z))
    report("synthetic sampling max |z|", worst, lambda v: v < 5, "< 5", max)


def maxk_monte_carlo(seeds: int) -> None:
    """test_maxk.test_max_at_k_unbiased_monte_carlo."""
    from creditrl import maxk_quantities

    values, probs = torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.tensor([0.4, 0.3, 0.2, 0.1])
    n, k, groups = 6, 3, 20000
    cdf = probs.cumsum(0).double()
    exact = float((values.double() * (cdf ** k - torch.cat([torch.zeros(1).double(), cdf[:-1]]) ** k)).sum())
    zs = []
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        draws = values[torch.multinomial(probs, n * groups, replacement=True, generator=g)]
        rho = maxk_quantities(draws, torch.arange(groups).repeat_interleave(n), k).rho.reshape(groups, n)[:, 0]
        zs.append(abs(float(rho.mean()) - exact) / (float(rho.std()) / math.sqrt(groups)))
    report("maxk monte carlo |z|", zs, lambda v: v < 5, "< 5", max)


def bootstrap_ci(seeds: int) -> None:
    """test_experiments.test_bootstrap_ci_and_slope: the mean inside its CI, width < 0.5."""
    from creditrl.tools import tables  # noqa: F401
    from creditrl_research import rules  # noqa: F401

    inside, widths = [], []
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(400, generator=gen, dtype=torch.float64) + 3.0
        low, high = rules.bootstrap_ci(lambda idx: x[idx].mean(-1), 400, generator=gen)
        inside.append(float(low < x.mean() < high))
        widths.append(high - low)
    report("bootstrap_ci mean inside", inside, lambda v: v == 1, "inside", min)
    report("bootstrap_ci width", widths, lambda v: v < 0.5, "< 0.5", max)


def maxk_bandit(seeds: int) -> None:
    """test_experiments.test_maxk_bandit_fast_preset: slopes of the fast preset, seed 0, 1, ..."""
    import dataclasses

    from creditrl_research.experiments import maxk_bandit as mb

    slopes, plateau, ratio, reproduces = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(seeds):
            out = Path(tmp) / str(seed)
            mb.run(dataclasses.replace(mb.PRESETS["fast"], seed=seed), out)
            s = mb.summarize(out)
            slopes += [s["slope"]["EI"], s["slope"]["EI+L2O"]]
            plateau.append(s["last_decade_slope"]["EI+L1O"])
            ratio.append(s["final_error"]["EI+L1O"] / s["final_error"]["EI+L2O"])
            reproduces.append(float(mb.verdicts(out)[0].outcome == "reproduces"))
    report("maxk-bandit EI, EI+L2O slopes", slopes, lambda v: -0.65 < v < -0.35, "in (-0.65, -0.35)",
           lambda v: max(v, key=lambda s: abs(s + 0.5)))
    report("maxk-bandit L1O last-decade slope", plateau, lambda v: v > -0.25, "> -0.25", min)
    report("maxk-bandit L1O/L2O final error", ratio, lambda v: v > 5, "> 5", min)
    report("maxk-bandit first verdict", reproduces, lambda v: v == 1, "reproduces", min)


def horizon(seeds: int) -> None:
    """test_experiments.test_horizon_fast_preset: unbiased forms' scale interval holds 1 (or |c - 1| < 0.15)."""
    import dataclasses

    from creditrl.tools import tables  # noqa: F401
    from creditrl_research import rules  # noqa: F401
    from creditrl_research.experiments import horizon as hz

    misses, worst = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(seeds):
            out = Path(tmp) / str(seed)
            hz.run(dataclasses.replace(hz.PRESETS["fast"], seed=seed), out)
            rows = [r for r in tables.read_csv(out / "quality.csv")
                    if r["estimator"] in ("rloo", "otb+loo", "otb_isolated+loo")]
            miss = [r for r in rows if not (r["scale_low"] <= 1.0 <= r["scale_high"] or abs(r["scale"] - 1) < 0.15)]
            misses.append(len(miss))
            worst.append(max(abs(r["scale"] - 1) for r in rows))
    report("horizon rows failing", misses, lambda v: v == 0, "0 rows", max)
    report("horizon max |c - 1|", worst, lambda v: True, "(for the record)", max)


def proxy_fidelity(seeds: int) -> None:
    """test_experiments.test_proxy_fidelity_fast_preset: the Spearman estimate inside its bootstrap interval."""
    import dataclasses

    from creditrl_research.experiments import proxy_fidelity as pf

    inside = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(seeds):
            out = Path(tmp) / str(seed)
            pf.run(dataclasses.replace(pf.PRESETS["fast"], seed=seed), out)
            rho = pf.token_spearman_ci(out, 200)
            inside.append(float(rho.low <= rho.value <= rho.high))
    report("proxy-fidelity rho inside its CI", inside, lambda v: v == 1, "inside", min)


def otb_stability(seeds: int) -> None:
    """test_experiments.test_otb_stability_and_stapo_census_fast_presets: GRPO N=16's tokens over N=4's."""
    import dataclasses

    from creditrl.tools import tables  # noqa: F401
    from creditrl_research import rules  # noqa: F401
    from creditrl_research.experiments import otb_stability as ots

    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(seeds):
            out = Path(tmp) / str(seed)
            ots.run(dataclasses.replace(ots.PRESETS["fast"], seed=seed), out)
            tokens = {r["run"]: r["tokens"] for r in tables.read_csv(out / "seeds.csv")}
            ratios.append(tokens["grpo-n16"] / tokens["grpo-n4"])
    report("otb-stability tokens N16 / N4", ratios, lambda v: v > 2, "> 2", min)


def warm_start(seeds: int) -> None:
    """test_models.test_warm_start_learns_addition: sampled accuracy after at most 800 steps (target 0.3)."""
    from creditrl.runtime.models import WarmStartConfig, char_tokenizer, tiny_model, warm_start as run
    from creditrl.tasks import get_task

    task = get_task("addition")
    tok = char_tokenizer(task.alphabet())
    accuracy = []
    for seed in range(seeds):
        result = run(tiny_model(tok, seed=seed), tok, task,
                     WarmStartConfig(target_accuracy=0.3, max_steps=800, seed=seed), progress=False)
        accuracy.append(result.accuracy)
    report("warm start accuracy", accuracy, lambda v: v >= 0.3, ">= 0.3", min)


CHECKS = {f.__name__: f for f in (sampled_quality, coverage, noise_scale, count_sketch, tail_index,
                                  synthetic_sampling, maxk_monte_carlo, bootstrap_ci, maxk_bandit, horizon,
                                  proxy_fidelity, otb_stability, warm_start)}
DEFAULT_SEEDS = {"sampled_quality": 1000, "coverage": 50, "maxk_bandit": 30, "horizon": 50, "warm_start": 10,
                 "count_sketch": 200, "synthetic_sampling": 100, "proxy_fidelity": 10, "otb_stability": 5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checks", nargs="*", metavar="CHECK", help=f"which (default: all): {', '.join(CHECKS)}")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per check (default: 200, fewer for slow ones)")
    args = parser.parse_args()
    unknown = sorted(set(args.checks) - set(CHECKS))
    if unknown:
        parser.error(f"unknown check(s) {unknown}; valid checks are {list(CHECKS)}")
    torch.set_num_threads(1)
    os.environ.setdefault("CREDITRL_CACHE", tempfile.mkdtemp(prefix="creditrl-seed-margins-"))   # warm starts
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, 1 thread")
    for name in args.checks or CHECKS:
        start = time.perf_counter()
        CHECKS[name](args.seeds or DEFAULT_SEEDS.get(name, 200))
        print(f"{'':34s} ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
