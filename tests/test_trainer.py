"""Trainer: one update with every estimator and every loss option, the LR schedule, eval's
pass@k against brute force, a short end-to-end run with its outputs, and the CLI."""
from __future__ import annotations

import itertools
import json
import math
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from creditrl.config import ConfigError, load_config
from creditrl.core.estimators import list_estimators
from creditrl.runtime.models.tiny import TinyModelConfig, char_tokenizer, tiny_model
from creditrl.tasks import get_task
from creditrl.runtime.evaluation import evaluate
from creditrl.runtime.rollout import generate_rollouts
from creditrl.trainer import train
from creditrl.runtime.evaluation import sample_correctness
from creditrl.trainer.update import Learner, lr_lambda
from tolerances import assert_close_normwise, forward_chain, logp_atol, sum_rtol

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)
# a tiny model warm-started to ~30% on 1-digit addition in a few seconds (cached per session)
TINY_RUN = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
            "model.warm_start.max_steps=400", "model.warm_start.eval_every=25", "model.warm_start.eval_size=32",
            "model.warm_start.target_accuracy=0.3", "model.warm_start.lr=3e-3", "task.options.digits=1",
            "train.eval_problems=8", "train.eval_samples=4", "train.pass_k=[1,4]", "logging.progress=false",
            "train.threads=1"]
METRIC_KEYS = ("step tokens_total reward_mean reward_std accuracy response_len entropy grad_norm power_proxy "
               "adv_mean adv_std adv_abs_mean clip_frac_low clip_frac_high approx_kl mismatch_kl ppl_gap "
               "tokens_per_s time_rollout time_update lr clipped_frac").split()
# measured only by terms a default run leaves off (a KL term's reference, dual clip, a dropping correction, STAPO)
UNMEASURED_BY_DEFAULT = ("ref_kl", "clip_frac_dual", "is_masked_frac", "spurious_ratio")


@pytest.fixture(scope="module")
def setup():
    task = get_task("addition", digits=1)
    tok = char_tokenizer(task.alphabet())
    return task, tok


def random_batch(task, tok, model, seed=0):
    """A real rollout batch whose rewards are replaced by mixed 0/1 values (an untrained model
    scores 0, which would give all-zero advantages)."""
    problems = [task.sample(random.Random(seed + i)) for i in range(4)]
    batch = generate_rollouts(model, tok, task, problems, group_size=4, max_new_tokens=4,
                              generator=torch.Generator().manual_seed(seed))
    batch.rewards = (torch.arange(16) % 3 == 0).float()
    batch.correct = batch.rewards >= 1
    return batch


def one_step(setup, overrides):
    task, tok = setup
    cfg = load_config(None, ["rollout.group_size=4", "rollout.max_new_tokens=4", "optim.lr=1e-3"] + overrides)
    model = tiny_model(tok, SMALL, seed=0)
    ref = tiny_model(tok, SMALL, seed=0).requires_grad_(False) if cfg.loss.get("kl_coef", 0) > 0 else None
    before = [p.detach().clone() for p in model.parameters()]
    learner = Learner(model, cfg, ref_model=ref)
    metrics = learner.update(random_batch(task, tok, model), torch.Generator().manual_seed(0)).metrics
    changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return metrics, changed


def test_micro_batches_log_the_same_metrics_as_the_whole_batch(setup):
    """optim.micro_batch_size changes no metric's presence, and the aggregation's count is the whole
    mini-batch's (it was left out of a micro-batched step's metrics)."""
    whole, _ = one_step(setup, [])
    parts, _ = one_step(setup, ["optim.micro_batch_size=5"])
    assert set(parts) == set(whole)
    assert parts["agg_count"] == pytest.approx(whole["agg_count"], rel=1e-6)


def estimator_overrides(name):
    return ["algorithm.options.k=2"] if name in ("maxpo", "pkpo", "ei", "maxk_bon", "passk_chen") else []


@pytest.mark.parametrize("name", list_estimators())
def test_one_step_each_estimator(setup, name):
    metrics, changed = one_step(setup, [f"algorithm.estimator={name}"] + estimator_overrides(name))
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert changed and metrics["grad_norm"] > 0 and metrics["adv_abs_mean"] > 0


LOSS_OPTIONS = {
    "clip_c": ["loss.clip_c=3.0"],
    "agg_seq_mean_token_mean": ["loss.agg=seq-mean-token-mean"],
    "agg_seq_mean_token_sum": ["loss.agg=seq-mean-token-sum"],
    "agg_seq_mean_token_sum_norm": ["loss.agg=seq-mean-token-sum-norm"],
    "kl_k3": ["loss.kl_coef=0.1"],
    "kl_k1": ["loss.kl_coef=0.1", "loss.kl_estimator=k1"],
    "tis": ["loss.rollout_correction=tis"],
    "mis": ["loss.rollout_correction=mis", "loss.rollout_cap=1.5"],
    "seq_tis": ["loss.rollout_correction=seq-tis"],
    "stapo": ["loss.stapo.enabled=true", "loss.stapo.tau_p=0.5"],
    "trace": ["loss.trace.enabled=true", "loss.trace.lam=0.9", "loss.trace.style=both"],
    "trace_weight": ["loss.trace.enabled=true", "loss.trace.update=weight"],
    "epochs_minibatches": ["optim.epochs=2", "optim.minibatch_size=4", "optim.schedule=cosine",
                           "optim.warmup_steps=2"],
    "everything": ["loss.clip_c=3.0", "loss.kl_coef=0.05", "loss.rollout_correction=tis", "loss.stapo.enabled=true",
                   "loss.trace.enabled=true", "algorithm.estimator=otb_isolated"],
    "kl_k3+_bias_corrected": ["loss.kl_coef=0.1", "loss.kl_estimator=k3+", "loss.kl_bias_correction=true"],
    "gspo": ["loss.gspo.enabled=true"],
    "cispo": ["loss.cispo.enabled=true"],
    "sapo": ["loss.sapo.enabled=true"],
    "geo_mean": ["loss.geo_mean.enabled=true", "loss.agg=seq-mean-token-mean"],
    "dppo_tv": ["loss.dppo_tv.enabled=true"],
    "dppo_kl": ["loss.dppo_kl.enabled=true"],
    "clip_cov": ["loss.clip_cov.enabled=true", "loss.clip_cov.clip_cov_ratio=0.2", "loss.clip_cov.clip_cov_lb=0.0"],
    "kl_cov": ["loss.kl_cov.enabled=true", "loss.kl_cov.kl_cov_ratio=0.2"],
    "entropy_bonus": ["loss.entropy_bonus.enabled=true", "loss.entropy_bonus.coef=0.01"],
    "entropy_adaptive": ["loss.entropy_bonus.enabled=true", "loss.entropy_bonus.adaptive=true",
                         "optim.minibatch_size=8"],
    "top_entropy": ["loss.top_entropy.enabled=true", "loss.top_entropy.quantile=0.5"],
    "delta_l_norm": ["loss.delta_l_norm.enabled=true", "loss.delta_l_norm.alpha=0.75"],
    "new_terms_together": ["loss.gspo.enabled=true", "loss.cispo.enabled=true", "loss.entropy_bonus.enabled=true",
                           "loss.entropy_bonus.coef=0.01", "loss.top_entropy.enabled=true",
                           "loss.delta_l_norm.enabled=true", "loss.kl_coef=0.05", "loss.kl_estimator=k3+"],
}


@pytest.mark.parametrize("option", sorted(LOSS_OPTIONS))
def test_one_step_each_loss_option(setup, option):
    metrics, changed = one_step(setup, LOSS_OPTIONS[option])
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert changed
    # ref_kl is measured only with a KL term's reference (kl_cov is a covariance term, without one); at step 0
    # the policy is its reference, so the KL itself is ~0: present, yet no stand-in 0.0 without a reference
    assert ("ref_kl" in metrics) == any(o.startswith("loss.kl_coef=") for o in LOSS_OPTIONS[option])
    if option == "stapo":
        assert metrics["kept_frac"] <= 1.0


def test_lr_schedule_matches_formula():
    cfg = load_config(None, ["optim.schedule=cosine", "optim.warmup_steps=4", "train.steps=20",
                             "optim.min_lr_ratio=0.1"])
    f = lr_lambda(cfg)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    for s in range(4, 21):
        progress = (s - 4) / 16
        assert abs(f(s) - (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))) < 1e-12
    const = lr_lambda(load_config(None, ["optim.warmup_steps=2"]))
    assert [const(s) for s in range(5)] == [0.5, 1.0, 1.0, 1.0, 1.0]


def test_pass_at_k_against_bruteforce(setup):
    task, tok = setup
    model = tiny_model(tok, SMALL, seed=1)
    problems = task.test_set()[:6]
    n, seed = 5, 3
    # a model that answers at random: make correctness non-trivial by scoring any response
    task_any = get_task("addition", digits=1)
    task_any.reward = lambda problem, response: float(len(response) % 2 == 0)
    common = dict(top_p=1.0, max_new_tokens=3, max_tool_tokens=8, batch_size=512)
    correct, _ = sample_correctness(model, tok, task_any, problems, n=n, temperature=1.0,
                                 generator=torch.Generator().manual_seed(seed), **common)
    assert 0 < correct.float().mean() < 1
    result = evaluate(model, tok, task_any, problems, n=n, ks=[1, 2, 5], max_new_tokens=3, max_tool_tokens=8,
                      seed=seed)
    for k in (1, 2, 5):
        brute = sum(sum(any(row[i] for i in s) for s in itertools.combinations(range(n), k)) /
                    math.comb(n, k) for row in correct.tolist()) / len(problems)
        assert abs(result[f"pass@{k}"] - brute) < 1e-9
        assert abs(result[f"avg@{k}"] - correct[:, :k].double().mean().item()) < 1e-9
    assert abs(result["sampled_acc"] - correct.double().mean().item()) < 1e-9   # float64 means, to 12 decimals


def test_evaluate_rejects_bad_k(setup):
    task, tok = setup
    with pytest.raises(ValueError, match="ks"):
        evaluate(tiny_model(tok, SMALL), tok, task, task.test_set()[:2], n=2, ks=[4])
    for n in (0, -1, 2.0, True):           # n itself is named, not the ks it makes out of range
        with pytest.raises(ValueError, match=rf"n: expected the number of samples per problem, an int >= 1, got {n!r}"):
            evaluate(tiny_model(tok, SMALL), tok, task, task.test_set()[:2], n=n, ks=[1])
    assert "pass@2" in evaluate(tiny_model(tok, SMALL), tok, task, task.test_set()[:2], n=np.int64(2), ks=[2],
                                max_new_tokens=2)


@pytest.mark.slow
def test_the_summary_says_whether_this_run_made_the_warm_start(tmp_path):
    """The first run on an empty cache trains builtin:tiny's warm start; the second loads it, and its
    summary must not claim the warm start happened in it."""
    said = []
    for name in ("first", "second"):
        cfg = load_config(None, TINY_RUN + [f"model.cache_dir={tmp_path / 'cache'}", f"train.output_dir={tmp_path}",
                                            f"train.run_name={name}", "train.steps=1", "train.eval_every=0"])
        said.append(json.loads((train(cfg) / "summary.json").read_text())["warm_start"])
    assert said[0].endswith(", in this run (cached for later runs)"), said[0]
    assert "on training-stream problems, not held out" in said[0]
    assert said[1].startswith("loaded from the cache, made by an earlier run (") and "in this run" not in said[1]


@pytest.mark.slow
def test_short_run_writes_every_output(tmp_path_factory, capfd):
    base = tmp_path_factory.getbasetemp()
    out = tmp_path_factory.mktemp("runs")
    cfg = load_config(None, TINY_RUN + [f"model.cache_dir={base / 'tiny-cache'}", f"train.output_dir={out}",
                                        "train.run_name=short", "train.steps=4", "train.save_every=2",
                                        "train.keep_last=1", "train.eval_every=2"])
    run = train(cfg)
    assert "Writing model shards" not in capfd.readouterr().err      # logging.progress=false: no bar at all
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert set(METRIC_KEYS) <= set(metrics[0]) and not set(UNMEASURED_BY_DEFAULT) & set(metrics[0])
    assert metrics[-1]["tokens_total"] == sum(m["tokens_total"] - p for m, p in
                                              zip(metrics, [0] + [m["tokens_total"] for m in metrics[:-1]]))
    assert [e["step"] for e in evals] == [0, 2, 4]
    assert {"greedy_acc", "pass@1", "pass@4", "avg@1", "avg@4", "tokens_total"} <= set(evals[0])
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000004"]
    assert (run / "plots" / "train.png").is_file() and (run / "plots" / "eval.png").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["tokens_total"] == metrics[-1]["tokens_total"]
    assert summary["start"]["greedy_acc"] == evals[0]["greedy_acc"]
    assert (run / "summary.md").read_text().startswith("# creditrl run")
    assert load_config(run / "config.yaml").train.steps == 4  # the saved config reloads
    assert any((run / "tensorboard").iterdir())
    assert (run / "final" / "config.json").is_file()
    # creditrl eval on the finished run: the final model, the run's task, JSON out
    from creditrl.cli import main
    assert main(["eval", "--run", str(run), "--n", "2", "--k", "1", "2", "--problems", "4",
                 "--out", str(out / "eval.json"), "--no-progress"]) == 0
    result = json.loads((out / "eval.json").read_text())
    assert result["n_problems"] == 4 and {"greedy_acc", "pass@2", "avg@2"} <= set(result)
    # with the run's own eval settings, creditrl eval reproduces the run's last held-out eval: every eval
    # of a run samples with train.seed (the same draws at start and end, so their change is paired)
    assert main(["eval", "--run", str(run), "--out", str(out / "same.json"), "--no-progress"]) == 0
    same = json.loads((out / "same.json").read_text())
    shared = set(evals[-1]) - {"step", "tokens_total", "time_eval"}
    assert {key: same[key] for key in shared} == {key: evals[-1][key] for key in shared}


def cli(*args):
    return subprocess.run([sys.executable, "-m", "creditrl.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_help_lists_config_keys():
    res = cli("train", "--help")
    assert res.returncode == 0
    for key in ("algorithm.estimator", "optim.lr", "loss.stapo.tau_p", "train.pass_k", "--resume", "--config"):
        assert key in res.stdout


def test_cli_errors_are_clear(tmp_path, capsys, monkeypatch):
    from creditrl.cli import main

    monkeypatch.chdir(tmp_path)      # the default train.output_dir is ./runs

    cases = [(["train", "task.name=nope"], "task.name: unknown task 'nope'; valid tasks are ['addition'"),
             (["train", "algorithm.estimator=nope"], "valid estimators are"),
             (["train", "--config", str(tmp_path / "missing.yaml")], "no such file"),
             (["train", "algorithm.estimator=maxpo", "algorithm.options.k=8"], "k < rollout.group_size"),
             (["train", "optim.lr"], "expected key=value"),
             (["train", "--resume", str(tmp_path)], "config.yaml"),
             (["eval", "--run", str(tmp_path)], "config.yaml")]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())   # no run dir left behind
    assert main(["estimators"]) == 0
    out = capsys.readouterr().out
    assert "otb" in out and "maxpo" in out


def test_cli_dispatches_compare_and_experiment_lazily(capsys):
    from creditrl.cli import main

    for name in ("compare", "experiment"):
        try:
            code = main([name, "--help"])
        except SystemExit as exc:  # argparse --help of the subcommand's own parser
            code = exc.code
        text = capsys.readouterr()
        assert code == 0, (name, text.err)
        assert "usage" in (text.out + text.err).lower()


def test_config_errors_surface_before_model_load():
    with pytest.raises(ConfigError, match="rollout.top_p"):
        load_config(None, ["rollout.top_p=1.5"])


# --- shared-prompt training forward (performance path) vs the plain full forward -------------

def stats_and_grads(model, batch, group, rows=None):
    """response_stats (+ gradients of a fixed function of them) on ``rows`` of ``batch``."""
    from creditrl.runtime.scoring import response_stats

    rows = torch.arange(batch.input_ids.shape[0]) if rows is None else rows
    model.zero_grad(set_to_none=True)
    stats = response_stats(model, batch.input_ids[rows], batch.attention_mask[rows], batch.position_ids[rows],
                           batch.response_mask[rows], batch.prompt_len, temperature=0.8,
                           group=None if group is None else group[rows])
    (stats.logp.sum() + 0.3 * stats.entropy.sum()).backward()
    return stats, [p.grad.clone() for p in model.parameters()]


def stats_atol(model, batch) -> float:
    """logp's tolerance between two forwards of ``batch`` (tests/tolerances.py logp_atol), at the
    temperature 0.8 of stats_and_grads (any temperature >= 0.8 is covered)."""
    with torch.no_grad():
        scale = float(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                            position_ids=batch.position_ids).logits.abs().max()) / 0.8      # tempered logits
    return logp_atol(model, batch.input_ids.shape[1], scale)


def assert_same_stats(a, b, model, batch):
    """Packed and plain forwards of the same rows: the same statistics up to the forwards'
    rounding (tests/tolerances.py logp_atol; the entropy moves by <= (1 + log V)·|Δz| more, Σπ² and the
    energy by <= 2·|Δz|), and gradients through the same chain backwards (normwise)."""
    (sa, ga), (sb, gb) = a, b
    atol = stats_atol(model, batch)
    factors = {"logp": 1.0, "entropy": 1 + math.log(model.config.vocab_size), "sum_p2": 1.0, "energy": 1.0}
    for name, factor in factors.items():
        torch.testing.assert_close(getattr(sa, name), getattr(sb, name), atol=atol * factor, rtol=0)
    rtol = 2 * sum_rtol(2 * forward_chain(model, batch.input_ids.shape[1]) + model.config.vocab_size)
    for x, y in zip(ga, gb):
        assert_close_normwise(x, y, rtol, "parameter gradient")


@pytest.fixture(params=["one_pack_per_group", "a_pack_per_3_tokens", "a_pack_per_row", "eager", "checkpointed"])
def packs(request, monkeypatch):
    """Whole groups in one pack, groups cut into packs of 3 response inputs and of one row (every
    layout path); and the one-pack layout under eager attention (an additive float mask) and with
    gradient checkpointing. Returns a function that prepares a model for the variant."""
    from creditrl.runtime import scoring
    tokens = {"a_pack_per_3_tokens": 3, "a_pack_per_row": 1}.get(request.param)
    if tokens is not None:
        monkeypatch.setattr(scoring, "PACK_TOKENS", tokens)

    def prepare(model):
        if request.param == "eager":
            model.set_attn_implementation("eager")
        if request.param == "checkpointed":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        assert scoring._packable(model)
        return model
    return prepare


def test_packed_prompt_stats_match_plain_forward(setup, packs):
    task, tok = setup
    model = packs(tiny_model(tok, SMALL, seed=1))
    problems = [task.sample(random.Random(i)) for i in range(3)] + [task.sample(random.Random(7))]
    batch = generate_rollouts(model, tok, task, problems, group_size=5, max_new_tokens=9,
                              generator=torch.Generator().manual_seed(3))
    lengths = batch.attention_mask[:, batch.prompt_len:].sum(-1)
    assert len(set(lengths.tolist())) > 2  # rows of different lengths
    from creditrl.runtime import scoring
    layout = scoring.pack_rows(batch.input_ids, batch.attention_mask, batch.position_ids, batch.response_mask,
                               batch.prompt_len, batch.group, scoring.PACK_TOKENS)
    assert (layout.input_ids.shape[0] > 4) == (scoring.PACK_TOKENS < 9)   # 4 groups: cut into packs or not
    assert_same_stats(stats_and_grads(model, batch, None), stats_and_grads(model, batch, batch.group), model, batch)
    # a shuffled mini-batch: groups are not contiguous, some groups have one row
    rows = torch.randperm(20, generator=torch.Generator().manual_seed(0))[:9]
    assert_same_stats(stats_and_grads(model, batch, None, rows), stats_and_grads(model, batch, batch.group, rows),
                      model, batch)


def test_packed_prompt_stats_with_length_one_rows_and_tool_holes(setup, packs):
    """Rows of response length 1 (only the prompt's logits predict them) next to long rows, and
    mask-0 tokens inside a response (tool outputs): still the plain forward's values."""
    task, tok = setup
    model = packs(tiny_model(tok, SMALL, seed=2))
    batch = generate_rollouts(model, tok, task, [task.sample(random.Random(i)) for i in range(2)], group_size=4,
                              max_new_tokens=6, generator=torch.Generator().manual_seed(0))
    p = batch.prompt_len
    width = batch.input_ids.shape[1] - p
    lengths = torch.tensor([1, 1, 1, 1, width, 1, width, 2])
    cols = torch.arange(width)
    batch.attention_mask[:, p:] = (cols < lengths[:, None]).long()
    batch.response_mask[:, p:] = batch.attention_mask[:, p:].float()
    batch.response_mask[4, p + 1] = 0.0  # a tool-output token: attended, not trained on
    from creditrl.runtime.sampling import position_ids_from_mask
    batch.position_ids = position_ids_from_mask(batch.attention_mask)
    assert_same_stats(stats_and_grads(model, batch, None), stats_and_grads(model, batch, batch.group), model, batch)


def test_packed_prompt_stats_with_one_or_no_response_column(setup):
    """Batches cut to one response column (only the prompts' logits predict) or none: the plain
    forward's values, and [B, 0] statistics for no column."""
    task, tok = setup
    model = tiny_model(tok, SMALL, seed=3)
    batch = random_batch(task, tok, model)
    for width in (1, 0):
        for name in ("input_ids", "attention_mask", "position_ids", "response_mask"):
            setattr(batch, name, getattr(batch, name)[:, :batch.prompt_len + width])
        assert_same_stats(stats_and_grads(model, batch, None), stats_and_grads(model, batch, batch.group), model, batch)
        assert stats_and_grads(model, batch, batch.group)[0].logp.shape == (batch.input_ids.shape[0], width)


def test_packed_prompt_stats_reject_groups_with_different_prompts(setup):
    from creditrl.runtime.scoring import response_stats

    task, tok = setup
    model = tiny_model(tok, SMALL, seed=0)
    batch = random_batch(task, tok, model)
    wrong = batch.group.clone()
    wrong[4] = 0  # row 4 answers prompt 1 but claims group 0
    with pytest.raises(ValueError, match=r"group: .*rows \[4\]"):
        response_stats(model, batch.input_ids, batch.attention_mask, batch.position_ids, batch.response_mask,
                       batch.prompt_len, temperature=1.0, group=wrong)
    shifted = batch.position_ids.clone()
    shifted[5] += 3  # row 5's prompt at other positions than its group's: packing would move it
    with pytest.raises(ValueError, match=r"group: .*positions of attended columns.*rows \[5\]"):
        response_stats(model, batch.input_ids, batch.attention_mask, shifted, batch.response_mask,
                       batch.prompt_len, temperature=1.0, group=batch.group)
    half = batch.response_mask.clone()
    half[3, -1] = 0.5   # not a 0/1 mask: the plain forward's error, naming the row
    for group in (None, batch.group):
        with pytest.raises(ValueError, match=r"mask: expected a bool or 0/1 mask.*rows \[3\]"):
            response_stats(model, batch.input_ids, batch.attention_mask, batch.position_ids, half,
                           batch.prompt_len, temperature=1.0, group=group)
    shifted = batch.position_ids.clone()
    shifted[:, 0] += 5 * (batch.attention_mask[:, 0] == 0)   # positions of unattended columns do not count
    response_stats(model, batch.input_ids, batch.attention_mask, shifted, batch.response_mask,
                   batch.prompt_len, temperature=1.0, group=batch.group)


def test_a_prompt_with_no_attended_column_gives_finite_stats_of_its_own_rows(setup):
    """A group whose prompt is all padding: its first response token is predicted from a query
    with no key, which the plain forward leaves undefined (sdpa: zero attention; eager: spread over
    the row). Packed, it sees itself alone: finite, and the same however the rows are packed;
    every other value is the plain forward's."""
    from creditrl.runtime import scoring

    task, tok = setup
    model = tiny_model(tok, SMALL, seed=4)
    batch = random_batch(task, tok, model)
    p, empty = batch.prompt_len, batch.group == batch.group[0]
    batch.attention_mask[empty, :p] = 0
    args = (model, batch.input_ids, batch.attention_mask, batch.position_ids, batch.response_mask, p, batch.group)
    whole = scoring.packed_prompt_stats(*args, temperature=1.0)
    by_row = scoring.packed_prompt_stats(*args, temperature=1.0, pack_tokens=1)
    plain = scoring.response_stats(*args[:-1], temperature=1.0)
    atol = stats_atol(model, batch) * (1 + math.log(model.config.vocab_size))   # the entropy's factor covers all
    for name in ("logp", "entropy", "sum_p2", "energy"):
        a, b, c = getattr(whole, name), getattr(by_row, name), getattr(plain, name)
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=atol, rtol=0)
        torch.testing.assert_close(a[~empty], c[~empty], atol=atol, rtol=0)
        torch.testing.assert_close(a[empty, 1:], c[empty, 1:], atol=atol, rtol=0)


def test_packed_prompt_stats_without_position_ids_count_columns_as_the_plain_forward(setup):
    """position_ids=None: both forwards number the columns 0..W-1 (HF's default)."""
    from creditrl.runtime.scoring import response_stats

    task, tok = setup
    model = tiny_model(tok, SMALL, seed=5)
    batch = random_batch(task, tok, model)
    args = (model, batch.input_ids, batch.attention_mask, None, batch.response_mask, batch.prompt_len)
    packed, plain = response_stats(*args, temperature=1.0, group=batch.group), response_stats(*args, temperature=1.0)
    batch.position_ids = torch.arange(batch.input_ids.shape[1]).expand_as(batch.input_ids)   # for the logits' scale
    torch.testing.assert_close(packed.logp, plain.logp, atol=stats_atol(model, batch), rtol=0)


def test_alibi_models_are_scored_by_the_plain_forward():
    """ALiBi models (Falcon with alibi, Bloom) build their bias from a 2D mask: not packed."""
    import transformers

    from creditrl.runtime.scoring import _packable, response_stats

    for config, model_cls in [(transformers.FalconConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2,
                                                         num_attention_heads=4, alibi=True,
                                                         new_decoder_architecture=False),
                               transformers.FalconForCausalLM),
                              (transformers.BloomConfig(vocab_size=16, hidden_size=32, n_layer=2, n_head=4),
                               transformers.BloomForCausalLM)]:
        torch.manual_seed(0)
        model = model_cls(config).eval()
        assert not _packable(model)
        ids = torch.randint(1, 16, (2, 6))
        ids[1, :3] = ids[0, :3]
        attn, rmask = torch.ones_like(ids), (torch.arange(6) >= 3).float().expand(2, 6)
        grouped = response_stats(model, ids, attn, attn.cumsum(-1) - 1, rmask, 3, temperature=1.0,
                                 group=torch.tensor([0, 0]))
        plain = response_stats(model, ids, attn, attn.cumsum(-1) - 1, rmask, 3, temperature=1.0)
        assert torch.equal(grouped.logp, plain.logp)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_pack_rows_matches_a_loop_over_rows(data):
    """pack_rows against a loop: every fed response token of every row sits once in a pack of
    its group, with its id and position; each query attends exactly the keys it sees in the plain
    forward; a pack holds fewer than ``pack_tokens`` response inputs before its last row."""
    from creditrl.runtime.scoring import pack_rows

    sizes = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4), label="group sizes")
    p, r, pack_tokens = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 6)), data.draw(st.integers(1, 8))
    size = sum(sizes)
    perm = data.draw(st.permutations(range(size)), label="row order")   # groups need not be contiguous
    group = torch.tensor([g for g, n in enumerate(sizes) for _ in range(n)])[list(perm)] * 7 + 3
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    ids = torch.randint(0, 1000, (size, p + r), generator=gen)
    attn = (torch.rand(size, p + r, generator=gen) < 0.8).long()
    pos = torch.randint(0, 100, (size, p + r), generator=gen)
    prompt_of = {g: (ids[i, :p].clone(), attn[i, :p].clone(), pos[i, :p].clone()) for i, g in enumerate(group.tolist())}
    for i, g in enumerate(group.tolist()):
        ids[i, :p], attn[i, :p], pos[i, :p] = prompt_of[g]
    mask = (torch.rand(size, p + r, generator=gen) < 0.6) & (torch.arange(p + r) >= p)
    packs = pack_rows(ids, attn, pos, mask.float(), p, group, pack_tokens)

    def fed(b):   # response columns row b feeds: up to its last attended or trained column, less that one
        last = max([j for j in range(r) if attn[b, p + j] or mask[b, p + j]], default=0)
        return list(range(last))
    where = {(b, j): (k, s) for b, j, k, s in zip(packs.rows.tolist(), packs.cols.tolist(),
                                                   packs.row_pack[packs.rows].tolist(), packs.slots.tolist())}
    assert sorted(where) == sorted((b, j) for b in range(size) for j in fed(b))
    for (b, j), (k, s) in where.items():
        assert (packs.input_ids[k, s], packs.position_ids[k, s]) == (ids[b, p + j], pos[b, p + j])
    for k in range(packs.input_ids.shape[0]):
        rows = [b for b in range(size) if packs.row_pack[b] == k]
        assert len({int(group[b]) for b in rows}) == 1
        assert sum(len(fed(b)) for b in rows[:-1]) < pack_tokens
        head = int(packs.head_slot[k])
        assert packs.input_ids[k, head] == ids[rows[0], p - 1]
        # prompt slots: the attended prompt columns and the last one, in order, ending at the head
        prompt_cols = [c for c in range(p) if attn[rows[0], c] or c == p - 1]
        prompt_slot = dict(zip(prompt_cols, range(head - len(prompt_cols) + 1, head + 1)))
        for c, s in prompt_slot.items():
            assert packs.input_ids[k, s] == ids[rows[0], c]

        def attends(s, keys):   # the query at slot s sees exactly these slots (no key: itself alone)
            expected = torch.zeros(packs.input_ids.shape[1], dtype=torch.bool)
            expected[keys or [s]] = True
            return torch.equal(packs.allowed[k, 0, s], expected)
        for b in rows:
            for j in fed(b):
                keys = [prompt_slot[c] for c in range(p) if attn[b, c]]
                assert attends(where[b, j][1], keys + [where[b, i][1] for i in range(j + 1) if attn[b, p + i]])
        for c, s in prompt_slot.items():
            assert attends(s, [prompt_slot[i] for i in range(c + 1) if attn[rows[0], i]])


def test_train_plot_shows_a_reward_that_stayed_zero():
    """A curve 0 at every step is left out of train.png (approx_kl on-policy), but not the reward's or
    the accuracy's: a run that never scored must show it."""
    from creditrl.trainer.report import train_curves

    steps = [{"reward_mean": 0.0, "accuracy": 0.0, "entropy": 2.0 + i, "approx_kl": 0.0} for i in range(3)]
    assert train_curves(steps) == ["reward_mean", "accuracy", "entropy"]
    assert train_curves([{"entropy": 1.0}]) == ["entropy"]



@pytest.mark.parametrize("steps", [[1, 2], [1, 2, 3, 4], list(range(0, 500, 10))])
def test_step_axes_are_ticked_at_whole_steps(steps):
    """A run of a few steps is ticked at steps, not at 0.5 or 1.5 (matplotlib's default locator
    puts fractional ticks on a short integer axis)."""
    pytest.importorskip("matplotlib")
    from creditrl.utils.plots import figure, step_axis

    fig, (ax,) = figure()
    ax.plot(steps, [0.0] * len(steps))
    step_axis(ax)
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if steps[0] <= t <= steps[-1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert ax.get_xlabel() == "step"
