"""``time-to-accuracy``: the target-crossing logic against a loop written here, the learning-rate pick
and the pre-registered rules on constructed runs, bad configs, and the fast preset end to end."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from creditrl.tools import tables
from creditrl_research import experiments
from creditrl_research import rules
from creditrl_research.experiments import time_to_accuracy as tta


def crossing_loop(points, target):
    """Scan the evals for the first at or above the target; interpolate from the one before."""
    kept = [p for p in points if p[2] == p[2]]
    for i, (step, seconds, acc) in enumerate(kept):
        if acc >= target:
            if i == 0:
                return step, seconds, True
            s0, t0, a0 = kept[i - 1]
            w = (target - a0) / (acc - a0)
            return s0 + w * (step - s0), t0 + w * (seconds - t0), True
    return kept[-1][0], kept[-1][1], False


@pytest.mark.parametrize("accs, target, expect", [
    ([0.1, 0.3, 0.6], 0.5, (10 + 10 * 2 / 3, 5 + 5 * 2 / 3, True)),   # between the evals at 10 and 20
    ([0.1, 0.5, 0.2], 0.5, (10.0, 5.0, True)),                         # exactly at an eval; a later dip ignored
    ([0.6, 0.1, 0.7], 0.5, (0.0, 0.0, True)),                          # already there at the start
    ([0.1, 0.2, 0.3], 0.5, (20.0, 10.0, False)),                       # never: restricted at the budget
    ([0.1, math.nan, 0.7], 0.5, (0 + 20 * 4 / 6, 10 * 4 / 6, True)),   # a missing eval is skipped
])
def test_time_to_target_on_constructed_curves(accs, target, expect):
    points = [(10.0 * i, 5.0 * i, a) for i, a in enumerate(accs)]
    assert tta.time_to_target(points, target) == pytest.approx(expect)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=12), st.floats(0.05, 0.95),
       st.lists(st.floats(0.01, 3), min_size=12, max_size=12))
def test_time_to_target_matches_the_loop(accs, target, costs):
    seconds = [sum(costs[:i]) for i in range(len(accs))]
    points = [(5.0 * i, seconds[i], a) for i, a in enumerate(accs)]
    got = tta.time_to_target(points, target)
    assert got == pytest.approx(crossing_loop(points, target))
    steps, secs, reached = got
    assert 0 <= steps <= points[-1][0] and 0 <= secs <= points[-1][1]
    assert reached == any(a >= target for a in accs)
    with pytest.raises(ValueError, match="points: expected at least one eval"):
        tta.time_to_target([(0.0, 0.0, math.nan)], target)


def write_run(path, accs, every=10, step_seconds=0.5):
    """A run directory: metrics.jsonl (every step's rollout and update time) and eval.jsonl."""
    path.mkdir(parents=True)
    steps = every * (len(accs) - 1)
    path.joinpath("metrics.jsonl").write_text("".join(json.dumps(
        {"step": s, "time_rollout": step_seconds * 0.6, "time_update": step_seconds * 0.4, "tokens_total": 100 * s})
        + "\n" for s in range(1, steps + 1)))
    path.joinpath("eval.jsonl").write_text("".join(json.dumps({"step": every * i, "sampled_acc": a}) + "\n"
                                                   for i, a in enumerate(accs)))
    return path


def test_eval_points_count_training_seconds_up_to_each_eval(tmp_path):
    run = write_run(tmp_path / "otb-s3", [0.1, 0.4, 0.7], step_seconds=0.5)
    got = [x for point in tta.eval_points(run) for x in point]
    assert got == pytest.approx([0, 0.0, 0.1, 10, 5.0, 0.4, 20, 10.0, 0.7])
    cfg = tta.TimeToAccuracyConfig(steps=20, budgets=(10, 20), target=0.5)
    row = tta.run_row("otb", run, cfg, 1e-3)
    assert row["seed"] == 3 and row["reached"] == 1 and row["acc@20"] == 0.7 and row["s_per_step"] == 0.5
    assert row["steps_to_target"] == pytest.approx(10 + 10 / 3) and row["seconds_to_target"] == pytest.approx(5 + 5 / 3)


def test_learning_rate_pick_is_the_best_mean_accuracy_after_the_start(tmp_path, monkeypatch):
    """Per arm the rate with the highest mean accuracy after the start, averaged over the pilot seeds: otb's
    1e-4 is best on the first pilot seed alone (0.7) and in the best seed, but 1e-3 is best on average
    (0.55 against 0.4); rloo's rates tie and the smaller one is taken."""
    curves = {("otb", 1e-4, 1000): [0.1, 0.7, 0.7], ("otb", 1e-4, 1001): [0.1, 0.1, 0.1],
              ("otb", 1e-3, 1000): [0.1, 0.5, 0.6], ("otb", 1e-3, 1001): [0.1, 0.5, 0.6],
              **{("rloo", lr, s): [0.1, 0.4, 0.4] for lr in (1e-4, 1e-3) for s in (1000, 1001)}}

    def fake_study(cfg, study, runs, seeds, out, title):
        assert seeds == [1000 + cfg.seed, 1001 + cfg.seed]
        assert set(runs) == {"otb@0.0001", "otb@0.001", "rloo@0.0001", "rloo@0.001"}
        assert "optim.lr=0.001" in runs["otb@0.001"] and "algorithm.estimator=otb" in runs["otb@0.001"]
        return {name: [write_run(out / f"{name}-s{s}", curves[(name.split('@')[0], float(name.split('@')[1]), s)])
                       for s in seeds] for name in runs}

    monkeypatch.setattr(tta.studies, "run_study", fake_study)
    cfg = tta.TimeToAccuracyConfig(arms=("otb", "rloo"), lr_grid=(1e-4, 1e-3), pilot_seeds=2)
    chosen = tta.pick_lr(cfg, tta.validate(cfg), tmp_path)
    assert chosen == {"otb": 1e-3, "rloo": 1e-4}
    pilot = {(r["arm"], r["lr"]): r["mean_acc"] for r in tables.read_csv(tmp_path / "lr_pilot.csv")}
    assert pilot[("otb", 0.001)] == pytest.approx(0.55) and pilot[("otb", 0.0001)] == pytest.approx(0.4)
    one = tta.TimeToAccuracyConfig(arms=("otb", "rloo"), lr_grid=(3e-4,))   # one rate: no pilot runs
    monkeypatch.setattr(tta.studies, "run_study", lambda *a, **k: pytest.fail("a pilot ran"))
    assert tta.pick_lr(one, tta.validate(one), tmp_path / "one") == {"otb": 3e-4, "rloo": 3e-4}


def constructed(tmp_path, steps, reached=None, acc=None, seeds=6, step_seconds=None):
    """seeds.csv + summary.json of a finished study: steps[arm](seed) to target, accuracy at the budget,
    training seconds per step (``step_seconds[arm]``, default 0.5)."""
    rows = []
    for arm, fn in steps.items():
        for s in range(seeds):
            rows.append({"run": arm, "seed": s, "lr": 1e-3, "start_acc": 0.1, "steps_to_target": fn(s),
                         "seconds_to_target": (step_seconds or {}).get(arm, 0.5) * fn(s),
                         "reached": int((reached or {}).get(arm, lambda s: 1)(s)),
                         "acc@100": (acc or {}).get(arm, lambda s: 0.5)(s), "s_per_step": 0.5, "tokens": 1000})
    tables.write_csv(tmp_path / "seeds.csv", rows)
    tables.write_json(tmp_path / "summary.json", {"config": {"target": 0.5, "steps": 100, "budgets": [50, 100],
                                                             "lr_grid": [1e-3]},
                                                  "chosen_lr": {a: 1e-3 for a in steps}, "arms": {a: [] for a in steps}})
    return tmp_path


NOISE = (0.97, 1.03, 1.0, 0.98, 1.02, 1.0)


def test_rules_on_constructed_runs(tmp_path):
    """OTB needs 0.8× RLOO's steps on every seed but 1.2× GRPO's: 'partly'; its accuracy difference to
    both is noise around 0: a tie; a rival that reaches the target in fewer than half of its seeds makes
    the steps rules inconclusive (the precondition)."""
    steps = {"otb": lambda s: 40 * NOISE[s], "rloo": lambda s: 50.0, "grpo": lambda s: 40 / 1.2}
    acc = {"otb": lambda s: 0.5 + 0.01 * (-1) ** s}
    out = constructed(tmp_path / "a", steps, acc=acc)
    found = tta.verdicts(out)
    assert [v.outcome for v in found] == ["partly", "partly", "inconclusive"]
    ratio = found[0].statistics["OTB/rloo"]
    assert ratio.value == pytest.approx(0.8 * math.prod(NOISE) ** (1 / 6)) and ratio.high < 1 and ratio.df == 5
    assert found[0].statistics["OTB/grpo"].low > 1
    assert "learning rates otb 0.001" in found[0].ours
    few = constructed(tmp_path / "b", steps, reached={"grpo": lambda s: s < 2})   # 2 of 6 seeds
    first = tta.verdicts(few)[0]
    assert first.outcome == "inconclusive" and not first.condition_met and "grpo 2/6" in first.power
    assert first.note.endswith("fewer than half of their seeds: grpo.")
    assert tta.ratios([{"run": "a", "seed": 0, "k": 0.0}, {"run": "b", "seed": 0, "k": 0.0}], "a", "b", "k") == [1.0]
    assert tta.verdicts(constructed(tmp_path / "c", {"rloo": lambda s: 1.0, "grpo": lambda s: 1.0})) == []
    table = tta.arm_table(tables.read_csv(out / "seeds.csv"), [100], "rloo")
    assert "steps ratio to rloo" in table and "| otb | 0.001 | 6/6 |" in table


def estimate(low, high, ratio):
    """A hand-built statistic: a ratio (log scale, centre the geometric mean) or a difference."""
    value = math.sqrt(low * high) if ratio else (low + high) / 2
    return rules.Estimate(value, low, high, math.nan, 6, df=5, log=ratio)


WIN, LOSS, TIE, EDGE = (0.7, 0.9), (1.1, 1.4), (0.8, 1.2), (0.8, 1.0)   # step ratios; EDGE touches 1: a tie


@pytest.mark.parametrize("per_rival, outcome", [
    ((WIN, WIN), "reproduces"),
    ((WIN, LOSS), "partly"),
    ((WIN, TIE), "partly"),
    ((TIE, LOSS), "does not reproduce"),
    ((LOSS, LOSS), "does not reproduce"),
    ((TIE, TIE), "inconclusive"),
    ((EDGE, TIE), "inconclusive"),
    ((WIN,), "reproduces"),
    (((0.5, math.inf),), "inconclusive"),   # one seed: an unbounded interval decides nothing
])
def test_rules_on_hand_built_statistics(per_rival, outcome):
    """Rules (a)/(b): a ratio interval below 1 wins, above 1 loses; rule (c) the same on an accuracy
    difference mirrored (above 0 wins): OTB − rival = 1 − ratio turns each case into its counterpart."""
    names = [f"OTB/{r}" for r in ("rloo", "grpo", "x")[:len(per_rival)]]
    assert tta.sooner({n: estimate(*iv, ratio=True) for n, iv in zip(names, per_rival)}) == outcome
    diffs = {n: estimate(1 - high, 1 - low, ratio=False) for n, (low, high) in zip(names, per_rival)}
    assert tta.higher(diffs) == outcome


def test_wall_clock_rule_reads_the_seconds_and_the_precondition_overrides_the_statistics(tmp_path):
    """OTB takes 0.8× RLOO's and 1.2× GRPO's steps but twice the seconds per step: the steps verdict is
    'partly', the wall-clock one (1.6×, 2.4×) 'does not reproduce'. OTB winning everywhere while RLOO
    reaches the target in 2 of 6 seeds: the statistics alone reproduce, the verdict is inconclusive; in 3 of
    6 (exactly half) the precondition holds."""
    steps = {"otb": lambda s: 40 * NOISE[s], "rloo": lambda s: 50.0, "grpo": lambda s: 40 / 1.2}
    slow = tta.verdicts(constructed(tmp_path / "slow", steps, step_seconds={"otb": 1.0}))
    assert [v.outcome for v in slow[:2]] == ["partly", "does not reproduce"]
    assert slow[1].statistics["OTB/rloo"].value == pytest.approx(1.6 * math.prod(NOISE) ** (1 / 6))
    assert slow[1].statistics["OTB/grpo"].value == pytest.approx(2.4 * math.prod(NOISE) ** (1 / 6))
    assert "training wall-clock" in slow[1].claim and "seconds ratio OTB/rloo" in slow[1].ours
    fast = {"otb": lambda s: 30 * NOISE[s], "rloo": lambda s: 50.0, "grpo": lambda s: 45.0}
    for seeds_reached, outcome in ((2, "inconclusive"), (3, "reproduces")):
        found = tta.verdicts(constructed(tmp_path / f"r{seeds_reached}", fast,
                                         reached={"rloo": lambda s, k=seeds_reached: s < k}))
        assert [v.outcome for v in found[:2]] == [outcome] * 2
        assert all(v.decide(v.statistics) == "reproduces" for v in found[:2])
        assert found[0].condition_met == (outcome == "reproduces")
        assert found[2].condition_met and found[2].outcome == "inconclusive"   # (c) has no precondition


def test_accuracy_rule_statistics_and_pooling_over_seed_sets(tmp_path):
    """Rule (c) reads the paired accuracy difference at the largest budget; the verdicts pool over seed
    sets with their own rule (the statistics' names match across sets), and a failed precondition in one
    set makes the pooled steps verdict inconclusive."""
    steps = {"otb": lambda s: 30 * NOISE[s], "rloo": lambda s: 50.0, "grpo": lambda s: 45.0}
    acc = {"otb": lambda s: 0.6 + 0.01 * NOISE[s], "rloo": lambda s: 0.5, "grpo": lambda s: 0.62}
    first = tta.verdicts(constructed(tmp_path / "a", steps, acc=acc))
    diff = first[2].statistics["OTB − rloo"]
    assert diff.value == pytest.approx(0.1 + 0.01 * sum(NOISE) / 6) and diff.low > 0 and diff.n == 6
    assert first[2].statistics["OTB − grpo"].high < 0 and first[2].outcome == "partly"
    assert "after 100 steps" in first[2].claim
    second = tta.verdicts(constructed(tmp_path / "b", steps, acc=acc))
    third = tta.verdicts(constructed(tmp_path / "c", steps, acc=acc, reached={"grpo": lambda s: s < 1}))
    for i, expect in enumerate(("reproduces", "reproduces", "partly")):
        outcome, text = rules.pooled_verdict([first[i], second[i]])
        assert outcome == expect and text.startswith("OTB")
    assert rules.pooled_verdict([first[0], third[0]])[0] == "inconclusive"


def test_bad_configs_are_refused_before_any_work(tmp_path):
    base = experiments.experiment_config("time-to-accuracy", "full")
    for override, message in [
        ('extra_arms=["nope"]', "arms: name: unknown estimator 'nope'"),
        ('extra_arms=["x:optim.lr"]', "arms: expected an estimator label or 'NAME:key=value;key=value'"),
        ('extra_arms=["x:loss.nope.enabled=true"]', "arms: arm 'x' is not a valid train config: loss.nope"),
        ("arms=[otb, otb]", "arms, extra_arms: expected distinct arm names"),
        ("target=1.0", r"target: expected a held-out accuracy in \(0, 1\)"),
        ("budgets=[55]", r"budgets: expected multiples of eval_every \(10\) up to steps \(120\)"),
    ]:
        with pytest.raises(ValueError, match=message):       # with the config, before any run (or output)
            experiments.experiment_config("time-to-accuracy", "full", None, [override])
    assert not (tmp_path / "x").exists()
    assert base.extra_arms == ("maxrl", "reinforce_plus_plus") and base.num_seeds >= 16 and base.steps >= 100
    picked = experiments.experiment_config("time-to-accuracy", "full", None,
                                           ['extra_arms=[dr_grpo, "clip:algorithm.estimator=grpo;loss.clip_high=0.2"]'])
    assert tta.validate(picked)["clip"] == ["algorithm.estimator=grpo", "loss.clip_high=0.2"]


@pytest.mark.slow
def test_time_to_accuracy_fast_preset(tmp_path):
    out, _ = experiments.run_experiment("time-to-accuracy", "fast", tmp_path / "tta")
    rows = tables.read_csv(out / "seeds.csv")
    cfg = tta.PRESETS["fast"]
    assert {(r["run"], r["seed"]) for r in rows} == {(a, s) for a in cfg.arms for s in range(cfg.num_seeds)}
    for r in rows:
        assert 0 <= r["steps_to_target"] <= cfg.steps and r["seconds_to_target"] >= 0 and r["s_per_step"] > 0
        assert r["reached"] in (0, 1) and (r["reached"] or r["steps_to_target"] == cfg.steps)
    found = tta.verdicts(out)
    assert len(found) == 3 and all(v.outcome in rules.OUTCOMES and v.decide is not None for v in found)
    text = tta.report(out, "figures/time_to_accuracy.png")
    assert "steps ratio to rloo" in text and (out / "time_to_accuracy.png").stat().st_size > 0


def test_the_report_names_arms_tuned_at_the_grid_edge():
    """A chosen rate at either end of the grid is flagged (the best may lie beyond it); interior
    choices and a one-rate grid (no tuning claimed) give no note."""
    notes = tta.grid_edge_notes({"otb": 2e-4, "rloo": 1e-4, "grpo": 5e-5}, [5e-5, 1e-4, 2e-4])
    assert len(notes) == 1 and "otb (largest, 0.0002)" in notes[0] and "grpo (smallest, 5e-05)" in notes[0]
    assert "rloo" not in notes[0]
    assert tta.grid_edge_notes({"otb": 1e-4, "rloo": 1e-4}, [5e-5, 1e-4, 2e-4]) == []
    assert tta.grid_edge_notes({"otb": 1e-3}, [1e-3]) == []
