"""Tests of ``creditrl compare``: report aggregation against loops over synthetic runs, spec and
CLI errors, and one small end-to-end comparison with the real trainer."""
from __future__ import annotations

import json
import math
import statistics
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from creditrl.tools import tables
from creditrl.tools import compare
from creditrl.utils.rundir import RunDirError, mark_run
from tolerances import sum_rtol


def fake_run(root, name, seed, steps=12, scale=1.0):
    """A run dir with metrics.jsonl / eval.jsonl shaped like the trainer's."""
    d = root / "runs" / f"{name}-s{seed}"
    d.mkdir(parents=True)
    metrics = [{"step": s, "tokens_total": 100 * s + seed, "reward_mean": scale * s / steps + 0.01 * seed,
                "accuracy": 0.5 + 0.01 * seed, "entropy": 1.0 - 0.01 * s, "grad_norm": 2.0, "power_proxy": 3.0 + seed,
                "spurious_ratio": 0.0, "response_len": 5.0} for s in range(1, steps + 1)]
    evals = [{"step": 0, "tokens_total": 0, "greedy_acc": 0.2, "sampled_acc": 0.1, "pass@1": 0.1, "pass@4": 0.3},
             {"step": steps, "tokens_total": 100 * steps, "greedy_acc": 0.4 + 0.1 * seed * scale, "sampled_acc": 0.3,
              "pass@1": 0.3, "pass@4": 0.6}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (d / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    (d / "summary.json").write_text("{}")
    (d / "config.yaml").write_text(f"train:\n  seed: {seed}\n")
    return d


@settings(max_examples=30, deadline=None)
@given(values=st.lists(st.floats(-10, 10), min_size=1, max_size=30), window=st.integers(1, 8))
def test_smooth_matches_loop(values, window):
    got = compare.smooth(torch.tensor([values], dtype=torch.float64), window)[0]
    for i in range(len(values)):
        chunk = values[max(0, i + 1 - window): i + 1]
        # a window mean from float64 prefix sums: their difference cancels to 30·eps64 of Σ|values| <= 300
        assert math.isclose(got[i].item(), sum(chunk) / len(chunk), rel_tol=0, abs_tol=sum_rtol(32, torch.float64) * 300)


def test_report_aggregates_seeds(tmp_path):
    # the numbers below are float64 means and stds of three values read back from CSV (written exactly): a few
    # roundings, far inside pytest.approx's default (1e-6 relative)
    for seed in (0, 1, 2):
        fake_run(tmp_path, "otb", seed)
        fake_run(tmp_path, "grpo-n16", seed, scale=2.0)
    runs = compare.find_runs(tmp_path)
    assert sorted(runs) == ["grpo-n16", "otb"] and all(len(v) == 3 for v in runs.values())
    report = compare.write_report(runs, tmp_path, window=1)
    text = report.read_text()
    assert "![curves](compare.png)" in text and (tmp_path / "compare.png").stat().st_size > 0
    final = tables.read_csv(tmp_path / "final.csv")
    otb = [r for r in final if r["run"] == "otb"]
    assert [r["greedy_acc"] for r in otb] == pytest.approx([0.4, 0.5, 0.6])
    # mean ± std of the held-out greedy accuracy, computed by hand
    line = next(l for l in text.splitlines() if l.startswith("| otb"))
    assert f"{statistics.mean([0.4, 0.5, 0.6]):.3g} ± {statistics.stdev([0.4, 0.5, 0.6]):.2g}" in line
    # the last 10% of steps (here: 1 step of 12) of reward_mean, seed 1
    assert otb[1]["reward_mean"] == pytest.approx(12 / 12 + 0.01)
    curves = [r for r in tables.read_csv(tmp_path / "curves.csv") if r["run"] == "otb"]
    assert len(curves) == 12
    assert curves[0]["tokens_total"] == pytest.approx(101.0)  # mean of 100+seed over seeds 0..2
    assert curves[0]["power_proxy_mean"] == pytest.approx(4.0)
    assert curves[0]["power_proxy_std"] == pytest.approx(1.0)


def test_a_metric_one_run_did_not_measure_is_left_empty_not_an_error(tmp_path):
    """A run without STAPO logs no spurious_ratio (loss metrics appear only where measured); listed first, its
    rows once set curves.csv's columns and the STAPO run's rows raised. Its cells are empty, and read back absent."""
    for seed in (0, 1):
        run = fake_run(tmp_path, "a-grpo", seed)
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        (run / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in m.items() if k != "spurious_ratio"})
                                                   + "\n" for m in lines))
        fake_run(tmp_path, "b-stapo", seed)
    report = compare.write_report(compare.find_runs(tmp_path), tmp_path, window=1).read_text()
    curves = tables.read_csv(tmp_path / "curves.csv")
    assert {"spurious_ratio_mean" in r for r in curves if r["run"] == "a-grpo"} == {False}
    assert {r["spurious_ratio_mean"] for r in curves if r["run"] == "b-stapo"} == {0.0}
    assert "| a-grpo" in report


def test_uneven_seeds_are_truncated(tmp_path):
    fake_run(tmp_path, "a", 0, steps=10)
    fake_run(tmp_path, "a", 1, steps=7)
    xs, ys = compare.seed_curves(compare.find_runs(tmp_path)["a"], "reward_mean", "step")
    assert ys.shape == (2, 7) and xs.tolist() == list(range(1, 8))


def test_spec_file_and_errors(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("seeds: [0, 1]\noverrides: [train.steps=3]\nruns:\n  otb: [algorithm.estimator=otb]\n")
    loaded = compare.load_spec(spec)
    assert loaded.seeds == [0, 1] and loaded.runs == {"otb": ["algorithm.estimator=otb"]}
    spec.write_text("runs:\n  otb: [algorithm.estimator=otb]\nrunz: 1\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['runz'\]"):
        compare.load_spec(spec)
    spec.write_text("runs:\n  otb: algorithm.estimator\n")
    with pytest.raises(ValueError, match="runs.otb: expected a list of 'key=value'"):
        compare.load_spec(spec)
    with pytest.raises(FileNotFoundError, match="--spec: file not found"):
        compare.load_spec(tmp_path / "missing.yaml")


def test_cli_errors(tmp_path, capsys):
    assert compare.main(["--out", str(tmp_path)]) == 2
    assert "expected at least one run" in capsys.readouterr().err
    assert compare.main(["--out", str(tmp_path), "--run", "a", "oops"]) == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err
    assert compare.main(["--out", str(tmp_path), "--seeds", "x", "--run", "a", "k=v"]) == 2
    assert "--seeds: expected comma-separated integers" in capsys.readouterr().err
    assert compare.main(["--out", str(tmp_path), "--report-only"]) == 2
    assert "no runs with metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert compare.main(["--out", str(tmp_path / "afile"), "--no-progress", "--run", "a", "train.steps=1"]) == 2
    err = capsys.readouterr().err
    assert f"--out: expected a directory (made if missing), got {str(tmp_path / 'afile')!r}, a file" in err
    assert "failed" not in err                                   # refused before any run


def test_cli_rejects_bad_config_before_training(tmp_path, capsys):
    pytest.importorskip("creditrl.trainer.loop")
    rc = compare.main(["--out", str(tmp_path), "--run", "a", "algorithm.estimator=not-an-estimator"])
    assert rc == 2 and "not-an-estimator" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_report_only_cli(tmp_path):
    fake_run(tmp_path, "a", 0)
    fake_run(tmp_path, "b", 0)
    assert compare.main(["--out", str(tmp_path), "--report-only"]) == 0
    assert "| a | 1 |" in (tmp_path / "report.md").read_text()


def test_one_seed_shows_no_spread(tmp_path):
    """A run with one seed has no standard deviation: its cells say so, not "± 0"."""
    fake_run(tmp_path, "a", 0)
    fake_run(tmp_path, "b", 0)
    fake_run(tmp_path, "b", 1)
    text = (compare.write_report(compare.find_runs(tmp_path), tmp_path)).read_text()
    line = next(l for l in text.splitlines() if l.startswith("| a"))
    assert "(one seed)" in line and "±" not in line
    assert "±" in next(l for l in text.splitlines() if l.startswith("| b"))


def test_report_only_refuses_an_unfinished_run(tmp_path, capsys):
    """A compare interrupted during run b (step 7, no summary.json): redrawing would set b's last rows
    and step-0 eval beside a's end-of-run numbers, so it is refused, naming the run and its step."""
    fake_run(tmp_path, "a", 0)
    (fake_run(tmp_path, "b", 0, steps=7) / "summary.json").unlink()
    assert compare.main(["--out", str(tmp_path), "--report-only"]) == 2
    assert "expected finished runs, got 1 unfinished (b-s0 (step 7): no summary.json)" in capsys.readouterr().err
    assert not (tmp_path / "report.md").exists()


def test_report_only_refuses_a_copied_run_as_another_seed(tmp_path, capsys):
    """b-s1 copied from b-s0 (train.seed 0 in its config.yaml) would be counted as a second seed of b."""
    import shutil
    fake_run(tmp_path, "a", 0)
    shutil.copytree(fake_run(tmp_path, "b", 0), tmp_path / "runs" / "b-s1")
    assert compare.main(["--out", str(tmp_path), "--report-only"]) == 2
    err = capsys.readouterr().err
    assert "got b-s1 (train.seed=0) in config.yaml" in err and "another seed" in err
    (tmp_path / "runs" / "a-s0" / "config.yaml").unlink()
    assert compare.main(["--out", str(tmp_path), "--report-only"]) == 2
    assert "got none in a-s0: its seed and settings are unknown" in capsys.readouterr().err
    assert not (tmp_path / "report.md").exists()


@pytest.mark.slow
def test_compare_end_to_end_with_trainer(tmp_path):
    """Two configs x two seeds through the real trainer; a second call reuses finished runs."""
    pytest.importorskip("creditrl.trainer.loop")
    from creditrl.cli import main as cli_main

    argv = ["compare", "--out", str(tmp_path), "--seeds", "0,1", "--no-progress",
            "train.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=4", "train.eval_problems=4",
            "train.eval_samples=4", "train.pass_k=[1,4]", "train.save_every=0", "train.threads=1",
            "model.warm_start.max_steps=25", "logging.report_to=[jsonl]", "logging.plots=false",
            "--run", "grpo", "algorithm.estimator=grpo", "--run", "otb", "algorithm.estimator=otb"]
    assert cli_main(argv) == 0
    final = tables.read_csv(tmp_path / "final.csv")
    assert sorted((r["run"], r["seed"]) for r in final) == [("grpo", 0), ("grpo", 1), ("otb", 0), ("otb", 1)]
    assert all(r["steps"] == 2 and math.isfinite(r["entropy"]) for r in final)
    assert "| grpo | 2 |" in (tmp_path / "report.md").read_text()
    stamp = (tmp_path / "runs" / "grpo-s0" / "metrics.jsonl").stat().st_mtime_ns
    assert cli_main(argv) == 0  # finished runs are reused, not retrained
    assert (tmp_path / "runs" / "grpo-s0" / "metrics.jsonl").stat().st_mtime_ns == stamp
    argv[argv.index("train.steps=2")] = "train.steps=3"  # a changed recipe: finished runs are kept ...
    assert cli_main(argv) == 2
    assert (tmp_path / "runs" / "grpo-s0" / "metrics.jsonl").stat().st_mtime_ns == stamp
    assert cli_main([*argv, "--force"]) == 0                # ... until --force retrains them
    assert tables.read_csv(tmp_path / "final.csv")[0]["steps"] == 3


def planned(out, overrides=("train.steps=4",)):
    """A plan for run ``a`` seed 0 under ``out`` (``check_replaceable`` reads its target and recipe)."""
    return compare.PlannedRun("a", compare.run_dir(out, "a", 0),
                              {"config": None, "overrides": [*overrides, "train.seed=0"], "run_overrides": []}, None)


@pytest.mark.parametrize("force", [False, True])
def test_compare_never_replaces_a_folder_that_is_not_a_training_run(tmp_path, force):
    plan = planned(tmp_path)
    (plan.target / "chapters").mkdir(parents=True)
    (plan.target / "chapters" / "ch1.tex").write_text("precious")
    with pytest.raises(RunDirError, match="is not a creditrl training run"):
        compare.check_replaceable([plan], force)
    mark_run(plan.target, "diagnose")            # a diagnose report is no training run either
    with pytest.raises(RunDirError, match="is not a creditrl training run"):
        compare.check_replaceable([plan], force)


def test_compare_refuses_a_finished_run_from_another_recipe_unless_forced(tmp_path):
    plan = planned(tmp_path)
    plan.target.mkdir(parents=True)
    mark_run(plan.target, "train")
    (plan.target / "summary.json").write_text("{}")
    with pytest.raises(RunDirError, match=r"has no compare_recipe.json .*--force retrains it"):
        compare.check_replaceable([plan], False)
    (plan.target / compare.RECIPE_FILE).write_text(json.dumps(planned(tmp_path, ["train.steps=3"]).recipe))
    with pytest.raises(RunDirError, match=r"trained with \['train.steps=3'\] where this compare sets "
                                          r"\['train.steps=4'\]\); --force retrains it"):
        compare.check_replaceable([plan], False)
    compare.check_replaceable([plan], True)
    (plan.target / "summary.json").unlink()      # an unfinished run of compare's restarts without --force
    compare.check_replaceable([plan], False)


def test_compare_cli_keeps_a_folder_in_the_way(tmp_path, capsys):
    """Case: ``compare --run thesis`` deleted OUT/runs/thesis-s0 whatever it held; now it stops
    before any training and names the folder."""
    decoy = tmp_path / "runs" / "thesis-s0"
    decoy.mkdir(parents=True)
    (decoy / "ch1.tex").write_text("precious")
    assert compare.main(["--out", str(tmp_path), "--no-progress", "train.steps=1", "--run", "thesis", "--"]) == 2
    assert "is not a creditrl training run" in capsys.readouterr().err
    assert (decoy / "ch1.tex").read_text() == "precious" and sorted(p.name for p in decoy.iterdir()) == ["ch1.tex"]


def test_cli_rejects_bad_jobs(tmp_path, capsys):
    assert compare.main(["--out", str(tmp_path), "--jobs", "0", "--run", "a", "k=v"]) == 2
    assert "--jobs: expected" in capsys.readouterr().err and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_parallel_runs_match_sequential(tmp_path):
    """--jobs 2 trains in separate processes; every run's numbers are those of the sequential runs."""
    pytest.importorskip("creditrl.trainer.loop")
    common = ["--seeds", "0,1", "--no-progress", "train.steps=2", "rollout.prompts_per_step=2",
              "rollout.group_size=4", "train.eval_every=0", "train.eval_problems=4", "train.eval_samples=4",
              "train.pass_k=[1]", "train.save_every=0", "train.threads=1", "model.warm_start.max_steps=25",
              "logging.report_to=[jsonl]", "logging.plots=false", "--run", "otb", "algorithm.estimator=otb"]
    assert compare.main(["--out", str(tmp_path / "seq"), *common]) == 0
    assert compare.main(["--out", str(tmp_path / "par"), "--jobs", "2", *common]) == 0
    keys = ("loss", "reward_mean", "grad_norm", "entropy", "response_len")
    for seed in (0, 1):
        rows = {}
        for mode in ("seq", "par"):
            lines = (tmp_path / mode / "runs" / f"otb-s{seed}" / "metrics.jsonl").read_text().splitlines()
            rows[mode] = [{k: json.loads(line).get(k) for k in keys} for line in lines]
        assert len(rows["seq"]) == 2 and rows["seq"] == rows["par"]


def test_a_failing_run_leaves_a_report_of_the_runs_that_finished(tmp_path, monkeypatch, capsys):
    """Case 18: a run whose loss term raised stopped compare with no report for the runs that had
    finished. The other runs go on, the report covers them and names the failed run and its error,
    and compare exits 1."""
    (tmp_path / "exploding_term.py").write_text(
        "from dataclasses import dataclass, field\nfrom creditrl import register_loss_term\n\n"
        "@dataclass(frozen=True)\nclass Opts:\n    coef: float = field(default=0.1, metadata={'help': 'weight'})\n\n"
        "@register_loss_term('exploding', options=Opts, stage='penalty')\n"
        "def exploding(state, options):\n    return {}['token_loss']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    argv = ["--out", str(out), "--seeds", "0", "--no-progress", "train.steps=1", "rollout.prompts_per_step=2",
            "rollout.group_size=4", "train.eval_every=0", "train.eval_problems=4", "train.eval_samples=4",
            "train.pass_k=[1]", "train.save_every=0", "train.threads=1", "model.warm_start.max_steps=25",
            "logging.report_to=[jsonl]", "logging.plots=false",
            "--run", "broken", 'loss.terms=[{path: "exploding_term:exploding"}]', "--run", "plain"]
    assert compare.main(argv) == 1
    err = capsys.readouterr().err
    assert "1 run(s) failed (broken-s0); the report covers the runs that finished" in err
    report = (out / "report.md").read_text()
    assert "## Runs that failed" in report and "`broken-s0`: PluginError: loss term 'exploding' " \
        "(exploding_term:exploding) raised KeyError: 'token_loss'" in report
    assert [r["run"] for r in tables.read_csv(out / "final.csv")] == ["plain"]
    sys.modules.pop("exploding_term", None)


# ----------------------------------------------------------------------------- audit: overrides after the last --run

def test_overrides_ending_the_command_line_after_the_last_run_are_refused_when_ambiguous(tmp_path, monkeypatch, capsys):
    """`--run b algorithm.estimator=rloo train.steps=2` at the end: argparse gives train.steps to b alone,
    while it reads as an override for every run; refused, naming it and the two unambiguous forms."""
    monkeypatch.setattr(compare, "train", lambda *a, **k: pytest.fail("a run was trained"))
    argv = ["--out", str(tmp_path), "--no-progress", "--run", "a", "algorithm.estimator=grpo",
            "--run", "b", "algorithm.estimator=rloo", "train.steps=2", "rollout.group_size=4"]
    assert compare.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("creditrl compare: error: --run b: train.steps=2 rollout.group_size=4 "
                                                   "come after the last --run and set keys no other run sets")
    assert "-- train.steps=2 rollout.group_size=4" in err and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("tail, own, shared", [
    (["--", "train.steps=2"], ["algorithm.estimator=rloo"], ["train.steps=2"]),            # every run's, after --
    (["train.steps=2", "--"], ["algorithm.estimator=rloo", "train.steps=2"], []),           # b's own, ended by --
    (["train.steps=2", "--seeds", "0"], ["algorithm.estimator=rloo", "train.steps=2"], []),  # ended by an option
    ([], ["algorithm.estimator=rloo"], [])])                                                # keys a sets too
def test_unambiguous_forms_parse_as_documented(tmp_path, monkeypatch, tail, own, shared):
    seen = {}
    monkeypatch.setattr(compare, "run_all", lambda spec, *a, **k: seen.setdefault("spec", spec) and {})
    monkeypatch.setattr(compare, "write_report", lambda *a, **k: tmp_path / "report.md")
    compare.main(["--out", str(tmp_path), "--run", "a", "algorithm.estimator=grpo",
                  "--run", "b", "algorithm.estimator=rloo", *tail])
    spec = seen["spec"]
    assert spec.runs == {"a": ["algorithm.estimator=grpo"], "b": own} and spec.overrides == shared


def _configured_run(root, name, overrides, own):
    """A fake run whose config.yaml and compare_recipe.json are what compare writes."""
    import yaml
    from creditrl.config import config_to_dict, load_config
    from creditrl.recipe.resolve import resolve_config
    d = fake_run(root, name, 0)
    cfg = resolve_config(load_config(None, [*overrides, *own, f"train.run_name={name}-s0"]))
    (d / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    (d / compare.RECIPE_FILE).write_text(json.dumps({"config": None, "overrides": [*overrides, *own, "train.seed=0"],
                                                     "run_overrides": own}))


def test_report_names_config_keys_that_differ_and_warns_when_no_run_set_them(tmp_path):
    _configured_run(tmp_path / "x", "a", [], ["algorithm.estimator=otb"])
    _configured_run(tmp_path / "x", "b", ["train.steps=2"], ["algorithm.estimator=rloo"])   # another shared setting
    text = compare.write_report(compare.find_runs(tmp_path / "x"), tmp_path / "x", window=1).read_text()
    assert "## Warning: these runs are not comparable\n\nThey differ in `train.steps`, which no run's own" in text
    assert "| **train.steps** | 200 | 2 |" in text and "| algorithm.estimator | \"otb\" | \"rloo\" |" in text
    assert "algorithm.options.leave_one_out" in text and "`algorithm.options" not in text   # follows the estimator
    _configured_run(tmp_path / "y", "a", ["train.steps=2"], ["algorithm.estimator=otb"])
    _configured_run(tmp_path / "y", "b", ["train.steps=2"], ["algorithm.estimator=rloo"])
    text = compare.write_report(compare.find_runs(tmp_path / "y"), tmp_path / "y", window=1).read_text()
    assert "not comparable" not in text and "## Config keys that differ between the runs" in text
    assert "train.steps" not in text


def test_ctrl_c_in_compare_says_how_to_finish(monkeypatch, capsys):
    """Ctrl-C inside a command that does not catch it: one line naming what to do, exit 130, no traceback."""
    from creditrl import cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(compare, "main", interrupted)
    assert cli.main(["compare", "--out", "x"]) == 130
    err = capsys.readouterr().err
    assert err.startswith("creditrl compare: interrupted (to finish, run the same compare command again")
    assert "Traceback" not in err
