"""Tests of ``creditrl experiment``: brute-force checks of each experiment's math, and the
``fast`` presets run end to end asserting what must hold even at small scale."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from creditrl.studies import experiments
from creditrl.studies import reporting
from creditrl.studies.experiments import maxk_bandit as mb


# ---------------------------------------------------------------- maxk-bandit: brute force
def brute_objective(rewards: list[float], probs: torch.Tensor, k: int) -> torch.Tensor:
    """E[max of K draws] by enumerating all n^K ordered tuples (differentiable in probs)."""
    total = probs.new_zeros(())
    for tup in itertools.product(range(len(rewards)), repeat=k):
        total = total + torch.stack([probs[a] for a in tup]).prod() * max(rewards[a] for a in tup)
    return total


def ei_loop(r: list[float], k: int) -> list[float]:
    """EI_i = mean over (K-1)-subsets S of the others of relu(r_i - max S) (K = 1: r_i)."""
    if k == 1:
        return list(r)
    out = []
    for i in range(len(r)):
        others = [r[j] for j in range(len(r)) if j != i]
        vals = [max(0.0, r[i] - max(s)) for s in itertools.combinations(others, k - 1)]
        out.append(sum(vals) / len(vals))
    return out


def advantages_loop(r: list[float], k: int) -> dict[str, list[float]]:
    """The three estimators' advantages straight from their definitions (MaxPO §3)."""
    n = len(r)
    ei = ei_loop(r, k)
    l2o = []
    for i in range(n):
        pool = [r[j] for j in range(n) if j != i]
        ei_minus_i = ei_loop(pool, k)  # EI_j recomputed with i removed
        l2o.append(ei[i] - sum(ei_minus_i) / (n - 1))
    l1o = [ei[i] - sum(ei[j] for j in range(n) if j != i) / (n - 1) for i in range(n)]
    return {"EI": ei, "EI+L2O": l2o, "EI+L1O": l1o}


def test_true_gradient_matches_enumeration_and_finite_differences():
    gen = torch.Generator().manual_seed(1)
    rewards, logits = mb.sample_instances(2, 4, gen)
    for k in (1, 2, 3):
        grad = mb.true_gradient(rewards, logits, k)
        for s in range(2):
            theta = logits[s].clone().requires_grad_(True)
            obj = brute_objective(rewards[s].tolist(), torch.softmax(theta, -1), k)
            assert torch.allclose(mb.maxk_objective(rewards[s:s + 1], logits[s:s + 1], k)[0], obj.detach(), atol=1e-12)
            (expect,) = torch.autograd.grad(obj, theta)
            assert torch.allclose(grad[s], expect, atol=1e-10)
        h = 1e-6
        e0 = torch.zeros_like(logits)
        e0[:, 0] = h
        fd = (mb.maxk_objective(rewards, logits + e0, k) - mb.maxk_objective(rewards, logits - e0, k)) / (2 * h)
        assert torch.allclose(grad[:, 0], fd, atol=1e-7)


def test_gradient_estimates_match_loop():
    gen = torch.Generator().manual_seed(2)
    rewards, logits = mb.sample_instances(2, 6, gen)
    actions = mb.sample_actions(logits, 3, 5, gen)  # [S=2, M=3, N=5]
    k = 3
    got = mb.gradient_estimates(rewards, logits, actions, k)
    probs = torch.softmax(logits, -1)
    for s, m in itertools.product(range(2), range(3)):
        ys = actions[s, m].tolist()
        adv = advantages_loop([rewards[s, y].item() for y in ys], k)
        for name, a in adv.items():
            g = torch.zeros(6, dtype=torch.float64)
            for y, a_i in zip(ys, a):
                score = -probs[s].clone()
                score[y] += 1
                g += a_i * score
            assert torch.allclose(got[name][s, m], g * k / 5, atol=1e-12), name


def test_exact_expectation_ei_and_l2o_unbiased_l1o_biased():
    """Average over every possible batch, weighted by its probability: no sampling noise."""
    gen = torch.Generator().manual_seed(3)
    n, N, k = 3, 4, 2
    rewards, logits = mb.sample_instances(1, n, gen)
    batches = torch.tensor(list(itertools.product(range(n), repeat=N)))  # [n^N, N]
    probs = torch.softmax(logits[0], -1)
    weight = probs[batches].prod(dim=-1)  # probability of each ordered batch
    est = mb.gradient_estimates(rewards, logits, batches[None], k)
    truth = mb.true_gradient(rewards, logits, k)[0]
    mean = {name: (weight[:, None] * g[0]).sum(0) for name, g in est.items()}
    assert torch.allclose(mean["EI"], truth, atol=1e-12)
    assert torch.allclose(mean["EI+L2O"], truth, atol=1e-12)
    assert (mean["EI+L1O"] - truth).norm() > 1e-3 * truth.norm()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 12), N=st.integers(2, 9), data=st.data())
def test_estimates_are_tangent_and_k1_l1o_equals_l2o(seed, n, N, data):
    k = data.draw(st.integers(1, N - 1))
    gen = torch.Generator().manual_seed(seed)
    rewards, logits = mb.sample_instances(2, n, gen)
    est = mb.gradient_estimates(rewards, logits, mb.sample_actions(logits, 4, N, gen), k)
    for g in est.values():  # softmax gradients sum to zero over actions
        assert torch.allclose(g.sum(-1), torch.zeros(()).double(), atol=1e-10)
    if k == 1:  # no comparators: L1O's baseline no longer depends on y_i, both are RLOO
        assert torch.allclose(est["EI+L1O"], est["EI+L2O"], atol=1e-12)


def test_bandit_config_errors():
    with pytest.raises(ValueError, match="k: expected 1 <= k <= group_size-1"):
        mb.validate(mb.BanditConfig(k=16, group_size=16))
    with pytest.raises(ValueError, match="k_sweep"):
        mb.validate(mb.BanditConfig(k_sweep=(1, 16), group_size=16))


@pytest.fixture(scope="module")
def fast_root(tmp_path_factory):
    return tmp_path_factory.mktemp("fast")


def fast_run(root, name):
    """Run (once per module) the ``fast`` preset of experiment ``name`` under ``root/name``."""
    out = root / name
    if not (out / "summary.json").exists():
        experiments.run_experiment(name, "fast", out)
    return out


def test_maxk_bandit_fast_preset(fast_root, tmp_path):
    """L1O plateaus while EI and EI+L2O fall like M^-1/2; all variances finite; seeded."""
    summary = mb.summarize(fast_run(fast_root, "maxk-bandit"))
    (tmp_path / "a").symlink_to(fast_root / "maxk-bandit")
    for name in ("EI", "EI+L2O"):
        assert -0.65 < summary["slope"][name] < -0.35
    assert summary["last_decade_slope"]["EI+L1O"] > -0.25
    assert summary["final_error"]["EI+L1O"] > 5 * summary["final_error"]["EI+L2O"]
    rows = reporting.read_csv(tmp_path / "a" / "variance_actions.csv") + reporting.read_csv(tmp_path / "a" / "variance_k.csv")
    assert all(math.isfinite(r["variance"]) and r["variance"] > 0 for r in rows)
    assert (tmp_path / "a" / "maxk_bandit.png").stat().st_size > 0
    assert "figures/maxk_bandit.png" in mb.report(tmp_path / "a", "figures/maxk_bandit.png")
    first = mb.verdicts(tmp_path / "a")[0]
    assert first.outcome == "reproduces" and "slope" in first.ours
    # reproducible with a seed; a different seed gives different numbers
    small = dict(bias_batches=(10, 100), variance_batches=20, actions_sweep=(4,), k_sweep=(2,))
    cfg = mb.BanditConfig(seeds=3, num_actions=8, group_size=4, k=2, **small)
    mb.run(cfg, tmp_path / "b")
    mb.run(cfg, tmp_path / "c")
    for f in ("bias.csv", "variance_actions.csv", "variance_k.csv"):
        assert (tmp_path / "b" / f).read_text() == (tmp_path / "c" / f).read_text()
    import dataclasses
    mb.run(dataclasses.replace(cfg, seed=1), tmp_path / "d")
    assert (tmp_path / "b" / "bias.csv").read_text() != (tmp_path / "d" / "bias.csv").read_text()


# ---------------------------------------------------------------- CLI and shared helpers
def test_experiment_cli_errors(tmp_path, capsys):
    assert experiments.main(["maxk-bandit", "--out", str(tmp_path), "nope=1"]) == 2
    err = capsys.readouterr().err
    assert "nope: unknown key" in err and "group_size" in err
    # the trainer's typed merge: types, finiteness and tuple items are checked and named
    for bad, message in [("k=1.5", "k: expected int"), ("k_sweep=[2,x]", "k_sweep[1]: expected int"),
                         ("variance_batches=.inf", "expected int"), ("seed", "expected key=value")]:
        assert experiments.main(["maxk-bandit", "--out", str(tmp_path), bad]) == 2
        assert message in capsys.readouterr().err
    assert experiments.main(["grad-variance", "--out", str(tmp_path), "temperature=nan"]) == 2
    assert "temperature: expected a finite number" in capsys.readouterr().err
    # 'all' checks every experiment's config before the first one runs
    assert experiments.main(["all", "--out", str(tmp_path), "k_sweep=[2]"]) == 2
    assert "k_sweep: unknown key" in capsys.readouterr().err and not any(tmp_path.iterdir())
    with pytest.raises(SystemExit):
        experiments.main(["no-such-experiment"])
    with pytest.raises(ValueError, match="valid names"):
        experiments.experiment_module("nope")


def test_experiment_cli_runs_with_overrides(tmp_path):
    (tmp_path / "small.yaml").write_text("seeds: 2\nvariance_batches: 10\nactions_sweep: [4]\n")
    rc = experiments.main(["maxk-bandit", "--out", str(tmp_path), "--config", str(tmp_path / "small.yaml"),
                           "bias_batches=[5, 50]", "k_sweep=[2,3]"])
    assert rc == 0
    rows = reporting.read_csv(tmp_path / "bias.csv")
    assert sorted({r["batches"] for r in rows}) == [5, 50]
    assert reporting.read_json(tmp_path / "summary.json")["config"]["seeds"] == 2


def test_bootstrap_ci_and_slope():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(400, generator=gen, dtype=torch.float64) + 3.0
    low, high = reporting.bootstrap_ci(lambda idx: x[idx].mean(-1), 400, generator=gen)
    assert low < x.mean() < high and high - low < 0.5
    assert abs(reporting.loglog_slope([1, 10, 100], [1.0, 0.1 ** 0.5, 0.1])) - 0.5 < 1e-12
    rows = [{"a": 1, "b": 0.5, "c": "x"}]
    assert reporting.markdown_table(rows).splitlines()[2] == "| 1 | 0.5 | x |"
    # a '|' in a cell would split it into two columns: escaped
    assert reporting.markdown_table([{"a": "|x| change"}]).splitlines()[2] == "| \\|x\\| change |"


# ---------------------------------------------------------------- grad-variance / proxy-fidelity: exact gradients
@pytest.fixture(scope="module")
def tiny_rollouts():
    """A random (not warm-started) tiny policy and one rollout batch: 2 groups x 3 responses."""
    import random

    from creditrl.runtime.models.tiny import TinyModelConfig, char_tokenizer, tiny_model
    from creditrl.tasks import get_task
    from creditrl.runtime.rollout import generate_rollouts

    torch.manual_seed(0)
    task = get_task("multiplication", digits=1)
    tokenizer = char_tokenizer(task.alphabet())
    model = tiny_model(tokenizer, TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64))
    model.eval()
    problems = [task.sample(random.Random(i)) for i in (1, 2)]  # different prompt lengths -> left padding
    batch = generate_rollouts(model, tokenizer, task, problems, group_size=3, max_new_tokens=6,
                              generator=torch.Generator().manual_seed(0))
    batch.rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])  # non-degenerate groups
    params = [p for p in model.parameters() if p.requires_grad]
    return model, params, batch


def row_logp(model, batch, row):
    """Response log-probs of one row from its own unpadded forward (independent of the batch layout)."""
    keep = batch.attention_mask[row] > 0
    ids = batch.input_ids[row][keep][None]
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
    logp = torch.log_softmax(logits.double(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    resp = batch.response_mask[row][keep][1:] > 0
    return logp, resp


def test_block_gradients_match_per_response_loop(tiny_rollouts):
    from creditrl.studies.experiments import grad_variance as gv

    model, params, batch = tiny_rollouts
    cfg = gv.GradVarianceConfig(estimators=("reinforce", "rloo", "otb", "maxpo"), k=2, temperature=1.0)
    got, response_energy = gv.block_gradients(model, params, batch, cfg)  # [E, G, P], [B]
    with torch.no_grad():
        energy = gv.response_tokens(model, batch, slice(None), 1.0).energy
    mask = batch.response_mask[:, batch.prompt_len:] > 0
    torch.testing.assert_close(response_energy, (energy.double() * mask).sum(1))
    adv = gv.estimator_advantages(batch, energy, mask, cfg.estimators, cfg.k)
    for e in range(len(cfg.estimators)):
        for g in range(2):
            total = None
            rows = range(3 * g, 3 * g + 3)
            norm = sum(int(mask[r].sum()) for r in rows)
            for r in rows:  # Σ_t A_t log π(y_t) of each response separately, then its gradient
                logp, resp = row_logp(model, batch, r)
                a = adv[e, r][mask[r]].double()
                grads = torch.autograd.grad((a * logp[resp]).sum() / norm, params, allow_unused=True)
                flat = torch.cat([(torch.zeros_like(p) if x is None else x).reshape(-1) for p, x in zip(params, grads)])
                total = flat if total is None else total + flat
            assert torch.allclose(got[e, g].double(), total.double(), atol=1e-5, rtol=1e-4), cfg.estimators[e]


def test_baseline_summary_is_the_pooled_energy_weighted_mean():
    from creditrl.studies.experiments import grad_variance as gv
    r, w = [1.0, 0.0, 0.0, 1.0], [0.5, 3.0, 4.0, 0.5]
    sums = {"RW": sum(a * b for a, b in zip(r, w)), "W": sum(w), "R": sum(r), "n": 4,
            "W_correct": 1.0, "n_correct": 2}
    out = gv.baseline_summary(sums)
    assert out["b_star"] == pytest.approx(1.0 / 8.0)
    assert out["reward_mean_pooled"] == pytest.approx(0.5)
    assert out["energy_wrong_over_correct"] == pytest.approx(3.5 / 0.5)


def test_maxk_rows_keep_their_definitions_scale(tiny_rollouts):
    """MaxPO is compared with the paper's raw EI at scale 1; pkpo keeps PKPO's (K/N)·EI."""
    from creditrl import compute_advantages
    from creditrl.studies.experiments import grad_variance as gv

    model, params, batch = tiny_rollouts
    mask = batch.response_mask[:, batch.prompt_len:] > 0
    maxpo, ei, pkpo = gv.estimator_advantages(batch, torch.zeros(mask.shape), mask, ("maxpo", "ei", "pkpo"), 2)
    assert torch.allclose(maxpo, compute_advantages("maxpo", rewards=batch.rewards, mask=mask, group=batch.group, k=2))
    sizes = torch.bincount(batch.group)[batch.group][:, None]
    assert torch.allclose(pkpo, ei * 2 / sizes)
    assert set(gv.MAXK_SCALING) == set(gv.MAXK_ESTIMATORS)


@settings(max_examples=25, deadline=None)
@given(G=st.integers(2, 6), P=st.integers(1, 5), seed=st.integers(0, 1000))
def test_within_block_variance_matches_loop(G, P, seed):
    from creditrl.studies.experiments import grad_variance as gv

    grads = torch.randn(2, G, P, generator=torch.Generator().manual_seed(seed))
    got = gv.within_block_variance(grads)
    for e in range(2):
        mean = [sum(grads[e, g, p].item() for g in range(G)) / G for p in range(P)]
        expect = sum((grads[e, g, p].item() - mean[p]) ** 2 for g in range(G) for p in range(P)) / (G - 1)
        assert math.isclose(got[e].item(), expect, rel_tol=1e-6, abs_tol=1e-9)


def test_per_token_grad_norms_match_loop(tiny_rollouts):
    from creditrl.studies.experiments import proxy_fidelity as pf

    model, params, batch = tiny_rollouts
    for row in (0, 4):
        got, seq = pf.per_token_grad_sq_norms(model, params, batch, row, 1.0)
        logp, resp = row_logp(model, batch, row)
        cols = torch.nonzero(batch.response_mask[row, batch.prompt_len:] > 0).flatten().tolist()
        total = 0
        for t, lp in zip(cols, logp[resp]):
            grads = torch.autograd.grad(lp, params, retain_graph=True, allow_unused=True)
            flat = torch.cat([(torch.zeros_like(p) if x is None else x).reshape(-1) for p, x in zip(params, grads)])
            assert math.isclose(got[t].item(), flat.pow(2).sum().item(), rel_tol=1e-4)
            total = total + flat
        assert math.isclose(seq.item(), total.pow(2).sum().item(), rel_tol=1e-4)


@settings(max_examples=40, deadline=None)
@given(xs=st.lists(st.integers(0, 4), min_size=2, max_size=12))
def test_ranks_average_ties(xs):
    from creditrl.studies.experiments import proxy_fidelity as pf

    got = pf.ranks(torch.tensor(xs, dtype=torch.float64)).tolist()
    for i, x in enumerate(xs):  # average rank = (# smaller) + (# equal - 1) / 2
        expect = sum(v < x for v in xs) + (sum(v == x for v in xs) - 1) / 2
        assert got[i] == expect


def test_pearson_spearman_reference():
    from creditrl.studies.experiments import proxy_fidelity as pf

    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    assert math.isclose(pf.pearson(x, 2 * x + 1), 1.0, rel_tol=1e-12)
    assert math.isclose(pf.spearman(x, x.exp()), 1.0, rel_tol=1e-12)
    assert math.isclose(pf.spearman(x, -x ** 3), -1.0, rel_tol=1e-12)
    assert math.isnan(pf.pearson(x, torch.ones(5)))


def test_grad_variance_fast_preset(fast_root, tmp_path):
    """Every estimator's variance estimate is finite, CIs bracket it, and a seed reproduces it."""
    import dataclasses

    from creditrl.studies.experiments import grad_variance as gv

    (tmp_path / "a").symlink_to(fast_run(fast_root, "grad-variance"))
    rows = reporting.read_csv(tmp_path / "a" / "variance.csv")
    assert {r["estimator"] for r in rows} == set(gv.PRESETS["fast"].estimators)
    for r in rows:
        assert math.isfinite(r["variance"]) and r["variance"] >= 0
        assert r["variance_low"] - 1e-12 <= r["variance"] <= r["variance_high"] + 1e-12
        if r["estimator"] == "rloo":
            assert r["ratio_to_rloo"] == 1.0
    assert any(r["variance"] > 0 for r in rows)  # the checkpoint gives non-degenerate groups
    assert "dr_grpo" in gv.report(tmp_path / "a", "figures/grad_variance.png")
    claims = {v.claim: v for v in gv.verdicts(tmp_path / "a")}
    assert "OTB lowers the exact gradient variance versus DR_GRPO/RLOO" in claims
    otb = claims["OTB lowers the exact gradient variance versus DR_GRPO/RLOO"]
    assert "Tail index of the per-block variances" in otb.note
    assert all(v.outcome in reporting.OUTCOMES and "[" in v.ours for v in claims.values())
    with pytest.raises(ValueError, match=r"warm_start_accuracy: expected one entry per digits entry \(2\), got 1"):
        gv.run(dataclasses.replace(gv.PRESETS["fast"], digits=(1, 2)), tmp_path / "x")
    with pytest.raises(ValueError, match=r"digits: expected distinct entries, got \(1, 1\)"):
        gv.run(dataclasses.replace(gv.PRESETS["fast"], digits=(1, 1), warm_start_accuracy=(0.3, 0.3),
                                   groups=(12, 24)), tmp_path / "x")
    with pytest.raises(ValueError, match=r"groups: expected one entry per digits entry \(1\), got 2"):
        gv.run(dataclasses.replace(gv.PRESETS["fast"], groups=(12, 12)), tmp_path / "x")
    with pytest.raises(ValueError, match=r"block: expected 2 <= block and block × checkpoints <= groups"):
        gv.run(dataclasses.replace(gv.PRESETS["fast"], groups=(5,)), tmp_path / "x")
    small = dataclasses.replace(gv.PRESETS["fast"], groups=(4,), block=2, estimators=("rloo", "otb"))
    gv.run(small, tmp_path / "b")
    gv.run(small, tmp_path / "c")
    assert (tmp_path / "b" / "blocks.csv").read_text() == (tmp_path / "c" / "blocks.csv").read_text()


def test_proxy_fidelity_fast_preset(fast_root):
    from creditrl.studies.experiments import proxy_fidelity as pf

    tmp_path = fast_run(fast_root, "proxy-fidelity")
    summary = reporting.read_json(tmp_path / "summary.json")
    assert summary["tokens"] > 0 and summary["responses"] == 12
    assert math.isfinite(summary["token_spearman"]) and -1 <= summary["token_spearman"] <= 1
    tokens = reporting.read_csv(tmp_path / "tokens.csv")
    assert all(r["true_sq_norm"] >= 0 and 0 <= r["proxy"] <= 2 for r in tokens)  # ŵ = 1 − 2π + Σπ² ∈ [0, 2]
    assert "token_spearman" in pf.report(tmp_path, "figures/proxy_fidelity.png")
    (verdict,) = pf.verdicts(tmp_path)
    rho = pf.token_spearman_ci(tmp_path, 200)
    assert rho.low <= rho.value <= rho.high and verdict.outcome in reporting.OUTCOMES


@pytest.mark.slow
def test_learning_curves_fast_preset(fast_root):
    """Real trainer runs through ``creditrl compare``: the LR pilot picks from the grid, every run
    and seed finished with finite metrics (the Adam proxy included), verdicts come from the numbers."""
    from creditrl.studies.experiments import learning_curves as lc

    out = fast_run(fast_root, "learning-curves")
    cfg = lc.PRESETS["fast"]
    rows = reporting.read_csv(out / "seeds.csv")
    assert {(r["study"], r["run"]) for r in rows} == {(s, r) for s in cfg.studies for r in lc.STUDIES[s]["runs"]}
    assert all(math.isfinite(r["adam_variance_end"]) and r["adam_variance_end"] >= 0 for r in rows)
    assert set(reporting.read_json(out / "summary.json")["chosen_lr"].values()) <= set(cfg.lr_grid)
    claims = [v.claim for v in lc.verdicts(out)]
    assert claims[0] == "GRPO-λ learns faster than GRPO" and "MaxPO improves held-out pass@4" in claims[-1]
    assert all(v.outcome == "inconclusive" for v in lc.verdicts(out))  # one seed: no interval
    with pytest.raises(ValueError, match="valid studies"):
        lc.run(lc.LearningCurvesConfig(studies=("nope",)), out / "x")


@pytest.mark.slow
def test_otb_stability_and_stapo_census_fast_presets(fast_root):
    from creditrl.studies.experiments import otb_stability as ots
    from creditrl.studies.experiments import stapo_census as sc

    out = fast_run(fast_root, "otb-stability")
    rows = reporting.read_csv(out / "seeds.csv")
    assert {r["run"] for r in rows} == set(ots.RUNS)
    tokens = {r["run"]: r["tokens"] for r in rows}
    assert tokens["grpo-n16"] > 2 * tokens["grpo-n4"]
    assert [v.outcome for v in ots.verdicts(out)] == ["inconclusive", "inconclusive"]  # 1 seed, no collapse
    out = fast_run(fast_root, "stapo-census")
    batches = reporting.read_csv(out / "batches.csv")
    assert sum(b["tokens"] for b in batches) >= sc.PRESETS["fast"].census_tokens
    tokens = reporting.read_csv(out / "tokens.csv")
    assert tokens and all(r["grad_norm"] >= 0 and 0 <= r["prob"] <= 1 for r in tokens)
    assert len(sc.verdicts(out)) == 3


@pytest.mark.slow
def test_results_report_from_fast_runs(fast_root, tmp_path):
    """docs/results.md is assembled from the CSVs: the summary table lists every verdict, figures
    are copied, a second run's verdicts are listed beside, missing experiments are named."""
    for name in experiments.EXPERIMENTS:
        fast_run(fast_root, name)
    partial = tmp_path / "partial"  # a check run of one experiment only
    partial.mkdir()
    (partial / "grad-variance").symlink_to(fast_root / "grad-variance")
    path = experiments.write_report(fast_root, tmp_path / "docs", checks=[fast_root, partial])
    text = path.read_text()
    for name in experiments.EXPERIMENTS:
        png = name.replace("-", "_") + ".png"
        assert f"figures/{png}" in text and (tmp_path / "docs" / "figures" / png).stat().st_size > 0
        assert (fast_root / name / "environment.json").exists()
    verdicts = [v for vs in experiments.collect_verdicts(fast_root).values() for v in vs]
    head = text.split("## Reproducibility")[0]
    assert all(f"| {v.claim} ({v.source}) |" in head for v in verdicts)
    assert f"{len(verdicts)} of {len(verdicts)} verdicts agree" in text  # the same run checked against itself
    partial_count = len(experiments.experiment_module("grad-variance").verdicts(partial / "grad-variance"))
    assert f"`{partial}` (only `grad-variance`)" in text
    assert f"{partial_count} of {partial_count} verdicts agree" in text and "(not run)" in text
    with pytest.raises(ValueError, match="--check: expected a directory holding finished experiments"):
        experiments.write_report(fast_root, tmp_path / "docs3", checks=[tmp_path / "nowhere"])
    assert not (tmp_path / "docs3").exists()  # refused before anything is written
    with pytest.raises(ValueError, match=r"--check: expected directories with distinct names .*'partial', 'partial'"):
        experiments.write_report(fast_root, tmp_path / "docs4", checks=[partial, partial])
    assert text.count("Rule: ") == len(verdicts) and text.count("Power: ") == len(verdicts)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "## Not run" in experiments.write_report(empty, tmp_path / "docs2").read_text()


def test_real_model_fast_preset(fast_root):
    from creditrl.studies.experiments import real_model as rm

    out = fast_run(fast_root, "real-model")
    pairs = reporting.read_csv(out / "pairs.csv")
    by = reporting.group_rows(pairs, "estimator")
    assert set(by) == {"rloo", "otb", "dr_grpo"}
    for a, b in zip(by["dr_grpo"], by["rloo"]):  # derived exactly: ((N-1)/N)^2 x RLOO's per pair
        assert a["variance"] == pytest.approx(b["variance"] * (3 / 4) ** 2, rel=1e-12)
    assert all(r["variance"] >= 0 for r in pairs)
    assert len(rm.verdicts(out)) == 2
    with pytest.raises(ValueError, match="variance_groups: expected an even number"):
        rm.run(rm.RealModelConfig(variance_groups=3), out / "x")


def test_pair_difference_matches_separate_group_gradients(tiny_rollouts):
    """real-model's one-backward ‖g₁ − g₂‖²/2 equals the difference of the two groups' own gradients."""
    from creditrl.studies.experiments import grad_variance as gv
    from creditrl.studies.experiments import real_model as rm

    model, params, batch = tiny_rollouts
    names = ("rloo", "ogb", "otb", "otb_isolated")
    grads, _ = gv.block_gradients(model, params, batch, gv.GradVarianceConfig(estimators=names))  # [E, 2, P]
    expected = (grads[:, 0].double() - grads[:, 1].double()).pow(2).sum(-1) / 2
    got = torch.tensor(rm.pair_difference_sq(model, params, batch, names, 1.0), dtype=torch.float64)
    assert float(expected.min()) > 0
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-9)


def test_dr_grpo_gradient_is_scaled_rloo(tiny_rollouts):
    """dr_grpo's advantage R − mean is exactly (N−1)/N × RLOO's, so are their group gradients."""
    from creditrl.studies.experiments import grad_variance as gv

    model, params, batch = tiny_rollouts
    cfg = gv.GradVarianceConfig(estimators=("dr_grpo", "rloo"))
    grads, _ = gv.block_gradients(model, params, batch, cfg)
    assert torch.allclose(grads[0], grads[1] * 2 / 3, atol=1e-7)
    assert gv.within_block_variance(grads)[0] == pytest.approx(float(gv.within_block_variance(grads)[1]) * 4 / 9,
                                                                rel=1e-5)
