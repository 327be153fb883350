"""Nothing silent (part of the reliability issue): run directories you cannot corrupt by accident,
non-finite config numbers, group_size=1, rewards that cannot be gamed by formatting, non-finite
rewards and updates. Each test would fail on the behaviour before these changes."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import shutil
import time
import types
from pathlib import Path

import pytest
import torch

from creditrl.config import ConfigError, load_config, load_saved_config, save_config
from creditrl.recipe.resolve import resolve_config
from tolerances import EPS32, sum_rtol
from creditrl.tasks import Problem, get_task
from creditrl.trainer import checkpoint as ckpt
from creditrl.trainer.logging import truncate_jsonl
from creditrl.utils.rundir import RunDirError, RunLock, clear_run

TINY = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
        "model.warm_start.max_steps=50", "model.warm_start.eval_every=25", "model.warm_start.eval_size=8",
        "task.options.digits=1", "train.eval_problems=4", "train.eval_samples=2", "logging.progress=false",
        "train.threads=1", "train.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "algorithm.estimator=grpo", "train.save_every=1"]


# ----------------------------------------------------------------------------- run directories

def test_existing_run_directory_is_refused_unless_overwritten(tmp_path, capsys):
    from creditrl.cli import main
    args = ["train", "--no-progress", *TINY, f"model.cache_dir={tmp_path / 'cache'}", f"train.output_dir={tmp_path}",
            "train.run_name=r"]
    assert main(args) == 0
    assert main(args) == 2                                  # a second start would append to the old logs
    err = capsys.readouterr().err
    assert "already exists" in err and "--resume" in err and "--overwrite" in err
    assert main(args + ["--overwrite"]) == 0                # cleared, then trained again
    metrics = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [1, 2]
    assert not (tmp_path / "r" / ".lock").exists()          # released


def test_run_lock_refuses_a_live_owner_and_takes_over_a_dead_one(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / ".lock").write_text(str(live.pid))
        with pytest.raises(RunDirError, match=rf"in use by another creditrl process \(PID {live.pid}\)"):
            with RunLock(tmp_path):
                pass
    finally:
        live.kill()
        live.wait()
    (tmp_path / ".lock").write_text(str(live.pid))          # its process is gone now: stale
    with RunLock(tmp_path):
        assert (tmp_path / ".lock").read_text() == str(os.getpid())
    assert not (tmp_path / ".lock").exists()
    (tmp_path / ".lock").write_text("garbage")              # unreadable owner: stale as well
    with RunLock(tmp_path):
        pass


def test_overwrite_never_clears_a_directory_a_live_run_holds(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / ".lock").write_text(str(live.pid))
        with pytest.raises(RunDirError, match="in use"):
            with RunLock(tmp_path):
                clear_run(tmp_path)
        with pytest.raises(RunDirError, match="needs this process to hold its lock"):
            clear_run(tmp_path)
        assert (tmp_path / "metrics.jsonl").exists()
    finally:
        live.kill()
        live.wait()


def test_unwritable_output_dir_fails_before_the_model_loads(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    import creditrl.trainer.loop as loop
    monkeypatch.setattr(loop, "load_configured_policy", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(RunDirError, match="train.output_dir: cannot write in"):
        loop.train(load_config(None, [f"train.output_dir={blocker}"]), progress=False)


def _save(run, step, value=1.0):
    return ckpt.save_checkpoint(run, step, {"w": torch.full((3,), value)}, {"x": step}, keep_last=5)


@pytest.mark.parametrize("damage", ["truncate-weights", "truncate-state", "flip-byte", "no-manifest", "empty-state"])
def test_damaged_newest_checkpoint_falls_back_to_an_older_valid_one(tmp_path, damage):
    _save(tmp_path, 1, 1.0)
    newest = _save(tmp_path, 2, 2.0)
    target = {"truncate-weights": ckpt.WEIGHTS, "truncate-state": ckpt.STATE, "flip-byte": ckpt.WEIGHTS,
              "no-manifest": ckpt.MANIFEST, "empty-state": ckpt.STATE}[damage]
    path = newest / target
    data = path.read_bytes()
    if damage == "no-manifest":
        path.unlink()
    elif damage == "flip-byte":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    elif damage == "empty-state":
        path.write_bytes(b"")
    else:
        path.write_bytes(data[: len(data) // 2])
    with pytest.warns(UserWarning, match="skipped damaged checkpoint.*step_000002.*resuming from step_000001"):
        weights, state = ckpt.load_latest(tmp_path)
    assert state["step"] == 1 and weights["w"].tolist() == [1.0, 1.0, 1.0]


def test_no_valid_checkpoint_is_a_clear_error(tmp_path):
    path = _save(tmp_path, 1) / ckpt.WEIGHTS
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"no valid checkpoint .*step_000001: weights.safetensors has 0 bytes"):
        ckpt.load_latest(tmp_path)


def test_failed_checkpoint_write_leaves_nothing_and_names_the_path(tmp_path, monkeypatch):
    import creditrl.trainer.checkpoint as checkpoint

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoint, "save_file", full_disk)
    with pytest.raises(OSError, match=r"checkpoint: could not write .*step_000003.*No space left"):
        _save(tmp_path, 3)
    assert list((tmp_path / "checkpoints").iterdir()) == []


@pytest.mark.parametrize("text, message", [("", "not filled in with defaults"),
                                           ("model:\n  name: builtin:tiny\n", "not filled in with defaults"),
                                           ("{{{ not yaml", r"(?s)unreadable saved config \(.*\); fix the file"),
                                           ("- a list\n", "not filled in with defaults")])
def test_resume_refuses_an_incomplete_config(tmp_path, text, message):
    (tmp_path / "config.yaml").write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_saved_config(tmp_path / "config.yaml")
    from creditrl.trainer import resume
    with pytest.raises(ConfigError):
        resume(tmp_path, progress=False)


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(None, ["train.steps=7"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_saved_config(tmp_path / "config.yaml").train.steps == 7


def test_log_rewrite_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    original = "".join(json.dumps({"step": s}) + "\n" for s in range(1, 6))
    path.write_text(original)

    def dies(*a, **k):
        raise OSError(5, "I/O error")
    monkeypatch.setattr(os, "replace", dies)
    with pytest.raises(OSError, match="could not write .*metrics.jsonl"):
        truncate_jsonl(path, 2)
    assert path.read_text() == original                     # nothing lost
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]   # no temporary left behind


# ----------------------------------------------------------------------------- config

@pytest.mark.parametrize("override, key", [
    ("optim.lr=.inf", "optim.lr"), ("rollout.temperature=nan", "rollout.temperature"),
    ("optim.max_grad_norm=nan", "optim.max_grad_norm"), ("loss.clip_low=-.inf", "loss.clip_low"),
    ("loss.kl_coef=.nan", "loss.kl_coef"), ("rollout.top_p=inf", "rollout.top_p")])
def test_non_finite_numbers_are_rejected(override, key):
    with pytest.raises(ConfigError, match=rf"{key}: expected a finite number"):
        resolve_config(load_config(None, [override]))


@pytest.mark.parametrize("value", ["1e-9", "0", "0.01", "11", "-1"])
def test_temperature_has_a_documented_range(value):
    with pytest.raises(ConfigError, match=r"rollout.temperature: expected a value (in \[0.05, 10.0\]|> 0)"):
        load_config(None, [f"rollout.temperature={value}"])


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "dr_grpo", "otb", "opo"])
def test_group_size_one_is_an_error_that_says_why(estimator):
    with pytest.raises(ConfigError, match=r"rollout.group_size: 1 response per prompt .* nothing would be learned"):
        resolve_config(load_config(None, ["rollout.group_size=1", f"algorithm.estimator={estimator}"]))
    resolve_config(load_config(None, ["rollout.group_size=1", "algorithm.estimator=reinforce"]))  # learns from one


@pytest.mark.parametrize("estimator, options", [("maxrl", []), ("passk_chen", ["algorithm.options.k=2"])])
def test_an_estimator_that_refuses_negative_rewards_refuses_the_overlong_penalty_at_config_time(estimator, options):
    """maxrl (rewards >= 0) and passk_chen (0/1 rewards) would raise at the first batch the overlong
    penalty touched, after the model loaded: the config says so first."""
    base = [f"algorithm.estimator={estimator}", *options, "rollout.max_new_tokens=16"]
    with pytest.raises(ConfigError, match=rf"rollout.overlong.buffer=4: the overlong penalty makes rewards negative "
                                          rf"\(down to -1\), which estimator '{estimator}' refuses"):
        resolve_config(load_config(None, [*base, "rollout.overlong.buffer=4"]))
    resolve_config(load_config(None, base))
    resolve_config(load_config(None, ["algorithm.estimator=grpo", "rollout.max_new_tokens=16", "rollout.overlong.buffer=4"]))


# ----------------------------------------------------------------------------- rewards

@pytest.fixture
def numeric(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n')
    return get_task("jsonl", path=str(path), checker="numeric")


@pytest.mark.parametrize("response, answer, reward", [
    ("1234568", "1234567", 0.0), ("1,2,3", "123", 0.0), ("1,234", "1234", 1.0), ("12,34", "1234", 0.0),
    ("the total is 1,234,567.", "1234567", 1.0), ("0.30000001", "0.3", 0.0), ("0.30", "0.3", 1.0),
    ("-5", "5", 0.0), ("1e3", "1000", 1.0), ("", "1", 0.0)])
def test_numeric_checker_is_exact(numeric, response, answer, reward):
    assert numeric.reward(Problem("q", answer), response) == reward


def test_math_checker_reads_the_tail_quietly(tmp_path, capfd):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "42"}\n{"prompt": "b", "answer": "2"}\n')
    task = get_task("jsonl", path=str(path), checker="math")
    huge = ("\\frac{" * 20 + "x" + "}" * 20 + " and ") * 4000 + "so the answer is $\\boxed{42}$"   # ~200 KB
    assert task.reward(Problem("a", "42"), "42") == 1.0   # starts the checker process (not what is timed)
    start = time.perf_counter()
    assert task.reward(Problem("a", "42"), huge) == 1.0
    assert time.perf_counter() - start < 5
    captured = capfd.readouterr()
    assert "frac" not in captured.err and "frac" not in captured.out


def test_non_finite_rewards_count_as_zero_and_are_logged():
    from creditrl.runtime.models.tiny import TinyModelConfig, char_tokenizer, tiny_model
    from creditrl.runtime.rollout import generate_rollouts
    from creditrl.trainer.update import Learner
    task = get_task("addition", digits=1)
    values = iter([float("nan"), float("inf"), 1.0, 0.0] * 4)
    task.reward = lambda problem, response: next(values)
    tok = char_tokenizer(task.alphabet())
    model = tiny_model(tok, TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64))
    batch = generate_rollouts(model, tok, task, [Problem("1+2=", "3"), Problem("2+2=", "4")], group_size=4,
                              max_new_tokens=3, generator=torch.Generator().manual_seed(0))
    assert batch.rewards.tolist() == [0.0, 0.0, 1.0, 0.0] * 2 and batch.reward_invalid.sum() == 4
    cfg = load_config(None, ["rollout.group_size=4", "rollout.prompts_per_step=2", "rollout.max_new_tokens=3",
                             "algorithm.estimator=grpo"])
    metrics = Learner(model, cfg).update(batch, torch.Generator().manual_seed(0)).metrics
    assert metrics["reward_invalid_frac"] == 0.5 and metrics["skipped_updates"] == 0


# ----------------------------------------------------------------------------- non-finite updates

def test_non_finite_gradient_never_reaches_the_weights():
    from creditrl.runtime.models.tiny import TinyModelConfig, char_tokenizer, tiny_model
    from creditrl.runtime.rollout import generate_rollouts
    from creditrl.trainer.update import Learner
    task = get_task("addition", digits=1)
    tok = char_tokenizer(task.alphabet())
    model = tiny_model(tok, TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64))
    batch = generate_rollouts(model, tok, task, [Problem("1+2=", "3")], group_size=4, max_new_tokens=3,
                              generator=torch.Generator().manual_seed(0))
    batch.rewards = torch.tensor([3e38, 0.0, -3e38, 0.0])   # finite, but the gradient overflows
    cfg = load_config(None, ["rollout.group_size=4", "rollout.prompts_per_step=1", "rollout.max_new_tokens=3",
                             "algorithm.estimator=dr_grpo", "optim.lr=1e-2"])
    before = [p.detach().clone() for p in model.parameters()]
    metrics = Learner(model, cfg).update(batch, torch.Generator().manual_seed(0)).metrics
    assert metrics["skipped_updates"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_repeated_skipped_updates_stop_the_run_naming_the_cause():
    from creditrl.trainer.loop import Trainer, TrainingStopped
    trainer = Trainer.__new__(Trainer)
    trainer.cfg, trainer.step, trainer.skipped_streak = load_config(None, []), 5, 0
    trainer.learner = types.SimpleNamespace(skip_error=None)
    trainer.check_skipped({"skipped_updates": 1, "reward_mean": 1e30})
    trainer.check_skipped({"skipped_updates": 0})          # a good step resets the count
    for _ in range(2):
        trainer.check_skipped({"skipped_updates": 1, "reward_mean": 1e30})
    with pytest.raises(TrainingStopped, match=r"NaN/inf for 3 steps in a row.*optim.lr=5e-05.*1e\+30"):
        trainer.check_skipped({"skipped_updates": 1, "reward_mean": 1e30})


def test_cli_reports_a_stopped_run_without_a_traceback(tmp_path, monkeypatch, capsys):
    import creditrl.trainer.loop as loop
    from creditrl.cli import main

    def stop(*a, **k):
        raise loop.TrainingStopped("training stopped at step 3: the loss or gradient was NaN/inf")
    monkeypatch.setattr("creditrl.trainer.loop.train", stop)
    assert main(["train", "--no-progress", f"train.output_dir={tmp_path}"]) == 2
    assert "training stopped at step 3" in capsys.readouterr().err
    assert Path(tmp_path).exists()


# ----------------------------------------------------------------------------- data

def _jsonl(tmp_path, body: bytes, name="d.jsonl"):
    path = tmp_path / name
    path.write_bytes(body)
    return str(path)


GOOD = b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n'


@pytest.mark.parametrize("body, message", [
    (b"", r"d.jsonl has no rows"),
    (b"\n\n  \n", r"d.jsonl has no rows"),
    (GOOD + b'{"prompt": "3+3=", "answer": 6\n', r"d.jsonl line 3: malformed JSON"),
    (GOOD[:34] + b'{"prompt": "\xff", "answer": "1"}\n', r"d.jsonl line 2 is not valid UTF-8"),
    (b'{"prompt": "' + b"x" * (1 << 20) + b'", "answer": "1"}\n' + GOOD, r"d.jsonl line 1 is longer than 1 MiB"),
    (GOOD + b'[1, 2]\n"text"\n', r"line\(s\) 3, 4 are not JSON objects"),
    (GOOD + b'{"prompt": "5+5=", "answer": null}\n', r"row 3: answer: missing \(the row has no answer, or it is null\)"),
    (GOOD + b'{"prompt": "5+5="}\n', r"row 3: answer: missing .*; expected a string, a number, a list or a mapping"),
    (GOOD + b'{"prompt": "5+5=", "answer": NaN}\n', r"row 3: answer: expected a finite number, got nan"),
    # the default checker (exact) reads the answer as text: a mapping or an empty text is refused up front
    (GOOD + b'{"prompt": "5+5=", "answer": {"a": 1}}\n', r"1 answer\(s\) the checker\(s\) \['exact'\] cannot "
                                                       r"read \(row 3: a dict\)"),
    (GOOD + b'{"prompt": "5+5=", "answer": " "}\n', r"\(row 3: an empty answer\)"),
    (GOOD + b'{"answer": "1"}\n{"prompt": null, "answer": "1"}\n', r"2 invalid row\(s\); row 3: prompt: .*; row 4"),
])
def test_bad_data_gets_one_clear_error(tmp_path, body, message):
    with pytest.raises(ValueError, match=message):
        get_task("jsonl", path=_jsonl(tmp_path, body))


def test_a_data_tasks_automatic_response_budget_fits_the_tokenizers_context(tmp_path):
    """A jsonl task's automatic rollout.max_new_tokens (256) on builtin:tiny's 256-token context was refused
    as 'got 256', a value the user never set: it is at most half the tokenizer's stated context."""
    from types import SimpleNamespace
    from creditrl.recipe.build import DEFAULT_MAX_NEW_TOKENS, default_max_new_tokens
    task = get_task("jsonl", path=_jsonl(tmp_path, GOOD))
    assert default_max_new_tokens(task, SimpleNamespace(model_max_length=256)) == 128
    assert default_max_new_tokens(task, SimpleNamespace(model_max_length=8192)) == DEFAULT_MAX_NEW_TOKENS
    assert default_max_new_tokens(task, SimpleNamespace(model_max_length=int(1e30))) == DEFAULT_MAX_NEW_TOKENS


@pytest.mark.parametrize("task", ["addition", "countdown"])
def test_a_response_budget_past_the_context_is_refused_for_generated_tasks_too(task, tmp_path, capsys):
    """A built-in task draws its prompts as it goes (no data set to measure), but no prompt fits in
    the context max_new_tokens leaves: refused before the warm start, naming the key, as for jsonl."""
    from creditrl.cli import main
    out = tmp_path / "new" / "runs"
    assert main(["train", "--no-progress", f"train.output_dir={out}", f"task.name={task}",
                 "rollout.max_new_tokens=1000", "model.tiny.max_position_embeddings=256"]) == 2
    assert not (tmp_path / "new").exists()            # refused: no empty output folders left behind
    err = capsys.readouterr().err
    assert "rollout.max_new_tokens: expected at most 255 (the model's context of 256 tokens less one" in err
    assert "got 1000" in err


@pytest.mark.parametrize("path", [5, 1.5, ["a.jsonl"], None])
def test_a_data_path_that_is_no_string_is_named(path):
    with pytest.raises(ValueError, match=r"path: expected the path of a local .jsonl/.json/.parquet file \(a string"):
        get_task("jsonl", path=path)


def test_a_json_array_file_reads_like_json_lines(tmp_path):
    task = get_task("jsonl", path=_jsonl(tmp_path, b'[{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 2}]',
                                         name="d.json"))
    assert sorted(p.answer for p in task.train_set() + task.test_set()) == ["1", "2"]


def test_prompts_longer_than_the_context_are_refused_or_truncated(tmp_path):
    from creditrl.runtime.models.tiny import char_tokenizer
    from creditrl.tasks.chat import check_prompt_lengths, render_task_prompts
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "9" * 40 + "+1=", "answer": "1"}] + \
        [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(8)]
    path = _jsonl(tmp_path, "".join(json.dumps(r) + "\n" for r in rows).encode())
    tok = char_tokenizer("0123456789+=")
    task = get_task("jsonl", path=path)
    with pytest.raises(ValueError, match=r"1 prompt\(s\) are longer than the 15 tokens .*context \(20\).*"
                                         r"truncate_prompts=true"):
        check_prompt_lengths(tok, task, context=20, max_new_tokens=5)
    assert check_prompt_lengths(tok, task, context=64, max_new_tokens=5) == 0
    with pytest.raises(ValueError, match=r"rollout.max_new_tokens: expected at most 19 \(the model's context of 20 "
                                         r"tokens less one for a prompt\), got 20"):
        check_prompt_lengths(tok, task, context=20, max_new_tokens=20)
    cut = get_task("jsonl", path=path, truncate_prompts=True)
    assert check_prompt_lengths(tok, cut, context=20, max_new_tokens=5) == 1
    (ids,) = render_task_prompts(tok, cut, ["9" * 40 + "+1="])
    assert len(ids) == 15 and tok.decode(ids).endswith("+1=")


# ----------------------------------------------------------------------------- library inputs

def _loss_inputs():
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 5, generator=g)).requires_grad_()
    return logp, logp.detach() - 0.01, torch.tensor([1.0, -1.0, 0.5]), torch.ones(3, 5)


@pytest.mark.parametrize("max_len", [-3, 0])
def test_policy_loss_rejects_a_bad_max_len(max_len):
    from creditrl import policy_loss
    logp, old, adv, mask = _loss_inputs()
    with pytest.raises(ValueError, match=rf"max_len: expected a value in \[1, inf\], got {max_len}"):
        policy_loss(logp, old, adv, mask, agg="seq-mean-token-sum-norm", max_len=max_len)


@pytest.mark.parametrize("estimator, options", [("grpo", {}), ("maxpo", {"k": 2, "normalize": "std"}),
                                                ("maxpo", {"k": 2}), ("pkpo", {"k": 2}),
                                                ("maxk_bon", {"k": 2}), ("passk_chen", {"k": 2})])
@pytest.mark.parametrize("eps, error", [(0.0, ValueError), (-0.577, ValueError), (float("nan"), ValueError),
                                        ("1e-6", ValueError)])
def test_estimators_reject_a_bad_eps(estimator, options, eps, error):
    from creditrl import compute_advantages
    with pytest.raises(error, match=rf"{estimator}.eps: expected"):
        compute_advantages(estimator, rewards=torch.ones(4), mask=torch.ones(4, 2), group=torch.zeros(4, dtype=torch.long),
                           eps=eps, **options)


@pytest.mark.parametrize("n, c, k, error, message", [
    (4, "x", 2, TypeError, "c: expected an int"), (4, 2, None, TypeError, "k: expected an int"),
    (4, 2, True, TypeError, "k: expected an int"), (float("nan"), 2, 2, ValueError, "n: expected whole numbers"),
    (float("inf"), 2, 2, ValueError, "n: expected whole numbers"), (4, 1.5, 2, ValueError, "c: expected whole"),
    (4, 5, 2, ValueError, "c: expected 0 <= c <= n"), (4, 2, 0, ValueError, "k: expected 1 <= k <= n")])
def test_pass_at_k_checks_its_counts(n, c, k, error, message):
    from creditrl import pass_at_k
    with pytest.raises(error, match=message):
        pass_at_k(n, c, k)


@pytest.mark.parametrize("call", ["gamma", "lam", "temperature", "clip_low", "kl_coef"])
def test_non_numeric_scalars_name_the_argument(call):
    from creditrl import TraceOptions, compute_advantages, policy_loss, token_stats
    logp, old, adv, mask = _loss_inputs()
    with pytest.raises(TypeError if call != "gamma" else ValueError,
                       match=rf"{call}: expected a real number, got str" if call != "gamma" else
                       r"reinforce.gamma: expected float, got '0.9' \(str\)"):
        if call == "gamma":
            compute_advantages("reinforce", rewards=torch.ones(2), mask=torch.ones(2, 2),
                               group=torch.zeros(2, dtype=torch.long), gamma="0.9")
        elif call == "lam":
            TraceOptions(lam="0.9")
        elif call == "temperature":
            token_stats(torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long), temperature="1")
        else:
            policy_loss(logp, old, adv, mask, **{call: "0.2"})


@pytest.mark.parametrize("value", [2, 0.5, -1])
def test_token_stats_follows_the_one_mask_rule(value):
    from creditrl import token_stats
    mask = torch.ones(2, 3)
    mask[1, 1] = value
    with pytest.raises(ValueError, match=r"mask: expected a bool or 0/1 mask.*rows \[1\]"):
        token_stats(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), mask)


def test_minus_inf_logits_are_a_legal_masked_vocabulary():
    from creditrl import token_stats
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 7, generator=g)
    banned = torch.zeros(2, 4, 7, dtype=torch.bool)
    banned[0, :, 5:] = True
    banned[1, 2, 0] = True
    tokens = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 1]])
    masked = logits.masked_fill(banned, float("-inf")).requires_grad_()
    stats = token_stats(masked, tokens)
    for name in ("logp", "entropy", "sum_p2", "energy"):
        assert torch.isfinite(getattr(stats, name)).all(), name
    # reference: the same distribution written the obvious way (the banned entries get probability 0)
    ref_logits = logits.masked_fill(banned, -1e4).double().requires_grad_()
    logq = torch.log_softmax(ref_logits, -1)
    q = logq.exp()
    ref_entropy = -(q * logq).sum(-1)
    ref_logp = logq.gather(-1, tokens[..., None]).squeeze(-1)
    # float32 sums over V = 7 of terms <= |z − m| + log V <= 8: (V + 8)·eps32 of that (test_token_stats)
    atol = sum_rtol(7 + 8) * 8
    torch.testing.assert_close(stats.entropy.double(), ref_entropy, atol=atol, rtol=0)
    torch.testing.assert_close(stats.logp.double(), ref_logp, atol=atol, rtol=0)
    torch.testing.assert_close(stats.sum_p2.double(), q.square().sum(-1), atol=atol, rtol=0)
    (stats.logp.sum() + stats.entropy.sum()).backward()
    (ref_logp.sum() + ref_entropy.sum()).backward()
    assert torch.isfinite(masked.grad).all() and bool((masked.grad[banned] == 0).all())
    torch.testing.assert_close(masked.grad.double(), ref_logits.grad, atol=atol, rtol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_plus_inf_logits_raise_naming_the_positions(bad):
    from creditrl import token_stats
    from creditrl.utils.validate import NonFiniteError
    logits = torch.zeros(2, 3, 5)
    logits[1, 2, 3] = bad
    with pytest.raises(NonFiniteError, match=r"logits: 1 valid position\(s\) have NaN or \+inf .*rows \[1\]"):
        token_stats(logits, torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_apply_trace_refuses_non_finite_values_naming_rows(bad):
    from creditrl import apply_trace
    values = torch.zeros(3, 6)
    values[2, 5] = bad
    with pytest.raises(ValueError, match=r"values: 1 row\(s\) contain NaN or inf, e.g. rows \[2\]"):
        apply_trace(values, torch.ones(3, 6), lam=0.9)
    mask = torch.ones(3, 6)
    mask[2, 5] = 0                                        # off-mask garbage is ignored
    assert torch.isfinite(apply_trace(values, mask, lam=0.9)).all()


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
def test_empty_batches_give_defined_results(shape):
    import creditrl
    from creditrl import apply_trace, compute_advantages, list_estimators, policy_loss, token_stats
    from creditrl.core.losses import spurious_token_mask
    b, t = shape
    mask, group = torch.ones(b, t), torch.zeros(b, dtype=torch.long)
    for name in list_estimators():
        options = {"k": 2} if name in ("maxpo", "ei", "pkpo", "passk_chen", "maxk_bon") else {}
        adv = compute_advantages(name, rewards=torch.ones(b), mask=mask, group=group, energy=torch.ones(b, t),
                                 **options)
        assert adv.shape == shape and adv.dtype == torch.float32
    for options in ({}, {"stapo": True, "entropy": torch.ones(b, t)}, {"trace": creditrl.TraceOptions(lam=0.9)},
                    {"agg": "seq-mean-token-mean"}):
        logp = torch.zeros(b, t, requires_grad=True)
        loss, metrics = policy_loss(logp, torch.zeros(b, t), torch.zeros(b), mask, **options)
        loss.backward()
        assert float(loss.detach()) == 0.0 and logp.grad.shape == shape and set(metrics.values()) == {0.0}
    assert apply_trace(torch.zeros(b, t), mask, lam=0.9).shape == shape
    assert spurious_token_mask(torch.zeros(b, t), torch.ones(b, t), torch.ones(b), mask).shape == shape
    assert token_stats(torch.zeros(b, t, 4), torch.zeros(b, t, dtype=torch.long), mask).logp.shape == shape
    with pytest.raises(ValueError, match="advantages"):            # still validated when empty
        policy_loss(torch.zeros(b, t), torch.zeros(b, t), torch.zeros(b + 1), mask)


@pytest.mark.parametrize("logp_dtype, other_dtype", [(torch.float32, torch.float64), (torch.float64, torch.float32),
                                                     (torch.bfloat16, torch.float64)])
def test_mixed_float_dtypes_are_computed_in_the_wider_precision(logp_dtype, other_dtype):
    import creditrl
    from creditrl import policy_loss
    g = torch.Generator().manual_seed(0)
    base = -torch.rand(3, 6, generator=g, dtype=torch.float64)
    options = dict(rollout_logp=base - 0.02, rollout_correction="tis", ref_logp=base - 0.01, kl_coef=0.1,
                   trace=creditrl.TraceOptions(lam=0.9))
    logp = base.to(logp_dtype).requires_grad_()
    loss, _ = policy_loss(logp, (base - 0.05).to(other_dtype), torch.tensor([1.0, -0.5, 2.0], dtype=other_dtype),
                          torch.ones(3, 6), **{k: v.to(other_dtype) if isinstance(v, torch.Tensor) else v
                                                for k, v in options.items()})
    loss.backward()
    ref_logp = base.to(logp_dtype).double().requires_grad_()     # the same inputs, all float64
    ref, _ = policy_loss(ref_logp, base - 0.05, torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64),
                         torch.ones(3, 6), **options)
    ref.backward()
    assert logp.grad.dtype == logp_dtype
    # Both run in float64; the inputs of other_dtype float32 were rounded to it first: each log-prob (<= 1.05 in
    # magnitude) moves by eps32/2, a ratio or KL term (<= ~1.1) by as much, times |A| <= 2, in a few places:
    # 8·eps32·2 on the loss and on each gradient entry. A bf16 gradient is rounded to bf16 on top (relative).
    atol = 8 * EPS32 * 2
    torch.testing.assert_close(loss.detach().double(), ref.detach(), rtol=0, atol=atol)
    rtol = torch.finfo(torch.bfloat16).eps if logp_dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(logp.grad.double(), ref_logp.grad, rtol=rtol, atol=atol)


def test_estimator_options_are_declared_once_and_agree_everywhere():
    from creditrl import compute_advantages, register_estimator
    from creditrl.core.estimators.registry import _REGISTRY, get_estimator

    @register_estimator("scaled_test_only")
    def scaled(batch, scale=2.0, *, shift):            # positional-or-keyword and keyword-only options
        return (batch.rewards - shift) * scale

    try:
        assert get_estimator("scaled_test_only").options == {"scale": 2.0,
                                                             "shift": __import__("inspect").Parameter.empty}
        common = dict(rewards=torch.ones(2), mask=torch.ones(2, 3), group=torch.arange(2))
        assert compute_advantages("scaled_test_only", scale=3.0, shift=0.5, **common)[0, 0] == 1.5
        with pytest.raises(ValueError, match=r"scaled_test_only.shift: required"):
            compute_advantages("scaled_test_only", **common)
        with pytest.raises(ValueError, match=r"unknown option\(s\) \['k'\]; valid options are \['scale', 'shift'\]"):
            compute_advantages("scaled_test_only", shift=0.0, k=2, **common)
        with pytest.raises(ConfigError, match=r"algorithm.options: unknown option\(s\) \['k'\]; "
                                              r"valid options are \['scale', 'shift'\]"):
            resolve_config(load_config(None, ["algorithm.estimator=scaled_test_only", "algorithm.options.k=2"]))
    finally:
        _REGISTRY.pop("scaled_test_only", None)


# ============================================================================= second layer (issue 22)

def _tiny_policy(seed=0, lora=None):
    from creditrl.config import LoraSettings
    from creditrl.runtime.models import _with_adapters
    from creditrl.runtime.models.tiny import TinyModelConfig, char_tokenizer, tiny_model
    task = get_task("addition", digits=1)
    tok = char_tokenizer(task.alphabet())
    model = tiny_model(tok, TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64), seed=seed)
    if lora:
        model = _with_adapters(model, None, LoraSettings(r=4, target_modules=["q_proj", "v_proj", "o_proj"]))
    return task, tok, model


def _spread_batch(task, tok, model, seed=0):
    """A real rollout batch with mixed rewards (an untrained model earns 0 everywhere)."""
    import random as pyrandom
    from creditrl.runtime.rollout import generate_rollouts
    problems = [task.sample(pyrandom.Random(seed + i)) for i in range(2)]
    batch = generate_rollouts(model, tok, task, problems, group_size=4, max_new_tokens=4,
                              generator=torch.Generator().manual_seed(seed))
    batch.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    batch.correct = batch.rewards >= 1
    return batch


# ----------------------------------------------------------------------------- mixed precision

@pytest.mark.parametrize("precision, lora", [("fp32", False), ("bf16", False), ("fp32", True), ("bf16", True),
                                             pytest.param("fp16", False, marks=pytest.mark.cuda),
                                             pytest.param("fp16", True, marks=pytest.mark.cuda)])
def test_every_trainable_tensor_moves_at_a_tiny_lr_in_every_precision(precision, lora):
    """At lr 1e-6 a bf16 weight would round every AdamW step away; float32 master weights under
    autocast keep each one: after 3 applied steps every trainable tensor has changed (LoRA's B starts
    at 0, so A moves from the second step on). fp16's loss scaler starts at 2^16 and skips a step
    whose gradients overflow, halving its scale (seen on an H200 with LoRA): only it may skip, and
    the skip is counted."""
    from creditrl.trainer.loop import precision_notes
    from creditrl.trainer.update import Learner
    task, tok, model = _tiny_policy(lora=lora)
    device = "cuda" if precision == "fp16" else "cpu"
    model = model.to(device)
    cfg = load_config(None, ["rollout.group_size=4", "rollout.prompts_per_step=2", "rollout.max_new_tokens=4",
                             "algorithm.estimator=grpo", "optim.lr=1e-6", f"train.precision={precision}",
                             f"train.device={device}"] + (["model.lora.enabled=true"] if lora else []))
    cfg = resolve_config(cfg)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert all(p.dtype == torch.float32 for p in trainable.values()) and not precision_notes(model, cfg)
    before = {n: p.detach().clone() for n, p in trainable.items()}
    learner = Learner(model, cfg)
    applied = 0
    for step in range(3 + (16 if precision == "fp16" else 0)):    # 16 halvings take 2^16 to 1
        scale = learner.scaler.get_scale() if learner.scaler is not None else None
        metrics = learner.update(_spread_batch(task, tok, model, seed=step), torch.Generator().manual_seed(step)).metrics
        assert metrics["skipped_updates"] == 0 or precision == "fp16", metrics["skipped_updates"]
        if metrics["skipped_updates"]:          # the scaler's own overflow backoff, nothing else
            assert learner.scaler.get_scale() < scale, (scale, learner.scaler.get_scale())
        applied += metrics["skipped_updates"] == 0
        if applied == 3:
            break
    assert applied == 3, f"{step + 1 - applied} of {step + 1} fp16 steps skipped"
    frozen = [n for n, p in trainable.items() if torch.equal(p.detach(), before[n])]
    assert not frozen, f"{len(frozen)} of {len(trainable)} trainable tensors never changed: {frozen[:5]}"


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("setting, moves", [("optim.lr=1e-30", False), ("optim.max_grad_norm=1e-30", False),
                                            ("optim.lr=1e-8", True), ("optim.lr=5e-5", True)])
def test_whether_an_update_moved_the_policy_is_measured_against_every_weight(setting, moves, lora):
    """AdamW moves a weight by about lr, and by lr·g/eps where the clipped gradient's elements g are below
    eps. At lr 1e-30, or with the gradient clipped to norm 1e-30, no weight of the model changes beyond
    2^-24 of the larger of its size and the model's RMS weight (computed here over every trainable
    weight), and the sample's moved_frac is 0, LoRA's B (starting at 0) included; at lr 1e-8 (a warmup's
    first steps; the sample holds norm weights near 1 beside matrices near 0.02) and at the default,
    weights move and moved_frac is positive. update_ratio estimates the full ||Δθ||/||θ||."""
    from creditrl.trainer.update import RESOLUTION, Learner
    base = ["rollout.group_size=4", "rollout.prompts_per_step=2", "rollout.max_new_tokens=4",
            "algorithm.estimator=grpo"] + (["model.lora.enabled=true"] if lora else [])
    task, tok, model = _tiny_policy(lora=lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    before = torch.cat([p.detach().double().flatten() for p in trainable])
    learner = Learner(model, resolve_config(load_config(None, base + [setting])))
    metrics = learner.update(_spread_batch(task, tok, model), torch.Generator().manual_seed(0)).metrics
    delta = torch.cat([p.detach().double().flatten() for p in trainable]) - before
    rms = before.square().mean().sqrt()
    moved = delta.abs() > RESOLUTION * torch.maximum(before.abs(), rms)
    assert metrics["grad_norm"] > 0, metrics["grad_norm"]
    assert (bool(moved.any()), metrics["moved_frac"] > 0) == (moves, moves), (setting, moved.double().mean(),
                                                                            metrics["moved_frac"])
    full = float(delta.norm() / before.norm())
    if moves and not lora:      # the sample's estimate of the full ratio, within its sampling error
        assert full / 4 < metrics["update_ratio"] < 4 * full, (full, metrics["update_ratio"])


def test_the_weight_sample_strides_stay_inside_tensors_past_float32s_integers():
    """An embedding of 2^24 + 3 elements: positions past 2^24 are integers float32 cannot hold (a float32
    linspace indexed one past the end); each tensor gives min(numel, 64) distinct in-bounds positions,
    its first and last element included."""
    from creditrl.trainer.update import WeightSample
    params = [torch.ones(2**24 + 3, dtype=torch.uint8), torch.ones(1), torch.ones(3, 5), torch.ones(65)]
    sample = WeightSample(params)
    for p, index in zip(params, sample.index):
        assert index.numel() == min(p.numel(), 64) == index.unique().numel()
        assert int(index[0]) == 0 and int(index[-1]) == p.numel() - 1
    assert sample.read().shape == (64 + 1 + 15 + 64,)
    assert sample.update(sample.read()) == {"update_ratio": 0.0, "moved_frac": 0.0}


def test_the_weight_samples_ratio_and_share_weigh_each_tensor_by_its_size():
    """A 64-element sample of a 6,400-element matrix stands for 100 times what a 64-element norm weight
    does: moving only the norm weights (1% of the model) gives moved_frac 0.01, and the ratio of the
    whole model, not of the sample."""
    from creditrl.trainer.update import WeightSample
    matrix, norm = torch.full((80, 80), 0.02), torch.ones(64)
    sample = WeightSample([matrix, norm])
    before = sample.read()
    norm += 1e-3
    got = sample.update(before)
    assert got["moved_frac"] == pytest.approx(64 / (6400 + 64), rel=1e-12)
    step, small = float(norm[0]) - 1.0, float(matrix[0, 0])         # the float32 values, exactly
    full = (64 * step**2) ** 0.5 / (6400 * small**2 + 64) ** 0.5
    assert got["update_ratio"] == pytest.approx(full, rel=1e-12)


def _signal_step(step: int, grad_norm: float, moved_frac: float, **extra) -> dict:
    """A step's metrics with a reward signal (groups whose rewards differ) and an applied update."""
    return {"step": step, "zero_spread_frac": 0.5, "reward_std": 0.4, "kept_frac": 1.0, "skipped_updates": 0,
            "lr": 5e-5, "grad_norm": grad_norm, "moved_frac": moved_frac, "update_ratio": moved_frac * 1e-4,
            **extra}


def test_idle_updates_are_told_apart_from_steps_without_signal_or_update():
    from creditrl.trainer.report import idle_update
    assert idle_update(_signal_step(1, 0.0, 0.0)) == "zero_gradient"
    assert idle_update(_signal_step(1, 0.0, 0.5)) == "zero_gradient"      # momentum or weight decay moved them
    assert idle_update(_signal_step(1, 2.0, 0.0)) == "unmoved"
    assert idle_update(_signal_step(1, 2.0, 1e-6)) is None
    assert idle_update(_signal_step(1, 2.0, 0.0, skipped_updates=1)) is None          # the skip warnings say why
    assert idle_update(_signal_step(1, 2.0, 0.0, zero_spread_frac=1.0, reward_std=0.0)) is None   # no signal
    assert idle_update({k: v for k, v in _signal_step(1, 0.0, 0.0).items() if k != "moved_frac"}) is None


def test_a_run_whose_updates_never_taught_the_policy_ends_with_a_warning_naming_why():
    from creditrl.config import OptimConfig
    from creditrl.trainer.report import rewards_taught_nothing
    optim = OptimConfig(lr=1e-30)
    flat = {"zero_spread_frac": 1.0, "reward_std": 0.0}
    tiny = [_signal_step(1, 2.0, 0.0), _signal_step(2, 1.5, 0.0, update_ratio=1e-29), _signal_step(3, 1.0, 0.0, **flat)]
    warning = rewards_taught_nothing(tiny, optim)
    assert warning.startswith("this run learned nothing from its rewards. At every one of the 2 steps")
    assert "grad_norm up to 2" in warning and "optim.lr=1e-30" in warning and "update_ratio at most 1e-29" in warning
    mixed = rewards_taught_nothing([_signal_step(1, 0.0, 0.5, high_entropy_frac=0.01), _signal_step(2, 1.0, 0.0)],
                                   optim)
    assert "exactly 0" in mixed and "loss.top_entropy kept 1.00%" in mixed and "; at the others, the gradient" in mixed
    assert "grad_norm up to 1)" in mixed                        # the unmoved kind's own steps' numbers
    assert rewards_taught_nothing([*tiny, _signal_step(4, 1.0, 1e-3)], optim) is None          # one step moved it
    assert rewards_taught_nothing([_signal_step(1, 1.0, 0.0, **flat)], optim) is None          # learned_nothing's case


def test_the_idle_update_streak_warns_once_and_steps_without_signal_neither_break_nor_extend_it():
    from creditrl.config import Config
    from creditrl.trainer.loop import Trainer
    from creditrl.trainer.report import NO_SIGNAL_STEPS
    trainer = types.SimpleNamespace(no_signal_steps=[], idle_steps=[], cfg=Config())
    warn = lambda m: Trainer.streak_warnings(trainer, m)[1]     # noqa: E731
    flat = _signal_step(0, 0.0, 0.0, zero_spread_frac=1.0, reward_std=0.0)
    said = [warn(_signal_step(i, 0.0, 0.3)) for i in range(1, NO_SIGNAL_STEPS)] + [warn(flat)]
    said += [warn(_signal_step(NO_SIGNAL_STEPS, 1e-12, 0.0, update_ratio=1e-9)),
             warn(_signal_step(NO_SIGNAL_STEPS + 1, 1.0, 0.0))]
    assert said[:-2] == [None] * NO_SIGNAL_STEPS and said[-1] is None
    assert said[-2].startswith(f"warning: {NO_SIGNAL_STEPS} steps in a row with a reward signal taught the policy "
                               f"nothing (step {NO_SIGNAL_STEPS})"), said[-2]
    # each kind's reason from its own steps: the zero-gradient steps' moved weights are not the unmoved one's
    assert "exactly 0" in said[-2] and "update_ratio at most 1e-09" in said[-2]
    warn(_signal_step(9, 1.0, 1e-3))
    assert trainer.idle_steps == []


def test_a_tiny_learning_rate_ends_the_run_with_the_warning(tmp_path, capfd):
    """Whatever rewards the two steps drew: with a signal at some step the run says it learned nothing
    from its rewards, naming the idle updates; with none, that it learned nothing from its task."""
    run = _finished_run(tmp_path, "optim.lr=1e-30")
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(m["moved_frac"] == 0 and m["update_ratio"] == 0 for m in metrics), metrics
    warning = json.loads((run / "summary.json").read_text())["warning"]
    from creditrl.trainer.report import no_signal
    expected = ("learned nothing from its task" if all(no_signal(m) for m in metrics) else
                "no sampled weight changed by more than half a float32 ulp")
    assert expected in warning and expected in capfd.readouterr().err


def test_low_precision_trainable_weights_get_a_warning_that_names_the_effect():
    from creditrl.trainer.loop import precision_notes
    _, _, model = _tiny_policy()
    model = model.to(torch.bfloat16)
    (note,) = precision_notes(model, load_config(None, ["model.dtype=bfloat16", "optim.lr=1e-6"]))
    assert "stored in torch.bfloat16" in note and "rounded away" in note and "train.precision=bf16" in note


def _weight_bytes(*modules) -> int:
    """Bytes of the distinct storages behind the modules' parameters and buffers."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for m in modules for t in [*m.parameters(), *m.buffers()]}
    return sum(storages.values())


def _modules(obj) -> list:
    return [v for v in vars(obj).values() if isinstance(v, torch.nn.Module)]


def test_lora_kl_reference_is_the_base_model_with_adapters_off_and_no_copy():
    """LoRA + KL: the reference log-probs are the base model's (adapters disabled); the learner
    holds the weights once (a full-model KL run holds them twice), and reading the reference
    allocates less than one model."""
    from creditrl.recipe.build import policy_loss_from_config
    from creditrl.trainer.loop import reference_model
    from creditrl.runtime.precision import Precision
    from creditrl.trainer.update import Batch, Learner, statistics_no_grad
    from creditrl.utils.memory import PeakMemory
    task, tok, model = _tiny_policy(lora=True)
    _, _, base = _tiny_policy()                                     # the same weights without adapters
    cfg = resolve_config(load_config(None, ["rollout.group_size=4", "rollout.prompts_per_step=2",
                                            "rollout.max_new_tokens=4", "algorithm.estimator=grpo", "optim.lr=1e-2",
                                            "loss.kl_coef=0.1", "model.lora.enabled=true"]))
    model_bytes = _weight_bytes(model)
    loss = policy_loss_from_config(cfg)
    learner = Learner(model, cfg, loss, ref_model=reference_model(model, cfg, loss, Precision()))
    assert learner.ref_model is None and _weight_bytes(*_modules(learner)) == model_bytes
    full_cfg = resolve_config(load_config(None, ["loss.kl_coef=0.1", "rollout.group_size=4"]))
    full_loss = policy_loss_from_config(full_cfg)
    full = Learner(base, full_cfg, full_loss, ref_model=reference_model(base, full_cfg, full_loss, Precision()))  # a copy
    assert _weight_bytes(*_modules(full)) >= 2 * _weight_bytes(base) - 1
    for step in range(2):                                           # the adapters move away from the base
        learner.update(_spread_batch(task, tok, model, seed=step), torch.Generator().manual_seed(step))
    batch = Batch.from_rollout(_spread_batch(task, tok, model, seed=5), torch.device("cpu"))
    with PeakMemory() as reading:
        ref = learner.reference_logp(batch)
    assert reading.peak < model_bytes
    torch.testing.assert_close(ref, statistics_no_grad(base, batch, cfg, Precision()).logp)
    assert not torch.allclose(ref, statistics_no_grad(model, batch, cfg, Precision()).logp)   # the policy itself differs


# ----------------------------------------------------------------------------- resume never lies

def _finished_run(tmp_path, *extra, name="r", steps=2):
    from creditrl.trainer import train
    cfg = load_config(None, TINY + [f"model.cache_dir={tmp_path / 'cache'}", f"train.output_dir={tmp_path}",
                                    f"train.run_name={name}", f"train.steps={steps}", *extra])
    return train(cfg, progress=False)


def test_a_runs_weights_are_as_readable_as_its_other_files(tmp_path):
    """final/ and each checkpoint: every file has the mode a plain open gives under the umask (the
    safetensors weights were written 0600, unreadable by the other users of a shared run directory)."""
    import stat
    run = _finished_run(tmp_path)
    mask = os.umask(0)
    os.umask(mask)
    files = [f for folder in [run / "final", *(run / "checkpoints").iterdir()] for f in folder.iterdir()]
    assert any(f.suffix == ".safetensors" for f in files)
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in files} == {f.name: 0o666 & ~mask for f in files}


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077, 0o002])
def test_atomic_directory_modes_follow_the_umask_without_setting_it(tmp_path, monkeypatch, umask):
    """A completed directory and its files have the modes a plain mkdir / open give under the
    umask (mkdtemp's 0700 and safetensors' 0600 are not kept), read from a probe file: the umask
    is process-wide, so setting it to read it would race with other threads' file creation."""
    import stat
    from creditrl.utils.io import atomic_directory
    old = os.umask(umask)
    try:
        plain = tmp_path / "plain"
        plain.mkdir()
        (plain / "f").write_text("x")
        want_dir, want_file = (stat.S_IMODE(p.stat().st_mode) for p in (plain, plain / "f"))
        monkeypatch.setattr(os, "umask", lambda *a: pytest.fail("os.umask was called"))
        with atomic_directory(tmp_path / "out") as tmp:
            (tmp / "weights").write_text("w")
            os.chmod(tmp / "weights", 0o600)
        monkeypatch.undo()
    finally:
        os.umask(old)
    out = tmp_path / "out"
    assert stat.S_IMODE(out.stat().st_mode) == want_dir == 0o777 & ~umask
    assert stat.S_IMODE((out / "weights").stat().st_mode) == want_file == 0o666 & ~umask
    assert [p.name for p in out.iterdir()] == ["weights"]             # no probe file left behind


def test_a_checkpoint_carries_the_loss_scale_the_warning_streaks_and_the_diagnosis(tmp_path):
    """fp16's GradScaler state (its backed-off scale and growth tracker), the streak counters behind
    the skipped-step stop and the no-signal warning, and the in-training diagnosis window come back
    on resume: restarted at 2^16, 0 and empty, a resumed run would skip updates the run did not make,
    stop later than it would have, and log other diagnose/* numbers."""
    from creditrl.trainer import checkpoint as ckpt
    from creditrl.trainer.loop import Trainer
    cfg = load_config(None, TINY + [f"model.cache_dir={tmp_path / 'cache'}", f"train.output_dir={tmp_path}",
                                    "train.run_name=r", "train.steps=1", "logging.diagnose_every=1"])
    trainer = Trainer(cfg, tmp_path / "r", progress=False)
    window = trainer.diagnosis.window
    for seed in range(3):         # the in-training diagnosis window goes on from where it was
        window.add(torch.randn(4, len(window.names), trainer.diagnosis.space.dim,
                               generator=torch.Generator().manual_seed(seed)))
    trainer.learner.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)     # what fp16 on CUDA builds
    trainer.learner.scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    trainer.skipped_streak, trainer.clipped_streak, trainer.no_signal_steps = 2, 1, [{"step": 1}]
    trainer.idle_steps = [{"step": 2}]
    trainer.save()
    resumed = Trainer(cfg, tmp_path / "r", progress=False)
    resumed.learner.scaler = torch.amp.GradScaler("cpu")
    resumed.load_state(*ckpt.load_latest(tmp_path / "r"))
    assert resumed.learner.scaler.get_scale() == 1024.0
    assert (resumed.skipped_streak, resumed.clipped_streak, resumed.no_signal_steps) == (2, 1, [{"step": 1}])
    assert resumed.idle_steps == [{"step": 2}]
    assert resumed.diagnosis.metrics() == trainer.diagnosis.metrics() and len(resumed.diagnosis.window.steps) == 3
    other = Trainer(load_config(None, TINY + [f"model.cache_dir={tmp_path / 'cache'}", f"train.output_dir={tmp_path}",
                                              "train.run_name=r", "logging.diagnose_every=1",
                                              "logging.diagnose_estimators=[grpo]"]), tmp_path / "r", progress=False)
    other.load_state(*ckpt.load_latest(tmp_path / "r"))          # other rows: the window starts empty, said
    assert not other.diagnosis.window.steps and any("diagnosis window starts empty" in n for n in other.notes)


@pytest.mark.parametrize("steps", [1, 3, 12])
def test_the_summarys_recent_train_reward_says_how_many_steps_it_averages(tmp_path, steps):
    from creditrl.trainer.report import write_summary
    metrics = [{"step": i + 1, "tokens_total": 10 * (i + 1), "reward_mean": float(i)} for i in range(steps)]
    summary = write_summary(tmp_path, title="t", metrics=metrics, evals=[], wall_time=1.0)
    tail = [m["reward_mean"] for m in metrics][-10:]
    assert summary["train_reward_last10_steps"] == len(tail) == min(steps, 10)
    assert summary["train_reward_last10"] == pytest.approx(sum(tail) / len(tail), rel=EPS32)


def test_a_set_precision_is_in_the_summary_too(tmp_path):
    """An explicit train.precision is recorded in the summary beside the config (only auto's choice was)."""
    run = _finished_run(tmp_path, "train.precision=fp32")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["precision"] == "fp32, as train.precision set it (not timed)"
    assert "- precision: fp32, as train.precision set it" in (run / "summary.md").read_text()


def _edit(run, **changes):
    """Set dotted keys of run/config.yaml (a None value deletes the key)."""
    import yaml
    data = yaml.safe_load((run / "config.yaml").read_text())
    for key, value in changes.items():
        *parents, last = key.replace("__", ".").split(".")
        node = data
        for part in parents:
            node = node[part]
        if value is None:
            del node[last]
        else:
            node[last] = value
    (run / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def test_resume_applies_a_changed_lr_and_records_it(tmp_path):
    from creditrl.trainer import resume
    from creditrl.trainer.loop import Trainer
    run = _finished_run(tmp_path, "optim.lr=1e-4", "optim.schedule=cosine", "optim.weight_decay=0.0")
    _edit(run, optim__lr=3e-4, train__steps=4, optim__weight_decay=0.01)
    trainer = Trainer.resume(run, progress=False)
    opt, sched = trainer.learner.optimizer, trainer.learner.scheduler
    factor = __import__("creditrl.trainer.update", fromlist=["lr_lambda"]).lr_lambda(trainer.cfg)(2)
    assert sched.base_lrs == [3e-4] and opt.param_groups[0]["lr"] == pytest.approx(3e-4 * factor)
    assert opt.param_groups[0]["weight_decay"] == 0.01 and trainer.step == 2
    (run / ".lock").unlink(missing_ok=True)
    resume(run, progress=False)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert metrics[1]["lr"] < 1e-4 < metrics[2]["lr"]                       # the new rate from step 3 on
    records = [json.loads(line) for line in (run / "resumes.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 2 and records[-1]["changes"]["optim.lr"] == [1e-4, 3e-4]
    assert "resumed at step 2 with config changes optim.lr 0.0001 -> 0.0003" in (run / "summary.md").read_text()
    assert load_saved_config(run / "config.yaml").optim.lr == 3e-4       # true from step 3 on, and recorded


@pytest.mark.parametrize("key, value", [("model__lora__r", 4), ("rollout__group_size", 4),
                                        ("algorithm__estimator", "rloo"), ("train__seed", 7), ("loss__kl_coef", 0.1),
                                        ("model__name", "builtin:smollm2-135m"), ("train__precision", "bf16"),
                                        ("task__options__digits", 2), ("rollout__max_new_tokens", 9),
                                        ("algorithm__options__eps", 0.01)])
def test_resume_refuses_a_key_that_cannot_change_mid_run_by_name(tmp_path, key, value):
    from creditrl.trainer import resume
    run = _finished_run(tmp_path)
    _edit(run, **{key: value}, **({"algorithm__options": {}} if key == "algorithm__estimator" else {}))
    text = (run / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=rf"cannot change in the middle of a run \(.*{key.replace('__', '.')}: .*"
                                          r"a resumed run may change only optim.lr"):
        resume(run, progress=False)
    assert (run / "config.yaml").read_text() == text and not (run / "resumes.jsonl").exists()


def test_a_bad_value_in_a_resumed_config_names_the_file(tmp_path):
    from creditrl.trainer import resume
    run = _finished_run(tmp_path)
    _edit(run, optim__lr="abc", train__steps=3)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(run / 'config.yaml'))}: optim.lr: expected float, got 'abc'"):
        resume(run, progress=False)


def test_resume_names_an_edited_estimator_whose_options_no_longer_resolve(tmp_path):
    """Only `estimator:` edited (grpo -> rloo), grpo's options left beside it: the refusal names the
    edited key, as for any key that cannot change mid-run, not rloo's unknown options."""
    from creditrl.trainer import resume
    run = _finished_run(tmp_path)
    _edit(run, algorithm__estimator="rloo")
    with pytest.raises(ConfigError, match=r"cannot change in the middle of a run \(algorithm.estimator: 'grpo' -> 'rloo'\)"):
        resume(run, progress=False)


def test_resume_follows_a_moved_run_and_refuses_an_edit_that_would_move_it(tmp_path):
    """A run resumes in its directory: config.yaml naming where the run was trained (a moved
    directory) or where it is now is followed and recorded; naming a third place is refused before
    anything changes (before, the edit was silently reverted)."""
    from creditrl.trainer import resume
    run = _finished_run(tmp_path)
    _edit(run, train__output_dir=str(tmp_path / "elsewhere"), train__steps=3)
    text = (run / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"config.yaml: train.output_dir '.*elsewhere' / train.run_name 'r' name "
                                          r".*a resumed run continues in its own directory.*otherwise restore "
                                          rf"train.output_dir '{tmp_path}' and train.run_name 'r'"):
        resume(run, progress=False)
    assert (run / "config.yaml").read_text() == text and not (run / "resumes.jsonl").exists()
    _edit(run, train__output_dir=str(tmp_path))
    moved = tmp_path / "moved" / "r2"
    shutil.move(run, moved)
    resume(moved, progress=False)
    record = json.loads((moved / "resumes.jsonl").read_text().splitlines()[-1])
    assert record["changes"]["train.output_dir"] == [str(tmp_path), str(moved.parent)]
    assert record["changes"]["train.run_name"] == ["r", "r2"]
    saved = load_saved_config(moved / "config.yaml").train
    assert (saved.output_dir, saved.run_name) == (str(moved.parent), "r2")


def test_a_copy_resumed_by_a_relative_path_records_only_its_new_name(tmp_path, monkeypatch):
    """A copy beside the original, resumed as ``runs/copy`` from its parent's folder: the record and
    config.yaml change train.run_name only (the output_dir is the same place; recording
    '/abs/runs' -> 'runs' said a move that did not happen), and a later resume from another working
    directory records nothing."""
    import shutil
    from creditrl.trainer import resume
    runs = tmp_path / "runs"
    run = _finished_run(runs)
    copy = runs / "copy"
    shutil.copytree(run, copy)
    _edit(copy, train__steps=3)
    monkeypatch.chdir(tmp_path)
    resume(Path("runs") / "copy", progress=False)
    record = json.loads((copy / "resumes.jsonl").read_text().splitlines()[-1])
    assert record["changes"] == {"train.run_name": ["r", "copy"], "train.steps": [2, 3]}
    saved = load_saved_config(copy / "config.yaml").train
    assert (saved.output_dir, saved.run_name) == (str(runs), "copy")
    _edit(copy, train__steps=4)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    resume(copy, progress=False)
    assert json.loads((copy / "resumes.jsonl").read_text().splitlines()[-1])["changes"] == {"train.steps": [3, 4]}


def test_resume_refuses_fewer_steps_than_done_and_an_incomplete_config(tmp_path):
    from creditrl.trainer import resume
    run = _finished_run(tmp_path)
    _edit(run, train__steps=1)
    with pytest.raises(ConfigError, match=r"train.steps: the run has already trained 2 steps; expected a value >= 2"):
        resume(run, progress=False)
    _edit(run, train__steps=2, loss__clip_high=None)
    with pytest.raises(ConfigError, match=r"incomplete saved config \(missing loss.clip_high\).*not filled in"):
        resume(run, progress=False)
    _edit(run, loss__clip_high=0.28, optim__lr=None)
    with pytest.raises(ConfigError, match=r"incomplete saved config \(missing optim.lr\)"):
        resume(run, progress=False)


def test_resuming_a_finished_run_says_so_and_changes_nothing(tmp_path, capsys):
    from creditrl.trainer.command import main
    run = _finished_run(tmp_path)
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"}
    capsys.readouterr()
    assert main(["--resume", str(run)]) != 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "already finished (2/2 steps, final/ complete); nothing to resume" in err
    assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"} == before
    assert not (run / "resumes.jsonl").exists()


def test_resume_without_a_checkpoint_starts_again_and_says_so(tmp_path):
    from creditrl.trainer import resume
    run = _finished_run(tmp_path, "train.save_every=0")
    _edit(run, model__tiny__hidden_size=64, train__steps=1)             # nothing trained is kept: any edit goes
    for name in ("summary.json", "final"):                              # as a run killed before its end
        shutil.rmtree(run / name) if (run / name).is_dir() else (run / name).unlink()
    resume(run, progress=False)
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    assert [json.loads(x)["step"] for x in (run / "eval.jsonl").read_text().splitlines()] == [0, 1]
    assert "restarted from step 0 with config.yaml as it is now (changes not compared" in (run / "summary.md").read_text()
    assert json.loads((run / "resumes.jsonl").read_text().splitlines()[-1])["changes"] is None


def test_resuming_a_finished_run_without_a_checkpoint_is_refused(tmp_path, capsys):
    """A run that finished with train.save_every=0 (the SmolLM2 preset) has final/ and no checkpoint:
    --resume would train it again from step 0 and replace final/, so it is refused, nothing changed,
    pointing to a new run from final/ (which then trains); a damaged final/ is a run to finish again."""
    from creditrl.trainer.command import main
    run = _finished_run(tmp_path, "train.save_every=0")
    _edit(run, train__steps=3)
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"}
    capsys.readouterr()
    assert main(["--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "finished (final/ complete) and kept no checkpoint" in err
    assert f"model.name={run / 'final'}" in err and "--overwrite" in err
    assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"} == before
    cfg = load_config(None, TINY + [f"model.cache_dir={tmp_path / 'cache'}", f"train.output_dir={tmp_path}",
                                    "train.run_name=next", "train.steps=1", f"model.name={run / 'final'}"])
    from creditrl.trainer import train
    assert (train(cfg, progress=False) / "final").is_dir()


def test_resume_changes_are_computed_on_resolved_configs():
    from creditrl.config import config_to_dict, resume_changes
    before = config_to_dict(resolve_config(load_config(None, [])))
    after = config_to_dict(resolve_config(load_config(None, ["optim.lr=1e-3", "logging.plots=false"])))
    assert resume_changes(before, after, 5) == {"logging.plots": [True, False], "optim.lr": [5e-05, 1e-3]}
    assert resume_changes(before, before, 5) == {}
    changed = config_to_dict(resolve_config(load_config(None, ["algorithm.options.gamma=0.9"])))
    with pytest.raises(ConfigError, match=r"algorithm.options.gamma: 1.0 -> 0.9"):
        resume_changes(before, changed, 5)


# ----------------------------------------------------------------------------- final/ and model directories

def test_final_is_written_atomically_with_a_manifest(tmp_path, monkeypatch):
    from creditrl.trainer.loop import Trainer, final_problem
    from creditrl.utils.io import manifest_problem
    run = _finished_run(tmp_path)
    final = run / "final"
    assert manifest_problem(final) is None and final_problem(final) is None
    listed = json.loads((final / "manifest.json").read_text())["files"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(listed)
    before = {p.name: p.read_bytes() for p in final.iterdir()}
    _edit(run, train__steps=3)                 # a finished run is not resumed: one more step to go
    trainer = Trainer.resume(run, progress=False)

    def killed(*a, **k):
        raise KeyboardInterrupt        # a kill in the middle of the save
    monkeypatch.setattr(trainer.tokenizer, "save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        trainer.save_final()
    assert {p.name: p.read_bytes() for p in final.iterdir()} == before      # the old final/ is untouched
    assert not list(run.glob(".tmp-final-*"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("finished")
    return _finished_run(root), _finished_run(root, "model.lora.enabled=true", "model.lora.r=4", name="lora")


def _damaged(tmp_path, source, damage):
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    damage(copy)
    return copy


def _cut(path):
    path.write_bytes(path.read_bytes()[:100])


@pytest.mark.parametrize("what, damage, message", [
    ("full", lambda d: _cut(d / "final" / "model.safetensors"), r"model.safetensors has 100 bytes, the manifest says"),
    ("full", lambda d: (d / "final" / "tokenizer.json").unlink(), r"tokenizer.json missing"),
    ("full", lambda d: (d / "final" / "config.json").write_text((d / "final" / "config.json").read_text().replace(
        '"hidden_size": 32', '"hidden_size": 64')), r"is damaged: config.json does not match its SHA-256"),
    ("lora", lambda d: (d / "final" / "adapter_model.safetensors").unlink(), r"adapter_model.safetensors missing"),
    ("full", lambda d: __import__("shutil").rmtree(d / "final"), r"final' not found: the run has not finished"),
])
def test_eval_tells_a_damaged_final_from_a_complete_one(finished, tmp_path, capsys, what, damage, message):
    from creditrl.cli import main
    run = _damaged(tmp_path, finished[0] if what == "full" else finished[1], damage)
    assert main(["eval", "--no-progress", str(run)]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err and "Repo id" not in err, err


def _no_manifest(d):
    (d / "manifest.json").unlink()


@pytest.mark.parametrize("damage, message", [
    (lambda d: [p.unlink() for p in d.glob("tokenizer*")], r"has no tokenizer files"),
    (lambda d: (d / "config.json").unlink(), r"has no config.json"),
    (lambda d: (d / "config.json").write_text("{{"), r"config.json in .* is not valid JSON"),
    (lambda d: _cut(d / "model.safetensors"), r"model.safetensors in .* is damaged or cut short"),
    (lambda d: (d / "model.safetensors").unlink(), r"has no weights file"),
    (lambda d: (d / "config.json").write_text((d / "config.json").read_text().replace('"hidden_size": 32',
                                                                                      '"hidden_size": 64')),
     r"the weights in .* do not match its config.json"),
])
def test_a_plain_model_directory_with_a_bad_file_gets_an_error_naming_it(finished, tmp_path, damage, message):
    from creditrl.runtime.models import ModelDirError, load_policy
    model_dir = _damaged(tmp_path, finished[0] / "final", lambda d: (_no_manifest(d), damage(d)))
    with pytest.raises(ModelDirError, match=message):
        load_policy(str(model_dir), task=None, progress=False)


def test_a_lora_adapter_without_a_local_base_or_weights_is_named(finished, tmp_path):
    from creditrl.runtime.models import ModelDirError, load_policy
    lora = finished[1] / "final"
    no_base = _damaged(tmp_path / "a", lora, lambda d: (_no_manifest(d), (d / "adapter_config.json").write_text(
        (d / "adapter_config.json").read_text().replace(json.loads((d / "adapter_config.json").read_text())[
            "base_model_name_or_path"], "/nowhere"))))
    with pytest.raises(ModelDirError, match=r"names base model '/nowhere' in adapter_config.json"):
        load_policy(str(no_base), task=None, progress=False)
    no_weights = _damaged(tmp_path / "b", lora, lambda d: (_no_manifest(d), (d / "adapter_model.safetensors").unlink()))
    with pytest.raises(ModelDirError, match=r"has no weights file \(expected one of \['adapter_model.safetensors'"):
        load_policy(str(no_weights), task=None, progress=False)


def test_a_run_directory_given_as_a_model_points_to_its_final(finished):
    from creditrl.runtime.models import ModelDirError, load_policy
    with pytest.raises(ModelDirError, match=r"is a creditrl run directory, not a model directory; its model is .*final"):
        load_policy(str(finished[0]), task=None, progress=False)


# ----------------------------------------------------------------------------- creditrl eval

def test_eval_takes_a_run_or_a_model_directory_positionally(finished, capsys):
    from creditrl.cli import main
    run = finished[0]
    assert main(["eval", "--no-progress", str(run), "--n", "1", "--problems", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == str(run / "final") and out["n_problems"] == 2 and out["n_samples"] == 1
    assert main(["eval", "--no-progress", "--n", "1", "--problems", "2", str(run / "final"), "rollout.temperature=0.5",
                 "train.eval_samples=1"]) == 0
    out = json.loads(capsys.readouterr().out)
    # a run's final/ is evaluated as the run (its task and settings, audit #10), and the result records what
    # produced it, overrides included
    saved = load_saved_config(run / "config.yaml")
    assert out["model"] == str(run / "final") and out["task"] == saved.task.name
    assert out["settings"]["task_options"] == saved.task.options and out["settings"]["temperature"] == 0.5
    assert out["settings"]["overrides"] == ["rollout.temperature=0.5", "train.eval_samples=1"]


@pytest.mark.parametrize("args, message", [
    (["--n", "0"], r"--n: expected a positive number of samples per problem, got 0"),
    (["--n", "-3"], r"--n: expected a positive number"),
    (["--k", "0"], r"--k: expected distinct values in \[1, n=2\]"),
    (["--k", "3"], r"--k: expected distinct values in \[1, n=2\]"),
    (["--k", "1", "1"], r"--k: expected distinct values"),
    (["--problems", "0"], r"--problems: expected a value in \[1, \d+\]"),
    (["--problems", "-1"], r"--problems: expected a value in \[1, \d+\]"),
    (["--problems", "100000"], r"--problems: expected a value in \[1, \d+\] \(the task's held-out set has"),
    (["model.name=builtin:tiny"], r"model.name: given twice"),
    (["optim.lr=0.5", "model.tiny.hidden_size=64", "rollout.top_p=0.9"],
     r"optim.lr: creditrl eval does not read optim.lr, model.tiny.hidden_size \(training settings, or how a model "
     r"is built: the weights come from the directory\); drop them"),
    (["train.steps=3"], r"train.steps: creditrl eval does not read train.steps .*; drop it"),
    (["RUN", "RUN"], r"RUN_OR_MODEL: expected one run or model directory"),
    (["--config", "default"], r"--config: a run directory is evaluated with its own config.yaml"),
    (["--out", "RUN"], r"--out: expected a file path for the JSON result, got the directory"),
])
def test_eval_checks_every_argument_before_the_model_loads(finished, monkeypatch, capsys, args, message):
    import creditrl.cli as cli
    monkeypatch.setattr("creditrl.tools.evaluate.load_configured_policy", lambda *a, **k: pytest.fail("the model was loaded"))
    run = str(finished[0])
    assert cli.main(["eval", "--no-progress", run, *[run if a == "RUN" else a for a in args]]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_eval_of_a_run_without_its_config_names_the_missing_file(finished, tmp_path, capsys):
    """A run directory that lost its config.yaml is named as such, not taken for a model directory
    without config.json (model.name)."""
    import shutil
    from creditrl.cli import main
    run = tmp_path / "run"
    shutil.copytree(finished[0], run)
    (run / "config.yaml").unlink()
    assert main(["eval", "--no-progress", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"{str(run)!r} is a creditrl training run (its .creditrl-run marker) but has no config.yaml" in err


def test_eval_of_something_that_is_not_a_directory_says_what_it_expects(capsys):
    from creditrl.cli import main
    assert main(["eval", "--no-progress", "no/such/run"]) == 2
    assert "RUN_OR_MODEL: 'no/such/run' is not a directory; expected a creditrl run directory" in capsys.readouterr().err


# ----------------------------------------------------------------------------- stop strings, LoRA, seeds, YAML

@pytest.mark.parametrize("stop", ['[""]', '["</s>", ""]'])
def test_an_empty_stop_string_is_refused_by_name(stop):
    with pytest.raises(ConfigError, match=r"rollout.stop\[\d\]: expected a non-empty string, got ''.*cut each one"):
        load_config(None, [f"rollout.stop={stop}"])
    from creditrl.runtime.sampling import decode_responses, generate
    task, tok, model = _tiny_policy()
    with pytest.raises(ValueError, match=r"stop_strings\[0\]: expected a non-empty string"):
        generate(model, tok, [tok.encode("1+1=")], max_new_tokens=2, stop_strings=[""])
    with pytest.raises(ValueError, match=r"stop_strings\[0\]: expected a non-empty string"):
        decode_responses(tok, torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2), [""])


@pytest.mark.parametrize("override, message", [
    ("model.lora.target_modules=[]", r"model.lora.target_modules: expected a non-empty list of module names"),
    ("model.lora.r=0", r"model.lora.r: expected a positive int"),
    ("model.lora.dropout=1", r"model.lora.dropout: expected a value in \[0, 1\)"),
    ("train.seed=-1", r"train.seed: expected an integer in \[0, 2\*\*32 - 1\]"),
    ("model.warm_start.seed=4294967296", r"model.warm_start.seed: expected an integer in \[0, 2\*\*32 - 1\]"),
])
def test_lora_settings_and_seeds_are_checked_by_name(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.lora.enabled=true", override])


def test_unknown_lora_target_modules_name_the_key_and_the_model_modules():
    from creditrl.config import LoraSettings
    from creditrl.runtime.models import _with_adapters
    _, _, model = _tiny_policy()
    with pytest.raises(ConfigError, match=r"model.lora.target_modules: .*\['nope'\]; this model's linear modules "
                                          r"are \[.*'q_proj'"):
        _with_adapters(model, None, LoraSettings(target_modules=["nope"]))


def test_a_lora_final_as_model_name_needs_lora_on_with_its_own_settings(finished):
    from creditrl.recipe.build import check_lora_source
    final = str(finished[1] / "final")
    base = ["model.tiny.hidden_size=32", f"model.name={final}"]
    with pytest.raises(ConfigError, match=r"model.lora.enabled: model.name .* is a LoRA adapter directory.*"
                                          r"model.lora.enabled=true and its settings \(model.lora.r=4"):
        check_lora_source(load_config(None, base))
    with pytest.raises(ConfigError, match=r"model.lora.r=16 but the adapter has 4"):
        check_lora_source(load_config(None, base + ["model.lora.enabled=true"]))
    check_lora_source(load_config(None, base + ["model.lora.enabled=true", "model.lora.r=4"]))


def test_a_yaml_key_given_twice_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 1.0e-5\n  lr: 1.0e-3\n")
    with pytest.raises(ConfigError, match=r"invalid YAML: key 'lr' appears twice"):
        load_config(path)


# ----------------------------------------------------------------------------- creditrl compare / experiment

@pytest.mark.parametrize("spec, args, message", [
    ("runs:\n  a: [train.steps=1]\n  a: [train.steps=2]\n", [], r"key 'a' appears twice"),
    ("runs:\n  a: [train.steps=1]\nseeds: []\n", [], r"seeds: expected a non-empty list of integers"),
    ("runs:\n  a: [train.steps=1]\nseeds: [0, 0]\n", [], r"seeds: expected distinct seeds"),
    ("runs:\n  a/b: [train.steps=1]\n", [], r"expected a run name of letters, digits"),
    ("runs:\n  a: [train.seed=3]\n", [], r"compare sets train.seed, train.output_dir, train.run_name itself"),
    ("- 1\n", [], r"expected a mapping with runs"),
    (None, ["--run", "a", "train.steps=1", "--run", "a", "train.steps=2"], r"--run: duplicate run name 'a'"),
    (None, ["--run", "a", "train.steps=1", "--seeds", ""], r"--seeds: expected comma-separated integers"),
    (None, ["--run", "a", "train.steps=1", "--seeds", "0,-1"], r"--seeds: expected a non-empty list of integers"),
    (None, ["--run", "a", "train.steps=1", "--smooth", "0"], r"--smooth: expected a moving-average window"),
    (None, ["--report-only", "--run", "a", "x=1"], r"--report-only: redraws the report from OUT/runs alone"),
])
def test_compare_checks_its_specs_before_training(tmp_path, monkeypatch, capsys, spec, args, message):
    from creditrl.tools import compare
    monkeypatch.setattr(compare, "train", lambda *a, **k: pytest.fail("a run was trained"))
    if spec is not None:
        (tmp_path / "spec.yaml").write_text(spec)
        args = ["--spec", str(tmp_path / "spec.yaml"), *args]
    assert compare.main([*args, "--out", str(tmp_path / "out")]) == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("args, message", [
    (["maxk-bandit", "seed=-1"], r"seed: expected an integer in \[0, 2\*\*32 - 1\] for experiment maxk-bandit"),
    (["maxk-bandit", "seeds=0"], r"seeds: expected > 0 for experiment maxk-bandit, got 0"),
    (["maxk-bandit", "k_sweep=[]"], r"k_sweep: expected at least one value"),
    (["learning-curves", "eval_every=-1"], r"eval_every: expected >= 0"),
    (["maxk-bandit", "bogus=1"], r"bogus: unknown key"),
    (["report", "seed=3"], r"report does not use key=value"),
    (["report", "--preset", "full"], r"report does not use --preset"),
    (["maxk-bandit", "--check", "x"], r"maxk-bandit does not use --check"),
    (["maxk-bandit", "--docs", "x"], r"maxk-bandit does not use --docs"),
])
def test_experiment_arguments_are_checked_before_anything_runs(monkeypatch, capsys, args, message):
    from creditrl_research import experiments
    monkeypatch.setattr(experiments, "run_experiment", lambda *a, **k: pytest.fail("an experiment ran"))
    monkeypatch.setattr(experiments, "write_report", lambda *a, **k: pytest.fail("a report was written"))
    assert experiments.main(args) == 2
    assert re.search(message, capsys.readouterr().err)


# ----------------------------------------------------------------------------- a run that learns nothing

def test_learned_nothing_names_invalid_and_zero_spread_rewards():
    from creditrl.trainer.report import learned_nothing, streak_warning
    invalid = [{"step": s, "reward_invalid_frac": 1.0, "zero_spread_frac": 1.0, "reward_mean": 0.0, "adv_mean": 0.0,
                "adv_std": 0.0} for s in range(1, 7)]
    assert "every reward was invalid" in learned_nothing(invalid, "grpo")
    flat = [{**m, "reward_invalid_frac": 0.0, "reward_mean": 1.0} for m in invalid]
    text = learned_nothing(flat, "grpo")
    assert "every group's rewards were equal" in text and "advantages were 0 at every step" in text
    assert "reinforce still gave advantages" in learned_nothing([{**m, "adv_mean": 0.5} for m in flat], "reinforce")
    assert learned_nothing(flat[:-1] + [{**flat[-1], "zero_spread_frac": 0.5}], "grpo") is None
    assert learned_nothing([], "grpo") is None
    assert streak_warning(flat[:5]).startswith("warning: no reward signal for 5 steps in a row (step 5)")
    assert streak_warning(flat[:4]) is None and streak_warning(flat[:6]) is None   # once per streak


def test_flat_groups_with_rewards_differing_between_them():
    """rollout.group_size=1 (or any flat groups) with rewards that differ across the step: an estimator
    comparing across groups (reinforce, whose advantages are then not 0) learns, so no warning; one
    comparing within groups (advantages 0) learns nothing, and the message says the rewards differed
    only between groups instead of "every response scored the same". The mean reward is over the steps
    the message covers, not the last step's."""
    from creditrl.trainer.report import learned_nothing, no_signal, streak_warning
    rewards = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    steps = [{"step": s + 1, "reward_invalid_frac": 0.0, "zero_spread_frac": 1.0, "reward_mean": r, "reward_std": 0.5,
              "adv_mean": 0.3, "adv_std": 0.4} for s, r in enumerate(rewards)]
    assert [no_signal(m) for m in steps] == [None] * 6 and learned_nothing(steps, "reinforce") is None
    within = [{**m, "adv_mean": 0.0, "adv_std": 0.0} for m in steps]
    text = learned_nothing(within, "grpo")
    assert "rewards differed only between groups" in text and "every response scored the same" not in text
    assert "mean reward 0.333 over those steps" in text
    assert "mean reward 0.2 over those steps" in streak_warning(within[:5])
    # every reward of the batch equal: no signal for any estimator, whatever its advantages
    same = [{**m, "reward_mean": 1.0, "reward_std": 0.0} for m in steps]
    assert "reinforce still gave advantages" in learned_nothing(same, "reinforce")
    assert "every response scored the same" in learned_nothing(same, "reinforce")


def test_a_run_whose_checker_always_raises_says_so(tmp_path, capsys, monkeypatch):
    from creditrl.cli import main
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "bad_checker.py").write_text("def check(prompt, response, answer):\n    raise RuntimeError('boom')\n")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                                              for i in range(20)))
    # an untrained tiny model saved as a model directory: builtin:tiny's warm start refuses a reward invalid
    # for every reference response before training (case 13), a model directory needs none
    from creditrl.config import TinyModelConfig
    from creditrl.runtime.models.tiny import char_tokenizer, tiny_model
    tokenizer = char_tokenizer(get_task("jsonl", path=str(tmp_path / "d.jsonl")).alphabet())
    tiny_model(tokenizer, TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64), seed=0).save_pretrained(
        tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    args = [a for a in TINY if not a.startswith(("task.options.digits", "model."))]
    assert main(["train", "--no-progress", *args, "task.name=jsonl", f"task.options.path={tmp_path / 'd.jsonl'}",
                 "task.options.checker=bad_checker:check", "rollout.max_new_tokens=4", "train.steps=5", "train.eval_problems=2",
                 "train.save_every=0", f"model.name={tmp_path / 'model'}",
                 f"train.output_dir={tmp_path}", "train.run_name=r"]) == 0
    captured = capsys.readouterr()
    err = captured.out + captured.err
    assert "warning: no reward signal for 5 steps in a row" in err
    assert "warning: this run learned nothing from its task. At all 5 steps every reward was invalid" in err
    summary = (tmp_path / "r" / "summary.md").read_text()
    assert "this run learned nothing from its task" in summary and "the task's checker raised" in summary


# ----------------------------------------------------------------------------- the second-layer audit

def test_experiment_report_states_the_presets_and_experiments_it_covers(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from creditrl_research.experiments import runner
    names = runner.experiment_names()
    fake = SimpleNamespace(run=lambda cfg, out: {}, presets=runner.get_experiment(names[0]).presets, validate=None)
    monkeypatch.setattr(runner, "get_experiment", lambda name: fake)
    runner.run_experiment(names[0], "fast", tmp_path / names[0])
    assert (tmp_path / names[0] / "preset.txt").read_text().strip() == "fast"
    presets = runner.recorded_presets(tmp_path, [names[0], names[1]])
    assert presets == {names[0]: "fast", names[1]: "not recorded"}
    text = " ".join(runner.provenance({names[0]: "fast"}).split())
    assert "It is not a complete `creditrl experiment all --preset full` run" in text
    assert f"covers 1 of {len(names)} experiments, preset fast: `{names[0]}`." in text
    assert "within 75 minutes (each" not in text
    assert runner.provenance(dict.fromkeys(names, "full")) == runner.FULL_PROVENANCE
    assert runner.provenance(dict.fromkeys(names, "fast")) != runner.FULL_PROVENANCE
    assert "Generated by `creditrl experiment all --preset full`" in runner.FULL_PROVENANCE


def _rows_file(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("mode", ["auto", "true", "false"])
def test_conversational_prompts_on_a_model_without_chat_template_fail_before_the_warm_start(tmp_path, mode,
                                                                                            monkeypatch):
    from creditrl.recipe import build as setup
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)} for i in range(8)]
    cfg = load_config(None, ["task.name=jsonl", f"task.options.path={_rows_file(tmp_path / 'd.jsonl', rows)}",
                             f"task.options.chat_template={mode}", "rollout.max_new_tokens=8"])
    monkeypatch.setattr(setup, "load_policy", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ConfigError, match=r"task.options.chat_template: the prompts are lists of messages.*"
                                          r"model.name='builtin:tiny'"):
        setup.load_configured_policy(cfg, setup.build_task(cfg), "cpu", False)
    system = load_config(None, ["task.options.system_prompt=Be brief."])
    with pytest.raises(ConfigError, match="task.options.system_prompt: a system prompt needs .* drop "
                                          "task.options.system_prompt or use a model whose tokenizer has"):
        setup.check_tiny_prompts(system, setup.build_task(system))


def test_prompts_longer_than_the_tiny_context_fail_before_the_warm_start(tmp_path, monkeypatch):
    from creditrl.recipe import build as setup
    from creditrl.runtime.models.warm_start import sft_batch
    rows = [{"prompt": "1+" * 300 + "1=", "answer": "301"}] + [{"prompt": "1+1=", "answer": "2"}] * 7
    path = _rows_file(tmp_path / "d.jsonl", rows)
    cfg = load_config(None, ["task.name=jsonl", f"task.options.path={path}", "rollout.max_new_tokens=16"])
    monkeypatch.setattr(setup, "load_policy", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ConfigError, match=r"task: 1 prompt\(s\) are longer than the 240 tokens .*longest: 602"):
        setup.load_configured_policy(cfg, setup.build_task(cfg), "cpu", False)
    cut = load_config(None, ["task.name=jsonl", f"task.options.path={path}", "rollout.max_new_tokens=16",
                             "task.options.truncate_prompts=true"])
    task = setup.build_task(cut)
    assert setup.check_tiny_prompts(cut, task) == 1 and task.max_prompt_tokens == 240
    assert setup.check_tiny_prompts(cut, task) == 1          # counted the same after the model loads
    tokenizer = setup.char_tokenizer(task.alphabet())
    longest = max(task.train_set() + task.test_set(), key=lambda p: len(p.prompt))
    assert sft_batch(task, tokenizer, [longest])["input_ids"].shape[1] == 240 + len("301") + 1   # + EOS


def test_a_reward_beyond_float32_range_counts_as_invalid_not_a_crash():
    from creditrl.runtime.rollout import reward_tensor
    from creditrl.tasks.rewards import RewardFunction
    for value in (1e39, float("inf"), -float("inf")):
        reward, _, problem = RewardFunction._value(value)
        assert math.isnan(reward) and "not a finite float32 reward" in problem
    assert RewardFunction._value(3e38)[0] == 3e38
    rewards, invalid = reward_tensor([1.0, 1e39, -1e300, float("nan"), float("inf"), 3e38])
    assert invalid.tolist() == [False, True, True, True, True, False]
    assert torch.isfinite(rewards).all() and rewards[:5].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("estimator, k, message", [
    ("pkpo", 1, r"algorithm.options.k: pkpo needs 2 <= k <= rollout.group_size \(=4\), got k=1"),
    ("ei", 5, r"algorithm.options.k: ei needs 2 <= k <= rollout.group_size \(=4\), got k=5"),
    ("maxpo", 4, r"algorithm.options.k: maxpo needs 1 <= k < rollout.group_size \(=4\)"),
    ("maxk_bon", 0, r"algorithm.options.k: maxk_bon needs 1 <= k < rollout.group_size \(=4\), got k=0"),
    ("passk_chen", 4, r"algorithm.options.k: passk_chen needs 1 <= k < rollout.group_size \(=4\), got k=4")])
def test_a_maxk_k_out_of_range_names_algorithm_options_k(estimator, k, message):
    from creditrl.core.estimators.registry import get_estimator
    with pytest.raises(ConfigError, match=message):
        resolve_config(load_config(None, [f"algorithm.estimator={estimator}", f"algorithm.options.k={k}",
                                          "rollout.group_size=4"]))
    # the declared range is what the code checks and what the reference shows
    assert get_estimator(estimator).k_range.text("rollout.group_size") in message.replace("\\", "")
    from creditrl.recipe import reference
    assert get_estimator(estimator).k_range.text() in reference.markdown()


def test_a_model_directory_with_non_finite_weights_is_refused_naming_the_tensor(tmp_path):
    from creditrl.config import TinyModelConfig
    from creditrl.runtime.models import ModelDirError, char_tokenizer, load_policy, tiny_model
    tokenizer = char_tokenizer("0123456789+=")
    model = tiny_model(tokenizer, TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32))
    model.save_pretrained(tmp_path / "ok")
    tokenizer.save_pretrained(tmp_path / "ok")
    assert load_policy(str(tmp_path / "ok"), None, progress=False)[0] is not None
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    model.save_pretrained(tmp_path / "bad")
    tokenizer.save_pretrained(tmp_path / "bad")
    with pytest.raises(ModelDirError, match=r"model.name: the weights loaded from '.*bad' are not finite: "
                                            r"model.layers.0.mlp.up_proj.weight \(32, 16\) holds 1 NaN/inf"):
        load_policy(str(tmp_path / "bad"), None, progress=False)


@pytest.mark.parametrize("override", ["rollout.stop=[1]", "rollout.stop=[0.5]", "model.lora.target_modules=[1]"])
def test_a_number_in_a_list_of_strings_is_refused_not_coerced(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}\[0\]: expected a string, got .*quote it"):
        load_config(None, [override])
    assert load_config(None, ['rollout.stop=["1"]']).rollout.stop == ["1"]


def test_compare_report_carries_a_runs_learned_nothing_warning(tmp_path):
    from creditrl.tools import compare
    for name, warning in (("ok", None), ("flat", "this run learned nothing from its task. At all 2 steps ...")):
        d = tmp_path / "runs" / f"{name}-s0"
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "tokens_total": 10 * s, "reward_mean": 0.0})
                                                 + "\n" for s in (1, 2)))
        (d / "summary.json").write_text(json.dumps({"warning": warning} if warning else {}))
    text = compare.write_report(compare.find_runs(tmp_path), tmp_path, window=1).read_text()
    assert "## Warnings from the runs" in text
    assert "- **flat** (`flat-s0`): this run learned nothing from its task" in text and "**ok**" not in text


def test_jsonl_errors_name_the_task_options_key_and_a_directory_is_not_missing(tmp_path):
    from creditrl.recipe.build import build_task
    data = _rows_file(tmp_path / "d.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)])
    for overrides, message in (([f"task.options.path={tmp_path}"], r"task.options.path: expected a local "
                                r".jsonl/.json/.parquet file, got the directory"),
                               ([f"task.options.path={tmp_path / 'no.jsonl'}"], r"task.options.path: no such file"),
                               ([f"task.options.path={data}", "task.options.answer_key=zz"],
                                r"task.options.answer_key: column 'zz' not in d.jsonl"),
                               ([f"task.options.path={data}", "task.options.tolerance=-1"],
                                r"task.options.tolerance: expected a value in \[0, inf\]")):
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            build_task(load_config(None, ["task.name=jsonl", *overrides]))


def test_experiment_all_accepts_only_keys_every_experiment_has(monkeypatch, capsys):
    from creditrl_research.experiments import runner
    monkeypatch.setattr(runner, "run_experiment", lambda *a, **k: pytest.fail("an experiment ran"))
    assert runner.main(["all", "num_seeds=2"]) == 2
    err = capsys.readouterr().err
    assert "num_seeds: `experiment all` accepts only keys every experiment has (['seed', 'threads'])" in err
    assert "num_seeds belongs to [" in err and "'learning-curves'" in err
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "e.g. `seed=3 threads=1`" in readme and "seed=3 num_seeds=5" not in readme


def test_a_skipped_damaged_checkpoint_is_a_resume_note_and_the_warm_start_line_says_mean_reward(tmp_path):
    from creditrl.trainer import loop
    ckpt.save_checkpoint(tmp_path, 1, {"w": torch.zeros(2)}, {"step": 1}, keep_last=3)
    newer = ckpt.save_checkpoint(tmp_path, 2, {"w": torch.ones(2)}, {"step": 2}, keep_last=3)
    _cut_file = newer / ckpt.WEIGHTS
    _cut_file.write_bytes(_cut_file.read_bytes()[:10])
    skipped = []
    _, state = ckpt.load_latest(tmp_path, skipped)          # no UserWarning: the trainer prints it as a note
    assert state["step"] == 1 and len(skipped) == 1 and skipped[0].startswith("step_000002: ")
    note = loop.resume_note({"step": 1, "changes": {}, "checkpoint": True, "skipped": skipped})
    assert note.startswith("resumed at step 1 (skipped damaged checkpoint(s): step_000002: ")
    assert "sampled accuracy" not in Path(loop.__file__).read_text()


# ---------------------------------------------------------------- black-box audit: loss inputs

@pytest.mark.parametrize("name", ["logp", "old_logp", "ref_logp", "rollout_logp"])
@pytest.mark.parametrize("value", [math.inf, -math.inf])
def test_policy_loss_refuses_infinite_log_probs_of_sampled_tokens(name, value):
    """+inf is no log-probability and -inf is a probability 0 for a token that was sampled: each gave a
    finite loss (clipping hid it) with a made-up KL; a -inf in the current ``logp`` gave the token no
    gradient, silently. On a masked token either is padding, and ignored."""
    import creditrl
    gen = torch.Generator().manual_seed(0)
    logp, mask, adv = -torch.rand(2, 3, generator=gen), torch.ones(2, 3), torch.tensor([1.0, -1.0])
    bad = -torch.rand(2, 3, generator=gen)
    bad[0, 1] = value
    names = ("logp", "old_logp", "ref_logp", "rollout_logp")
    inputs = {**{k: logp.detach() for k in names}, name: bad}
    options = dict(kl_coef=0.1, rollout_correction="tis")
    what = "log-probabilities <= 0" if value > 0 else "finite log-probabilities"
    with pytest.raises(ValueError, match=rf"^{name}: expected {what}"):
        creditrl.policy_loss(inputs.pop("logp"), inputs.pop("old_logp"), adv, mask, **inputs, **options)
    padded = {**{k: logp.detach() for k in names},
              name: torch.where(torch.arange(3) == 1, torch.tensor(value), -torch.rand(2, 3, generator=gen))}
    loss, _ = creditrl.policy_loss(padded.pop("logp"), padded.pop("old_logp"), adv, mask * (torch.arange(3) != 1),
                                   **padded, **options)
    assert torch.isfinite(loss)


def test_stapo_refuses_a_negative_entropy_and_trace_a_positive_clamp():
    import creditrl
    logp, mask, adv = -torch.rand(2, 3, generator=torch.Generator().manual_seed(0)), torch.ones(2, 3), torch.ones(2)
    entropy = torch.full((2, 3), 0.5)
    entropy[1, 2] = -0.5
    with pytest.raises(ValueError, match=r"^entropy: expected token entropies >= 0 .* got values down to -0.5"):
        creditrl.policy_loss(logp, logp.detach(), adv, mask, entropy=entropy, stapo=True)
    entropy[1, 2] = -1e-6                                     # rounding of an entropy of 0: accepted
    creditrl.policy_loss(logp, logp.detach(), adv, mask, entropy=entropy, stapo=True)
    with pytest.raises(ValueError, match=r"^trace.adv_clamp: expected a finite float <= 0"):
        creditrl.TraceOptions(adv_clamp=0.5)
    with pytest.raises(ValueError, match=r"^trace.adv_clamp: expected a finite float <= 0 .*-1e30: no clamp"):
        creditrl.TraceOptions(adv_clamp=-math.inf)            # the config could not read it back
    creditrl.TraceOptions(adv_clamp=-1e30)                    # no clamp in effect


# ----------------------------------------------------------------------------- audit: estimators

AUDIT = dict(mask=torch.ones(4, 3), group=torch.tensor([0, 0, 1, 1]))


@pytest.mark.parametrize("inputs", [
    dict(rewards=torch.tensor([3e38, 3e38, -3e38, 3e38]), energy=torch.full((4, 3), 0.5)),   # -inf advantages
    dict(rewards=torch.tensor([1.0, 0, 1, 0]), energy=torch.full((4, 3), 0.5), is_weights=torch.full((4, 3), 1e30)),
    dict(rewards=torch.tensor([1.0, 0, 1, 0]), energy=torch.full((4, 3), 3e38))])              # NaN advantages
def test_masked_output_estimators_refuse_non_finite_advantages(inputs):
    from creditrl import compute_advantages
    with pytest.raises(ValueError, match=r"estimator 'otb' returned non-finite advantages in rows \[.*\] from finite "
                                         r"inputs: a sum beyond float32's range .* rescale the rewards or energies"):
        compute_advantages("otb", **AUDIT, **inputs)


@pytest.mark.parametrize("name", ["otb_isolated", "ogb", "otb"])
def test_an_overflowed_weight_sum_is_refused_not_a_zero_baseline(name):
    """Per-token weights each finite (ρ̄² ŵ = 2.25e38) whose group sum overflows to inf: finite / inf would make
    the baseline 0 and A = R (otb_isolated did; otb's and ogb's sums overflowed before and raised already, kept
    here as the same contract); the leave-one-out form's sums over the one other member are finite and exact
    (A = R_i − R_other)."""
    from creditrl import compute_advantages
    inputs = dict(rewards=torch.tensor([1.0, 0.0]), mask=torch.ones(2, 3), group=torch.tensor([0, 0]),
                  energy=torch.ones(2, 3), is_weights=torch.full((2, 3), 1.5e19))
    with pytest.raises(ValueError, match=rf"estimator '{name}' returned non-finite advantages .* a sum beyond float32"):
        compute_advantages(name, **inputs)
    if name == "otb_isolated":        # otb's W_t and ogb's row sums add a row's tokens first: those overflow already
        loo = compute_advantages(name, **inputs, leave_one_out=True)
        assert torch.equal(loo, torch.tensor([[1.0] * 3, [-1.0] * 3]))


@pytest.mark.parametrize("leave_one_out", [False, True])
def test_inputs_with_grad_are_read_as_data(leave_one_out):
    """Rewards and energies that carry gradients (a reward model's output, energies from a live forward) give
    the same advantages as detached ones, without a graph: some estimators crashed on their out= buffers,
    others returned advantages attached to the caller's graph."""
    from creditrl import compute_advantages, list_estimators
    from creditrl.core.estimators.registry import get_estimator
    rewards, energy = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.rand(4, 3, generator=torch.Generator().manual_seed(0))
    for name in list_estimators():
        options = get_estimator(name).options or {}
        if leave_one_out and "leave_one_out" not in options:
            continue
        kwargs = dict(mask=torch.ones(4, 3), group=torch.zeros(4, dtype=torch.long),
                      **({"k": 2} if "k" in options else {}), **({"leave_one_out": True} if leave_one_out else {}))
        got = compute_advantages(name, rewards=rewards.clone().requires_grad_(), energy=energy.clone().requires_grad_(),
                                 **kwargs)
        assert not got.requires_grad, name
        assert torch.equal(got, compute_advantages(name, rewards=rewards, energy=energy, **kwargs)), name


def test_a_masked_output_plug_in_is_checked_on_valid_tokens_only():
    from creditrl import compute_advantages, register_estimator
    from creditrl.core.estimators.registry import _REGISTRY
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
    values = {}

    @register_estimator("audit_masked_plugin", masked_output=True, overwrite=True)
    def plugin(batch):
        return values["out"].clone()

    try:
        args = dict(rewards=torch.zeros(4), mask=mask, group=torch.tensor([0, 0, 1, 1]))
        values["out"] = torch.where(mask.bool(), 1.0, 0.0)
        values["out"][2, 1] = float("nan")                         # a valid token
        with pytest.raises(ValueError, match=r"'audit_masked_plugin' returned non-finite advantages in rows \[2\]"):
            compute_advantages("audit_masked_plugin", **args)
        values["out"] = torch.where(mask.bool(), 1.0, float("nan"))  # NaN only where mask == 0: the contract's 0 there
        assert torch.equal(compute_advantages("audit_masked_plugin", **args), mask)
        values["out"] = torch.where(mask.bool(), 3e38, 0.0)         # finite, though row 2's float32 sum overflows
        assert torch.equal(compute_advantages("audit_masked_plugin", **args), mask * 3e38)
    finally:
        _REGISTRY.pop("audit_masked_plugin", None)                  # other tests list the registry


@pytest.mark.parametrize("name, options", [("grpo", {}), ("maxpo", {"k": 1, "normalize": "std"}), ("gdpo", {}),
                                           ("reinforce_plus_plus", {}), ("reinforce_plus_plus_baseline", {}),
                                           ("passk_chen", {"k": 1}), ("maxk_bon", {"k": 1})])
def test_eps_must_be_finite_in_float32(name, options):
    from creditrl import compute_advantages
    args = dict(rewards=torch.tensor([1.0, 0, 1, 0]), **AUDIT, **options)
    for eps in (1e300, 3.5e38):                                # finite in Python, inf in float32
        with pytest.raises(ValueError, match=rf"{name}.eps: expected a value in \(0, 3.40282e\+38\], "
                                             rf"got {re.escape(repr(eps))}"):
            compute_advantages(name, eps=eps, **args)
    assert torch.isfinite(compute_advantages(name, eps=3.4e38, **args)).all()   # the largest float32 is accepted


@pytest.mark.parametrize("seed", range(3))
def test_gdpo_rewards_must_be_the_weighted_sum_of_the_components(seed):
    """Rewards summed in float32 (TRL's nansum of float32 products) pass: the check's tolerance is
    (K + 1)·eps32·Σ|w C|; a reward off by 16 times that, or the audit's 100 vs 0, is refused."""
    from creditrl import compute_advantages
    gen = torch.Generator().manual_seed(seed)
    b, k = 64, 3
    components = torch.randn(b, k, generator=gen) * 10.0 ** torch.randint(-3, 4, (b, k), generator=gen)
    components[torch.rand(b, k, generator=gen) < 0.2] = float("nan")
    components[5] = float("nan")                            # no term gave a reward: its reward is a stand-in
    weights = torch.tensor([1.0, 0.5, -0.25])
    rewards = (components * weights).nansum(1)                # float32, as TRL sums it
    rewards[5] = 123.0
    args = dict(mask=torch.ones(b, 2), group=torch.arange(b) // 4, components=components, component_weights=weights)
    assert torch.isfinite(compute_advantages("gdpo", rewards=rewards, **args)).all()
    scale = float((components * weights).abs().nansum(1)[0])
    off = rewards.clone()
    off[0] += 16 * (k + 1) * EPS32 * scale
    with pytest.raises(ValueError, match=r"rewards: expected each row's reward to be the weighted sum of its "
                                         r"components .* 1 row\(s\) differ, e.g. row 0"):
        compute_advantages("gdpo", rewards=off, **args)
    m = torch.ones(4, 3)
    with pytest.raises(ValueError, match=r"rewards: .*components.* e.g. row 0: rewards 100, components·weights 0"):
        compute_advantages("gdpo", rewards=torch.tensor([100.0, 0, 1, 0]), mask=m, group=AUDIT["group"],
                           components=torch.tensor([[0.0], [1], [1], [0]]))
    # an estimator that reads R, not the components, ignores them, as documented
    without = {k: v for k, v in args.items() if not k.startswith("component")}
    assert torch.equal(compute_advantages("grpo", rewards=off, **args), compute_advantages("grpo", rewards=off, **without))


@pytest.mark.parametrize("name, kwargs, error, message", [
    ("", {}, ValueError, r"name: expected a non-empty estimator name of letters, digits, '_', '-' or '.' .*got ''"),
    ("my est", {}, ValueError, r"name: expected .*\(no spaces\), got 'my est'"),
    (3, {}, ValueError, r"name: expected .*got 3"),
    ("audit_k", {"k_range": "1..N"}, TypeError, r"k_range: expected a creditrl.KRange .* got str '1..N'"),
    ("audit_e", {"needs_energy": "no"}, TypeError, r"needs_energy: expected a bool \(True or False\), got str 'no'"),
    ("audit_t", {"token_level": 1}, TypeError, r"token_level: expected a bool .* got int 1"),
    ("audit_m", {"masked_output": None}, TypeError, r"masked_output: expected a bool"),
    ("audit_o", {"overwrite": "yes"}, TypeError, r"overwrite: expected a bool")])
def test_register_estimator_checks_its_own_arguments_before_registering(name, kwargs, error, message):
    from creditrl import list_estimators, register_estimator
    before = list_estimators()
    with pytest.raises(error, match=message):
        @register_estimator(name, **kwargs)
        def fn(batch, *, k: int = 2):
            return batch.rewards
    assert list_estimators() == before


@pytest.mark.parametrize("window", [1, 0, -3])
def test_a_diagnose_window_below_two_is_refused_by_name(window):
    with pytest.raises(ConfigError, match=rf"logging.diagnose_window: expected an integer >= 2 .*got {window}"):
        load_config(None, ["logging.diagnose_every=1", f"logging.diagnose_window={window}"])
    assert load_config(None, ["logging.diagnose_every=1", "logging.diagnose_window=2"]).logging.diagnose_window == 2


def test_eval_pass_at_1_is_the_sampled_accuracy_and_avg_at_1_the_first_samples(monkeypatch, capsys):
    """pass@1 (unbiased, all n samples) equals sampled_acc and avg@n exactly (no 0.1250000000000001),
    avg@1 is the first sample's accuracy: different numbers on the same samples, by definition."""
    from creditrl.runtime import evaluation
    sampled = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)   # c/n = 1/8
    greedy = torch.tensor([[1], [0], [1], [0]], dtype=torch.bool)
    monkeypatch.setattr(evaluation, "sample_correctness",
                        lambda *a, n, **k: (greedy if n == 1 else sampled, None))
    task = types.SimpleNamespace(test_set=lambda: [Problem(str(i), "0") for i in range(4)])
    monkeypatch.setattr(evaluation, "dataset_names", lambda task: [])
    result = evaluation.evaluate(None, None, task, n=4, ks=[1, 4])
    assert result["pass@1"] == result["sampled_acc"] == result["avg@4"] == 0.125
    assert result["avg@1"] == 0.25 and result["greedy_acc"] == 0.5
    from creditrl.tools.evaluate import main
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "so pass@1 = sampled_acc" in text and "avg@1 reads one sample per prompt" in text


def test_diagnose_width_and_an_undefined_noise_scale_read_as_words():
    from creditrl.tools.diagnose.measure import width_text
    from creditrl.trainer.report import diagnosis_section
    assert [width_text({"width": w}) for w in (0.25, 10.0, 7504.04, float("inf"), float("nan"))] == \
        ["±25%", "±1000%", "> ±1000%", "undefined", "undefined"]
    step = {"step": 1, "time_diagnose": 1.0, "diagnose/steps": 1}
    text = "\n".join(diagnosis_section([step], []))
    assert "B_simple of the estimator trained: undefined." in text and "undefined groups" not in text
    assert "B_simple of the estimator trained: 12.3 groups." in "\n".join(
        diagnosis_section([{**step, "diagnose/noise_scale": 12.34}], []))


def test_ctrl_c_says_where_the_run_stands_and_how_to_continue(tmp_path, capsys, monkeypatch):
    """Ctrl-C during step 4 of a run checkpointed every 2 steps: one line naming the step reached, the
    newest checkpoint and the resume command with the steps it redoes, then exit 130 (no traceback);
    without checkpoints it says a resume starts again from step 0."""
    from creditrl.cli import main
    from creditrl.trainer.loop import Trainer
    real = Trainer.train_step

    def interrupted_at_4(self):
        if self.step == 3:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(Trainer, "train_step", interrupted_at_4)
    for save_every, says in ((2, "the newest checkpoint is step 2: `creditrl train --resume {run}` continues from it, "
                                 "redoing step 3"),
                             (0, "no checkpoint was saved (train.save_every=0): `creditrl train --resume {run}` starts "
                                 "again from step 0")):
        name = f"r{save_every}"
        assert main(["train", "--no-progress", *TINY, "train.steps=5", f"train.save_every={save_every}",
                     f"train.output_dir={tmp_path}", f"train.run_name={name}"]) == 130
        err = capsys.readouterr().err
        assert f"interrupted at step 3 of 5; {says.format(run=tmp_path / name)}" in err
        assert err.rstrip().endswith("creditrl train: interrupted") and "Traceback" not in err


@pytest.mark.parametrize("token_level", [False, True])
def test_finite_rewards_whose_float32_total_overflows_are_accepted(token_level):
    """The rewards' finiteness test reads one float32 total: finite rewards whose total overflows
    fail it, and the exact pass must then accept them (each row's R fits float32), giving what the
    same batch gives scaled down by 2^100 (exact in float32), scaled back."""
    from creditrl import compute_advantages
    big = torch.tensor([3e38, 2e38, 1e38, 3e38])
    scale = 2.0 ** 100
    mask = torch.ones(4, 3)
    group = torch.tensor([0, 0, 1, 1])

    def rewards(values):
        if not token_level:
            return values
        return torch.zeros(4, 3).index_put_((torch.arange(4), torch.full((4,), 2)), values)
    got = compute_advantages("dr_grpo", rewards=rewards(big), mask=mask, group=group)
    want = compute_advantages("dr_grpo", rewards=rewards(big / scale), mask=mask, group=group) * scale
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    r = big.double()                                   # the float32 rewards, centred in float64, rounded once
    assert got[0, 0] == ((r[0] - r[1]) / 2).float()


def test_a_rows_reward_does_not_depend_on_another_rows_size():
    """Only rows whose own float32 sum is not finite are summed again in float64: a batch whose total
    overflows because of another group leaves this group's R, and so its advantages, as they are (a
    float64 re-sum moves them by an ulp), and a row at the float32 limit is accepted whatever the
    other rows hold (its float64 sum rounds to inf)."""
    from creditrl import compute_advantages
    eps = 2.0 ** -24
    small = torch.tensor([[1.0, eps, eps], [0.0, 0.0, 0.0]])
    mask, group = torch.ones(4, 3), torch.tensor([0, 0, 1, 1])
    alone = compute_advantages("dr_grpo", rewards=torch.cat([small, torch.zeros(2, 3)]), mask=mask, group=group)
    big = torch.tensor([[3e38, 0.0, 0.0], [3e38, 0.0, 0.0]])
    beside = compute_advantages("dr_grpo", rewards=torch.cat([small, big]), mask=mask, group=group)
    assert torch.equal(alone[:2], beside[:2])
    limit = torch.tensor([[torch.finfo(torch.float32).max, 2.0 ** 102, 2.0 ** 102], [1e38, 0.0, 0.0]])
    got = compute_advantages("dr_grpo", rewards=limit, mask=torch.ones(2, 3), group=torch.tensor([0, 0]))
    assert torch.isfinite(got).all()


def test_power_proxy_refuses_negative_energies_beyond_rounding():
    """Σ A² ŵ with ŵ = ‖e_y − π‖² >= 0: a negative energy is a caller's mistake, not a smaller power; rounding
    just below 0 (π_y → 1) is accepted, as compute_advantages accepts it."""
    import creditrl
    mask = torch.ones(3, 4)
    with pytest.raises(ValueError, match=r"energy: expected .* >= 0 on valid tokens, got a minimum of -0.5"):
        creditrl.power_proxy(torch.ones(3), torch.full((3, 4), -0.5), mask)
    assert creditrl.power_proxy(torch.ones(3), torch.full((3, 4), -1e-7), mask) == pytest.approx(-4e-7)
    garbage = torch.full((3, 4), -5.0).masked_fill(torch.eye(3, 4, dtype=torch.bool), 0.25)   # masked negatives
    assert creditrl.power_proxy(torch.ones(3), garbage, torch.eye(3, 4)) == pytest.approx(0.25)
    assert creditrl.power_proxy(torch.ones(3), torch.ones(3, 0), torch.ones(3, 0)) == 0.0      # T = 0: defined


def test_agg_loss_names_a_non_finite_kept_token():
    import creditrl
    with pytest.raises(ValueError, match=r"loss_mat: 1 row\(s\) contain NaN or inf, e.g. rows \[1\]"):
        creditrl.agg_loss(torch.tensor([[1.0, 2.0], [float("nan"), 1.0]]), torch.ones(2, 2), "token-mean")
    with pytest.raises(ValueError, match=r"loss_mat: finite on the kept tokens, but its seq-mean-token-sum sum overflows"):
        creditrl.agg_loss(torch.full((1, 2), 3e38), torch.ones(1, 2), "seq-mean-token-sum")
    masked_nan = torch.tensor([[1.0, float("nan")]])
    assert creditrl.agg_loss(masked_nan, torch.tensor([[1, 0]]), "token-mean").item() == 1.0


def test_estimator_argument_errors_name_the_argument():
    """A k beyond int64, component weights as a string and grpo's batch std of one response: each named, or
    defined without torch's own warning."""
    import warnings

    from creditrl import compute_advantages
    common = dict(rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]), mask=torch.ones(4, 2), group=torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"ei: k=100000000000000000000 is out of range for group id 0 \(N=4"):
        compute_advantages("ei", **common, k=10**20)
    with pytest.raises(ValueError, match=r"component_weights: expected 2 real numbers .*, got '1,0.5'"):
        compute_advantages("gdpo", **common, components=torch.ones(4, 2), component_weights="1,0.5")
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # torch's "degrees of freedom is <= 0" must not leak
        one = compute_advantages("grpo", rewards=torch.tensor([1.0]), mask=torch.ones(1, 2), group=torch.tensor([0]),
                                 scale="batch")
    assert torch.equal(one, torch.zeros(1, 2))


def test_policy_loss_checks_entropy_and_truncated_it_does_not_read():
    """Passed but unused by the chosen terms: still shape- and type-checked, as ref_logp and rollout_logp are."""
    import creditrl
    logp = torch.full((7, 9), -1.0)
    args = (logp, logp, torch.ones(7), torch.ones(7, 9))
    with pytest.raises(TypeError, match="entropy: expected a torch.Tensor, got str"):
        creditrl.policy_loss(*args, entropy="yes")
    with pytest.raises(ValueError, match=r"entropy: expected the shape of logp \[7, 9\], got \[7, 8\]"):
        creditrl.policy_loss(*args, entropy=torch.ones(7, 8))
    with pytest.raises(ValueError, match=r"truncated: expected shape \[7\], got \[7, 9\]"):
        creditrl.policy_loss(*args, truncated=torch.ones(7, 9))
    loss, _ = creditrl.policy_loss(*args, entropy=torch.ones(7, 9), truncated=torch.zeros(7, dtype=torch.bool))
    assert loss.item() == -1.0
