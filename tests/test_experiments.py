"""Tests of ``creditrl experiment``: brute-force checks of each experiment's math, and the
``fast`` presets run end to end asserting what must hold even at small scale."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from creditrl import experiments
from creditrl.experiments import common
from creditrl.experiments import maxk_bandit as mb


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


def test_maxk_bandit_fast_preset(tmp_path):
    """L1O plateaus while EI and EI+L2O fall like M^-1/2; all variances finite; seeded."""
    summary = mb.run(mb.PRESETS["fast"], tmp_path / "a")
    for name in ("EI", "EI+L2O"):
        assert -0.65 < summary["slope"][name] < -0.35
    assert summary["last_decade_slope"]["EI+L1O"] > -0.25
    assert summary["final_error"]["EI+L1O"] > 5 * summary["final_error"]["EI+L2O"]
    rows = common.read_csv(tmp_path / "a" / "variance_actions.csv") + common.read_csv(tmp_path / "a" / "variance_k.csv")
    assert all(math.isfinite(r["variance"]) and r["variance"] > 0 for r in rows)
    assert (tmp_path / "a" / "maxk_bandit.png").stat().st_size > 0
    section = mb.report(tmp_path / "a", "figures/maxk_bandit.png")
    assert "reproduces" in section and "figures/maxk_bandit.png" in section
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
    assert experiments.main(["maxk-bandit", "--out", str(tmp_path), "--set", "nope=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown field 'nope'" in err and "group_size" in err
    with pytest.raises(SystemExit):
        experiments.main(["no-such-experiment"])
    with pytest.raises(ValueError, match="valid names"):
        experiments.experiment_module("nope")


def test_experiment_cli_runs_with_overrides(tmp_path):
    rc = experiments.main(["maxk-bandit", "--out", str(tmp_path), "--set", "seeds=2", "--set", "bias_batches=5,50",
                           "--set", "variance_batches=10", "--set", "actions_sweep=4", "--set", "k_sweep=2,3"])
    assert rc == 0
    rows = common.read_csv(tmp_path / "bias.csv")
    assert sorted({r["batches"] for r in rows}) == [5, 50]
    assert common.read_json(tmp_path / "summary.json")["config"]["seeds"] == 2


def test_bootstrap_ci_and_slope():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(400, generator=gen, dtype=torch.float64) + 3.0
    low, high = common.bootstrap_ci(lambda idx: x[idx].mean(-1), 400, generator=gen)
    assert low < x.mean() < high and high - low < 0.5
    assert abs(common.loglog_slope([1, 10, 100], [1.0, 0.1 ** 0.5, 0.1])) - 0.5 < 1e-12
    rows = [{"a": 1, "b": 0.5, "c": "x"}]
    assert common.markdown_table(rows).splitlines()[2] == "| 1 | 0.5 | x |"
